"""The GatedDeltaNet's causal conv and delta-rule core, and the switches that replace them.

The forward calls module-level functions of its modeling module; a switch installed there runs
q35lab's version while a patched layer is the caller and the original otherwise."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
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
    """``causal_conv1d_fn(x [B, C, T], weight [C, K], bias, activation, ...)`` by q35lab's kernel,
    which honours packed boundaries (``cu_seq_lens_q``)."""

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


#: The switch installed in each modeling module, by module name: a later wrapper may hide it.
CONV_SWITCHES: dict = {}


class ConvSwitch:
    """Installed as a modeling module's ``causal_conv1d_fn``: q35lab's convolution while a patched
    GatedDeltaNet's forward runs, the module's own function at every other call."""

    _rebuild = None  # set on the class of one installed switch (``install``)

    def __new__(cls, *args, **kwargs):
        if not args and not kwargs and cls._rebuild is not None:
            # unpickling a `kernels` object calls type(the module's attribute)(), i.e. this class
            return cls._rebuild()
        return super().__new__(cls)

    @classmethod
    def install(cls, original):
        """A switch around ``original``, of its own class that rebuilds ``original``'s type when
        called without arguments."""
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


class CoreSwitch(ConvSwitch):
    """Installed as a modeling module's delta-rule cores where q35lab skips the q/k head repeat
    (``patch.conv.skip_key_head_repeat``): the repeat is made here instead whenever transformers'
    wrapper is about to run its PyTorch core, which needs it (``versions.hub_calls_pytorch_core``).
    fla's core reads grouped heads itself; layers that still repeat reach it with equal heads."""

    def replacement(self):
        return self.original

    def __call__(self, query, key, value, *args, **kwargs):
        group = value.shape[-2] // key.shape[-2]
        if group > 1 and versions.hub_calls_pytorch_core():
            query, key = query.repeat_interleave(group, dim=-2), key.repeat_interleave(group, dim=-2)
        return super().__call__(query, key, value, *args, **kwargs)


class DeltaRuleSwitch(CoreSwitch):
    """Installed as a modeling module's ``torch_chunk_gated_delta_rule``: per packed sequence while a
    patched GatedDeltaNet runs (``_PerSequenceDeltaRule``), the original otherwise; q and k repeated
    for transformers' PyTorch core as ``CoreSwitch`` does."""

    fla_core = None  # whether the wrapped function resolves to fla's

    def replacement(self):
        if self.fla_core is None:  # asked once: transformers resolves its core at import
            self.fla_core = _is_fla_function(_resolved_core(self.original))
        return _PerSequenceDeltaRule(self.original, self.fla_core)


class _PerSequenceDeltaRule:
    """The delta rule run once per sequence of a packed [1, T, ...] row, outputs concatenated along T
    and final states stacked one per sequence: transformers' PyTorch core ignores ``cu_seqlens`` and
    would carry one sequence's state into the next. fla's core (``fla_core``) honours them and runs
    as it is, on q, k, v made contiguous by ``contiguous_rows`` (faster than fla's own copy)."""

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
        bounds = cu_seqlens.tolist()  # a host sync, acceptable on this slow fallback path
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


#: The delta-rule switches installed in each modeling module, by module name.
DELTA_RULE_SWITCHES: dict = {}
RECURRENT_SWITCHES: dict = {}


@contextlib.contextmanager
def switched_to_q35lab(gdn: torch.nn.Module):
    """Within the block, this layer's modeling module calls q35lab's conv and per-sequence delta rule
    if q35lab patched the layer's conv; otherwise nothing changes."""
    switches = []
    if marked(gdn, CONV) is not None:
        name = type(gdn).__module__
        switches = [s for s in (CONV_SWITCHES.get(name), DELTA_RULE_SWITCHES.get(name)) if s is not None]
    for switch in switches:
        switch.active += 1
    try:
        yield
    finally:
        for switch in switches:
            switch.active -= 1


def conv_problem(gdn: torch.nn.Module) -> str | None:
    if versions.module_function(versions.modeling_module(gdn), versions.CONV) is None:
        return "no causal_conv1d_fn in this transformers version"
    if package_installed("causal_conv1d"):
        return "the causal-conv1d CUDA package runs it"
    return None


def switch_in(module, attribute: str, registry: dict, kind: type) -> None:
    """Make ``registry[module]`` a switch that ``module.attribute`` really is: the registered one,
    one found there, or a new one around the current function (if someone replaced ours, toggling a
    switch nothing calls would silently leak packed sequences)."""
    current = getattr(module, attribute)
    if registry.get(module.__name__) is current:
        return
    if not isinstance(current, kind):  # delegates to ``current`` while no patched layer runs
        current = kind.install(current)
        setattr(module, attribute, current)
    registry[module.__name__] = current


def _resolved_core(function):
    """The function a delta-rule name really calls, through q35lab's switch (``.original``) and
    transformers' hub wrapper (which fixes its ``implementation`` at import)."""
    return versions.hub_implementation(getattr(function, "original", function))


def core_groups_key_heads(gdn: torch.nn.Module) -> bool:
    """Whether both cores the forward can call (chunked, and recurrent for cached decode) are fla's."""
    module = sys.modules[type(gdn).__module__]
    names = (versions.CHUNK_CORE, versions.RECURRENT_CORE)
    return all(_is_fla_function(_resolved_core(getattr(module, name, None))) for name in names)


def _is_fla_function(function) -> bool:
    """Whether ``function`` (as ``_resolved_core`` finds it) is one of flash-linear-attention's."""
    return callable(function) and getattr(function, "__module__", "").startswith("fla.")


def repeats_key_heads(gdn: torch.nn.Module) -> bool:
    """Whether the GatedDeltaNet's forward repeats q and k to the value heads before any core.

    The repeat is a copy that fla's kernels do not need: they read key head ``i // (Hv/Hk)`` for
    value head ``i``, ``repeat_interleave``'s own order. transformers' PyTorch core needs it."""
    return gdn.num_v_heads != gdn.num_k_heads and forward_repeats_key_heads(type(gdn))


@functools.cache
def package_installed(package: str) -> bool:
    """Whether ``package`` can be imported (cached: a lookup walks sys.path)."""
    return importlib.util.find_spec(package) is not None


def triton_at_least(version: tuple[int, ...]) -> bool:
    import triton

    digits = [int("".join(c for c in part if c.isdigit()) or 0) for part in triton.__version__.split(".")[:3]]
    return tuple(digits) >= version


def core_is_fla(gdn: torch.nn.Module) -> bool:
    """Whether the chunked core this GatedDeltaNet calls resolves to fla's (not whether fla is
    installed: transformers may still have resolved its PyTorch one, which ignores boundaries)."""
    return _is_fla_function(_resolved_core(core_function(gdn)))


#: Compute capabilities where FlashQLA runs forward and backward (on SM120 only a grad-free forward).
FLASH_QLA_TRAINS_ON = ((9, 0), (10, 0), (10, 3))


def flash_qla_problem(gdn: torch.nn.Module) -> str | None:
    """Why fla does not hand this GatedDeltaNet's chunked delta rule to FlashQLA (the Qwen team's
    fused TileLang kernels, an fla backend from 0.6) in training, or None where it does. fla's own
    test decides whether the backend is installed and enabled (``FLA_FLASH_QLA``); it then takes
    bf16/fp16 calls with 128-wide heads on the GPUs of ``FLASH_QLA_TRAINS_ON``."""
    try:
        from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend
    except ImportError:
        return "this flash-linear-attention has no FlashQLA backend (it came in 0.6)"
    if not FlashQLABackend.is_available():
        return "FlashQLA is not installed (pip install flash-qla, which brings tilelang)"
    if not FlashQLABackend().is_enabled():
        return "FlashQLA is installed but turned off (FLA_FLASH_QLA=0)"
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":  # fla reads it once, at import: no backend runs
        return "fla's backends are turned off (FLA_DISABLE_BACKEND_DISPATCH=1)"
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability is not None and capability not in FLASH_QLA_TRAINS_ON:
        return f"FlashQLA trains only on SM90/SM100/SM103, not on this SM{capability[0]}{capability[1]}"
    if (gdn.head_k_dim, gdn.head_v_dim) != (128, 128):
        return f"FlashQLA takes 128-wide heads, not {gdn.head_k_dim} and {gdn.head_v_dim}"
    return None


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
    """The causal conv1d this GatedDeltaNet's forward calls, ``fn(x [B, C, T], weight [C, K], bias,
    activation=..., **kwargs)``: q35lab's when patched, else its modeling module's; or None."""
    if marked(gdn, CONV) is not None:
        return CausalConv()
    return versions.module_function(modeling_module(gdn), versions.CONV)


def core_function(gdn: torch.nn.Module):
    """The chunked delta-rule core this GatedDeltaNet's forward calls: its modeling module's
    ``torch_chunk_gated_delta_rule`` (looked up at each call, as the forward does), or None."""
    return versions.module_function(modeling_module(gdn), versions.CHUNK_CORE)


#: Whether a GatedDeltaNet class's forward repeats q and k to the value heads itself (by version).
forward_repeats_key_heads = versions.forward_repeats_key_heads


def gated_delta_net_problem(gdn: torch.nn.Module) -> str | None:
    """Why ``tiled_gated_delta_net`` cannot compute this module, or None if it can."""
    if not is_gated_delta_net(gdn):
        return f"{type(gdn).__name__} is not a transformers GatedDeltaNet"
    if conv_function(gdn) is None:
        return "no causal_conv1d_fn in this transformers version"
    if core_function(gdn) is None:
        return "no chunk_gated_delta_rule in this transformers version"
    return None
