"""How q35lab's ops meet ``torch.compile``.

Custom ops (``torch.library``, namespace ``q35lab``): ``offset_rms_norm``, ``gated_rms_norm``,
``causal_conv1d`` and ``lora_linear``. Each is a forward and a backward op with fake
implementations (shapes and dtypes only) and ``register_autograd`` joining them, so Dynamo traces
through the op, forward and backward, with no graph break, and Inductor fuses the code around it;
the real implementations launch the kernels (``lora_linear``'s: its GEMMs) and choose their launch
configuration at run time (an explicit ``config=`` travels as a list of its fields). Gradients not
asked for come back as empty tensors (a custom op returns no None). Under ``torch.compile`` a
second derivative raises torch's "double backward" error rather than q35lab's (eager raises
q35lab's). ``causal_conv1d`` with ``cu_seqlens`` still breaks the graph once, before the op:
checking the sequence starts reads them back to the host. ``lora_linear``'s dropout seed is a
one-element int64 CPU tensor that ``torch.randint`` draws before the op and the op reads on the
host: eager mode draws it from the global RNG as it always did; in a compiled graph the draw is
the backend's (Inductor's own random numbers unless ``fallback_random``).

Graph breaks (``opaque_to_compile``): every other public op. Dynamo compiles the code around
them, the op runs eagerly with its own autograd node, and the compiled graphs' backward and the
op's backward interleave as usual. Each holds what a custom op cannot yet say without changing its
results or its memory:

* ``linear_cross_entropy``: for "mean" and "sum" the forward makes dx and dW and the backward only
  scales them by the upstream scalar, in place when autograd frees the graph, so ``.grad`` is the
  buffer the forward made. A custom op would return dx and dW as outputs (sound), but the scaling
  is then a write into saved tensors: declared as a mutation, a compiled backward functionalises
  it into a copy (which only a reinplacing backend may remove again); done out of place, it
  allocates one more ``[T, H]`` and ``[V, H]``: the buffers the in-place scaling exists to avoid.
* ``swiglu``, ``swiglu_packed``, ``swiglu_down``: the backward writes dg and du over the saved g
  and u when ``_ownership.may_overwrite`` finds, by counting the references held to them when the
  backward runs, that it is their last reader. No custom-op schema says "mutates this input if
  nobody else holds it": declared pure it would lie to the compiler (which may alias or reread g
  and u), declared mutating its copies cost the two ``[T, I]`` gradients the overwrite saves, and
  inside a compiled graph the counts describe the compiler's references, not the caller's.
  ``swiglu_down`` also hands state between its two nodes (outputs not read yet, thread-local).
* ``fused_lora_projections`` (and the patch's ``ProjectionGroup.output``): the frozen weights'
  concatenation is cached across calls (``ConcatCache``, keyed on the weights' identity and
  version; ``pack_rows`` moves them into one buffer), the outputs are tensors set over disjoint
  blocks of one buffer (a custom op's outputs may not share memory), and the patch keys the
  node's outputs on its input's identity and version across the four modules' calls.
* ``contiguous_rows`` (a strided copy, with a differentiable backward) and ``routed_experts``: not
  converted yet; the long-context tiles: Python callables as arguments, per-tile RNG state.

A custom op reaches a ``TorchDispatchMode`` as one call, whatever runs inside it.
``run_bodies_under(Mode)`` makes the ops whose bodies are torch code (``lora_linear``'s GEMMs) run
them op by op under that mode instead, for a mode that counts ops or the memory they allocate.
"""

from __future__ import annotations

import torch

__all__ = ["opaque_to_compile", "run_bodies_under", "torch_bodies"]

#: custom op -> the function it runs (same arguments), for the ops whose bodies are torch code
_BODIES: dict = {}


def opaque_to_compile(fn):
    """``fn`` as a graph break under ``torch.compile`` (and nothing else, in eager mode)."""
    return torch.compiler.disable(fn, recursive=True)


def torch_bodies(*pairs) -> None:
    """Record ``(custom_op, body)`` pairs: each op runs ``body`` with its own arguments."""
    _BODIES.update(pairs)


def run_bodies_under(mode_class: type) -> None:
    """Under a ``TorchDispatchMode`` of class ``mode_class``, each recorded custom op runs its body
    op by op (the mode is off while it handles a call; turned back on, it sees every op inside)."""
    for custom_op, body in _BODIES.items():
        def rule(mode, func, types, args, kwargs, body=body):
            with mode:
                return body(*args, **(kwargs or {}))

        custom_op.register_torch_dispatch(mode_class, rule)
