"""The GatedDeltaNet's causal conv and delta-rule core: which functions its forward calls, and the
switches through which q35lab replaces them for one layer's call.

transformers' ``Qwen3_5GatedDeltaNet.forward`` calls module-level functions (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``) of its modeling module. q35lab swaps such a function, for the
duration of one patched layer's call only, for a switch that runs q35lab's conv (or the delta
rule one packed sequence at a time) when that layer is the caller, and the original otherwise."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types

import torch

from ..hf import versions
from ..ops.causal_conv1d import causal_conv1d
from ..ops.contiguous_rows import contiguous_rows
from .forwards import marked
from .modules import is_gated_delta_net

CONV = "_q35lab_conv"  # attribute of a GatedDeltaNet whose convolution q35lab computes


class CausalConv:
    """``causal_conv1d_fn(x [B, C, T], weight [C, K], bias, activation, ...)`` by q35lab's kernel.

    Packed sequences: transformers passes their boundaries as ``cu_seq_lens_q`` (5.15 on), which
    the kernel honours; its own fallback ignores them."""

    def __call__(self, *args, **kwargs):
        names = ("hidden_states", "weight", "bias", "activation")
        values = dict(zip(names, args))
        values.setdefault("hidden_states", kwargs.pop("x", None))
        values.update({k: kwargs.pop(k) for k in names if k in kwargs})
        if kwargs.get("seq_idx") is not None:
            raise NotImplementedError("q35lab's causal_conv1d takes cu_seqlens, not seq_idx: patch with conv=False")
        cu_seqlens = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
        x = values["hidden_states"].transpose(1, 2)  # [B, T, C]: the in_proj output itself
        y = causal_conv1d(x, values["weight"], values.get("bias"), activation=values.get("activation"),
                          cu_seqlens=cu_seqlens)
        return y.transpose(1, 2)


#: The switch installed in each modeling module, by module name (a timer or another patch may
#: wrap the module's function afterwards; the layers find their switch here, not by that name).
CONV_SWITCHES: dict = {}


class ConvSwitch:
    """Installed as a modeling module's ``causal_conv1d_fn``: q35lab's convolution while a patched
    GatedDeltaNet's forward runs, the module's own function at every other call."""

    _rebuild = None  # set on the class of one installed switch (``install``)

    def __new__(cls, *args, **kwargs):
        if not args and not kwargs and cls._rebuild is not None:
            # transformers >= 5.25 makes these functions `kernels` objects, and a model pickled with
            # them is unpickled by calling type(the module's attribute)() — this switch's class now:
            # give back a fresh object of the type the switch wraps, as it would have been
            return cls._rebuild()
        return super().__new__(cls)

    @classmethod
    def install(cls, original):
        """A switch around ``original``, of a class of its own that rebuilds ``original``'s type
        when called without arguments (what `kernels`' unpickling does; a plain function's type
        cannot be called so, and is never asked to)."""
        rebuild = None if isinstance(original, types.FunctionType) else staticmethod(lambda: type(original)())
        own = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                          "_rebuild": rebuild})
        return own(original)

    def __init__(self, original):
        self.original = original
        self.active = 0
        functools.update_wrapper(self, original)

    def replacement(self):
        return CausalConv()

    def __call__(self, *args, **kwargs):
        return (self.replacement() if self.active else self.original)(*args, **kwargs)


class DeltaRuleSwitch(ConvSwitch):
    """Installed as a modeling module's ``torch_chunk_gated_delta_rule``: per sequence of a packed
    row while a patched GatedDeltaNet's forward runs (``_PerSequenceDeltaRule``), as it was otherwise."""

    fla_core = None  # whether the wrapped function resolves to fla's (asked at the first call)

    def replacement(self):
        if self.fla_core is None:  # asked once: transformers resolves its core at import
            self.fla_core = _is_fla_function(_resolved_core(self.original))
        return _PerSequenceDeltaRule(self.original, self.fla_core)


class _PerSequenceDeltaRule:
    """transformers' PyTorch ``torch_chunk_gated_delta_rule`` takes ``cu_seqlens`` and ignores it:
    in a packed row each sequence's recurrent state would flow into the next. Given boundaries, this
    runs the function once per sequence (a slice of the [1, T, ...] inputs; its initial state, if
    any, the sequence's row of ``initial_state``) and concatenates the outputs along T; the final
    states, when asked for, are stacked one per sequence, as flash-linear-attention returns them.
    Without boundaries, or when the wrapped function is fla's (``fla_core``: its kernel honours
    them), the function runs as it is. Whether fla is installed does not decide it: transformers may
    have resolved its PyTorch function all the same. When the function is fla's, q, k and v reach it
    contiguous, copied by ``contiguous_rows``: the forward splits them out of the convolution's
    output as strided views, which fla would copy at a third of the copy rate."""

    def __init__(self, original, fla_core: bool = False):
        self.original = original
        self.fla_core = fla_core

    def __call__(self, query, key, value, g, beta, *args, cu_seqlens=None, initial_state=None, **kwargs):
        if cu_seqlens is None or self.fla_core:
            if self.fla_core:
                query, key, value = (contiguous_rows(t) for t in (query, key, value))
            return self.original(query, key, value, g, beta, *args, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                 **kwargs)
        if query.shape[0] != 1:
            raise ValueError(f"cu_seqlens: packed sequences come in one row (batch 1), got batch {query.shape[0]}")
        bounds = cu_seqlens.tolist()  # one host sync per layer call: the fallback is slow anyway
        if bounds[0] != 0 or bounds[-1] != query.shape[1] or any(b > e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens: expected 0 = c0 <= c1 <= ... = {query.shape[1]} (the row's tokens), "
                             f"got {bounds}")
        outputs, states = [], []
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            piece = [t[:, start:end] for t in (query, key, value, g, beta)]
            state = None if initial_state is None else initial_state[i:i + 1]
            out, final = self.original(*piece, *args, initial_state=state, **kwargs)
            outputs.append(out)
            states.append(final)
        final = torch.cat(states) if all(s is not None for s in states) else None
        return torch.cat(outputs, dim=1), final


#: The delta-rule switch installed in each modeling module, by module name (as for the conv).
DELTA_RULE_SWITCHES: dict = {}


@contextlib.contextmanager
def switched_to_q35lab(gdn: torch.nn.Module):
    """While the block runs, the GatedDeltaNet's modeling module calls q35lab's convolution and
    delta-rule wrapper (``_PerSequenceDeltaRule``: packed boundaries honoured, q, k, v copied by
    ``contiguous_rows`` for fla) where this layer's conv is patched by its module's switches;
    nothing changes for a layer that is not (or is patched through its own attribute)."""
    switches = []
    if marked(gdn, CONV) not in (None, "attribute"):  # patched through its module's switches
        name = type(gdn).__module__
        switches = [s for s in (CONV_SWITCHES.get(name), DELTA_RULE_SWITCHES.get(name)) if s is not None]
    for switch in switches:
        switch.active += 1
    try:
        yield
    finally:
        for switch in switches:
            switch.active -= 1


def conv_style(gdn: torch.nn.Module) -> str | None:
    """"attribute", "module" or None: where this GatedDeltaNet's convolution function lives."""
    if versions.keeps_kernels_on_the_layer(gdn):
        return "attribute"
    if versions.module_function(versions.modeling_module(gdn), versions.CONV) is not None:
        return "module"
    return None


def conv_problem(gdn: torch.nn.Module) -> str | None:
    style = conv_style(gdn)
    if style is None:
        return "no causal_conv1d_fn in this transformers version"
    if (versions.layer_conv(gdn) is not None if style == "attribute"
            else package_installed("causal_conv1d")):
        return "the causal-conv1d CUDA package runs it"
    return None


def switch_in(module, attribute: str, registry: dict, kind: type) -> None:
    """Make ``registry[module]`` a switch the modeling module calls: the registered one while the
    module's function is still it; a switch found there (put back by whoever replaced it); else a
    new one around what the module calls now. The last covers a function replaced after an
    earlier patch (another library, a monkeypatch undone): the layers would otherwise toggle a
    switch nothing calls, and packed sequences would leak while the report said they do not."""
    current = getattr(module, attribute)
    if registry.get(module.__name__) is current:
        return
    if not isinstance(current, kind):  # delegates to ``current`` while no patched layer runs
        current = kind.install(current)
        setattr(module, attribute, current)
    registry[module.__name__] = current


def _resolved_core(function):
    """The function a modeling module's delta-rule name really calls: through q35lab's switch
    (``.original``) and transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper, which
    picks an implementation once, at import, and keeps it in its closure as ``implementation``
    (the package's function, or its own PyTorch one when the import failed for any reason)."""
    return versions.hub_implementation(getattr(function, "original", function))


def core_groups_key_heads(gdn: torch.nn.Module) -> bool:
    """Whether both cores the forward can call (the chunked one; the recurrent one, for a cached
    decode) are flash-linear-attention's functions, as transformers resolved them."""
    module = sys.modules[type(gdn).__module__]
    names = (versions.CHUNK_CORE, versions.RECURRENT_CORE)
    return all(_is_fla_function(_resolved_core(getattr(module, name, None))) for name in names)


def _is_fla_function(function) -> bool:
    """Whether ``function`` (as ``_resolved_core`` finds it) is one of flash-linear-attention's."""
    return callable(function) and getattr(function, "__module__", "").startswith("fla.")


def repeats_key_heads(gdn: torch.nn.Module) -> bool:
    """Whether the GatedDeltaNet's forward repeats q and k to the value heads before any core.

    transformers before 5.23 does (``repeat_interleave``, a copy of both, and a sum in the
    backward: 54 ms of a 9B step at 32k); flash-linear-attention's kernels take fewer key heads
    than value heads and read key head ``i // (Hv/Hk)`` for value head ``i``, which is
    ``repeat_interleave``'s own order (fla 0.6: ``chunk_delta_h.py``, ``wy_fast.py``,
    ``fused_recurrent.py``). transformers' PyTorch core broadcasts the heads and needs the repeat,
    and so does ``torch.export``, under which transformers always calls it (not supported here)."""
    return gdn.num_v_heads != gdn.num_k_heads and forward_repeats_key_heads(type(gdn))


@functools.cache
def package_installed(package: str) -> bool:
    """Whether ``package`` can be imported: asked once a process (the delta-rule switch asks at every
    call, and a lookup walks sys.path)."""
    return importlib.util.find_spec(package) is not None


def triton_at_least(version: tuple[int, ...]) -> bool:
    import triton

    digits = [int("".join(c for c in part if c.isdigit()) or 0) for part in triton.__version__.split(".")[:3]]
    return tuple(digits) >= version


def core_is_fla(gdn: torch.nn.Module) -> bool:
    """Whether the chunked delta-rule core this GatedDeltaNet calls is fla's, as transformers
    resolved it: the layer's own attribute (older transformers) or its module's function (through
    the hub wrapper). Not whether fla is installed: transformers may have resolved its PyTorch
    function all the same, and that one ignores packed sequences' boundaries."""
    return _is_fla_function(_resolved_core(core_function(gdn)))


def packing_problem(gdn: torch.nn.Module) -> str | None:
    """Why this GatedDeltaNet cannot keep sequences packed in one row (cu_seq_lens_q) apart, or None."""
    conv_ok = marked(gdn, CONV) is not None or conv_problem(gdn) == "the causal-conv1d CUDA package runs it"
    core_ok = core_is_fla(gdn) or type(gdn).__module__ in DELTA_RULE_SWITCHES and marked(gdn, CONV) is not None
    missing = [what for what, ok in (("causal conv1d", conv_ok), ("delta rule", core_ok)) if not ok]
    if not missing:
        return None
    return (f"transformers' PyTorch {' and '.join(missing)} cannot keep the sequences of a packed row apart (the "
            "boundaries are ignored or refused); patch with conv=True (or install flash-linear-attention and "
            "causal-conv1d)")


def modeling_module(gdn: torch.nn.Module):
    return sys.modules[type(gdn).__module__]


def conv_function(gdn: torch.nn.Module):
    """The causal conv1d the GatedDeltaNet's own forward calls, by transformers' convention
    ``fn(x [B, C, T], weight [C, K], bias, activation=..., **kwargs)``: q35lab's when patched
    (``conv=True``), else the layer's attribute (transformers < 5.15) or its modeling module's
    function (the causal-conv1d package's, or transformers' PyTorch one). None if there is none."""
    if marked(gdn, CONV) is not None:
        return CausalConv()
    attribute = versions.layer_conv(gdn)
    if callable(attribute):
        return attribute
    return versions.module_function(modeling_module(gdn), versions.CONV)


def core_function(gdn: torch.nn.Module):
    """The chunked delta-rule core the GatedDeltaNet's own forward calls: the layer's attribute
    (transformers < 5.15), else its modeling module's ``torch_chunk_gated_delta_rule`` — fla's
    ``chunk_gated_delta_rule`` when flash-linear-attention is installed, transformers' PyTorch one
    otherwise (looked up at each call, as the forward does: a timer wrapping it sees the tiles)."""
    attribute = versions.layer_core(gdn)
    if callable(attribute):
        return attribute
    return versions.module_function(modeling_module(gdn), versions.CHUNK_CORE)


#: Whether a GatedDeltaNet class's forward repeats q and k to the value heads itself (by version).
forward_repeats_key_heads = versions.forward_repeats_key_heads


def gated_delta_net_problem(gdn: torch.nn.Module) -> str | None:
    """Why ``tiled_gated_delta_net`` cannot compute this module, or None if it can."""
    if not is_gated_delta_net(gdn):
        return f"{type(gdn).__name__} is not a transformers GatedDeltaNet"
    if conv_function(gdn) is None:
        return "no causal_conv1d_fn in this transformers version (the layer's own conv module is not tiled)"
    if core_function(gdn) is None:
        return "no chunk_gated_delta_rule in this transformers version"
    return None
