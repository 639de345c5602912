"""Patch a transformers Qwen3.5 model (bare, or wrapped by PEFT) with q35lab's kernels.

``apply_to_qwen3_5`` walks the module tree and swaps each module it knows for q35lab's
equivalent *in place*, reusing the original parameters (same objects, so optimizers, PEFT and
checkpoints keep seeing them). ``revert`` puts the originals back. Both are idempotent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import numbers
import sys
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from . import long_context, packed_attention
from .hf import versions
# apply_to_qwen3_5's argument long_context hides the module: what it calls by name
from .long_context import _check_tile_tokens, tile_only_above as _tile_only_above
from .ops._checks import check_bool, check_module
from .ops._compile import opaque_to_compile
from .ops.causal_conv1d import causal_conv1d
from .ops.contiguous_rows import contiguous_rows
from .ops.gated_rms_norm import GatedRMSNorm
from .ops.fused_projections import (ConcatCache, Projection, _rows_of_one_buffer, fused_lora_projections, pack_rows,
                                     unpack_rows)
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.lora import _compute_dtype, lora_linear
from .ops.offset_rms_norm import OffsetRMSNorm
from .ops import swiglu as swiglu_ops
from .ops.routed_experts import routed_experts

__all__ = ["PatchReport", "apply_to_qwen3_5", "revert", "route_lora"]

#: transformers classes computing x̂·(1+w) with Gemma-style casting (checked line by line
#: against ``offset_rms_norm_ref`` in tests/test_patch.py).
OFFSET_RMS_NORM_CLASSES = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")

#: transformers' gated norms after each GatedDeltaNet: w · bf16(x̂), rounded three times ("hf").
HF_GATED_NORM_CLASSES = ("Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated")

_ORIGINAL = "_q35lab_original"  # attribute of a patched module: the module it replaced
_LORA_PATCHED = "_q35lab_lora"  # attribute of a PEFT LoRA layer whose forward q35lab routes
_IN_PROJ = "_q35lab_in_proj"  # attribute of a GatedDeltaNet projection computed by its group
_FLCE = "_q35lab_flce"  # attribute of a causal LM whose loss goes through linear_cross_entropy


@dataclass
class PatchReport:
    """What ``apply_to_qwen3_5``, ``route_lora`` or ``revert`` did; ``print`` it for a summary.

    Attributes:
        replaced (Counter): what was patched (mostly the original class name) → count.
        left_alone (Counter): ``"class: why"`` → count, for modules q35lab cannot compute exactly.
        already_patched (int): modules patched by an earlier call, left as they are.
        not_applied (dict): flag → why it did nothing.
        reverted (Counter): class name → count (``revert``).
        qwen3_5 (bool): whether a Qwen3.5 module was found (``apply_to_qwen3_5`` patches nothing else).
        runs (dict): what computes the parts q35lab does not replace, or replaces only sometimes
            (the delta-rule core, the causal conv1d, packed batches, the long-context plan), and
            what to do where it is slow.
    """

    replaced: Counter = field(default_factory=Counter)
    left_alone: Counter = field(default_factory=Counter)
    already_patched: int = 0
    not_applied: dict = field(default_factory=dict)
    reverted: Counter = field(default_factory=Counter)
    qwen3_5: bool = True
    runs: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.replaced.values())

    @property
    def nothing_to_patch(self) -> bool:
        return self.total == 0 and self.already_patched == 0 and not self.reverted

    def __str__(self) -> str:
        lines = []
        for name, count in sorted(self.replaced.items()):
            lines.append(f"replaced {count} × {name}")
        for why, count in sorted(self.left_alone.items()):
            lines.append(f"left {count} × {why}")
        for name, count in sorted(self.reverted.items()):
            lines.append(f"restored {count} × {name}")
        if self.already_patched:
            lines.append(f"{self.already_patched} module(s) already patched, left as they are")
        if self.nothing_to_patch:
            why = "" if self.qwen3_5 else ": not a Qwen3.5 model (no Qwen3.5 module found)"
            lines.append(f"nothing to patch{why}")
        for flag, why in self.not_applied.items():
            lines.append(f"{flag}: {why}")
        for part, what in self.runs.items():
            lines.append(f"{part}: {what}")
        return "PatchReport(\n  " + "\n  ".join(lines) + "\n)"


def _marked(module: torch.nn.Module, marker: str):
    """The value q35lab stored on this very module under ``marker`` (None if absent).

    Read from the module's own ``__dict__``: wrappers such as PeftModel forward attribute
    look-ups to the model inside, so ``hasattr`` would see the inner model's mark.
    """
    return vars(module).get(marker)


class _Forward:
    """The instance-level ``forward`` q35lab gives a module (``nn.Module.__call__`` prefers it).

    An object that holds its module rather than a closure over it: ``copy.deepcopy`` then gives
    the copy a forward bound to the copied module (deepcopy's memo maps one to the other), and
    ``pickle``/``torch.save`` store it by its class's name. ``inspect.signature`` follows
    ``__wrapped__`` to the class's own forward, so Trainer still sees the forward's arguments.
    Subclasses implement ``__call__``.
    """

    __name__ = "forward"

    def __init__(self, module: torch.nn.Module):
        self.module = module

    @property
    def __wrapped__(self):
        return type(self.module).forward.__get__(self.module)

    def __repr__(self) -> str:
        return f"<q35lab {type(self).__name__} of {type(self.module).__name__}>"


def _override_forward(module: torch.nn.Module, marker: str, forward_class: type, problem: str | None,
                      label: str, report: "PatchReport") -> None:
    """Give ``module`` an instance-level forward of ``forward_class``, unless it already has one
    of ours or ``problem`` says it cannot be handled exactly; the report says which."""
    if _marked(module, marker) is not None:
        report.already_patched += 1
    elif problem:
        report.left_alone[f"{label}: {problem}"] += 1
    else:
        module.forward = forward_class(module)
        object.__setattr__(module, marker, True)
        report.replaced[label] += 1


def _restore_forward(module: torch.nn.Module, marker: str, label: str, report: "PatchReport") -> None:
    if _marked(module, marker) is not None:
        del module.forward
        object.__delattr__(module, marker)
        report.reverted[label] += 1


def _named_children_everywhere(model: torch.nn.Module):
    """Yield (parent, attribute name, child) for every submodule, parents first."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            yield parent, name, child


def _share_weight(patched: torch.nn.Module, original: torch.nn.Module) -> torch.nn.Module:
    """Give ``patched`` the original's weight Parameter (same object) and remember the original."""
    patched.weight = original.weight  # training state, optimizer and PEFT references carry over
    patched.train(original.training)
    object.__setattr__(patched, _ORIGINAL, original)  # not a submodule: no duplicate state
    return patched


def _offset_norm_from(original: torch.nn.Module) -> OffsetRMSNorm:
    return _share_weight(OffsetRMSNorm(original.weight.shape[0], eps=original.eps, device="meta"), original)


def _gated_norm_from_hf(original: torch.nn.Module) -> GatedRMSNorm:
    width, eps = original.weight.shape[0], original.variance_epsilon
    return _share_weight(GatedRMSNorm(width, eps=eps, rounding="hf", device="meta"), original)


def _gated_norm_from_fla(original: torch.nn.Module) -> GatedRMSNorm | str:
    """flash-linear-attention's FusedRMSNormGated, when it computes what ours does."""
    if original.activation not in ("swish", "silu"):
        return f"activation {original.activation!r} (only silu/swish is fused here)"
    if original.weight is None or getattr(original, "bias", None) is not None:
        return "no weight or a bias (not the GatedDeltaNet norm)"
    width = original.weight.shape[0]
    return _share_weight(GatedRMSNorm(width, eps=original.eps, rounding="fused", device="meta"), original)


# ----------------------------------------------------------------------------------------------
# PEFT LoRA Linear layers: the layer object stays (PEFT's merge, save, adapter switching keep
# working); its forward is routed through lora_linear whenever the call is one lora_linear
# computes exactly, and falls back to PEFT's own forward otherwise.
# ----------------------------------------------------------------------------------------------
def _is_peft_lora_linear(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Linear" and cls.__module__.startswith("peft.tuners.lora")


def _lora_static_problem(layer: torch.nn.Module) -> str | None:
    """Why lora_linear can never compute this layer exactly, or None if it can."""
    base = layer.base_layer
    if type(base) is not torch.nn.Linear:
        return f"base layer {type(base).__name__} (quantized or custom)"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    if getattr(layer, "lora_variant", None):
        return "a LoRA variant (DoRA or similar)"
    for name in layer.lora_A:
        a, b = layer.lora_A[name], layer.lora_B[name]
        if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or a.bias is not None or b.bias is not None:
            return "adapter matrices with a bias or of another type"
        dropout = layer.lora_dropout[name]
        if not isinstance(dropout, (torch.nn.Identity, torch.nn.Dropout)):
            return f"dropout module {type(dropout).__name__}"
    return None


def _lora_call(layer: torch.nn.Module, x: torch.Tensor, args: tuple, kwargs: dict):
    """lora_linear for this call, or None when PEFT's own forward must run."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    base, dropout = layer.base_layer, layer.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) and dropout.training else 0.0
    return lora_linear(x, base.weight, layer.lora_A[name].weight, layer.lora_B[name].weight,
                       layer.scaling[name], base.bias, p)


class _RoutedLoRAForward(_Forward):
    """A PEFT LoRA layer's forward: lora_linear when it computes the call exactly, else PEFT's."""

    def __call__(self, x, *args, **kwargs):
        out = _lora_call(self.module, x, args, kwargs)
        return type(self.module).forward(self.module, x, *args, **kwargs) if out is None else out


def _route_lora(layer: torch.nn.Module, report: "PatchReport") -> None:
    _override_forward(layer, _LORA_PATCHED, _RoutedLoRAForward, _lora_static_problem(layer),
                      "PEFT lora.Linear (forward)", report)


def _unroute_lora(layer: torch.nn.Module, report: "PatchReport") -> None:
    _restore_forward(layer, _LORA_PATCHED, "PEFT lora.Linear (forward)", report)


# ----------------------------------------------------------------------------------------------
# GatedDeltaNet in_proj fusion: the four projections of one input become one autograd node. The
# module tree is left as it is (state-dict keys, PEFT's methods); each projection's forward asks
# its group, and the first call with a new input computes all four outputs at once.
# ----------------------------------------------------------------------------------------------
IN_PROJ_NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _is_gated_delta_net(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__.endswith("GatedDeltaNet") and cls.__module__.startswith("transformers.") and all(
        hasattr(module, name) for name in IN_PROJ_NAMES)


def _base_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The frozen Linear itself, or the one a PEFT LoRA layer wraps."""
    return getattr(module, "base_layer", module)


def _base_is_trainable(module: torch.nn.Module) -> bool:
    base = _base_layer(module)
    return base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)


def _projection_problem(module: torch.nn.Module) -> str | None:
    if _base_is_trainable(module):
        return "trainable base projection (full fine-tuning; the fusion is for frozen bases)"
    if type(module) is torch.nn.Linear:
        return None
    if _is_peft_lora_linear(module):
        return _lora_static_problem(module)
    return f"{type(module).__name__} projection"


def _projection_now(module: torch.nn.Module) -> Projection | None:
    """This call's Projection for ``module``, or None when only its own forward is exact."""
    if _base_is_trainable(module):  # unfrozen after patching
        return None
    if type(module) is torch.nn.Linear:
        return Projection(module.weight, module.bias)
    base = module.base_layer
    if module.disable_adapters and module.merged:  # PEFT's forward unmerges first: only it is exact
        return None
    if module.disable_adapters or module.merged:  # PEFT's forward is then base_layer(x) alone
        return Projection(base.weight, base.bias)
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) > 1 or (active and active[0] in getattr(module, "lora_variant", {})):
        return None
    if not active:
        return Projection(base.weight, base.bias)
    name = active[0]
    dropout = module.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) and dropout.training else 0.0
    return Projection(base.weight, base.bias, module.lora_A[name].weight, module.lora_B[name].weight,
                      module.scaling[name], p)


class _ProjectionGroup:
    """Projections of one shared input (a GatedDeltaNet's four in_proj, an MLP's gate and up),
    computed together by ``fused_lora_projections``; ``own_buffer``: the indices of those whose
    output gets a contiguous buffer of its own (see there)."""

    def __init__(self, modules: list[torch.nn.Module], own_buffer: tuple[int, ...] = ()):
        self.modules = modules
        self.own_buffer = own_buffer
        # The four frozen base weights moved into one buffer, so that the fused GEMM's
        # concatenated weight is a view of it rather than a second copy of the weights.
        self.packed = pack_rows([_base_layer(m).weight for m in modules])
        self._reset()

    def _reset(self) -> None:
        # a copy (weights not one buffer: FSDP2's gathered ones, or split by a later .to()) lives
        # only while the step needs it, not between steps
        self.cache = ConcatCache(keep_copies=False)
        self.input_key = None
        self.pending: dict[int, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) keeps the modules, not the outputs or weights of this step.
        return {"modules": self.modules, "packed": self.packed, "own_buffer": self.own_buffer}

    def __setstate__(self, state: dict) -> None:
        self.modules = state["modules"]
        self.own_buffer = state.get("own_buffer", ())
        # deepcopy and pickle give each weight a buffer of its own: packed again at the first call
        self.packed = None if state["packed"] else False
        self._reset()

    @opaque_to_compile  # keyed on the input's identity and version: eager Python state
    def output(self, index: int, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        module = self.modules[index]
        if args or kwargs:
            return type(module).forward(module, x, *args, **kwargs)
        key = (id(x), x._version, x.data_ptr(), torch.is_grad_enabled(),
               torch.is_autocast_enabled(x.device.type))
        if key != self.input_key or index not in self.pending:
            outputs = self.fused(x)
            if outputs is None:  # e.g. two active adapters: PEFT's own path
                return type(module).forward(module, x)
            self.pending = dict(enumerate(outputs))
            self.input_key = key
        return self.pending.pop(index)

    def fused(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Every projection's output of ``x`` from one fused node, or None when one of them
        must run its own forward this call."""
        if self.packed is None:
            self.packed = _pack_again([_base_layer(m).weight for m in self.modules])
        projections = [_projection_now(m) for m in self.modules]
        if any(p is None for p in projections):
            return None
        return fused_lora_projections(x, projections, cache=self.cache, own_buffer=self.own_buffer)


def _pack_again(weights: list[torch.Tensor]) -> bool:
    """Pack a copied group's weights, unless they still lie back to back (torch.load keeps the
    buffer they shared when saved; deepcopy gives each weight its own)."""
    if _rows_of_one_buffer(weights, weights[0].dtype) is not None:
        return True
    with torch.no_grad():
        return pack_rows(weights)


class _InProjForward(_Forward):
    """One in_proj projection's forward: its output from the group's fused computation."""

    def __init__(self, module: torch.nn.Module, group: _ProjectionGroup, index: int):
        super().__init__(module)
        self.group, self.index = group, index

    def __call__(self, x, *args, **kwargs):
        return self.group.output(self.index, x, args, kwargs)


# The group's order: z last and in a buffer of its own. The GatedDeltaNet reshapes z to
# [T·heads, head_dim] for its norm, which copies a column block of a shared buffer (256 MiB at
# 32k tokens, kept for the norm's backward beside the shared buffer's own z columns); qkv, b and
# a are read where they lie (the convolution and elementwise ops take strides), so they share
# one buffer and one GEMM.
IN_PROJ_GROUP = (*(name for name in IN_PROJ_NAMES if name != "in_proj_z"), "in_proj_z")
IN_PROJ_OWN_BUFFER = (IN_PROJ_GROUP.index("in_proj_z"),)


def _fuse_in_proj(gdn: torch.nn.Module, report: "PatchReport") -> None:
    modules = [getattr(gdn, name) for name in IN_PROJ_GROUP]
    if any(_marked(m, _IN_PROJ) is not None for m in modules):
        report.already_patched += 1
        return
    problems = [p for p in map(_projection_problem, modules) if p]
    if problems:
        report.left_alone[f"{type(gdn).__name__} in_proj: {problems[0]}"] += 1
        return
    group = _ProjectionGroup(modules, own_buffer=IN_PROJ_OWN_BUFFER)
    for index, module in enumerate(modules):
        if _marked(module, _LORA_PATCHED) is not None:  # routed by lora=True earlier: the group takes over
            _unroute_lora(module, PatchReport())
        module.forward = _InProjForward(module, group, index)
        object.__setattr__(module, _IN_PROJ, group)
    report.replaced[f"{type(gdn).__name__} in_proj (4 projections, 1 node)"] += 1


def _unfuse_in_proj(module: torch.nn.Module, report: "PatchReport") -> None:
    group = _marked(module, _IN_PROJ)
    if group is not None:
        del module.forward
        object.__delattr__(module, _IN_PROJ)
        if module is group.modules[0]:
            if group.packed:  # each weight in a buffer of its own again, as transformers made them
                unpack_rows([_base_layer(m).weight for m in group.modules])
            report.reverted["GatedDeltaNet in_proj"] += 1


# ----------------------------------------------------------------------------------------------
# The GatedDeltaNet's causal convolution. transformers calls ``causal_conv1d_fn`` on the in_proj
# output transposed to [B, C, T] and transposes the result back; q35lab's kernel reads the
# channels-last tensor underneath that view, so neither transpose copies. Where the function
# lives depends on the transformers version: an attribute of each GatedDeltaNet (None when the
# causal-conv1d package is missing; transformers < 5.15), or a function of the modeling module
# (5.15 on), which a patched layer's forward switches to q35lab's for the duration of its call.
# ----------------------------------------------------------------------------------------------
_CONV = "_q35lab_conv"  # attribute of a GatedDeltaNet whose convolution q35lab computes


class _CausalConv:
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
_CONV_SWITCHES: dict = {}


class _ConvSwitch:
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
        return _CausalConv()

    def __call__(self, *args, **kwargs):
        return (self.replacement() if self.active else self.original)(*args, **kwargs)


class _DeltaRuleSwitch(_ConvSwitch):
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
_DELTA_RULE_SWITCHES: dict = {}


@contextlib.contextmanager
def switched_to_q35lab(gdn: torch.nn.Module):
    """While the block runs, the GatedDeltaNet's modeling module calls q35lab's convolution and
    delta-rule wrapper (``_PerSequenceDeltaRule``: packed boundaries honoured, q, k, v copied by
    ``contiguous_rows`` for fla) where this layer's conv is patched by its module's switches;
    nothing changes for a layer that is not (or is patched through its own attribute)."""
    switches = []
    if _marked(gdn, _CONV) not in (None, "attribute"):  # patched through its module's switches
        name = type(gdn).__module__
        switches = [s for s in (_CONV_SWITCHES.get(name), _DELTA_RULE_SWITCHES.get(name)) if s is not None]
    for switch in switches:
        switch.active += 1
    try:
        yield
    finally:
        for switch in switches:
            switch.active -= 1


class _SwitchedConvForward(_Forward):
    """A GatedDeltaNet's own forward, with its module's convolution switched to q35lab's (and its
    PyTorch delta rule to one that honours packed sequences' boundaries)."""

    def __call__(self, *args, **kwargs):
        with switched_to_q35lab(self.module):
            return type(self.module).forward(self.module, *args, **kwargs)


def _conv_style(gdn: torch.nn.Module) -> str | None:
    """"attribute", "module" or None: where this GatedDeltaNet's convolution function lives."""
    if versions.keeps_kernels_on_the_layer(gdn):
        return "attribute"
    if versions.module_function(versions.modeling_module(gdn), versions.CONV) is not None:
        return "module"
    return None


def _conv_problem(gdn: torch.nn.Module) -> str | None:
    style = _conv_style(gdn)
    if style is None:
        return "no causal_conv1d_fn in this transformers version"
    if (versions.layer_conv(gdn) is not None if style == "attribute"
            else _installed("causal_conv1d")):
        return "the causal-conv1d CUDA package runs it"
    return None


def _patch_conv(gdn: torch.nn.Module, report: "PatchReport") -> None:
    label = f"{type(gdn).__name__} causal conv1d"
    problem = _conv_problem(gdn)
    if _marked(gdn, _CONV) is not None:
        report.already_patched += 1
    elif problem:
        report.left_alone[f"{label}: {problem}"] += 1
    elif _conv_style(gdn) == "attribute":
        gdn.causal_conv1d_fn = _CausalConv()
        object.__setattr__(gdn, _CONV, "attribute")
        report.replaced[label] += 1
    else:
        module = sys.modules[type(gdn).__module__]
        _switch_in(module, "causal_conv1d_fn", _CONV_SWITCHES, _ConvSwitch)
        if versions.module_function(module, versions.CHUNK_CORE) is not None:
            _switch_in(module, versions.CHUNK_CORE, _DELTA_RULE_SWITCHES, _DeltaRuleSwitch)
        _override_forward(gdn, _CONV, _SwitchedConvForward, None, label, report)


def _switch_in(module, attribute: str, registry: dict, kind: type) -> None:
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


def _unpatch_conv(gdn: torch.nn.Module, report: "PatchReport") -> None:
    style = _marked(gdn, _CONV)
    if style == "attribute":
        gdn.causal_conv1d_fn = None
        object.__delattr__(gdn, _CONV)
        report.reverted[f"{type(gdn).__name__} causal conv1d"] += 1
    elif style is not None:
        _restore_forward(gdn, _CONV, f"{type(gdn).__name__} causal conv1d", report)


_KEY_HEADS = "_q35lab_key_heads"  # attribute of a GatedDeltaNet whose q/k head repeat q35lab skips: its num_k_heads


def _resolved_core(function):
    """The function a modeling module's delta-rule name really calls: through q35lab's switch
    (``.original``) and transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper, which
    picks an implementation once, at import, and keeps it in its closure as ``implementation``
    (the package's function, or its own PyTorch one when the import failed for any reason)."""
    return versions.hub_implementation(getattr(function, "original", function))


def _core_groups_key_heads(gdn: torch.nn.Module) -> bool:
    """Whether both cores the forward can call (the chunked one; the recurrent one, for a cached
    decode) are flash-linear-attention's functions, as transformers resolved them."""
    module = sys.modules[type(gdn).__module__]
    names = (versions.CHUNK_CORE, versions.RECURRENT_CORE)
    return all(_is_fla_function(_resolved_core(getattr(module, name, None))) for name in names)


def _is_fla_function(function) -> bool:
    """Whether ``function`` (as ``_resolved_core`` finds it) is one of flash-linear-attention's."""
    return callable(function) and getattr(function, "__module__", "").startswith("fla.")


def _repeats_key_heads(gdn: torch.nn.Module) -> bool:
    """Whether the GatedDeltaNet's forward repeats q and k to the value heads before any core.

    transformers before 5.23 does (``repeat_interleave``, a copy of both, and a sum in the
    backward: 54 ms of a 9B step at 32k); flash-linear-attention's kernels take fewer key heads
    than value heads and read key head ``i // (Hv/Hk)`` for value head ``i``, which is
    ``repeat_interleave``'s own order (fla 0.6: ``chunk_delta_h.py``, ``wy_fast.py``,
    ``fused_recurrent.py``). transformers' PyTorch core broadcasts the heads and needs the repeat,
    and so does ``torch.export``, under which transformers always calls it (not supported here)."""
    return gdn.num_v_heads != gdn.num_k_heads and long_context._forward_repeats_key_heads(type(gdn))


def _skip_key_head_repeat(gdn: torch.nn.Module, report: "PatchReport") -> None:
    """The forward repeats by ``num_v_heads // num_k_heads``: with ``num_k_heads`` set to the value
    heads on this module, the factor is 1 and q, k reach fla's core as the projections made them.
    The forward reads ``num_k_heads`` for nothing else (its dimensions are set at construction)."""
    if _marked(gdn, _KEY_HEADS) is not None:
        report.already_patched += 1
    elif not _repeats_key_heads(gdn):
        return
    elif not _core_groups_key_heads(gdn):
        report.left_alone[f"{type(gdn).__name__} q/k head repeat: transformers calls its PyTorch core, not "
                          "flash-linear-attention's, which alone reads grouped key heads"] += 1
    else:
        object.__setattr__(gdn, _KEY_HEADS, gdn.num_k_heads)
        gdn.num_k_heads = gdn.num_v_heads
        report.replaced[f"{type(gdn).__name__} q/k head repeat (skipped: fla's core groups the key heads)"] += 1


def _unskip_key_head_repeat(gdn: torch.nn.Module, report: "PatchReport") -> None:
    heads = _marked(gdn, _KEY_HEADS)
    if heads is not None:
        gdn.num_k_heads = heads
        object.__delattr__(gdn, _KEY_HEADS)
        report.reverted[f"{type(gdn).__name__} q/k head repeat"] += 1


# ----------------------------------------------------------------------------------------------
# The MLP, down(silu(gate(x)) · up(x)): gate and up share their input, so with frozen bases they
# become one fused node like the in_proj (their weights packed into one buffer), and the SwiGLU
# between them is one Triton kernel forward and backward, which also computes down_proj
# (swiglu_down) where its own forward is not needed: see _MLPForward. Anything the fusion cannot
# compute exactly keeps the projections' own forwards; the SwiGLU kernel runs either way.
# ----------------------------------------------------------------------------------------------
MLP_CLASSES = ("Qwen3_5MLP", "Qwen3_5MoeMLP")
_MLP = "_q35lab_mlp"  # attribute of an MLP whose forward q35lab computes


def _is_swiglu_mlp(module: torch.nn.Module) -> bool:
    cls = type(module)
    return (cls.__name__ in MLP_CLASSES and cls.__module__.startswith("transformers.")
            and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")))


def _mlp_problem(mlp: torch.nn.Module) -> str | None:
    if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(mlp.act_fn).__name__} (only SiLU is fused here)"
    return None


class _MLPForward(_Forward):
    """``down(swiglu(gate(x), up(x)))`` with gate and up fused when their bases are frozen, and
    the SwiGLU and the down projection two nodes (``swiglu_down``: ``h`` is not kept for the
    backward) when this call's down projection is a frozen base with at most one adapter,
    without dropout or hooks, in the input's own compute dtype."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        pair = [module.gate_proj, module.up_proj]
        fusable = not any(map(_projection_problem, pair))
        self.group = _ProjectionGroup(pair) if fusable else None
        self.down_fusable = _projection_problem(module.down_proj) is None  # what a call cannot change

    def __call__(self, x):
        mlp = self.module
        # the fused group leaves gate_proj's and up_proj's module calls out: a hook on either (PEFT's
        # adapter_names pre-hooks of a mixed-adapter batch among them) needs those calls
        hooked = self.group is not None and _hooks_would_see(*mlp.gate_proj.modules(), *mlp.up_proj.modules())
        gate_up = self.group.fused(x) if self.group is not None and not hooked else None
        gate, up = gate_up if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
        down = self._down_now(gate)
        if down is None:
            return mlp.down_proj(swiglu_ops.swiglu(gate, up, rounding="hf"))
        return swiglu_ops.swiglu_down(gate, up, down.weight, down.lora_A, down.lora_B, down.scaling, down.bias,
                                      rounding="hf")

    def _down_now(self, gate: torch.Tensor) -> Projection | None:
        """This call's down projection as a ``Projection`` for ``swiglu_down``, or None when its
        own forward must run (see the class docstring)."""
        down_proj = self.module.down_proj
        if not self.down_fusable or _hooks_would_see(*down_proj.modules()):
            return None
        down = _projection_now(down_proj)
        if down is None or down.dropout or _compute_dtype(gate) != gate.dtype:
            return None
        if down.lora_A is not None and _is_peft_lora_linear(down_proj) and _marked(down_proj, _LORA_PATCHED) is None:
            return None  # lora=False: the adapter's math stays PEFT's, as on every other projection
        return down


def _patch_mlp(mlp: torch.nn.Module, report: "PatchReport") -> None:
    _override_forward(mlp, _MLP, _MLPForward, _mlp_problem(mlp), f"{type(mlp).__name__} (SwiGLU)", report)
    forward = vars(mlp).get("forward")
    if _marked(mlp, _MLP) is True and forward.group is not None:  # newly patched, gate and up fused
        for proj in forward.group.modules:  # the group computes them: no routing of their own
            _unroute_lora(proj, PatchReport())
        object.__setattr__(mlp, _MLP, forward.group)  # the mark is the group, as for the in_proj
        report.replaced[f"{type(mlp).__name__} gate/up (2 projections, 1 node)"] += 1


def _unpatch_mlp(mlp: torch.nn.Module, report: "PatchReport") -> None:
    group = _marked(mlp, _MLP)
    if isinstance(group, _ProjectionGroup) and group.packed:
        unpack_rows([_base_layer(m).weight for m in group.modules])
    _restore_forward(mlp, _MLP, f"{type(mlp).__name__} (SwiGLU)", report)


# ----------------------------------------------------------------------------------------------
# The MoE's routed experts (frozen in a LoRA fine-tune: PEFT's "all-linear" wraps nn.Linear, and
# the experts are 3-D parameters): sorted by expert, two grouped GEMMs, the router's weight folded
# into one SwiGLU kernel, and a gather and a slot sum in Triton instead of transformers' PyTorch
# ops on [tokens·k, hidden] tensors (q35lab.ops.routed_experts). Trainable expert weights (a full
# fine-tune, or PEFT's target_parameters) keep transformers' forward, checked at every call.
# ----------------------------------------------------------------------------------------------
EXPERTS_CLASSES = ("Qwen3_5MoeExperts",)
_EXPERTS = "_q35lab_experts"


def _is_routed_experts(module: torch.nn.Module) -> bool:
    cls = type(module)
    return (cls.__name__ in EXPERTS_CLASSES and cls.__module__.startswith("transformers.")
            and all(isinstance(getattr(module, n, None), torch.Tensor) for n in ("gate_up_proj", "down_proj")))


def _experts_problem(experts: torch.nn.Module) -> str | None:
    if type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(getattr(experts, 'act_fn', None)).__name__} (only SiLU is fused here)"
    layout = {"has_bias": False, "is_transposed": False, "has_gate": True, "has_post_expert_norm": False}
    if any(getattr(experts, name, default) != default for name, default in layout.items()):
        return "a weight layout other than Qwen3.5's (bias, transposed, ungated or post-norm experts)"
    if getattr(experts, "_is_expert_parallel", False):
        return "expert parallelism (its sentinel expert ids)"
    if experts.gate_up_proj.requires_grad or experts.down_proj.requires_grad:
        return "trainable expert weights (the fused path is for frozen experts, as in a LoRA fine-tune)"
    return None


class _ExpertsForward(_Forward):
    """``routed_experts`` while the expert weights are frozen; transformers' forward otherwise."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        experts = self.module
        if experts.gate_up_proj.requires_grad or experts.down_proj.requires_grad:
            return type(experts).forward(experts, hidden_states, top_k_index, top_k_weights)
        return routed_experts(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj)


def _patch_experts(experts: torch.nn.Module, report: "PatchReport") -> None:
    _override_forward(experts, _EXPERTS, _ExpertsForward, _experts_problem(experts),
                      f"{type(experts).__name__} (routed experts)", report)


def _unpatch_experts(experts: torch.nn.Module, report: "PatchReport") -> None:
    _restore_forward(experts, _EXPERTS, f"{type(experts).__name__} (routed experts)", report)


# ----------------------------------------------------------------------------------------------
# The loss: with labels, the causal LM's forward runs with its lm_head swapped for an identity
# (its "logits" are then the hidden states, and nothing vocabulary-sized is made), and the loss
# is computed by linear_cross_entropy from the hidden states and lm_head's weight, with the
# model's own loss semantics (shifted labels, ignore_index, num_items_in_batch). Logits are not
# returned then. Without labels the forward is the model's own.
# ----------------------------------------------------------------------------------------------
FLCE_CLASSES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


class _HiddenStates(torch.nn.Module):
    def forward(self, hidden_states):
        return hidden_states


def causal_lm_loss(hidden_states, head_weight, labels, *, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None):
    """transformers' ForCausalLMLoss over ``hidden_states @ head_weightᵀ``, without the logits."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    shift_labels = shift_labels.to(hidden_states.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(hidden_states, head_weight, shift_labels, ignore_index=ignore_index,
                                reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _head_linear(head) -> torch.nn.Linear | None:
    """The plain ``nn.Linear`` that computes the head right now: the head itself, or, for a head
    that PEFT trains whole (``modules_to_save``, e.g. new tokens), the copy of the one active
    adapter, or the original when adapters are disabled. None for anything else."""
    if type(head).__name__ == "ModulesToSaveWrapper":
        active = getattr(head, "active_adapters", None) or [getattr(head, "active_adapter", None)]
        if getattr(head, "disable_adapters", False) or active[0] not in head.modules_to_save:
            head = head.original_module
        elif len(active) == 1:
            head = head.modules_to_save[active[0]]
        else:
            return None
    return head if type(head) is torch.nn.Linear else None


def _flce_problem(model: torch.nn.Module) -> str | None:
    head = getattr(model, "lm_head", None)
    linear = _head_linear(head)
    if linear is None:
        return f"lm_head is {type(head).__name__} (a LoRA or quantized head keeps the model's loss)"
    if linear.bias is not None:
        return "lm_head has a bias"
    return None


#: A module's hook dictionaries, forward and backward (``register_full_backward_hook`` and its
#: pre-hook act through the module call too), and nn.Module's global ones of the same kinds.
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooks_would_see(*modules: torch.nn.Module | None) -> bool:
    """Whether a hook of one of ``modules`` or a global module hook would see the call, forward or
    backward: a fused path that does not call those modules must then let them run."""
    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, f"_global{name}", None) for name in _HOOKS):
        return True
    return any(getattr(m, name, None) for m in modules if m is not None for name in _HOOKS)


def _head_has_hooks(head: torch.nn.Module) -> bool:
    """Whether a forward hook would see lm_head's output (its own, its active linear's, or a global
    one): such hooks expect logits, so the fused loss, which makes none, must not run."""
    return _hooks_would_see(head, _head_linear(head))


class _FusedLossForward(_Forward):
    """A causal LM's forward that, given labels, computes the loss from the hidden states.

    The model's own forward runs with lm_head swapped for an identity, so its "logits" are the
    hidden states and everything else it does (the backbone, a VL model's vision tower, an MoE's
    router loss) is its own. The swap is a plain attribute write, which torch.compile traces.
    Logits are not returned then. Without labels, or when a hook is registered on lm_head (it
    expects logits), the model's own forward runs, and its loss is transformers'.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.identity = _HiddenStates()

    def __call__(self, *args, **kwargs):
        model = self.module
        own_forward = type(model).forward
        labels = kwargs.pop("labels", None)
        if (labels is None or kwargs.get("return_dict") is False or len(args) > 1 or _flce_problem(model)
                or _head_has_hooks(model.lm_head)):
            return own_forward(model, *args, labels=labels, **kwargs)  # the model's own path
        head = model.lm_head
        model.lm_head = self.identity
        try:
            out = own_forward(model, *args, **kwargs)  # "logits" = hidden states
        finally:
            model.lm_head = head
        out.loss = causal_lm_loss(out.logits, _head_linear(head).weight, labels,
                                  num_items_in_batch=kwargs.get("num_items_in_batch"),
                                  ignore_index=kwargs.get("ignore_index", -100),
                                  shift_labels=kwargs.get("shift_labels"))
        out.logits = None
        return out


def _patch_loss(model: torch.nn.Module, report: "PatchReport") -> None:
    name = type(model).__name__
    problem = _flce_problem(model)
    label = f"{name} loss" if problem else f"{name} loss (fused linear cross entropy)"
    _override_forward(model, _FLCE, _FusedLossForward, problem, label, report)


def _unpatch_loss(model: torch.nn.Module, report: "PatchReport") -> None:
    _restore_forward(model, _FLCE, f"{type(model).__name__} loss", report)


def _replacement_rule(module: torch.nn.Module):
    """(flag, builder) for a module q35lab knows how to replace, else None.

    Matched by class name *and* defining package, so that e.g. axolotl's class of the same name
    as flash-linear-attention's is not mistaken for it.
    """
    cls = type(module)
    if cls.__name__ in OFFSET_RMS_NORM_CLASSES and cls.__module__.startswith("transformers."):
        return "rms_norm", _offset_norm_from
    if cls.__name__ in HF_GATED_NORM_CLASSES and cls.__module__.startswith("transformers."):
        return "gated_norm", _gated_norm_from_hf
    if cls.__name__ == "FusedRMSNormGated" and cls.__module__.startswith("fla."):
        return "gated_norm", _gated_norm_from_fla
    return None


def _computed_by_a_fused_mlp(child: torch.nn.Module, parent: torch.nn.Module) -> bool:
    """Whether ``child`` is the gate or up projection of an MLP whose fused node computes it."""
    return isinstance(_marked(parent, _MLP), _ProjectionGroup) and child in (parent.gate_proj, parent.up_proj)


@functools.cache
def _installed(package: str) -> bool:
    """Whether ``package`` can be imported: asked once a process (the delta-rule switch asks at every
    call, and a lookup walks sys.path)."""
    return importlib.util.find_spec(package) is not None


def _triton_at_least(version: tuple[int, ...]) -> bool:
    import triton

    digits = [int("".join(c for c in part if c.isdigit()) or 0) for part in triton.__version__.split(".")[:3]]
    return tuple(digits) >= version


def _core_is_fla(gdn: torch.nn.Module) -> bool:
    """Whether the chunked delta-rule core this GatedDeltaNet calls is fla's, as transformers
    resolved it: the layer's own attribute (older transformers) or its module's function (through
    the hub wrapper). Not whether fla is installed: transformers may have resolved its PyTorch
    function all the same, and that one ignores packed sequences' boundaries."""
    return _is_fla_function(_resolved_core(long_context._core_function(gdn)))


def _delta_rule_core(gdn: torch.nn.Module) -> str:
    """Which delta-rule core this GatedDeltaNet will run, and what to install when it is slow."""
    if not _core_is_fla(gdn):
        fix = ("transformers did not take the installed flash-linear-attention (its import failed when the "
               "modeling module was imported: import fla to see why)" if _installed("fla")
               else "pip install flash-linear-attention (on Hopper with Triton >= 3.7.1)")
        return (f"transformers' PyTorch fallback, far slower than fla's (`python -m q35lab bench delta_rule` "
                f"measures both): {fix}")
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if hopper and not _triton_at_least((3, 7, 1)):
        return ("flash-linear-attention's, whose backward refuses Hopper with this Triton (< 3.7.1, fla#640): "
                "install Triton 3.7.1 (or torch >= 2.12.1)")
    return "flash-linear-attention's chunk_gated_delta_rule"


def _causal_conv(gdn: torch.nn.Module) -> str:
    if _marked(gdn, _CONV) is not None:
        return "q35lab's causal_conv1d (channels last, no transposes)"
    if _conv_problem(gdn) == "the causal-conv1d CUDA package runs it":
        return "the causal-conv1d CUDA package"
    return "transformers' PyTorch fallback (a depthwise nn.Conv1d between two transposes): patch with conv=True"


def _packing_problem(gdn: torch.nn.Module) -> str | None:
    """Why this GatedDeltaNet cannot keep sequences packed in one row (cu_seq_lens_q) apart, or None."""
    conv_ok = _marked(gdn, _CONV) is not None or _conv_problem(gdn) == "the causal-conv1d CUDA package runs it"
    core_ok = _core_is_fla(gdn) or type(gdn).__module__ in _DELTA_RULE_SWITCHES and _marked(gdn, _CONV) is not None
    missing = [what for what, ok in (("causal conv1d", conv_ok), ("delta rule", core_ok)) if not ok]
    if not missing:
        return None
    return (f"transformers' PyTorch {' and '.join(missing)} cannot keep the sequences of a packed row apart (the "
            "boundaries are ignored or refused); patch with conv=True (or install flash-linear-attention and "
            "causal-conv1d)")


def _packing(gdn: torch.nn.Module) -> str:
    """What a row of packed sequences gets: kept apart, or refused (``_PackedBoundaries`` raises)."""
    problem = _packing_problem(gdn)
    if problem:
        return f"a row of packed sequences is refused (ValueError): {problem}"
    core = ("fla's delta rule" if _core_is_fla(gdn)
            else "transformers' PyTorch delta rule, run by q35lab once per sequence")
    return ("sequences kept apart when their boundaries come as cu_seq_lens_q (DataCollatorWithFlattening("
            "return_flash_attn_kwargs=True)) or as the position_ids of one row without an attention mask, a "
            "sequence starting wherever they do not step by one (transformers' rule; q35lab derives cu_seq_lens_q "
            f"from them): the conv honours them, and {core}; such a row runs with use_cache=False, as transformers' "
            "full-attention mask ignores the packing when it has a cache")


class _PackedBoundaries:
    """Forward pre-hook of the module that runs the decoder layers, for a row of packed sequences.

    Boundaries given as ``cu_seq_lens_q`` are used as they are. Otherwise a row whose
    ``position_ids`` do not step by one (``packed_attention.boundaries_from_positions``: transformers'
    rule, where its masks find packed sequences) gets them as ``cu_seq_lens_q/k`` and
    ``max_length_q/k``, which the decoder layers pass on to the GatedDeltaNet (``position_ids`` stop
    at the decoder layer); only for one row without an attention mask or a cache, as transformers'
    masks do. A packed row then runs with ``use_cache=False``: with a cache (the default builds
    one) transformers' full-attention mask ignores the packing. The positions read are those
    transformers' masks read (``_text_positions``: the text row of the [4, B, T] form too). Refused
    (``ValueError``): a packed row with a cache of the caller's, or in a model whose GatedDeltaNet
    cannot keep it apart; packed sequences in a batch of several rows or in [3, B, T] positions
    (transformers' mask would keep them apart or not at all, the GatedDeltaNet the other way);
    cu_seq_lens_q that position_ids contradict, or that the full attention would not see."""

    def __reduce__(self):  # unpickled in a fresh process: the attention it feeds is registered there too
        return (_packed_boundaries, ())

    def __call__(self, module, args, kwargs):
        derived = {}
        positions = kwargs.get("position_ids")
        text = _text_positions(positions)  # what transformers' masks find packing in
        given = kwargs.get("cu_seq_lens_q")
        if given is None:
            if kwargs.get("attention_mask") is not None or long_context._has_cache(kwargs):
                return None  # transformers' masks look for no packing either
            if text is None:
                _refuse_restarting_mrope(positions)
                return None
            if text.shape[0] != 1:
                if bool((text.diff(dim=-1) != 1).any()):  # a sync, for rows of explicit positions only
                    raise ValueError(f"position_ids: {text.shape[0]} rows, and a row holds packed sequences (its "
                                     "positions do not step by one); q35lab keeps packed sequences apart in one row "
                                     "(batch 1): pack them into one row, or pad them with an attention_mask")
                return None
            found = packed_attention.boundaries_from_positions(text)  # the one sync
            if found is None:
                return None  # one sequence: nothing to keep apart
            cu, longest = found
            derived = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        elif long_context._has_cache(kwargs):
            raise ValueError("cache: a cache continues one sequence a row, and the row holds packed sequences "
                             "(cu_seq_lens_q); call the model without a cache and with use_cache=False")
        else:
            if text is not None and text.shape[0] == 1 and not packed_attention.boundaries_agree(given, text):
                edges = packed_attention.boundaries_from_positions(text)
                edges = [0, text.shape[-1]] if edges is None else edges[0].tolist()
                raise ValueError(f"cu_seq_lens_q {given.tolist()} and position_ids (sequences at {edges}: a sequence "
                                 "starts wherever they do not step by one) split the row differently; pass "
                                 "boundaries that agree, or only one of them")
            unseen = _attention_misses_boundaries(module, text is None or kwargs.get("attention_mask") is not None)
            if unseen:
                raise ValueError(f"cu_seq_lens_q: {unseen}")
        gdn = next((m for m in module.modules() if _is_gated_delta_net(m)), None)
        problem = None if gdn is None else _packing_problem(gdn)
        if problem:
            raise ValueError(f"q35lab: a row of packed sequences: {problem}")
        if kwargs.get("use_cache"):
            warnings.warn("q35lab: use_cache=True for a row of packed sequences: it runs with use_cache=False and "
                          "returns no cache (a cache continues one sequence a row, and transformers' mask would "
                          "let the sequences see each other); pass use_cache=False", stacklevel=2)
        return args, {**kwargs, **derived, "use_cache": False}


def _text_positions(positions: torch.Tensor | None) -> torch.Tensor | None:
    """The [B, T] positions transformers' Qwen3.5 masks read: 2-D ``position_ids``, or the text row
    (the first) of the [4, B, T] form; None for the [3, B, T] form (rotary rows only) or none."""
    if positions is None:
        return None
    if positions.dim() == 2:
        return positions
    if positions.dim() == 3 and positions.shape[0] == 4:
        return positions[0]
    return None


def _refuse_restarting_mrope(positions: torch.Tensor | None) -> None:
    """[3, B, T] position_ids carry no text row: transformers' masks then find no packing, and a
    restart (the temporal row, which never falls within a sequence, falls) would leak silently."""
    if positions is not None and positions.dim() == 3 and positions.shape[0] == 3 and positions.shape[-1] > 1:
        if bool((positions[0].diff(dim=-1) < 0).any()):  # a sync, for explicit [3, B, T] positions only
            raise ValueError("position_ids: the [3, B, T] rotary positions restart within a row (packed "
                             "sequences), and in this form transformers' attention mask does not find packed "
                             "sequences; pass the [4, B, T] form (the text positions first, as generate builds "
                             "them) or the boundaries as cu_seq_lens_q, one row")


def _attention_misses_boundaries(stack: torch.nn.Module, mask_misses: bool) -> str | None:
    """Why the full attention under ``stack`` would not see boundaries given as cu_seq_lens_q, or
    None. q35lab's implementation and transformers' flash paths read them; the others (SDPA,
    eager, flex) read transformers' mask, which finds packing only in position_ids, without an
    attention mask (``mask_misses``: this call has not those)."""
    layer = next((m for m in stack.modules() if type(m).__name__ in ATTENTION_CLASSES), None)
    implementation = str(getattr(getattr(layer, "config", None), "_attn_implementation", None))
    if layer is None or not mask_misses or implementation == packed_attention.NAME or "flash" in implementation:
        return None
    return (f"the full attention ({implementation}) keeps packed sequences apart by transformers' mask, which "
            "finds them only in position_ids and without an attention_mask; pass position_ids that restart at each "
            "sequence and no attention_mask, or patch with varlen_attention=True")


def _packed_boundaries() -> _PackedBoundaries:
    if importlib.util.find_spec("transformers") is not None:
        packed_attention.register()
    return _PackedBoundaries()


# Full attention of packed rows: transformers' SDPA takes a packed row's boundaries as a dense
# [T, T] mask; q35lab's attention implementation (packed_attention.NAME) gives them to PyTorch's
# varlen flash attention and is transformers' SDPA for every other call.
ATTENTION_CLASSES = ("Qwen3_5Attention", "Qwen3_5MoeAttention")


class _AttentionConfig:
    """The config a full-attention layer of a patched model reads: its model's config in every
    attribute, read or written, except that SDPA reads as q35lab's implementation. The switch is
    this model's, not the config object's, which other models may share (one built from the same
    config keeps SDPA), and a later change of the model's implementation reaches the layer."""

    def __init__(self, config):
        object.__setattr__(self, "_q35lab_config", config)

    def __getattr__(self, name):  # only what the view itself lacks: every config attribute
        if name == "_q35lab_config":  # (not set yet: an instance that copy or pickle is building)
            raise AttributeError(name)
        value = getattr(self._q35lab_config, name)
        return packed_attention.NAME if name == "_attn_implementation" and value == "sdpa" else value

    def __setattr__(self, name, value):
        setattr(self._q35lab_config, name, value)

    def __delattr__(self, name):
        delattr(self._q35lab_config, name)

    def __reduce__(self):  # unpickled in a fresh process: the implementation is registered there too
        return (_attention_config, (self._q35lab_config,))

    def __repr__(self) -> str:
        return f"<q35lab attention view of {type(self._q35lab_config).__name__}>"


def _attention_config(config) -> _AttentionConfig:
    packed_attention.register()
    return _AttentionConfig(config)


def _attention_layers(model: torch.nn.Module, implementation: str | None = None) -> list:
    """The model's full-attention modules (text decoder) that read their implementation from a
    config; with ``implementation``, those set to it."""
    return [m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES
            and type(m).__module__.startswith("transformers.") and getattr(m, "config", None) is not None
            and (implementation is None or getattr(m.config, "_attn_implementation", None) == implementation)]


def _patch_attention(model: torch.nn.Module, report: "PatchReport") -> None:
    layers = _attention_layers(model)
    switched = [m for m in layers if isinstance(m.config, _AttentionConfig)]
    on_sdpa = [m for m in layers if m not in switched and m.config._attn_implementation == "sdpa"]
    others = {str(m.config._attn_implementation) for m in layers if m not in switched} - {"sdpa"}
    if not on_sdpa:
        if others:
            report.not_applied["varlen_attention"] = (f"the attention runs {', '.join(sorted(others))}, not "
                                                      "transformers' SDPA: left as it is")
        report.already_patched += len(switched)
        return
    if packed_attention.varlen_attention_function() is None:
        report.not_applied["varlen_attention"] = packed_attention.describe()
        return
    views = {}
    for m in on_sdpa:  # one view per config object, shared by the layers of this model that share it
        if id(m.config) not in views:
            views[id(m.config)] = _attention_config(m.config)
        m.config = views[id(m.config)]
    report.replaced[f"{type(on_sdpa[0]).__name__} (SDPA; packed rows: varlen flash attention)"] += len(on_sdpa)


def _unpatch_attention(model: torch.nn.Module, report: "PatchReport") -> None:
    switched = [m for m in _attention_layers(model) if isinstance(m.config, _AttentionConfig)]
    for m in switched:
        m.config = m.config._q35lab_config
    if switched:
        report.reverted[f"{type(switched[0]).__name__} (SDPA)"] += len(switched)


def _derive_packed_boundaries(model: torch.nn.Module) -> None:
    """Register ``_PackedBoundaries`` on every module that holds decoder layers (once)."""
    for stack in long_context._layer_stacks(model):
        if not long_context.stack_pre_hooks(stack, _PackedBoundaries):
            stack.register_forward_pre_hook(_PackedBoundaries(), with_kwargs=True)


def _forget_packed_boundaries(model: torch.nn.Module) -> None:
    for stack in long_context._layer_stacks(model):
        long_context.remove_stack_pre_hooks(stack, _PackedBoundaries)


def _record_what_runs(model: torch.nn.Module, report: "PatchReport") -> None:
    layers = [m for m in model.modules() if _is_gated_delta_net(m)]
    if layers:
        report.runs["delta-rule core"] = _delta_rule_core(layers[0])
        report.runs["causal conv1d"] = _causal_conv(layers[0])
        report.runs["packed batches"] = _packing(layers[0])
    if _attention_layers(model, packed_attention.NAME):
        report.runs["packed full attention"] = packed_attention.describe()


#: What ``apply_to_qwen3_5`` looks for (transformers' classes; a GatedDeltaNet of any provider too).
QWEN3_5_CLASSES = (OFFSET_RMS_NORM_CLASSES + HF_GATED_NORM_CLASSES + MLP_CLASSES + EXPERTS_CLASSES + ATTENTION_CLASSES
                   + FLCE_CLASSES)


def _is_qwen3_5_module(module: torch.nn.Module) -> bool:
    cls = type(module)
    known = cls.__name__ in QWEN3_5_CLASSES and cls.__module__.startswith("transformers.")
    return known or _is_gated_delta_net(module)


def _holds_qwen3_5(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a Qwen3.5 module, or one that q35lab put in the place of one."""
    return any(_is_qwen3_5_module(m) or _is_qwen3_5_module(vars(m).get(_ORIGINAL)) for m in model.modules())


def _not_qwen3_5(model: torch.nn.Module) -> str:
    return (f"model: no Qwen3.5 module found in {type(model).__name__} (looked for transformers' "
            f"{', '.join(QWEN3_5_CLASSES)} and GatedDeltaNet); nothing was patched. For the PEFT LoRA layers of "
            "another model, q35lab.patch.route_lora(model)")


def _refuse_sharded(model: torch.nn.Module, what: str) -> None:
    """Raise when ``model`` is sharded already (FSDP2's ``fully_shard``, or DTensor parameters).

    ``fully_shard`` records the (module, name) of each parameter and, before each forward, gives the
    gathered weight to that module alone. A module put in afterwards (q35lab's norms) or put back
    (``revert``) would hold the sharded DTensor for good, and a kernel would fail on it deep inside."""
    if not torch.distributed.is_available():
        return
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without FSDP2: nothing can be sharded by it
        return
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) or any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            where = f"module {name!r}" if name else "the model itself"
            raise RuntimeError(
                f"{what}: the model is sharded already ({where} is managed by FSDP2's fully_shard or holds DTensor "
                "parameters). Patch before sharding: call apply_to_qwen3_5(model) first, then fully_shard each "
                "decoder layer and the root (the patched modules hold the original Parameters, which fully_shard "
                "then shards like any other); to revert, rebuild the model, or revert before sharding.")


def apply_to_qwen3_5(
    model: torch.nn.Module,
    *,
    rms_norm: bool = True,
    gated_norm: bool = True,
    lora: bool = True,
    in_proj: bool = True,
    flce: bool | None = None,
    conv: bool = True,
    swiglu: bool = True,
    experts: bool = True,
    varlen_attention: bool = True,
    tiled_mlp: int | None = None,
    tiled_gdn: int | None = None,
    offload_checkpoints: float | int | None = 0,
    long_context: int | None = None,
    strict: bool = False,
    fused_linear_cross_entropy: bool | None = None,
) -> PatchReport:
    """Replace a Qwen3.5 model's modules by q35lab's kernels, in place, and report what was done.

    Works on ``Qwen3_5ForCausalLM``, ``Qwen3_5ForConditionalGeneration``, the MoE variants and any
    PEFT wrapper around them: patch after ``peft.get_peft_model`` and after moving the model to its
    device and dtype, and with FSDP2 before ``fully_shard``. The modules keep their parameters (the
    same objects); patching twice is harmless, ``revert`` undoes it. A patched model deep-copies,
    pickles and compiles (q35lab's ops are graph breaks). Where a call is one a kernel cannot
    compute exactly (a hook on ``lm_head``, two active adapters, DoRA, ...) the module's own forward
    runs, and the report says which modules can never be patched.

    Packed rows (``DataCollatorWithFlattening``, with or without ``return_flash_attn_kwargs``) give
    each sequence what it gets alone under the forward's default arguments: such a row runs with
    ``use_cache=False``. Where the GatedDeltaNet cannot keep them apart (``conv=False`` without the
    causal-conv1d package) a packed row is refused; the report's ``packed batches`` line says which.

    Args:
        model (nn.Module): a transformers Qwen3.5 model, bare or wrapped by PEFT.
        rms_norm (bool): the decoder norms as ``OffsetRMSNorm``. Default: True.
        gated_norm (bool): the GatedDeltaNet's gated norm as ``GatedRMSNorm``. Default: True.
        lora (bool): each PEFT LoRA ``Linear`` through ``lora_linear`` (LoRA layers added later need
            another call). Default: True.
        in_proj (bool): a GatedDeltaNet's four input projections as one ``fused_lora_projections``
            node (frozen bases). Default: True.
        flce (bool, optional): the causal LM's loss by ``linear_cross_entropy``, which makes no
            logits. Default: True.
        conv (bool): the GatedDeltaNet's causal conv1d as ``causal_conv1d`` (unless the causal-conv1d
            package runs it), and fla's delta rule given the key heads unrepeated. Default: True.
        swiglu (bool): the MLP as a fused gate/up projection and ``swiglu_down``. Default: True.
        experts (bool): a MoE layer's frozen routed experts as ``routed_experts``. Default: True.
        varlen_attention (bool): full attention over a packed row (``cu_seq_lens_q``, or ``position_ids``
            that do not step by one) as variable-length flash attention, each sequence alone; this
            model's layers only, not others built from the same config. Default: True.
        tiled_mlp (int, optional): every MLP computed in tiles of this many tokens, each recomputed
            in backward. Default: None (untiled).
        tiled_gdn (int, optional): every GatedDeltaNet decoder layer that trains on more tokens
            computed in such tiles, its state carried from tile to tile (calls with a cache or
            packed sequences run untiled, with a warning). Default: None.
        offload_checkpoints (float or int, optional): the decoder layers, a fraction in [0, 1] or a
            count, whose gradient-checkpoint inputs wait in pinned host memory. Default: 0.
        long_context (int, optional): the longest step's tokens: plans the three options above for
            it (``long_context.plan_long_context`` against the model's GPU; dense models only), in
            place of them. Default: None.
        strict (bool): raise, rather than warn, when ``model`` holds no Qwen3.5 module. Default: False.
        fused_linear_cross_entropy (bool, optional): Liger's name for ``flce``; give one of the two.

    Returns:
        PatchReport: the modules replaced, those left alone and why, the flags that did nothing,
        and what runs where q35lab does not replace the code.

    Raises:
        TypeError: ``model`` not a module, a flag not a bool, a tile or ``long_context`` not an int,
            ``offload_checkpoints`` not a number, ``flce`` and ``fused_linear_cross_entropy`` both
            given, ``long_context`` for a model without a transformers config.
        ValueError: a tile, ``long_context`` or ``offload_checkpoints`` out of range, ``long_context``
            with the options it plans or on a model that has them, no Qwen3.5 module with ``strict``.
        NotImplementedError: ``long_context`` for a MoE model.
        RuntimeError: the model is sharded already (FSDP2).

    Warns:
        UserWarning: no Qwen3.5 module found (nothing is patched), or a ``long_context`` plan that
            does not fit.
    """
    check_module("model", model)
    flags = {"rms_norm": rms_norm, "gated_norm": gated_norm, "lora": lora, "in_proj": in_proj, "conv": conv,
             "swiglu": swiglu, "experts": experts, "varlen_attention": varlen_attention, "strict": strict}
    for name, value in flags.items():
        check_bool(name, value)
    flce = _flce_option(flce, fused_linear_cross_entropy)
    tiled_mlp, tiled_gdn = _tile_option("tiled_mlp", tiled_mlp), _tile_option("tiled_gdn", tiled_gdn)
    offload_checkpoints = _offload_option(model, offload_checkpoints)
    if long_context is not None:
        long_context = _check_tile_tokens(long_context, "long_context", "the longest step's tokens")
        if tiled_mlp or tiled_gdn or offload_checkpoints:
            raise ValueError("long_context: it plans tiled_mlp, tiled_gdn and offload_checkpoints itself; pass either "
                             "long_context or those options, not both")
    _refuse_sharded(model, "apply_to_qwen3_5")
    if not _holds_qwen3_5(model):
        if strict:
            raise ValueError(_not_qwen3_5(model))
        warnings.warn(f"q35lab.apply_to_qwen3_5: {_not_qwen3_5(model)} (strict=True makes this an error)",
                      stacklevel=2)
        return PatchReport(qwen3_5=False)
    plan = None
    if long_context is not None:
        plan = _plan_long_context(model, long_context)
        if not plan.fits:
            warnings.warn(f"q35lab: long_context={long_context}: {plan}", stacklevel=2)
        tiled_mlp, tiled_gdn, offload_checkpoints = plan.tiled_mlp, plan.tiled_gdn, plan.offload_layers
    enabled = {"rms_norm": rms_norm, "gated_norm": gated_norm, "lora": lora, "in_proj": in_proj, "flce": flce,
               "conv": conv, "swiglu": swiglu, "experts": experts, "varlen_attention": varlen_attention}
    report = PatchReport()
    for flag, wanted in enabled.items():
        if not wanted:
            report.not_applied[flag] = "disabled by the caller"
    if lora and not any(map(_is_peft_lora_linear, model.modules())):
        report.not_applied["lora"] = ("no PEFT LoRA layers in the model; if you add adapters later "
                                      "(peft.get_peft_model), call apply_to_qwen3_5 again afterwards")
    for module in model.modules():
        cls = type(module)
        if in_proj and _is_gated_delta_net(module):
            _fuse_in_proj(module, report)
        if conv and _is_gated_delta_net(module):
            _patch_conv(module, report)
            _skip_key_head_repeat(module, report)
        if tiled_gdn and _is_gated_delta_net(module):  # wraps the conv's forward, and calls the fused in_proj
            _tile_gdn(module, tiled_gdn, report)
        if tiled_gdn:  # a GatedDeltaNet's decoder layer: calls the above's pieces, tile by tile
            _tile_gdn_layer(module, tiled_gdn, report)
        if swiglu and _is_swiglu_mlp(module):
            _patch_mlp(module, report)
        if experts and _is_routed_experts(module):
            _patch_experts(module, report)
        if tiled_mlp and _is_swiglu_mlp(module):  # wraps the above
            _tile_mlp(module, tiled_mlp, report)
        if flce and cls.__name__ in FLCE_CLASSES and cls.__module__.startswith("transformers."):
            _patch_loss(module, report)
    for parent, name, child in _named_children_everywhere(model):
        if _marked(child, _ORIGINAL) is not None:
            report.already_patched += 1
            continue
        if _is_peft_lora_linear(child):
            if lora and _marked(child, _IN_PROJ) is None and not _computed_by_a_fused_mlp(child, parent):
                _route_lora(child, report)
            continue
        rule = _replacement_rule(child)
        if rule is None or not enabled[rule[0]]:
            continue
        replacement = rule[1](child)
        if isinstance(replacement, str):
            report.left_alone[f"{type(child).__name__}: {replacement}"] += 1
        else:
            setattr(parent, name, replacement)
            report.replaced[type(child).__name__] += 1
    if varlen_attention:
        _patch_attention(model, report)
    if offload_checkpoints:
        _offload_checkpoints(model, offload_checkpoints, report)
    if any(_is_gated_delta_net(m) for m in model.modules()):
        _derive_packed_boundaries(model)  # said in report.runs["packed batches"]
    _record_what_runs(model, report)
    if tiled_gdn:
        _report_tiled_gdn(model, tiled_gdn, report)
    if plan is not None and plan.untiled_up_to:  # short steps need no tiles: they would pay launches for nothing
        _tile_only_above(model, plan.untiled_up_to)
    if plan is not None:
        report.runs["long context"] = str(plan)
    return report


def _plan_long_context(model: torch.nn.Module, tokens) -> "long_context.LongContextPlan":
    """``long_context.plan_long_context`` for this model: its text config, its LoRA rank, its other
    trainable parameters, the bytes of its weights' dtype (the activations'), and the memory of
    the GPU it is on. Refused where the memory model does not describe the step: a MoE model, a
    model that carries long-context options already (a plan only adds)."""
    tokens = long_context._check_tile_tokens(tokens, "long_context", "the longest step's tokens")
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"long_context: {type(model).__name__} has no transformers config to plan from")
    if getattr(config.get_text_config(), "num_experts", None):
        raise NotImplementedError("long_context: the memory model covers the dense Qwen3.5 models, not the MoE; "
                                  "pass tiled_gdn and offload_checkpoints yourself")
    weight = next(model.parameters(), None)
    if weight is None:
        raise TypeError(f"long_context: {type(model).__name__} has no parameters to plan for")
    if long_context.has_long_context_options(model):
        raise ValueError("long_context: the model carries long-context options already (tiles or an offload); "
                         "q35lab.revert(model) first, then patch it with the plan")
    lora = [m for m in model.modules() if _is_peft_lora_linear(m) and m.r]
    adapters = {id(p) for m in lora for name, p in m.named_parameters() if "lora_" in name}
    others = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in adapters)
    return long_context.plan_long_context(config, tokens, gpu_bytes=long_context.usable_gpu_bytes(weight.device),
                                          lora_rank=max((max(m.r.values()) for m in lora), default=0),
                                          dtype_bytes=weight.element_size(), other_trainable_parameters=others)


def _tile_mlp(mlp: torch.nn.Module, tile_tokens: int, report: "PatchReport") -> None:
    if long_context.tile_mlp(mlp, tile_tokens):
        report.replaced[f"{type(mlp).__name__} (tiled, {tile_tokens} tokens a tile)"] += 1


def _offload_checkpoints(model: torch.nn.Module, layers, report: "PatchReport") -> None:
    offloader = long_context.offload_decoder_layers(model, layers)
    report.replaced[f"decoder-layer checkpoints offloaded to host memory ({offloader.layers} layers)"] += 1


def _report_tiled_gdn(model: torch.nn.Module, tile_tokens: int, report: "PatchReport") -> None:
    if any(isinstance(vars(m).get("forward"), long_context.TiledGDNForward) for m in model.modules()):
        report.runs["tiled GatedDeltaNet"] = (
            f"tiles of {tile_tokens} tokens when a GatedDeltaNet trains on more, its whole decoder layer (norms, MLP, "
            "residuals) in each tile where the MLP is per token; untiled without grad (eval, "
            "generation) and, with a warning, given a cache (use_cache=False without gradient checkpointing) or "
            "packed sequences (cu_seq_lens_q: their boundaries do not line up with tiles)")


def _tile_option(name: str, value) -> int | None:
    """A long-context tile size: None (or 0) for off, else a positive int; errors name ``name``."""
    if value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == 0):
        return None
    return long_context._check_tile_tokens(value, name)


def _offload_option(model: torch.nn.Module, value) -> float | int:
    """``offload_checkpoints`` checked against ``model``'s decoder layers: None (or 0) for off."""
    if value is None:
        return 0
    layers = long_context._decoder_layers(model)
    long_context._layer_count("offload_checkpoints", value, len(layers))
    if value and not layers:
        raise ValueError("offload_checkpoints: the model has no decoder layers to offload (transformers' "
                         "*DecoderLayer in a `layers` list)")
    return value


def _flce_option(flce, fused_linear_cross_entropy) -> bool:
    """The loss switch under either of its names (Liger's is the long one); True unless given."""
    if flce is not None and fused_linear_cross_entropy is not None:
        raise TypeError("flce, fused_linear_cross_entropy: expected one of the two (they are one switch), got both")
    if fused_linear_cross_entropy is not None:
        return check_bool("fused_linear_cross_entropy", fused_linear_cross_entropy)
    return True if flce is None else check_bool("flce", flce)


def _tile_gdn(gdn: torch.nn.Module, tile_tokens: int, report: "PatchReport") -> None:
    problem = long_context.gated_delta_net_problem(gdn)
    if problem:
        report.left_alone[f"{type(gdn).__name__} (tiled): {problem}"] += 1
    elif long_context.tile_gated_delta_net(gdn, tile_tokens):
        report.replaced[f"{type(gdn).__name__} (tiled, {tile_tokens} tokens a tile)"] += 1
    else:
        report.already_patched += 1


def _tile_gdn_layer(layer: torch.nn.Module, tile_tokens: int, report: "PatchReport") -> None:
    if not long_context.is_gated_delta_net_layer(layer) or long_context.gated_delta_net_problem(layer.linear_attn):
        return  # a problem is said once, by _tile_gdn
    if long_context.tile_gated_delta_net_layer(layer, tile_tokens):
        what = f"{type(layer).__name__} (GatedDeltaNet and MLP tiled together, {tile_tokens} tokens a tile)"
        report.replaced[what] += 1
    else:
        report.already_patched += 1


def route_lora(model: torch.nn.Module) -> PatchReport:
    """Route the PEFT LoRA ``Linear`` layers of any model through ``lora_linear``, where it computes
    the call exactly (else PEFT's own forward runs): what ``apply_to_qwen3_5(lora=True)`` does in a
    Qwen3.5 model. ``revert`` undoes it.

    Args:
        model (nn.Module): a model with PEFT LoRA layers (``peft.get_peft_model``).

    Returns:
        PatchReport: the layers routed, and those left to PEFT (and why).

    Raises:
        TypeError: ``model`` not a module.
        RuntimeError: the model is sharded already (FSDP2).
    """
    check_module("model", model)
    _refuse_sharded(model, "route_lora")
    report = PatchReport(qwen3_5=_holds_qwen3_5(model))
    for parent, name, child in _named_children_everywhere(model):
        fused = _marked(child, _IN_PROJ) is not None or _computed_by_a_fused_mlp(child, parent)
        if _is_peft_lora_linear(child) and not fused:
            _route_lora(child, report)
    if not any(map(_is_peft_lora_linear, model.modules())):
        report.not_applied["lora"] = "no PEFT LoRA layers in the model"
    return report


def revert(model: torch.nn.Module) -> PatchReport:
    """Undo ``apply_to_qwen3_5`` (or ``route_lora``): every patched module gets its original back,
    with the same parameters.

    Args:
        model (nn.Module): a patched model (an unpatched one is left as it is).

    Returns:
        PatchReport: what was restored (``reverted``), by class.

    Raises:
        TypeError: ``model`` not a module.
        RuntimeError: the model is sharded already (FSDP2): rebuild it instead.
    """
    check_module("model", model)
    _refuse_sharded(model, "revert")
    report = PatchReport()
    _forget_packed_boundaries(model)
    _unpatch_attention(model, report)
    if long_context.restore_decoder_layers(model):
        report.reverted["decoder-layer checkpoint offload"] += 1
    for module in model.modules():
        _unpatch_loss(module, report)
        if long_context.untile_mlp(module):
            report.reverted[f"{type(module).__name__} (tiled)"] += 1
        _unpatch_mlp(module, report)
        _unpatch_experts(module, report)
        # a GatedDeltaNet (before the conv: it wraps the conv's forward) or its decoder layer
        if long_context.untile_gated_delta_net(module) or long_context.untile_gated_delta_net_layer(module):
            report.reverted[f"{type(module).__name__} (tiled)"] += 1
        _unpatch_conv(module, report)
        _unskip_key_head_repeat(module, report)
    for parent, name, child in _named_children_everywhere(model):
        _unroute_lora(child, report)
        _unfuse_in_proj(child, report)
        original = _marked(child, _ORIGINAL)
        if original is not None:
            original.weight = child.weight  # keep any Parameter swap made while patched
            original.train(child.training)
            setattr(parent, name, original)
            report.reverted[type(original).__name__] += 1
    return report
