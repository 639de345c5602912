"""Long-context memory for Qwen3.5 LoRA training: a sequence-tiled MLP and GatedDeltaNet,
decoder-layer checkpoints offloaded to host memory, and the memory-per-token model that says how
long a step fits.

Under gradient checkpointing a training step's peak is linear in the tokens T::

    peak ≈ fixed + T · bytes_per_token
    bytes_per_token = (layers whose checkpoint input is on the GPU) · H · e     checkpoint inputs
                    + max over phases of one layer's backward working set      (MLP, GatedDeltaNet, attention)
                    + the loss's per-token tensors                            (the logits are chunked)

with H the hidden size and e the activation's bytes (2 in bf16): 32 · 4096 · 2 = 256 KiB a token
of checkpoint inputs for Qwen3.5-9B. The two remedies are those of Arctic Long Sequence Training
(Snowflake, arXiv 2506.13996):

* ``tiled_mlp`` computes the MLP a tile of the sequence at a time and recomputes each tile in
  the backward, so its working set is one tile's ``[tile, I]`` intermediates instead of T's
  (the MLP is per token, so this is exact);
* ``tiled_gated_delta_net`` does the same for a GatedDeltaNet, whose only state along the
  sequence — the causal conv's last K−1 input rows and the delta rule's recurrent state — is
  carried from tile to tile in the forward and its gradient from tile to tile in the backward
  (also exact: a scan, not an approximation);
* ``offload_decoder_layers`` / ``offloaded_checkpoints`` move the checkpoint inputs (one
  ``[B, T, H]`` hidden state per decoder layer) to host memory during the forward, on a side
  CUDA stream, and bring them back during the backward, the next layer's prefetched.

``bytes_per_token`` predicts the slope term by term for a Qwen3.5 config (LoRA, gradient
checkpointing, q35lab's kernels, fla's delta-rule core, SDPA attention); ``longest_fit`` turns
it into the longest step on a GPU. Nothing here launches a kernel: the pieces are PyTorch
autograd and stream plumbing, and run on a CPU (where the "offload" is a copy).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import sys
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from .hf import versions
from .ops._autograd import first_order_only
from .ops._checks import check_bool, check_int, check_module, check_real
from .ops._compile import opaque_to_compile
from .ops._prepared import shared_preparations
from .ops.causal_conv1d import causal_conv1d
from .ops.swiglu import is_unread, unread_down_outputs

# What users call: the planner, and the options by hand (apply_to_qwen3_5 installs them). Every other
# name (the tiles' engine, the modules' forwards, the memory terms) stays importable for the notebooks
# and tests, but is not listed here nor by dir().
__all__ = [
    "plan_long_context",
    "longest_planned_step",
    "LongContextPlan",
    "usable_gpu_bytes",
    "bytes_per_token",
    "MemoryModel",
    "plan_offload_layers",
    "tile_only_above",
    "offload_decoder_layers",
    "restore_decoder_layers",
    "CheckpointOffloader",
    "offloaded_checkpoints",
    "enable_checkpointing",
    "default_host_reserve",
    "host_memory_available",
    "HOST_RESERVE_BYTES",
    "H200_USABLE_BYTES",
]


def __dir__() -> list[str]:
    return sorted(__all__)


GiB = 2**30
KiB = 2**10


# ==============================================================================================
# 1. Sequence tiling: one engine, the tiled MLP and the tiled GatedDeltaNet
# ==============================================================================================
class _Tiles:
    """What a tiled Function's backward needs besides tensors: the per-tile function, the tiling,
    the autocast state of the forward and each tile's RNG state (plain attributes: never saved
    tensors).

    ``fn`` is either a per-token map ``fn(piece) -> y`` (``scan=False``: the MLP), or a scan step
    ``fn(piece, carry, (start, end)) -> (y, carry)`` (``scan=True``: the GatedDeltaNet), where
    ``carry`` is None for the first tile and otherwise the tuple of tensors the previous tile
    returned — what the sequence carries across a tile boundary. ``y`` may come as a tuple of
    addends (a decoder layer's residual and its MLP's output): the forward writes their sum, and
    the backward roots each on the same gradient, so that the MLP's output can stay uncomputed
    (``_recompute_tile``)."""

    def __init__(self, fn, tile: int, preserve_rng_state: bool, device: torch.device, *, scan: bool = False,
                 name: str = "mlp_forward"):
        self.fn, self.tile, self.preserve_rng_state, self.scan, self.name = fn, tile, preserve_rng_state, scan, name
        self.device_type = device.type
        # the device whose RNG dropout draws from (none for a CPU input: the CPU state is always kept)
        self.rng_devices = [device.index if device.index is not None else 0] if device.type not in ("cpu", "meta") else []
        self.autocast = _autocast_state(device.type)
        self.rng_states: list = []
        self.stash = None  # the _StashInput node that holds x, when there is one

    def bounds(self, tokens: int):
        return [(start, min(start + self.tile, tokens)) for start in range(0, tokens, self.tile)]

    def step(self, piece: torch.Tensor, carry, span: tuple[int, int]):
        """(the tile's output, the carry it hands on): a per-token map hands on nothing."""
        if self.scan:
            return self.fn(piece, carry, span)
        return self.fn(piece), None

    def record_rng(self) -> None:
        device_states = [_device_module(self.device_type).get_rng_state(d) for d in self.rng_devices]
        self.rng_states.append((torch.get_rng_state(), device_states))

    def restore_rng(self, index: int) -> None:
        cpu_state, device_states = self.rng_states[index]
        torch.set_rng_state(cpu_state)
        for d, state in zip(self.rng_devices, device_states):
            _device_module(self.device_type).set_rng_state(state, d)


def _device_module(device_type: str):
    return getattr(torch, device_type)


def _autocast_state(device_type: str) -> dict:
    """The autocast state of the forward, to be re-entered by the recompute (the backward runs on
    another thread on CUDA, and outside the caller's ``autocast`` block on the CPU)."""
    state = {"cpu": dict(enabled=torch.is_autocast_enabled("cpu"), dtype=torch.get_autocast_dtype("cpu"),
                         cache_enabled=torch.is_autocast_cache_enabled())}
    if device_type != "cpu" and torch.amp.is_autocast_available(device_type):
        state[device_type] = dict(enabled=torch.is_autocast_enabled(device_type),
                                  dtype=torch.get_autocast_dtype(device_type),
                                  cache_enabled=torch.is_autocast_cache_enabled())
    return state


@contextlib.contextmanager
def _autocast(state: dict):
    with contextlib.ExitStack() as stack:
        for device_type, kwargs in state.items():
            stack.enter_context(torch.amp.autocast(device_type, **kwargs))
        yield


def _run_tiles(tiles: _Tiles, x: torch.Tensor, record_rng: bool, keep_carries: bool = True) -> tuple[torch.Tensor, list]:
    """``fn`` over each tile of ``x`` (along dim -2), written into one output. Returns the output
    and the carry that entered each tile (None for the first tile, and for every tile of a
    per-token map): the backward's recompute of tile i starts from carry i. Without a backward
    to come (``keep_carries=False``) only the current carry is alive: a 512k-token GatedDeltaNet
    in 8192-token tiles would otherwise hold 64 states of 2 MiB until the call returns."""
    tokens = x.shape[-2]
    out, carry, carries = None, None, []
    with shared_preparations():  # the projections' weight-only casts: built by the first tile, reused
        for start, end in tiles.bounds(tokens):
            if record_rng:
                tiles.record_rng()
            if keep_carries:
                carries.append(carry)
            # detached: a view made without grad of an input that requires it claims to require grad with no
            # node behind it, which a module hook registering gradient hooks on inputs rejects (torch's ModuleTracker)
            piece = x[..., start:end, :].detach()
            y, carry = tiles.step(piece, carry, (start, end))
            y = _summed(y)
            if not isinstance(y, torch.Tensor) or y.dim() != piece.dim() or y.shape[:-1] != piece.shape[:-1]:
                got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise ValueError(f"{tiles.name}: expected a tensor of shape {tuple(piece.shape[:-1])} + (N,) for a "
                                 f"tile of shape {tuple(piece.shape)}, got {got}")
            if out is None:
                out = y.new_empty((*x.shape[:-2], tokens, y.shape[-1]))
            out[..., start:end, :].copy_(y)
    return out, carries


def _flatten_carries(carries: list) -> tuple[list, list]:
    """The carries' tensors in one list (for ``save_for_backward``) and each carry's count (0: None)."""
    sizes = [0 if c is None else len(c) for c in carries]
    return [t for c in carries if c is not None for t in c], sizes


def _unflatten_carries(flat, sizes: list) -> list:
    carries, at = [], 0
    for n in sizes:
        carries.append(None if n == 0 else tuple(flat[at:at + n]))
        at += n
    return carries


def _carry_leaves(carry):
    """A saved carry as fresh leaves of the recompute, those of a float dtype requiring grad."""
    if carry is None:
        return None
    return tuple(c.detach().requires_grad_(c.is_floating_point()) for c in carry)


class _StashInput(torch.autograd.Function):
    """Saves the tiled MLP's input as its own autograd node, *before* any tile is computed.

    Why a node of its own: under non-reentrant gradient checkpointing of the decoder layer, the
    layer's recompute stops (early stop, PyTorch's default) as soon as the last tensor the
    original forward saved has been saved again. In a Qwen3.5 layer that last tensor is the
    MLP's input (the residual add after the MLP saves nothing). A Function's own
    ``save_for_backward`` is packed only after its forward has returned, so the recompute would
    run every tile's forward once more, for nothing; saved here, the pack comes first and the
    recompute stops before the tiles.
    """

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)  # internal: only the tiled Function reads it

    @staticmethod
    def backward(ctx, grad):
        return grad


class _TiledFunction(torch.autograd.Function):
    """``y[..., s:e, :], c_i = fn(x[..., s:e, :], c_{i-1})`` for each tile ``[s, e)`` of the sequence.

    Forward (grad disabled): each tile's output is written into one ``[..., T, N]`` buffer; no
    tile's intermediates are kept, only the carries ``c_i`` entering each tile (saved tensors, so
    that a gradient checkpoint around the caller drops and recomputes them like any other, unless
    the call hides them from it: ``_tiled_call``).
    Backward, tiles in reverse (a per-token map's in order: they are independent): the RNG state
    recorded before tile i's forward is restored, the tile is recomputed with grad under the
    forward's autocast state from ``x[..., s:e, :]`` and ``c_{i-1}`` (fresh leaves), and
    ``autograd.grad`` of (its slice of ``dy``, the gradient of the carry it handed on, from tile
    i+1) gives its ``dx`` (written into one ``[..., T, H]`` buffer), the gradient of ``c_{i-1}``
    (handed to tile i−1) and its parameter gradients, summed over tiles (in fp32 for 16-bit
    parameters, cast once). Parameters are inputs of this node, so
    ``autograd.grad`` of the loss with respect to them, gradient hooks and accumulation behave as
    for the untiled module. A per-token map carries nothing and is the case ``c_i = None``.
    Subclasses name the op (its second-derivative error says which).
    """

    @staticmethod
    def forward(ctx, tiles: _Tiles, x: torch.Tensor, *params: torch.Tensor):
        out, carries = _run_tiles(tiles, x, record_rng=tiles.preserve_rng_state)
        flat, ctx.carry_sizes = _flatten_carries(carries)
        ctx.tiles = tiles
        ctx.params = params  # references, not saved tensors: no pack, no recompute of a parameter
        ctx.save_for_backward(*(() if tiles.stash is not None else (x,)), *flat)
        return out


def _addends(y) -> tuple:
    return y if isinstance(y, tuple) else (y,)


def _summed(y):
    """A tile's output: ``y``, or the sum of its addends."""
    return functools.reduce(torch.add, _addends(y))


def _recompute_tile(tiles: _Tiles, piece: torch.Tensor, carry_in, span: tuple[int, int], index: int):
    """Tile ``index``'s forward again, with grad, for its backward: ``(addends of y, carry)``.

    ``y`` only roots the tile's backward (``autograd.grad(y, ..., dy)``), and a q35lab-patched MLP
    makes it (or its last addend, in a decoder layer) with ``swiglu_down``, whose down GEMM's
    backward needs ``dy`` alone: that GEMM is left uncomputed (``unread_down_outputs``), as the
    untiled layer's checkpoint recompute stops before it. 2·T·I·H FLOPs a layer saved (106 TFLOP a
    9B step at 32k). If the last addend is anything but the unmodified output of the one GEMM
    skipped, something may have read the uncomputed values: the tile runs again in full (its RNG
    state restored), its forward twice. A scan's carry comes from the mixer, before the MLP."""
    with unread_down_outputs() as skipped:
        y, carry = tiles.step(piece, carry_in, span)
    # exactly one skipped GEMM, and it is the last addend: with two (two MLPs chained), the first's
    # uncomputed output would have fed the second
    if not skipped or (len(skipped) == 1 and is_unread(_addends(y)[-1], skipped)):
        return _addends(y), carry
    del y, carry  # the first pass's graph holds its saved tensors: not alive beside the second's
    skipped.clear()
    if tiles.preserve_rng_state:
        tiles.restore_rng(index)
    y, carry = tiles.step(piece, carry_in, span)
    return _addends(y), carry


def _tiled_backward(ctx, grad_out):
    """The backward of ``_TiledFunction`` (see there): tiles in reverse, carries' gradients chained."""
    tiles = ctx.tiles
    saved = ctx.saved_tensors
    if tiles.stash is not None:
        (x,) = tiles.stash.saved_tensors
    else:
        x, saved = saved[0], saved[1:]
    carries = _unflatten_carries(saved, ctx.carry_sizes)
    want_x = ctx.needs_input_grad[1]
    wanted = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[2 + i]]
    dx = torch.empty_like(x) if want_x else None
    sums: dict[int, torch.Tensor] = {}
    handed_back = None  # the gradient of the carry the tile being recomputed hands on (tile i+1's)
    bounds = tiles.bounds(x.shape[-2])
    with torch.random.fork_rng(devices=tiles.rng_devices, enabled=tiles.preserve_rng_state,
                               device_type=tiles.device_type if tiles.rng_devices else "cuda"), shared_preparations():
        # a scan's carries chain the tiles backwards; a per-token map's are independent (in order)
        order = reversed(range(len(bounds))) if tiles.scan else range(len(bounds))
        for index in order:
            start, end = bounds[index]
            if tiles.preserve_rng_state:
                tiles.restore_rng(index)
            with torch.enable_grad(), _autocast(tiles.autocast):
                leaf = x[..., start:end, :].detach().requires_grad_(want_x)
                # the tile reads a view of its leaf: a module hook that hooks its inputs' gradients (torch's
                # ModuleTracker: FlopCounterMode) cannot hook a leaf inside autograd.grad
                piece = leaf.view_as(leaf) if want_x else leaf
                carry_in = _carry_leaves(carries[index])
                addends, carry_out = _recompute_tile(tiles, piece, carry_in, (start, end), index)
            pairs = [(y, grad_out[..., start:end, :]) for y in addends]
            if handed_back is not None:
                pairs += [(c, g) for c, g in zip(carry_out, handed_back) if g is not None]
            pairs = [(o, g) for o, g in pairs if o.requires_grad]
            leaves = [c for c in carry_in or () if c.requires_grad]
            inputs = ([leaf] if want_x else []) + leaves + [ctx.params[i] for i in wanted]
            grads = (torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
                     if pairs and inputs else (None,) * len(inputs))
            grads = list(grads)
            if want_x:
                g = grads.pop(0)
                if g is None:  # the tile's output does not depend on its input
                    dx[..., start:end, :].zero_()
                else:
                    dx[..., start:end, :].copy_(g)
            carry_grads = iter(grads[:len(leaves)])
            handed_back = None if carry_in is None else [next(carry_grads) if c.requires_grad else None
                                                         for c in carry_in]
            totals, addends = [], []
            for i, g in zip(wanted, grads[len(leaves):]):
                if g is None:
                    continue
                if i not in sums:
                    sums[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g.clone()
                else:
                    totals.append(sums[i])
                    addends.append(g)
            if totals:  # one multi-tensor launch a tile, not one small kernel per parameter
                torch._foreach_add_(totals, addends)
    param_grads = []
    for i, p in enumerate(ctx.params):
        g = sums.get(i)
        param_grads.append(None if g is None else g.to(p.dtype))
    return (None, dx, *param_grads)


class TiledMLPFunction(_TiledFunction):
    """The tiled MLP's node: ``_TiledFunction`` of a per-token map (no carry); ``tiled_mlp``."""

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        return _tiled_backward(ctx, grad_out)


class TiledGDNFunction(_TiledFunction):
    """The tiled GatedDeltaNet's node: ``_TiledFunction`` of a scan step whose carry is the conv's
    last K−1 input rows and the recurrent state; ``tiled_gated_delta_net``."""

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        return _tiled_backward(ctx, grad_out)


def _check_tile_tokens(tile_tokens: object, name: str = "tile_tokens", what: str = "tokens per tile",
                       minimum: int = 1) -> int:
    """A count of tokens: an int of at least ``minimum`` (a tile's size and a step's: 1)."""
    return check_int(name, tile_tokens, minimum=minimum, what=what)


def _parameters_of(fn) -> list[torch.Tensor] | None:
    """The trainable parameters ``fn`` computes with, when it says (a module, a bound method of
    one, or one of q35lab's forward objects holding ``.module``); else None."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "module", getattr(fn, "__self__", None))
    if isinstance(owner, torch.nn.Module):
        return [p for p in owner.parameters() if p.requires_grad]
    return None


def _check_params(params) -> tuple:
    params = tuple(params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}]: expected a torch.Tensor, got {type(p).__name__}")
    return params


@opaque_to_compile  # Python callables inside an autograd Function, per-tile RNG state: eager code
def tiled_mlp(mlp_forward, x: torch.Tensor, tile_tokens: int, *, params=None,
              preserve_rng_state: bool = True) -> torch.Tensor:
    """``mlp_forward(x)`` computed ``tile_tokens`` positions of the sequence (dim -2) at a time.

    ``mlp_forward`` maps ``[..., t, H]`` to ``[..., t, N]`` token by token (an MLP: transformers'
    ``Qwen3_5MLP``, the patched one with its LoRA adapters, any per-token callable). It is run
    once per tile in the forward, without grad, and once more per tile in the backward, with
    grad; nothing but ``x`` is kept between the two. ``params``: the tensors whose gradients
    flow through ``mlp_forward`` (default: the trainable parameters of the module it is, or is a
    method of, or holds as ``.module``; a plain function must pass them, ``()`` if none).

    Memory, per token (e = activation bytes, I = the MLP's width, 12288 in the 9B): the untiled
    q35lab MLP keeps ``x`` (H·e), gate/up (2I·e) and the SwiGLU output (I·e) until its backward,
    and its backward adds dh (I·e): (H + 4I)·e = 104 KiB a token in bf16. Tiled, the whole
    sequence holds only ``x`` and ``dx`` (2H·e = 16 KiB a token); the (H + 4I)·e working set
    exists for one tile at a time.

    Passes under the decoder layer's (non-reentrant) gradient checkpointing: forward 1 (tiles, no
    grad), the layer's recompute 0 (it stops at the saving of ``x``, which is made the layer's
    last saved tensor on purpose, see ``_StashInput``), backward 1 forward + 1 backward per tile,
    the forward without a q35lab-patched MLP's down GEMM (``_recompute_tile``) — the same MLP FLOPs
    as the untiled MLP under checkpointing, whose recompute stops before that GEMM. An MLP whose
    down projection is not ``swiglu_down``'s frozen GEMM recomputes it, one down projection more a
    tile: PEFT's or transformers' own forward (``lora=False``), a trainable down weight, dropout on
    the down adapter, a hook on ``down_proj``, a compute dtype other than the weights' under
    autocast. A callable that reads the skipped output runs each tile's forward twice in backward.
    With early stop disabled (``torch.utils.checkpoint.set_checkpoint_early_stop(False)``) the
    recompute runs the tiles' forward too: correct, one MLP forward more. Without outer
    checkpointing the tiling costs one MLP forward more than the untiled MLP.

    Dropout (LoRA dropout in train mode): the CPU RNG state and the input device's are recorded
    before each tile's forward and restored before its recompute, so each tile's masks are the
    same in both (as ``torch.utils.checkpoint``'s ``preserve_rng_state``); the global RNG state
    after the backward is left as it was (``fork_rng``). The masks differ from the untiled MLP's
    (a tile draws its own), as with any change of batch shape. Autocast: the forward's state is
    re-entered by the recompute. Frozen or trainable parameters, ``retain_graph`` and
    ``autograd.grad`` work; a second derivative raises (first order only).

    ``tile_tokens`` ≥ T, no tokens, or nothing requiring grad under grad mode: ``mlp_forward(x)``
    as it is (the last without grad: tile by tile).
    """
    if not callable(mlp_forward):
        raise TypeError(f"mlp_forward: expected a callable, got {type(mlp_forward).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x: expected [..., T, H] (at least 2 dimensions), got shape {tuple(x.shape)}")
    tile = _check_tile_tokens(tile_tokens)
    tokens = x.shape[-2]
    if tile >= tokens or tokens == 0:
        return mlp_forward(x)
    if params is None:
        params = _parameters_of(mlp_forward)
        if params is None:
            raise TypeError("params: mlp_forward is neither a module nor holds one; pass the tensors its gradients "
                            "flow to (params=() if none)")
    params = _check_params(params)
    tiles = _Tiles(mlp_forward, tile, bool(preserve_rng_state), x.device)
    return _tiled_call(TiledMLPFunction, tiles, x, params, stash=True)


def _tiled_call(function: type, tiles: _Tiles, x: torch.Tensor, params, stash: bool,
                hide_saved: bool = False) -> torch.Tensor:
    """``function.apply(tiles, x, *params)`` where a backward will need it (``x`` saved first by its
    own node if ``stash``: ``_StashInput``); without one, tile by tile without grad.

    ``hide_saved``: what the node saves (the carries; ``x`` where it is not stashed) is packed as it
    is, under saved-tensor hooks of its own, which a gradient checkpoint's or the offload's around
    the caller do not see: the checkpoint's recompute then has nothing of the node's to rebuild and
    stops at the stash, and the carries are freed when the node's backward has run."""
    if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
        with torch.no_grad():
            return _run_tiles(tiles, x, record_rng=False, keep_carries=False)[0]
    if stash and x.requires_grad:
        x = _StashInput.apply(x)
        tiles.stash = x.grad_fn
    if not hide_saved:
        return function.apply(tiles, x, *params)
    with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
        return function.apply(tiles, x, *params)


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# ----------------------------------------------------------------------------------------------
# The sequence-tiled GatedDeltaNet. Everything in a GatedDeltaNet is per token (in_proj, the
# gates, the gated norm, out_proj) except two things that carry along the sequence: the causal
# depthwise conv1d (window K = 4: output row t reads input rows t−K+1..t) and the delta rule's
# recurrent state S [B, Hv, dk, dv] (fp32). A tile [s, e) is exact given both: the conv's last
# K−1 *input* rows before s and S at s. Those are the carry of the scan; everything else is the
# module's own pieces (its projections as patched, its conv function, its core, its norm).
# ----------------------------------------------------------------------------------------------
#: The keyword arguments under which transformers hands a GatedDeltaNet a cache (by version).
_CACHE_ARGUMENTS = versions.CACHE_ARGUMENTS
#: ... and packed sequences' boundaries (flash-attention's kwargs; fla's and causal-conv1d's names).
_PACKING_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")


def _has_cache(kwargs: dict) -> bool:
    """Whether a forward's keyword arguments hand it a cache."""
    return any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS)


def _is_gated_delta_net(module: torch.nn.Module) -> bool:
    from .patch import _is_gated_delta_net as is_gdn

    return is_gdn(module)


def _switched_to_q35lab(gdn: torch.nn.Module):
    from .patch import switched_to_q35lab

    return switched_to_q35lab(gdn)


def _modeling_module(gdn: torch.nn.Module):
    return sys.modules[type(gdn).__module__]


def _conv_function(gdn: torch.nn.Module):
    """The causal conv1d the GatedDeltaNet's own forward calls, by transformers' convention
    ``fn(x [B, C, T], weight [C, K], bias, activation=..., **kwargs)``: q35lab's when patched
    (``conv=True``), else the layer's attribute (transformers < 5.15) or its modeling module's
    function (the causal-conv1d package's, or transformers' PyTorch one). None if there is none."""
    from .patch import _CONV, _CausalConv, _marked

    if _marked(gdn, _CONV) is not None:
        return _CausalConv()
    attribute = versions.layer_conv(gdn)
    if callable(attribute):
        return attribute
    return versions.module_function(_modeling_module(gdn), versions.CONV)


def _core_function(gdn: torch.nn.Module):
    """The chunked delta-rule core the GatedDeltaNet's own forward calls: the layer's attribute
    (transformers < 5.15), else its modeling module's ``torch_chunk_gated_delta_rule`` — fla's
    ``chunk_gated_delta_rule`` when flash-linear-attention is installed, transformers' PyTorch one
    otherwise (looked up at each call, as the forward does: a timer wrapping it sees the tiles)."""
    attribute = versions.layer_core(gdn)
    if callable(attribute):
        return attribute
    return versions.module_function(_modeling_module(gdn), versions.CHUNK_CORE)


#: Whether a GatedDeltaNet class's forward repeats q and k to the value heads itself (by version).
_forward_repeats_key_heads = versions.forward_repeats_key_heads


def gated_delta_net_problem(gdn: torch.nn.Module) -> str | None:
    """Why ``tiled_gated_delta_net`` cannot compute this module, or None if it can."""
    if not _is_gated_delta_net(gdn):
        return f"{type(gdn).__name__} is not a transformers GatedDeltaNet"
    if _conv_function(gdn) is None:
        return "no causal_conv1d_fn in this transformers version (the layer's own conv module is not tiled)"
    if _core_function(gdn) is None:
        return "no chunk_gated_delta_rule in this transformers version"
    return None


class _GatedDeltaNetTile:
    """One tile of a GatedDeltaNet's forward: ``(y, (conv rows, S)) = tile(x, (conv rows, S), span)``.

    What transformers' ``Qwen3_5GatedDeltaNet.forward`` computes (5.15 to 5.25, without a cache),
    on the tile's rows, with the module's own pieces::

        x            = x · mask[s:e]                          (padding rows zeroed; if a mask is given)
        qkv, z, b, a = in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x)   (one fused node, patched)
        rows         = [conv rows | qkv]                     (the previous tile's last K−1 qkv rows)
        q, k, v      = split(conv1d(rows)[drop the first len(conv rows)])        (silu)
        beta, g      = sigmoid(b), −exp(A_log) · softplus(a + dt_bias)           (fp32 g)
        o, S'        = core(q, k, v, g, beta, initial_state=S, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)    (q, k repeated by num_v_heads // num_k_heads,
                                                               as the forward would)
        y            = out_proj(norm(o, z))

    and hands on ``(last K−1 rows of [conv rows | qkv], S')``. q35lab's conv (patched) takes the
    carried rows as its initial rows and gives the last ones (``causal_conv1d(initial_rows=,
    return_final_rows=True)``): ``rows`` is never made; any other conv gets the concatenation.
    The first tile has no carry (the conv pads with zeros, S starts at zero: the module's own
    start). A tile shorter than K−1 hands on rows of earlier tiles too, so the conv of every
    tile sees exactly the rows it would see untiled. The carry is the conv's *input*, not x: the
    in_proj runs once per row, so LoRA dropout draws one mask per row as in the untiled module.
    """

    def __init__(self, gdn: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict):
        self.gdn, self.mask, self.kwargs = gdn, attention_mask, kwargs
        # resolved once a call: the forward's tiles and their recompute in backward use the same
        self.conv, self.core = _conv_function(gdn), _core_function(gdn)
        from .patch import _CausalConv

        # q35lab's kernel reads the carried rows where the tile's first rows' window starts and hands on
        # its last ones: no [K-1+tile, C] concatenation, whose slices' gradients cost three passes over it
        self.conv_carries_rows = isinstance(self.conv, _CausalConv)
        self.repeat = _forward_repeats_key_heads(type(gdn))
        self.apply_mask = getattr(_modeling_module(gdn), "apply_mask_to_padding_states", _apply_mask_to_padding_states)
        self.core_kwargs = {k: v for k, v in kwargs.items() if k != "cu_seq_lens_q"}  # as the forward pops it

    def __call__(self, x: torch.Tensor, carry, span: tuple[int, int]):
        gdn = self.gdn
        start, end = span
        if self.mask is not None:
            x = self.apply_mask(x, self.mask[:, start:end])
        batch, tokens, _ = x.shape
        qkv = gdn.in_proj_qkv(x)
        z = gdn.in_proj_z(x)
        b = gdn.in_proj_b(x)
        a = gdn.in_proj_a(x)
        previous, state = (None, None) if carry is None else carry
        mixed, rows = self._conv(qkv, previous)
        query, key, value = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        query = query.reshape(batch, tokens, -1, gdn.head_k_dim)
        key = key.reshape(batch, tokens, -1, gdn.head_k_dim)
        value = value.reshape(batch, tokens, -1, gdn.head_v_dim)
        beta = b.sigmoid()
        g = -gdn.A_log.float().exp() * torch.nn.functional.softplus(a.float() + gdn.dt_bias)
        group = gdn.num_v_heads // gdn.num_k_heads
        if self.repeat and group > 1:
            query = query.repeat_interleave(group, dim=2)
            key = key.repeat_interleave(group, dim=2)
        with _switched_to_q35lab(gdn):  # q35lab's wrapper of the core, as in the patched forward (q, k, v copied for fla)
            out, state = self.core(query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=None, **self.core_kwargs)
        out = gdn.norm(out.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
        y = gdn.out_proj(out.reshape(batch, tokens, -1))
        return y, (rows, state)

    def _conv(self, qkv: torch.Tensor, previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the conv's output for the tile's rows [B, t, C], the last K−1 rows of [previous | qkv])."""
        gdn = self.gdn
        if self.conv_carries_rows:
            return causal_conv1d(qkv, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, activation=gdn.activation,
                                 initial_rows=previous, return_final_rows=True)
        tokens = qkv.shape[1]
        rows = qkv if previous is None else torch.cat([previous.to(qkv.dtype), qkv], dim=1)
        mixed = self.conv(rows.transpose(1, 2), gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias,
                          activation=gdn.activation, **self.kwargs)
        keep = min(gdn.conv_kernel_size - 1, rows.shape[1])
        # a copy: a view would keep the whole tile's rows alive until the backward
        return mixed.transpose(1, 2)[:, rows.shape[1] - tokens:], rows[:, rows.shape[1] - keep:].clone()


def _apply_mask_to_padding_states(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_mask_to_padding_states`` (for a modeling module without one)."""
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def _packed(kwargs: dict) -> str | None:
    return next((name for name in _PACKING_ARGUMENTS if kwargs.get(name) is not None), None)


def _check_tiled_call(x, tile_tokens, attention_mask, kwargs: dict, hidden: int, what: str) -> int:
    """The tile size, after checking a tiled GatedDeltaNet's (or its layer's) call: ``x`` [B, T,
    hidden], a 2-D padding mask of [B, T] or None, no packed sequences (``ValueError`` naming the
    argument)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != hidden:
        raise ValueError(f"x: expected [B, T, {hidden}] ({what}'s input), got shape {tuple(x.shape)}")
    tile = _check_tile_tokens(tile_tokens)
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != tuple(x.shape[:2])):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask: expected a 2-D padding mask of shape {tuple(x.shape[:2])} or None, got {got}")
    packed = _packed(kwargs)
    if packed:
        raise ValueError(f"{packed}: packed sequences are not tiled (their boundaries do not line up with tiles); "
                         f"call {what} untiled")
    return tile


@opaque_to_compile  # Python callables inside an autograd Function, per-tile RNG state: eager code
def tiled_gated_delta_net(gdn: torch.nn.Module, x: torch.Tensor, tile_tokens: int, *,
                          attention_mask: torch.Tensor | None = None, preserve_rng_state: bool = True,
                          **kwargs) -> torch.Tensor:
    """A GatedDeltaNet's forward ``gdn(x, attention_mask=...)`` computed ``tile_tokens`` positions
    of the sequence at a time: exactly the module's function (not an approximation), with the
    backward's working set of one tile instead of the sequence's.

    ``gdn``: transformers' ``Qwen3_5GatedDeltaNet`` (or the MoE one), as it is or patched by
    q35lab (its fused in_proj, causal conv and gated norm are what each tile calls), with PEFT
    LoRA adapters or without; ``x``: its input ``[B, T, H]``; ``attention_mask``: the 2-D padding
    mask the model hands it (rows zeroed token by token, as the module does); ``kwargs``: the rest
    of the layer's keyword arguments, passed to the conv and the core as the module passes them.
    Packed sequences (``cu_seq_lens_q``) are refused (``ValueError``): their boundaries do not
    line up with tiles; ``TiledGDNForward`` runs such calls untiled.

    Each tile is ``_GatedDeltaNetTile``: the per-token parts on the tile's rows; the conv over the
    previous tile's last K−1 conv-input rows followed by the tile's (K = 4); the delta-rule core
    from the previous tile's final state S (``initial_state``, ``output_final_state=True``:
    transformers' PyTorch core and fla's ``chunk_gated_delta_rule`` take both, and fla's backward
    takes the final state's gradient ``dht`` and returns the initial state's — read from fla's code,
    to be confirmed on the GPU). Forward: tiles in order without grad, keeping only the
    carry into each tile — K−1 conv rows ([B, 3, 8192] bf16, 48 KiB) and S ([B, 32, 128, 128]
    fp32, 2 MiB, at 9B) — and the caller's ``x``. Backward (``TiledGDNFunction``): tiles in
    reverse, each recomputed with grad from its rows of ``x`` and its carry (leaves), backpropagated
    from (its ``dy``, the next tile's gradient of the carry) to ``dx``, the previous carry's
    gradient and every trainable parameter's (LoRA adapters, and A_log, dt_bias, the conv or the
    norm if they train).

    Memory (9B, bf16, per token): untiled, the GatedDeltaNet's backward holds ~181 KiB a token of
    its own (the in_proj output, z, the core's q, k, v, the WY matrix, its recomputed w, u and h,
    dh, dq, dk, dv, the norm's input and output, ...; 221 KiB with the checkpoints and residual
    gradients, ``bytes_per_token``). Tiled, the sequence holds ``x`` and ``dx`` (2H·e = 16 KiB a
    token) and the carries (2 MiB + 48 KiB a tile: 262 B a token at 8192-token tiles); the rest
    exists for one tile at a time.

    Passes: without outer checkpointing, each tile's forward runs twice (forward, and recompute in
    backward) and its backward once. Under the decoder layer's non-reentrant checkpoint, three
    times: the checkpoint's recompute needs the GatedDeltaNet's output to rebuild what the layer's
    later ops save (the post-attention norm's input, the MLP's input), and only a tile forward
    gives it — avoiding that pass would take keeping a [T, H] output per layer, which is what the
    checkpoint exists to drop. That is one GatedDeltaNet forward more than the untiled layer
    (8–10% of a GatedDeltaNet layer's step at 9B by GEMM FLOPs; the tiled MLP after it keeps its
    early stop). ``tiled_gated_delta_net_layer`` avoids it by tiling the whole decoder layer,
    which is what ``apply_to_qwen3_5(tiled_gdn=N)`` does where the layer's MLP is per token.

    Dropout, autocast, RNG, frozen or trainable parameters, ``retain_graph`` and the second
    derivative's error: as ``tiled_mlp``. With dropout the masks are the tile's own draws, not
    the untiled module's (as with any change of batch shape), replayed exactly in backward.
    ``tile_tokens`` ≥ T: one tile, the module's math with grad, no recompute. Nothing requiring
    grad: tile by tile without grad (a long prefill without a cache in less memory).
    """
    if not isinstance(gdn, torch.nn.Module) or not _is_gated_delta_net(gdn):
        raise TypeError(f"gdn: expected a transformers GatedDeltaNet module, got {type(gdn).__name__}")
    problem = gated_delta_net_problem(gdn)
    if problem:
        raise TypeError(f"gdn: cannot be tiled: {problem}")
    tile = _check_tiled_call(x, tile_tokens, attention_mask, kwargs, gdn.hidden_size, "the GatedDeltaNet")
    step = _GatedDeltaNetTile(gdn, attention_mask, kwargs)
    tokens = x.shape[1]
    if tile >= tokens or tokens == 0:
        return step(x, None, (0, tokens))[0]
    params = tuple(p for p in gdn.parameters() if p.requires_grad)
    tiles = _Tiles(step, tile, bool(preserve_rng_state), x.device, scan=True, name="GatedDeltaNet tile")
    # not stashed: the layer's recompute needs this node's output anyway (the passes above)
    return _tiled_call(TiledGDNFunction, tiles, x, params, stash=False)


class _GatedDeltaNetLayerTile:
    """One tile of a GatedDeltaNet decoder layer: ``((h, m), carry) = tile(x, carry, span)`` with

        h, carry' = x + GatedDeltaNet_tile(input_layernorm(x), carry)      (``_GatedDeltaNetTile``)
        m         = mlp(post_attention_layernorm(h))

    the layer's output ``h + m`` given as its two addends (``_Tiles``): what transformers'
    ``Qwen3_5DecoderLayer.forward`` computes for a linear-attention layer, on the tile's rows."""

    def __init__(self, layer: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict):
        self.layer = layer
        self.mixer = _GatedDeltaNetTile(layer.linear_attn, attention_mask, kwargs)
        # a tiled MLP's own forward: the layer's tile already bounds the MLP's working set, and an MLP
        # tiled again inside it would hide its down GEMM's output from _recompute_tile
        forward = vars(layer.mlp).get("forward")
        self.mlp = forward.untiled if isinstance(forward, TiledMLPForward) else layer.mlp

    def __call__(self, x: torch.Tensor, carry, span: tuple[int, int]):
        layer = self.layer
        mixed, carry = self.mixer(layer.input_layernorm(x), carry, span)
        h = x + mixed
        return (h, self.mlp(layer.post_attention_layernorm(h))), carry


class TiledGDNLayerFunction(_TiledFunction):
    """The tiled GatedDeltaNet decoder layer's node: ``_TiledFunction`` of ``_GatedDeltaNetLayerTile``,
    its carries hidden from a checkpoint around it (``_tiled_call``); ``tiled_gated_delta_net_layer``."""

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        return _tiled_backward(ctx, grad_out)


def is_gated_delta_net_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers decoder layer of a GatedDeltaNet and a per-token MLP
    (the dense Qwen3.5's; the MoE's routed block is not tiled with its layer)."""
    return (_is_decoder_layer(module) and getattr(module, "block_type", None) == "linear_attention"
            and _is_gated_delta_net(getattr(module, "linear_attn", None)) and _is_mlp(getattr(module, "mlp", None))
            and all(isinstance(getattr(module, n, None), torch.nn.Module)
                    for n in ("input_layernorm", "post_attention_layernorm")))


def _check_gated_delta_net_layer(layer) -> None:
    if not isinstance(layer, torch.nn.Module) or not is_gated_delta_net_layer(layer):
        raise TypeError(f"layer: expected a transformers GatedDeltaNet decoder layer with a per-token MLP, "
                        f"got {type(layer).__name__}")


@opaque_to_compile  # as tiled_gated_delta_net
def tiled_gated_delta_net_layer(layer: torch.nn.Module, x: torch.Tensor, tile_tokens: int, *,
                                attention_mask: torch.Tensor | None = None, preserve_rng_state: bool = True,
                                **kwargs) -> torch.Tensor:
    """A GatedDeltaNet decoder layer's forward ``layer(x, attention_mask=...)`` computed
    ``tile_tokens`` positions at a time, the whole layer in each tile (``_GatedDeltaNetLayerTile``:
    input norm, the GatedDeltaNet's tile with its carry, residual, post-attention norm, MLP,
    residual): exactly the layer's function, with the backward's working set of one tile.

    Why the whole layer and not the GatedDeltaNet alone (``tiled_gated_delta_net``): under the
    decoder layer's gradient checkpoint, the checkpoint's recompute must rebuild what the layer's
    later ops save (the post-attention norm's and the MLP's inputs), which takes the
    GatedDeltaNet's output, which only a tile pass gives: three GatedDeltaNet forwards a step
    where the untiled layer runs two (measured +10.9% of the 9B step at 32k on the H200, 963ed32).
    Tiled as a whole, the layer saves its input first (``_StashInput``) and hides its carries from
    the checkpoint (``_tiled_call``'s ``hide_saved``), so the checkpoint's recompute stops at the
    input: forward 1 (tiles, no grad), recompute 0, backward 1 forward (without the MLP's down
    GEMM, ``_recompute_tile``) and 1 backward per tile in reverse — the untiled checkpointed layer's
    passes. The carries, the fp32 delta-rule state and the conv's last K−1 input rows (2.05 MiB a
    tile at 9B), stay alive from the forward to the layer's backward: 24 layers × T / tile of them.
    An input that does not require grad (no stash) is kept by the node too, on the GPU even when
    the layer's checkpoint is offloaded.

    ``layer``: a decoder layer ``is_gated_delta_net_layer`` accepts, patched by q35lab or not;
    ``attention_mask``: the 2-D padding mask; ``kwargs``: the rest the layer would hand its
    GatedDeltaNet. Packed sequences are refused (``ValueError``); ``tile_tokens`` ≥ T runs the
    tile function once, with grad; nothing requiring grad: tile by tile without grad. Dropout, RNG,
    autocast, frozen or trainable parameters, ``retain_graph`` and the second derivative's error:
    as ``tiled_mlp``. Hooks on the layer's GatedDeltaNet or MLP are not called (its forward,
    ``TiledGDNLayerForward``, runs such a layer untiled)."""
    _check_gated_delta_net_layer(layer)
    problem = gated_delta_net_problem(layer.linear_attn)
    if problem:
        raise TypeError(f"layer: its GatedDeltaNet cannot be tiled: {problem}")
    tile = _check_tiled_call(x, tile_tokens, attention_mask, kwargs, layer.linear_attn.hidden_size, "the layer")
    step = _GatedDeltaNetLayerTile(layer, attention_mask, kwargs)
    tokens = x.shape[1]
    if tile >= tokens or tokens == 0:
        return _summed(step(x, None, (0, tokens))[0])
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    tiles = _Tiles(step, tile, bool(preserve_rng_state), x.device, scan=True, name="GatedDeltaNet layer tile")
    return _tiled_call(TiledGDNLayerFunction, tiles, x, params, stash=True, hide_saved=True)


# ----------------------------------------------------------------------------------------------
# The instance-level forwards that tile a module, and putting them on (and off) a model.
# ----------------------------------------------------------------------------------------------
#: Modules whose forward is a per-token MLP that ``tile_mlps`` tiles (transformers' classes).
MLP_CLASSES = ("Qwen3_5MLP", "Qwen3_5MoeMLP")


class _TiledForward:
    """A module's instance-level forward that tiles the forward it replaced (q35lab's patched one,
    or the class's own), which it calls for what it does not tile. An object holding its module,
    as q35lab's other forwards (see ``q35lab.patch._Forward``): ``copy.deepcopy`` binds the copy
    to the copied module, ``pickle`` stores it by class."""

    __name__ = "forward"

    #: a step of at most this many tokens (rows × sequence) runs untiled whatever the tile
    #: (``tile_only_above``: the longest step the memory model predicts to fit untiled); 0: every
    #: sequence longer than a tile is tiled
    untiled_up_to = 0

    def __init__(self, module: torch.nn.Module, tile_tokens: int, inner=None):
        self.module = module
        self.tile_tokens = _check_tile_tokens(tile_tokens)
        self.inner = inner  # the instance-level forward replaced (None: the class's)

    @property
    def __wrapped__(self):
        return type(self.module).forward.__get__(self.module)

    def __repr__(self) -> str:
        return f"<q35lab {type(self).__name__} of {type(self.module).__name__}, {self.tile_tokens} tokens a tile>"

    def nothing_to_tile(self, x, args: tuple) -> str | None:
        """Why a call of a sequence module (``x`` [B, T, H], its only positional argument) has
        nothing to tile, or None: another call signature, one tile's tokens, or no backward to come."""
        if len(args) > 1 or not isinstance(x, torch.Tensor) or x.dim() != 3:
            return "a call the tiles do not take"
        if x.shape[1] <= self.tile_tokens:
            return "one tile"
        if x.shape[0] * x.shape[1] <= self.untiled_up_to:
            return "fits untiled"
        if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in self.module.parameters())):
            return "no grad"
        return None

    def untiled(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class TiledMLPForward(_TiledForward):
    """An MLP's forward through ``tiled_mlp``; calls with extra arguments go to the wrapped forward untiled."""

    def __call__(self, x, *args, **kwargs):
        if (args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2
                or x.shape[:-1].numel() <= self.untiled_up_to):
            return self.untiled(x, *args, **kwargs)
        params = [p for p in self.module.parameters() if p.requires_grad]
        return tiled_mlp(self.untiled, x, self.tile_tokens, params=params)


class TiledGDNForward(_TiledForward):
    """A GatedDeltaNet's forward through ``tiled_gated_delta_net`` when it trains on more than a tile.

    Untiled (the wrapped forward, as the module computes it): no grad needed (eval, generation),
    ``T`` ≤ the tile, a call other than transformers' keyword one; and, with a warning (the memory
    the tiling would save is then spent), a cache (generation's prefill; a training forward
    without gradient checkpointing gets one unless ``use_cache=False``) or packed sequences
    (``cu_seq_lens_q``), whose state tiles cannot carry. Also untiled: a conv1d under accelerate's
    offload hooks (the tiles read its weight directly)."""

    def __call__(self, *args, **kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if self._untiled_because(x, args, kwargs):
            return self.untiled(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "attention_mask", *_CACHE_ARGUMENTS)}
        return tiled_gated_delta_net(self.module, x, self.tile_tokens, attention_mask=kwargs.get("attention_mask"),
                                     **rest)

    def _untiled_because(self, x, args: tuple, kwargs: dict) -> str | None:
        nothing_to_tile = self.nothing_to_tile(x, args)
        if nothing_to_tile:
            return nothing_to_tile
        if getattr(self.module.conv1d, "_hf_hook", None) is not None:
            return "accelerate hooks"
        why, packed = None, _packed(kwargs)
        if _has_cache(kwargs):
            why = ("a cache was passed (generation, or use_cache=True in a forward without gradient checkpointing: "
                   "pass use_cache=False)")
        elif packed:
            why = f"packed sequences ({packed}) do not line up with tiles"
        if why:
            warnings.warn(f"q35lab: tiled GatedDeltaNet ({self.tile_tokens} tokens a tile) runs untiled here: {why}; "
                          "its backward then holds the whole sequence's working set", stacklevel=3)
        return why


def _checkpoints_the_call() -> bool:
    """Whether transformers' ``GradientCheckpointingLayer`` checkpoints ``__call__`` (< 5.23), around an
    instance's forward, rather than the class's ``forward`` (5.23 on), which an instance's forward replaces."""
    return versions.checkpoints_the_call()


class TiledGDNLayerForward(_TiledForward):
    """A GatedDeltaNet decoder layer's forward through ``tiled_gated_delta_net_layer`` when it
    trains on more than a tile; otherwise the wrapped forward, whose GatedDeltaNet (tiled by
    ``TiledGDNForward`` where it can be) says why it runs untiled. Also the wrapped forward: a
    layer whose GatedDeltaNet or MLP has hooks (or a global module hook is set), and one whose
    forward was wrapped before (accelerate's hooks)."""

    #: the layer's own arguments, which its GatedDeltaNet does not take
    LAYER_ARGUMENTS = ("hidden_states", "attention_mask", "position_embeddings", "position_ids", *_CACHE_ARGUMENTS)

    def __call__(self, *args, **kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if self._untiled(x, args, kwargs):
            return self.untiled(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in self.LAYER_ARGUMENTS}
        tiled = functools.partial(tiled_gated_delta_net_layer, self.module, tile_tokens=self.tile_tokens,
                                  attention_mask=kwargs.get("attention_mask"), **rest)
        layer = self.module
        if layer.gradient_checkpointing and layer.training and not _checkpoints_the_call():
            # transformers that checkpoints the class's forward (which this one replaces): as it would, through the
            # layer's checkpoint function (the offload's hooks wrap it); one that checkpoints __call__ has already
            return layer._gradient_checkpointing_func(tiled, x)
        return tiled(x)

    def _untiled(self, x, args: tuple, kwargs: dict) -> bool:
        if self.nothing_to_tile(x, args):
            return True
        from .patch import _hooks_would_see

        layer = self.module
        gdn = layer.linear_attn
        return (_has_cache(kwargs) or _packed(kwargs) is not None or gated_delta_net_problem(gdn) is not None
                # hooks the tiles would not call (or would call per tile, on an uncomputed down output), and a
                # forward wrapped before the tiling (accelerate's device placement): the layer as it is
                or _hooks_would_see(gdn, layer.mlp) or self.inner is not None
                or any(getattr(m, "_hf_hook", None) is not None for m in (layer, gdn.conv1d)))


def _tile(module: torch.nn.Module, tile_tokens: int, forward_class: type) -> bool:
    """Give ``module`` a ``forward_class`` around its current forward; True if it had none (an
    existing one just takes the new tile size, and tiles every sequence longer than it again)."""
    tile_tokens = _check_tile_tokens(tile_tokens)
    current = vars(module).get("forward")
    if isinstance(current, forward_class):
        current.tile_tokens = tile_tokens
        vars(current).pop("untiled_up_to", None)
        return False
    module.forward = forward_class(module, tile_tokens, inner=current)
    return True


def _untile(module: torch.nn.Module, forward_class: type) -> bool:
    current = vars(module).get("forward")
    if not isinstance(current, forward_class):
        return False
    if current.inner is None:
        del module.forward
    else:
        module.forward = current.inner
    return True


def tile_mlp(mlp: torch.nn.Module, tile_tokens: int) -> bool:
    """Give ``mlp`` a ``TiledMLPForward`` around its current forward; True if it had none (an
    existing one just takes the new tile size). Call after any patch that sets the MLP's forward
    (``apply_to_qwen3_5``'s swiglu), and ``untile_mlp`` before undoing that patch."""
    return _tile(mlp, tile_tokens, TiledMLPForward)


def untile_mlp(mlp: torch.nn.Module) -> bool:
    """Put back the forward ``tile_mlp`` wrapped; True if there was a tiled one."""
    return _untile(mlp, TiledMLPForward)


def _is_mlp(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ in MLP_CLASSES and cls.__module__.startswith("transformers.")


def tile_mlps(model: torch.nn.Module, tile_tokens: int) -> int:
    """``tile_mlp`` on every Qwen3.5 MLP of ``model`` (PEFT wrappers included); how many were new."""
    return sum(tile_mlp(m, tile_tokens) for m in model.modules() if _is_mlp(m))


def untile_mlps(model: torch.nn.Module) -> int:
    return sum(untile_mlp(m) for m in model.modules() if _is_mlp(m))


def tile_gated_delta_net(gdn: torch.nn.Module, tile_tokens: int) -> bool:
    """Give a GatedDeltaNet a ``TiledGDNForward`` around its current forward; True if it had none
    (an existing one just takes the new tile size). Call after any patch that sets its forward
    (``apply_to_qwen3_5``'s conv), and ``untile_gated_delta_net`` before undoing that patch.
    ``TypeError`` (naming ``gdn``) for a module ``gated_delta_net_problem`` says cannot be tiled."""
    problem = gated_delta_net_problem(gdn)
    if problem:
        raise TypeError(f"gdn: cannot be tiled: {problem}")
    return _tile(gdn, tile_tokens, TiledGDNForward)


def untile_gated_delta_net(gdn: torch.nn.Module) -> bool:
    """Put back the forward ``tile_gated_delta_net`` wrapped; True if there was a tiled one."""
    return _untile(gdn, TiledGDNForward)


def tile_gated_delta_nets(model: torch.nn.Module, tile_tokens: int) -> int:
    """``tile_gated_delta_net`` on every GatedDeltaNet of ``model`` that can be tiled, and
    ``tile_gated_delta_net_layer`` on every decoder layer of one with a per-token MLP (the tiled
    layer is what trains; the tiled GatedDeltaNet serves the layers that cannot be tiled whole);
    how many modules were new."""
    new = 0
    for m in model.modules():
        if _is_gated_delta_net(m) and gated_delta_net_problem(m) is None:
            new += tile_gated_delta_net(m, tile_tokens)
        elif is_gated_delta_net_layer(m) and gated_delta_net_problem(m.linear_attn) is None:
            new += tile_gated_delta_net_layer(m, tile_tokens)
    return new


def untile_gated_delta_nets(model: torch.nn.Module) -> int:
    return sum(untile_gated_delta_net(m) or untile_gated_delta_net_layer(m) for m in model.modules())


def tile_gated_delta_net_layer(layer: torch.nn.Module, tile_tokens: int) -> bool:
    """Give a GatedDeltaNet decoder layer a ``TiledGDNLayerForward``; True if it had none.
    ``TypeError`` (naming ``layer``) for a module ``is_gated_delta_net_layer`` refuses."""
    _check_gated_delta_net_layer(layer)
    return _tile(layer, tile_tokens, TiledGDNLayerForward)


def untile_gated_delta_net_layer(layer: torch.nn.Module) -> bool:
    """Put back the forward ``tile_gated_delta_net_layer`` wrapped; True if there was a tiled one."""
    return _untile(layer, TiledGDNLayerForward)


def tile_only_above(model: torch.nn.Module, tokens: int) -> int:
    """Let every tiled MLP, GatedDeltaNet and decoder layer of ``model`` run untiled in a step of at
    most ``tokens`` tokens (rows × sequence), tiling only longer ones.

    Tiles trade launches for memory; ``apply_to_qwen3_5(long_context=N)`` sets this to the longest
    step its plan predicts to fit untiled (``LongContextPlan.untiled_up_to``).

    Args:
        model (nn.Module): a model patched with tiles.
        tokens (int): the longest step to run untiled; 0 tiles every sequence longer than a tile.

    Returns:
        int: how many tiled modules there were.

    Raises:
        TypeError: ``model`` not a module, ``tokens`` not an int.
        ValueError: ``tokens`` below 0.
    """
    check_module("model", model)
    tokens = _check_tile_tokens(tokens, "tokens", "the longest step to run untiled", minimum=0)
    tiled = [forward for m in model.modules() if isinstance(forward := vars(m).get("forward"), _TiledForward)]
    for forward in tiled:
        forward.untiled_up_to = tokens
    return len(tiled)


# ==============================================================================================
# 2. Checkpoint inputs offloaded to host memory
# ==============================================================================================
#: Saved tensors smaller than this stay where they are (a [B, T, H] bf16 checkpoint at H = 4096
#: passes it from T = 128 tokens on).
MIN_OFFLOAD_BYTES = 2**20

#: Host memory the checkpoint offload leaves to the process, the data loader and the OS (pinned
#: memory is never swapped out; a host that runs out ends the process). A 512k-token 9B step that
#: pinned 112 GiB of a 125 GiB host (about 12 GiB left) died without an error on the H200. A host
#: of less than 64 GiB keeps a quarter of its memory instead (``default_host_reserve``).
HOST_RESERVE_BYTES = 16 * 2**30

#: Host copies are made of pinned blocks of at most this size. PyTorch's pinned-memory allocator
#: rounds every request up to a power of two (``CachingHostAllocator``): one block per [T, H]
#: tensor would waste up to half the host memory (3 GiB → 4 GiB at T = 384k); blocks of 64 MiB
#: waste at most one block's rounding per tensor.
HOST_CHUNK_BYTES = 64 * 2**20


class _Kept:
    """A saved tensor left on its device, in the offloader's chain so that its unpacking
    prefetches the one saved before it."""

    __slots__ = ("tensor", "prev", "__weakref__")

    def __init__(self, tensor, prev):
        self.tensor, self.prev = tensor, prev


class _HostCopy:
    """A saved tensor's copy in host memory (pinned blocks for a CUDA tensor), with what it takes
    to bring it back: its shape, dtype and device, the D2H copy's event, and a prefetched copy."""

    __slots__ = ("chunks", "shape", "dtype", "device", "d2h", "prev", "fetched", "h2d", "__weakref__")

    def __init__(self, chunks, shape, dtype, device, d2h, prev):
        self.chunks, self.shape, self.dtype, self.device, self.d2h, self.prev = chunks, shape, dtype, device, d2h, prev
        self.fetched, self.h2d = None, None

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)


def _parameter_storages(model: torch.nn.Module) -> set[int]:
    """The data pointers of the storages ``model``'s parameters live in. A parameter sharded by
    FSDP2 (``fully_shard``) is a DTensor, which has no storage of its own: its local shard's is
    taken (the gathered weight FSDP2 hands the forward is an ``nn.Parameter``, which ``_wanted``
    refuses by type); a parameter whose storage FSDP2 has freed (size 0, pointer 0) has none."""
    pointers = set()
    with torch.no_grad():  # to_local of a DTensor that requires grad would record an autograd node
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            pointer = local.untyped_storage().data_ptr()
            if pointer:
                pointers.add(pointer)
    return pointers


class CheckpointOffloader:
    """Saved-tensor hooks that keep large saved tensors in host memory between forward and backward.

    Around a decoder layer's checkpoint call (``offload_decoder_layers``) the only tensor they pack
    is that checkpoint's input, ``[B, T, H]`` (what the layer saves inside is the checkpoint's own
    and recomputed); around a whole forward (``offloaded_checkpoints``), every tensor saved outside
    a checkpoint. A tensor of at least ``min_bytes`` that is not a parameter, nor shares memory with
    one, is copied into pinned host blocks on a side CUDA stream; in backward it comes back on that
    stream, and the one saved before it is prefetched. On a CPU the copies are plain host tensors.
    Unpacked tensors are contiguous. ``stats`` counts packed, offloaded (and their bytes), kept,
    unpacked and prefetched tensors.

    Args:
        min_bytes (int): smaller tensors stay where they are. Default: ``MIN_OFFLOAD_BYTES``.
        layers (int, optional): offload in the first this many decoder layers only (set by
            ``offload_decoder_layers``). Default: None (every layer).
        prefetch (bool): bring back the tensor saved before the one being unpacked. Default: True.
        pin_memory (bool, optional): pinned host blocks for a CUDA tensor. Default: None (pinned).
        chunk_bytes (int): the most bytes of one host block (the pinned allocator rounds a block up
            to a power of two). Default: ``HOST_CHUNK_BYTES``.
        host_reserve_bytes (int, optional): host memory an offload leaves free; a copy that would
            take it raises ``MemoryError``. Default: ``default_host_reserve()``.

    Raises:
        TypeError: an argument not of the type above.
        ValueError: ``min_bytes``, ``layers`` or ``host_reserve_bytes`` below 0, ``chunk_bytes`` below 1.
    """

    def __init__(self, *, min_bytes: int = MIN_OFFLOAD_BYTES, layers: int | None = None, prefetch: bool = True,
                 pin_memory: bool | None = None, chunk_bytes: int = HOST_CHUNK_BYTES,
                 host_reserve_bytes: int | None = None):
        self.min_bytes = check_int("min_bytes", min_bytes, minimum=0, what="bytes")
        if host_reserve_bytes is None:
            host_reserve_bytes = default_host_reserve()
        self.host_reserve_bytes = check_int("host_reserve_bytes", host_reserve_bytes, minimum=0, what="bytes")
        self.chunk_bytes = check_int("chunk_bytes", chunk_bytes, minimum=1, what="bytes")
        self.layers = None if layers is None else check_int("layers", layers, minimum=0, what="decoder layers")
        self.prefetch = check_bool("prefetch", prefetch)
        self.pin_memory = None if pin_memory is None else check_bool("pin_memory", pin_memory)
        self._reset()

    def _reset(self) -> None:
        self.stats = Counter()
        self._last = None  # weak reference to the handle packed last in this chain
        self._chain_bytes = 0  # host bytes this chain has offloaded so far
        self._most_bytes = 0  # the most any chain held: pinned blocks PyTorch's host allocator keeps for reuse
        self._streams: dict = {}
        self._offloading = True
        self._model = None  # weak reference to the model whose parameters are never offloaded
        self._parameter_storages: set = set()

    def exclude_parameters_of(self, model: torch.nn.Module) -> None:
        """Never offload a tensor that shares memory with one of ``model``'s parameters (a view of
        packed weights, a weight saved by a GEMM); read again at each new chain."""
        self._model = weakref.ref(model)
        self.new_chain()

    def __getstate__(self) -> dict:  # a copy keeps the settings, not the streams or this step's chain
        return {k: getattr(self, k) for k in ("min_bytes", "layers", "prefetch", "pin_memory", "chunk_bytes",
                                              "host_reserve_bytes")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return (f"CheckpointOffloader(min_bytes={self.min_bytes}, layers={self.layers}, prefetch={self.prefetch}, "
                f"stats={dict(self.stats)})")

    # -- the chain: tensors in the order packed; unpacking one prefetches its predecessor --------
    def new_chain(self) -> None:
        self._last = None
        self._chain_bytes = 0
        model = self._model() if self._model is not None else None
        if model is not None:
            self._parameter_storages = _parameter_storages(model)

    @contextlib.contextmanager
    def hooks(self, offload: bool = True):
        """The saved-tensor hooks, offloading (or, ``offload=False``, only chaining) what they pack."""
        previous, self._offloading = self._offloading, bool(offload)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            self._offloading = previous

    def _wanted(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.device.type == "meta" or isinstance(t, torch.nn.Parameter):
            return False
        if isinstance(t._base, torch.nn.Parameter):
            return False
        if t.numel() == 0 or t.numel() * t.element_size() < self.min_bytes:
            # empty: nothing to move. On an H100 (torch 2.11, CUDA) each non-reentrant checkpoint
            # call also saved an empty CPU tensor, which was counted as offloaded: 8 tensors for 4
            # layers in notebook 06 (2026-12-06); torch 2.13 on a CPU saves none
            return False
        return not self._holds_a_parameter(t)

    def _holds_a_parameter(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in one of the excluded model's parameter storages. Once that model is
        gone its pointers mean nothing: CUDA's caching allocator hands the memory to the next
        tensors, which would be taken for parameters and never offloaded."""
        if not self._parameter_storages:
            return False
        if self._model is not None and self._model() is None:
            self._parameter_storages = set()
            return False
        return t.untyped_storage().data_ptr() in self._parameter_storages

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, t: torch.Tensor):
        self.stats["packed"] += 1
        prev = self._last
        if not (self._offloading and self._wanted(t)):
            handle = _Kept(t.detach(), prev)  # detached: no reference cycle through an output's grad_fn
            self.stats["kept"] += 1
        else:
            handle = self._to_host(t, prev)
            self.stats["offloaded"] += 1
            self.stats["offloaded_bytes"] += t.numel() * t.element_size()
        if t.numel():
            # an empty tensor stays out of the chain: saved beside each layer's input (torch 2.11's
            # checkpoint does), it would sit between two inputs, and unpacking the later input would
            # prefetch it instead of the earlier input
            self._last = weakref.ref(handle)
        return handle

    def _to_host(self, t: torch.Tensor, prev) -> _HostCopy:
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        flat = src.view(-1)
        step = max(1, self.chunk_bytes // max(1, src.element_size()))
        self._claim_host_memory(src.numel() * src.element_size())
        if src.device.type != "cuda":
            chunks = [flat[i:i + step].clone() for i in range(0, flat.numel(), step)]
            return _HostCopy(chunks, src.shape, src.dtype, src.device, None, prev)
        pin = True if self.pin_memory is None else bool(self.pin_memory)
        current = torch.cuda.current_stream(src.device)
        side = self._stream(src.device)
        side.wait_stream(current)  # the tensor is complete on the compute stream
        chunks = []
        with torch.cuda.stream(side):
            for i in range(0, flat.numel(), step):
                piece = flat[i:i + step]
                host = torch.empty(piece.numel(), dtype=src.dtype, pin_memory=pin)
                host.copy_(piece, non_blocking=pin)
                chunks.append(host)
            d2h = torch.cuda.Event()
            d2h.record(side)
        src.record_stream(side)  # its memory is not reused before the copy has read it
        return _HostCopy(chunks, src.shape, src.dtype, src.device, d2h, prev)

    def _claim_host_memory(self, nbytes: int) -> None:
        """Refuse, with an error that says what to do, a copy that would leave the host less than
        ``host_reserve_bytes`` (pinned memory cannot be swapped: past that the kernel's OOM killer
        ends the process without a word). Only bytes beyond what an earlier chain held are new:
        PyTorch's host allocator keeps the blocks it pinned then and hands them out again."""
        self._chain_bytes += nbytes
        new = self._chain_bytes - self._most_bytes
        if new <= 0:
            return
        available = host_memory_available()
        if available is not None and available - new < self.host_reserve_bytes:
            raise MemoryError(
                f"q35lab: offloading this checkpoint would leave {max(0, available - new) / GiB:.1f} GiB of host memory "
                f"(this step holds {self._chain_bytes / GiB:.1f} GiB offloaded; the reserve is "
                f"{self.host_reserve_bytes / GiB:.1f} GiB): offload fewer decoder layers "
                "(apply_to_qwen3_5(offload_checkpoints=...), long_context.plan_offload_layers says how many fit)")
        self._most_bytes = self._chain_bytes

    def _fetch(self, h: _HostCopy) -> None:
        """Start bringing ``h`` back (an event to wait on, on CUDA; assembled at once on a CPU)."""
        if h.device.type != "cuda":
            h.fetched = torch.cat(h.chunks).view(h.shape) if h.chunks else torch.empty(h.shape, dtype=h.dtype)
            return
        side = self._stream(h.device)
        with torch.cuda.stream(side):
            side.wait_event(h.d2h)
            out = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # from the side stream's pool
            flat, start = out.view(-1), 0
            for host in h.chunks:
                flat[start:start + host.numel()].copy_(host, non_blocking=True)
                start += host.numel()
            h2d = torch.cuda.Event()
            h2d.record(side)
        h.fetched, h.h2d = out, h2d

    def unpack(self, handle):
        self.stats["unpacked"] += 1
        if isinstance(handle, _Kept):
            out = handle.tensor
        else:
            if handle.fetched is None:
                self._fetch(handle)
            out, handle.fetched = handle.fetched, None  # a retained graph fetches again next time
            if handle.device.type == "cuda":
                current = torch.cuda.current_stream(handle.device)
                current.wait_event(handle.h2d)
                out.record_stream(current)
        prev = handle.prev() if handle.prev is not None else None
        if self.prefetch and isinstance(prev, _HostCopy) and prev.fetched is None:
            self._fetch(prev)
            self.stats["prefetched"] += 1
        return out


@contextlib.contextmanager
def offloaded_checkpoints(model: torch.nn.Module | None = None, *, offloader: CheckpointOffloader | None = None,
                          **settings):
    """Offload what is saved inside the block to host memory (wrap the forward, not the backward)::

        with q35lab.long_context.offloaded_checkpoints(model) as offloader:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    With the decoder layers checkpointed, what is saved outside their checkpoints is their inputs,
    the final norm's input and the loss's saved tensors. ``offload_decoder_layers`` offloads some
    layers only, without changing the training loop.

    Args:
        model (nn.Module, optional): whose parameters (and tensors sharing their memory, such as
            packed weights saved by a GEMM) are never offloaded. Default: None.
        offloader (CheckpointOffloader, optional): the hooks to use. Default: a new one.
        **settings: ``CheckpointOffloader``'s arguments, for a new one.

    Yields:
        CheckpointOffloader: the hooks in use (``stats`` counts what moved).

    Raises:
        TypeError: ``model`` not a module, ``offloader`` not a ``CheckpointOffloader``, a setting
            with an offloader given.
    """
    if model is not None:
        check_module("model", model)
    if offloader is not None and not isinstance(offloader, CheckpointOffloader):
        raise TypeError(f"offloader: expected a CheckpointOffloader or None, got {type(offloader).__name__}")
    if offloader is not None and settings:
        raise TypeError(f"{', '.join(settings)}: settings of a new CheckpointOffloader, not with offloader")
    offloader = offloader if offloader is not None else CheckpointOffloader(**settings)
    if model is not None:
        offloader.exclude_parameters_of(model)
    offloader.new_chain()
    with offloader.hooks():
        yield offloader


class _OffloadedCheckpoint:
    """A decoder layer's gradient-checkpoint function (``layer._gradient_checkpointing_func``) run
    under the offloader's hooks, offloading if the layer is among the first ``count``.

    The checkpoint function is the one entry every transformers version goes through: 5.23 on calls
    it from the class's ``forward``, earlier from ``GradientCheckpointingLayer.__call__``,
    *around* the module call — a wrapped instance ``forward`` would run inside the checkpoint
    there, its hooks innermost, and offload every tensor the layer saves (and break the
    recompute, which then saves none). Here the hooks surround the checkpoint call, so the only
    tensor they pack is the checkpoint's input; inside, ``torch.utils.checkpoint``'s own hooks
    are innermost. An object, not a closure: it deep-copies and pickles with its model."""

    def __init__(self, offloader: CheckpointOffloader, index: int, inner):
        self.offloader, self.index, self.inner = offloader, index, inner

    def __repr__(self) -> str:
        return f"<q35lab offloaded checkpoint of decoder layer {self.index}>"

    def __call__(self, function, *args, **kwargs):
        count = self.offloader.layers
        with self.offloader.hooks(offload=count is None or self.index < count):
            return self.inner(function, *args, **kwargs)


class _OffloadGuard:
    """Forward pre-hook of the module that runs the decoder layers (``model.model`` for the text
    model): each forward starts a new offload chain, and any layer whose checkpoint function is
    not wrapped (gradient checkpointing enabled or re-enabled after ``offload_decoder_layers``;
    ``gradient_checkpointing_enable`` sets a fresh one on every layer) is wrapped again, before
    the first layer runs."""

    def __init__(self, offloader: CheckpointOffloader):
        self.offloader = offloader

    def __call__(self, stack: torch.nn.Module, args):
        self.offloader.new_chain()
        for index, layer in enumerate(_stack_layers(stack)):
            current = vars(layer).get("_gradient_checkpointing_func")
            if isinstance(current, _OffloadedCheckpoint):
                current.offloader, current.index = self.offloader, index
            elif current is not None:
                layer._gradient_checkpointing_func = _OffloadedCheckpoint(self.offloader, index, current)


def _is_decoder_layer(module: torch.nn.Module) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer) and type(module).__name__.endswith("DecoderLayer")


def _stack_layers(stack: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in stack.layers if _is_decoder_layer(m)]


def _layer_stacks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold decoder layers in a ``layers`` list (one for a text model; the
    language model of a vision-language one)."""
    return [m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList) and _stack_layers(m)]


def stack_pre_hooks(stack: torch.nn.Module, kind: type) -> dict:
    """The forward pre-hooks of ``stack`` that are ``kind`` objects, by their handle's key."""
    return {key: hook for key, hook in stack._forward_pre_hooks.items() if isinstance(hook, kind)}


def remove_stack_pre_hooks(stack: torch.nn.Module, kind: type) -> bool:
    """Remove ``stack``'s ``kind`` pre-hooks (with or without kwargs); whether there were any."""
    keys = list(stack_pre_hooks(stack, kind))
    for key in keys:
        del stack._forward_pre_hooks[key]
        stack._forward_pre_hooks_with_kwargs.pop(key, None)
    return bool(keys)


def _guards(stack: torch.nn.Module) -> dict:
    return stack_pre_hooks(stack, _OffloadGuard)


def offload_decoder_layers(model: torch.nn.Module, layers: float | int = 1.0, *,
                           offloader: CheckpointOffloader | None = None, **settings) -> CheckpointOffloader:
    """Offload the gradient-checkpoint inputs of the first ``layers`` decoder layers to host memory.

    The first layers' inputs are needed last in the backward, so their copies have the longest time
    to complete and to come back. Takes effect while the layers are gradient-checkpointed in train
    mode (``enable_checkpointing(model)``, before or after this call); otherwise the layers run as they
    are. Calling again updates the count; ``restore_decoder_layers`` undoes it.

    Args:
        model (nn.Module): a transformers model (or a PEFT wrapper) with decoder layers in a
            ``layers`` list.
        layers (float or int): a fraction of the decoder layers in [0, 1], or a count. Default: 1.0.
        offloader (CheckpointOffloader, optional): the hooks to use. Default: the model's current
            one, else a new one.
        **settings: ``CheckpointOffloader``'s arguments, for a new one.

    Returns:
        CheckpointOffloader: the hooks in use (``stats`` counts what moved).

    Raises:
        TypeError: ``model`` not a module, ``layers`` not a number, ``offloader`` not a
            ``CheckpointOffloader``, a setting with an offloader given.
        ValueError: ``layers`` out of range, a model without decoder layers.
    """
    check_module("model", model)
    stacks = _layer_stacks(model)
    found = [layer for stack in stacks for layer in _stack_layers(stack)]
    count = _layer_count("layers", layers, len(found))
    if not stacks:
        raise ValueError(f"model: expected a transformers model with decoder layers in a `layers` list, "
                         f"got {type(model).__name__}")
    if offloader is not None and not isinstance(offloader, CheckpointOffloader):
        raise TypeError(f"offloader: expected a CheckpointOffloader or None, got {type(offloader).__name__}")
    if offloader is not None and settings:
        raise TypeError(f"{', '.join(settings)}: settings of a new CheckpointOffloader, not with offloader")
    if offloader is None:
        existing = [hook.offloader for stack in stacks for hook in _guards(stack).values()]
        offloader = existing[0] if existing and not settings else CheckpointOffloader(**settings)
    offloader.layers = count
    offloader.exclude_parameters_of(model)
    for stack in stacks:
        remove_stack_pre_hooks(stack, _OffloadGuard)
        guard = _OffloadGuard(offloader)
        stack.register_forward_pre_hook(guard)
        guard(stack, ())  # wrap the checkpoint functions now (the guard does again at each forward)
    return offloader


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer for stack in _layer_stacks(model) for layer in _stack_layers(stack)]


def _layer_count(name: str, value: object, available: int) -> int:
    """How many of ``available`` decoder layers ``value`` asks for: a fraction (a float in [0, 1]) or
    a count (an int in [0, available]); ``TypeError`` / ``ValueError`` naming ``name`` else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a fraction of the decoder layers (a float in [0, 1]) or a count (an int), "
                        f"got {value!r}")
    if isinstance(value, numbers.Integral):
        if not 0 <= value <= available:
            raise ValueError(f"{name}: expected a count in [0, {available}] (the model's decoder layers), got {value}")
        return int(value)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(f"{name}: expected a fraction in [0, 1] of the decoder layers, got {value}")
    return round(value * available)


def restore_decoder_layers(model: torch.nn.Module) -> int:
    """Undo ``offload_decoder_layers``.

    Args:
        model (nn.Module): the model it was given.

    Returns:
        int: how many decoder layers were restored.

    Raises:
        TypeError: ``model`` not a module.
    """
    check_module("model", model)
    restored = 0
    for stack in _layer_stacks(model):
        guarded = remove_stack_pre_hooks(stack, _OffloadGuard)
        for layer in _stack_layers(stack):
            current = vars(layer).get("_gradient_checkpointing_func")
            if isinstance(current, _OffloadedCheckpoint):
                layer._gradient_checkpointing_func = current.inner
            restored += guarded or isinstance(current, _OffloadedCheckpoint)
    return restored


def host_memory_available() -> int | None:
    """The bytes of host memory this process may still take: ``MemAvailable`` (/proc/meminfo),
    capped by the cgroup's limit minus its usage where one is set (a container).

    Returns:
        int or None: the bytes, None where unknown.
    """
    available = _meminfo("MemAvailable")
    limit = _cgroup_limit_and_usage()
    if limit is not None:
        room = limit[0] - limit[1]
        available = room if available is None else min(available, room)
    return available


def default_host_reserve(total_bytes: float | None = None) -> int:
    """The host memory an offload leaves free by default: ``HOST_RESERVE_BYTES``, or a quarter of
    the host where that is less.

    Args:
        total_bytes (float, optional): the host's memory. Default: this host's (``MemTotal``, or
            the cgroup's limit); where unknown, the reserve is ``HOST_RESERVE_BYTES``.

    Returns:
        int: the bytes to leave free.

    Raises:
        TypeError: ``total_bytes`` not a number.
        ValueError: ``total_bytes`` negative or not finite.
    """
    total = total_bytes
    if total is None:
        total = _meminfo("MemTotal")
        limit = _cgroup_limit_and_usage()
        if limit is not None:
            total = limit[0] if total is None else min(total, limit[0])
    else:
        total = _memory_bytes(total, "total_bytes")
    return HOST_RESERVE_BYTES if total is None else int(min(HOST_RESERVE_BYTES, total // 4))


def enable_checkpointing(model: torch.nn.Module, **checkpoint_kwargs) -> None:
    """Turn on transformers' gradient checkpointing of every decoder layer, through
    ``activation_checkpointing_enable`` where the installed release has it (it deprecates
    ``gradient_checkpointing_enable``), else ``gradient_checkpointing_enable``.

    Args:
        model (nn.Module): a transformers model, or a PEFT wrapper of one.
        **checkpoint_kwargs: for ``torch.utils.checkpoint.checkpoint``. Default:
            ``use_reentrant=False`` (what the offload and the tiles take).

    Raises:
        TypeError: ``model`` not a transformers model.
    """
    check_module("model", model)
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise TypeError(f"model: expected a transformers model (with gradient_checkpointing_enable), "
                        f"got {type(model).__name__}")
    versions.enable_checkpointing(model, **{"use_reentrant": False, **checkpoint_kwargs})


def _meminfo(field: str) -> int | None:
    """One field of /proc/meminfo in bytes, None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit_and_usage() -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup (v2, else v1) where it sets a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        return (int(limit), usage) if limit.isdigit() and int(limit) < 2**60 else None
    return None


# ==============================================================================================
# 3. Memory per token
# ==============================================================================================
#: What an H200 leaves to a training process (of its 140 GiB; the CUDA context and NCCL take the rest).
H200_USABLE_BYTES = 139 * GiB


@dataclass(frozen=True)
class _Dims:
    H: int
    I: int
    L: int
    V: int
    layer_types: tuple
    Hk: int
    Hv: int
    dk: int
    dv: int
    conv_kernel: int
    nq: int
    nkv: int
    hd: int
    rotary: int
    tied: bool

    @property
    def key_dim(self):
        return self.Hk * self.dk

    @property
    def value_dim(self):
        return self.Hv * self.dv

    @property
    def conv_dim(self):
        return 2 * self.key_dim + self.value_dim


#: What the memory model reads of a config (a dense Qwen3.5 text config has them all).
_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                  "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim")


def _dims(config) -> _Dims:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_experts", None):
        raise NotImplementedError(
            f"config: expected a dense Qwen3.5 config, got a MoE one ({type(text).__name__}): the memory model does "
            "not cover routed experts; pass tiled_mlp, tiled_gdn and offload_checkpoints to apply_to_qwen3_5 yourself")
    missing = [name for name in _CONFIG_FIELDS if getattr(text, name, None) is None]
    if missing:
        raise TypeError(f"config: expected a dense Qwen3.5 config (transformers' Qwen3_5TextConfig, or a config "
                        f"holding one), got {type(config).__name__} without {', '.join(missing)}")
    L = text.num_hidden_layers
    layer_types = tuple(getattr(text, "layer_types", None) or ["full_attention"] * L)[:L]
    rope = getattr(text, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
    hd = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return _Dims(H=text.hidden_size, I=text.intermediate_size, L=L, V=text.vocab_size, layer_types=layer_types,
                 Hk=text.linear_num_key_heads, Hv=text.linear_num_value_heads, dk=text.linear_key_head_dim,
                 dv=text.linear_value_head_dim, conv_kernel=text.linear_conv_kernel_dim,
                 nq=text.num_attention_heads, nkv=text.num_key_value_heads, hd=hd, rotary=int(hd * factor),
                 tied=bool(getattr(text, "tie_word_embeddings", False)))


def _linears(d: _Dims) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every nn.Linear of one layer of each kind (what LoRA "all-linear" adapts)."""
    mlp = [(d.H, d.I), (d.H, d.I), (d.I, d.H)]
    gdn = [(d.H, d.conv_dim), (d.H, d.value_dim), (d.H, d.Hv), (d.H, d.Hv), (d.value_dim, d.H)]
    attn = [(d.H, 2 * d.nq * d.hd), (d.H, d.nkv * d.hd), (d.H, d.nkv * d.hd), (d.nq * d.hd, d.H)]
    return {"mlp": mlp, "linear_attention": gdn, "full_attention": attn}


def parameter_count(config) -> int:
    """Parameters of a dense Qwen3.5 text model (embeddings, head unless tied, every layer) of
    ``config``, a ``Qwen3_5TextConfig`` or a config holding one."""
    d = _dims(config)
    lin = _linears(d)
    count = d.V * d.H * (1 if d.tied else 2) + d.H  # embeddings, lm_head, final norm
    for kind in d.layer_types:
        count += 2 * d.H + sum(i * o for i, o in lin["mlp"] + lin[kind])  # two norms, MLP, mixer
        if kind == "linear_attention":
            count += d.conv_dim * d.conv_kernel + 2 * d.Hv + d.dv  # conv1d, dt_bias + A_log, gated norm
        else:
            count += 2 * d.hd  # q_norm, k_norm
    return count


def lora_parameter_count(config, rank: int = 16, targets: str | tuple = "all-linear") -> int:
    """LoRA parameters, r·(in + out) per adapted linear of every layer ("all-linear": each of
    them, lm_head excluded, as PEFT; or a tuple of projection kinds: "mlp", "mixer")."""
    rank = check_int("rank", rank, minimum=0, what="the LoRA rank")
    if targets != "all-linear" and (isinstance(targets, str) or not set(targets) <= {"mlp", "mixer"}):
        raise ValueError(f"targets: expected 'all-linear' or a tuple of 'mlp' and 'mixer', got {targets!r}")
    d = _dims(config)
    lin = _linears(d)
    kinds = ("mlp", "mixer") if targets == "all-linear" else tuple(targets)
    total = 0
    for kind in d.layer_types:
        pairs = (lin["mlp"] if "mlp" in kinds else []) + (lin[kind] if "mixer" in kinds else [])
        total += sum(rank * (i + o) for i, o in pairs)
    return total


def _gdn_terms(d: _Dims, e: int, r: int) -> tuple[dict, dict]:
    """The untiled GatedDeltaNet's per-token bytes: what its forward saves, what its backward adds."""
    H, Hv, dk, dv, vd = d.H, d.Hv, d.dk, d.dv, d.value_dim
    saved = {
        "GDN: input (saved by in_proj)": H * e,
        # z has a buffer of its own (the patch's own_buffer): the norm's reshape of it is a view
        "GDN: in_proj output [qkv|b|a], one buffer (saved by the conv)": (d.conv_dim + 2 * Hv) * e,
        "GDN: in_proj z, its own buffer (saved by the gated norm)": vd * e,
        "GDN: beta, softplus in/out, g (fp32)": Hv * (e + 12),
        "GDN core: q, k l2-normed + fp32 rstd": 2 * (d.key_dim * e + 4 * d.Hk),
        "GDN core: v (contiguous copy)": vd * e,
        "GDN core: A (WY, 64 per value head)": Hv * 64 * e,
        "GDN core: output (saved by gated norm)": vd * e,
        "GDN: gated-norm output (saved by out_proj)": vd * e,
        "GDN: LoRA x·Aᵀ (5 adapters)": 5 * r * e,
    }
    backward = {
        "GDN backward: d(out), dz from the gated norm": 2 * vd * e,
        "GDN core backward: w, u, v_new (recomputed)": (Hv * dk + 2 * Hv * dv) * e,
        "GDN core backward: h, dh (chunk states, per 64 tokens)": 2 * Hv * dk * dv * e / 64,
        "GDN core backward: dv, dw": (Hv * dv + Hv * dk) * e,
        "GDN core backward: dq, dk (per value head)": 2 * Hv * dk * e,
    }
    return saved, backward


def _gdn_carry_bytes(d: _Dims, e: int) -> int:
    """One tile's carry in the tiled GatedDeltaNet: the recurrent state S [Hv, dk, dv] in fp32 and
    the conv's last K−1 input rows [K−1, conv_dim] (a batch row's)."""
    return 4 * d.Hv * d.dk * d.dv + (d.conv_kernel - 1) * d.conv_dim * e


def _phase_terms(d: _Dims, e: int, r: int, tiled: bool, gdn_tile: int | None = None,
                 mlp_keeps_h: bool = False, gdn_whole_layer: bool = True) -> dict[str, dict[str, float]]:
    """Per-token bytes of each phase of one layer's backward (checkpoints and residual excluded).

    Counted from the code that runs on the GPU: q35lab's patched modules (fused in_proj and
    gate/up, SwiGLU with the down projection in its node, norms, conv, LoRA saving ``x·Aᵀ`` of
    r values), fla's
    ``chunk_gated_delta_rule`` (saves l2-normed q, k with their rstd, v, g, beta and the WY
    matrix A of 64 values per token and value head; its backward recomputes w, u, the chunk
    states h and makes dh, dv, dw, dq, dk) and SDPA's flash backend (saves q, k, v, out, lse; a
    fp32 dq accumulator in backward). fla's and SDPA's terms are read from their code, not
    measured: the GPU measurement closes them.

    ``tiled``: the MLP is tiled (its input and dx remain per token). ``gdn_tile``: a GatedDeltaNet's
    decoder layer is tiled whole at this many tokens (``tiled_gated_delta_net_layer``): its
    backward keeps only the layer's input and its dx per token, one phase; the rest is one tile's
    (``bytes_per_token`` counts it as fixed, and the carries every such layer holds as common).
    ``gdn_whole_layer=False``: the GatedDeltaNet alone is tiled (``tiled_gated_delta_net``, what
    ``tiled_gdn`` did before 2026-12-06): of its terms its input, its dx and its own carries
    (``_gdn_carry_bytes`` a tile) remain per token, and the MLP's phase follows it as untiled.
    ``mlp_keeps_h``: the down projection runs its own
    forward and keeps the SwiGLU output [I] for its backward (see ``bytes_per_token``).
    """
    H, I = d.H, d.I
    q = d.nq * d.hd
    kv = d.nkv * d.hd
    norm = {"post-attention norm: input + fp32 rstd": H * e + 4, "input norm: fp32 rstd": 4}
    if tiled:
        mlp = {"MLP: input (saved once by the tiling)": H * e, "MLP: dx of the whole sequence": H * e}
    else:
        # swiglu_down keeps no SwiGLU output: dh's buffer takes h again for the down adapter's dA,
        # and dgate, dup are written over the gate/up output
        mlp = {"MLP: input (saved by gate/up)": H * e, "MLP: gate/up output [2I]": 2 * I * e,
               "MLP: LoRA x·Aᵀ (3 adapters)": 3 * r * e, "MLP backward: dh [I], then h rebuilt in it": I * e}
        if mlp_keeps_h:
            mlp["MLP: SwiGLU output [I] (saved by down)"] = I * e
    gdn_saved, gdn_bwd = _gdn_terms(d, e, r)
    if gdn_tile is not None and not gdn_whole_layer:  # the layer's recompute rebuilds the GDN's output
        gdn_saved = {"GDN: input (saved once by the tiling)": H * e,
                     "GDN: carries into each tile (fp32 state, K−1 conv rows)": _gdn_carry_bytes(d, e) / gdn_tile}
        gdn_bwd = {"GDN: dx of the whole sequence": H * e}
    attn_saved = {
        "attention: input (saved by q/k/v)": H * e,
        "attention: q-norm input (contiguous copy)": q * e,
        "attention: k-norm input": kv * e,
        "attention: q, k after RoPE, v (saved by SDPA)": (q + 2 * kv) * e,
        "attention: SDPA output + its contiguous copy": 2 * q * e,
        "attention: sigmoid(gate), gated output (saved by o_proj)": 2 * q * e,
        "attention: lse (fp32)": 4 * d.nq,
        "attention: LoRA x·Aᵀ (4 adapters)": 4 * r * e,
    }
    attn_bwd = {
        "attention backward: d(gated), d(out), d(gate)": 3 * q * e,
        "attention backward: dq fp32 accumulator, dq, dk, dv": 4 * q + (q + 2 * kv) * e,
    }
    phases = {}
    kinds = set(d.layer_types)
    if "linear_attention" in kinds and gdn_tile is not None and gdn_whole_layer:
        phases["GatedDeltaNet layer backward (tiled)"] = {"GDN layer: input (saved once by the tiling)": H * e,
                                                          "GDN layer: dx of the whole sequence": H * e}
    elif "linear_attention" in kinds:
        phases["MLP backward (GatedDeltaNet layer)"] = {**gdn_saved, **norm, **mlp}
        phases["GatedDeltaNet backward"] = {**gdn_saved, **gdn_bwd, "input norm: fp32 rstd": 4}
    if "full_attention" in kinds:
        phases["MLP backward (attention layer)"] = {**attn_saved, **norm, **mlp}
        phases["attention backward"] = {**attn_saved, **attn_bwd, "input norm: fp32 rstd": 4}
    return phases


@dataclass
class MemoryModel:
    """The predicted peak of a LoRA training step, made by ``bytes_per_token``: ``fixed + T · per_token``
    bytes on the GPU and ``T · host_per_token`` in host memory.

    Attributes:
        terms (dict): per-token bytes at the peak phase, by name.
        phase (str): the phase of one layer's backward (or the loss) where the peak falls.
        phases (dict): each phase's per-token bytes.
        fixed (dict): the constant bytes, by name (weights, adapters and optimizer, slack, tiles).
        host_per_token (float): host bytes a token for the offloaded checkpoints.
        offloaded_layers (int): the decoder layers whose checkpoints are offloaded, of ``layers``.
    """

    terms: dict
    phase: str
    phases: dict
    fixed: dict
    host_per_token: float
    offloaded_layers: int
    layers: int
    notes: list = field(default_factory=list)

    @property
    def per_token(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def fixed_bytes(self) -> float:
        return float(sum(self.fixed.values()))

    def peak(self, tokens: int) -> float:
        """The predicted peak bytes of a step of ``tokens`` tokens."""
        return self.fixed_bytes + check_real("tokens", tokens, minimum=0) * self.per_token

    def longest_fit(self, gpu_bytes: float = H200_USABLE_BYTES, host_bytes: float | None = None,
                    multiple: int = 1024) -> int:
        """The most tokens, a multiple of ``multiple``, whose peak fits ``gpu_bytes`` and whose host
        copies fit ``host_bytes`` (if given); 0 where none do.

        Raises:
            TypeError: an argument not a number (``multiple`` not an int).
            ValueError: a negative or infinite number of bytes, ``multiple`` below 1.
        """
        gpu_bytes = _memory_bytes(gpu_bytes, "gpu_bytes")
        host_bytes = None if host_bytes is None else _memory_bytes(host_bytes, "host_bytes")
        multiple = check_int("multiple", multiple, minimum=1, what="tokens")
        tokens = (gpu_bytes - self.fixed_bytes) / self.per_token
        if host_bytes is not None and self.host_per_token:
            tokens = min(tokens, host_bytes / self.host_per_token)
        return max(0, int(tokens) // multiple * multiple)

    def table(self) -> str:
        width = max(map(len, list(self.terms) + list(self.fixed)))
        rows = [f"peak phase: {self.phase}"]
        rows += [f"  {name:<{width}}  {value / KiB:9.2f} KiB/token" for name, value in self.terms.items()]
        rows.append(f"  {'total':<{width}}  {self.per_token / KiB:9.2f} KiB/token")
        rows += [f"  {name:<{width}}  {value / GiB:9.2f} GiB" for name, value in self.fixed.items()]
        if self.host_per_token:
            rows.append(f"  host: {self.host_per_token / KiB:.2f} KiB/token ({self.offloaded_layers} of {self.layers} layers)")
        return "\n".join(rows)


def bytes_per_token(config, *, tiled_mlp_tokens: int | None = None, tiled_gdn_tokens: int | None = None,
                    offload: float | int | bool = False,
                    lora_rank: int = 16, dtype_bytes: int = 2, weight_bytes: int | None = None,
                    adapter_bytes: int = 4, batch: int = 1, loss_chunk_bytes: int | None = None,
                    slack_bytes: float = 2 * GiB, mlp_keeps_h: bool = False,
                    other_trainable_parameters: int = 0, gdn_whole_layer: bool = True) -> MemoryModel:
    """Predict the peak of a Qwen3.5 LoRA step under gradient checkpointing: its slope (bytes a
    token), term by term, and its constant part.

    Per token (e = ``dtype_bytes``): the checkpoint inputs on the GPU at the peak (L·H·e, or with k
    layers offloaded max(L − k, 2)·H·e), the residual stream's gradients (3·H·e), token ids,
    labels, positions and RoPE, and the largest phase: one layer's backward working set (the MLP's,
    the GatedDeltaNet's or the attention's, by ``_phase_terms``; a tiled one keeps its input and dx,
    2·H·e, and its carries) or the loss at the end of the forward. Constant: the weights, the
    adapters with their gradients and AdamW's two fp32 moments, one chunk of the fused loss's
    logits, one tile's working set where tiled, and ``slack_bytes``.

    Args:
        config: a dense Qwen3.5 text config (``Qwen3_5TextConfig``, or a config holding one).
        tiled_mlp_tokens (int, optional): the MLP's tile. Default: None (untiled).
        tiled_gdn_tokens (int, optional): the GatedDeltaNet decoder layer's tile. Default: None.
        offload (bool, float or int): the decoder layers whose checkpoints are in host memory: all
            (True), none (False), a fraction in [0, 1] or a count. Default: False.
        lora_rank (int): the adapters' rank, on every linear layer. Default: 16.
        dtype_bytes (int): bytes of an activation. Default: 2 (bf16).
        weight_bytes (int, optional): bytes of a frozen weight. Default: ``dtype_bytes``.
        adapter_bytes (int): bytes of an adapter's parameter. Default: 4 (fp32).
        batch (int): the step's rows, each of the tokens a step is planned for. Default: 1.
        loss_chunk_bytes (int, optional): one chunk of the loss's logits.
            Default: ``ops.linear_cross_entropy.CHUNK_BYTES``.
        slack_bytes (float): cuBLAS workspaces, allocator rounding. Default: 2 GiB.
        mlp_keeps_h (bool): the MLP's down projection runs its own forward and keeps the SwiGLU
            output (where its adapter has dropout or a hook watches it). Default: False.
        other_trainable_parameters (int): parameters that train besides the adapters
            (``modules_to_save``, a full fine-tune), each with a gradient and two AdamW moments. Default: 0.
        gdn_whole_layer (bool): the tiled GatedDeltaNet computes its whole decoder layer in each tile
            (False: the GatedDeltaNet alone). Default: True.

    Returns:
        MemoryModel: the terms; its ``peak(T)`` and ``longest_fit(gpu_bytes)`` read them.

    Raises:
        TypeError: ``config`` not a dense Qwen3.5 config, an argument not of the type above.
        ValueError: an argument out of range.
        NotImplementedError: a MoE config.
    """
    d = _dims(config)
    e = check_int("dtype_bytes", dtype_bytes, minimum=1, what="bytes of an activation")
    r = check_int("lora_rank", lora_rank, minimum=0, what="the adapters' rank")
    weight_bytes = e if weight_bytes is None else check_int("weight_bytes", weight_bytes, minimum=1,
                                                            what="bytes of a weight")
    adapter_bytes = check_int("adapter_bytes", adapter_bytes, minimum=1, what="bytes of an adapter's parameter")
    batch = check_int("batch", batch, minimum=1, what="rows")
    if loss_chunk_bytes is not None:
        loss_chunk_bytes = check_int("loss_chunk_bytes", loss_chunk_bytes, minimum=0, what="bytes")
    slack_bytes = _memory_bytes(slack_bytes, "slack_bytes")
    check_bool("mlp_keeps_h", mlp_keeps_h)
    check_bool("gdn_whole_layer", gdn_whole_layer)
    other_trainable_parameters = check_int("other_trainable_parameters", other_trainable_parameters, minimum=0,
                                           what="parameters")
    if tiled_mlp_tokens is not None:
        tiled_mlp_tokens = _check_tile_tokens(tiled_mlp_tokens, "tiled_mlp_tokens")
    if offload is True:
        k = d.L
    elif offload is False or offload is None:
        k = 0
    else:
        k = _layer_count("offload", offload, d.L)
    on_gpu = d.L if k == 0 else max(d.L - k, min(2, d.L))
    common = {
        f"checkpoint inputs ({on_gpu} of {d.L} layers on the GPU)": on_gpu * d.H * e,
        "residual-stream gradients": 3 * d.H * e,
        "token ids, labels, positions, RoPE": 8 + 8 + 32 + 2 * d.rotary * e,
    }
    gdn_tile = None if tiled_gdn_tokens is None else _check_tile_tokens(tiled_gdn_tokens, "tiled_gdn_tokens")
    gdn_layers = d.layer_types.count("linear_attention")
    carries = {}  # held from each tiled layer's forward to its backward: alive in every phase
    if gdn_tile is not None and gdn_layers and gdn_whole_layer:
        carries[f"GDN layers: carries held into each tile ({gdn_layers} layers)"] = (
            gdn_layers * _gdn_carry_bytes(d, e) / gdn_tile)
    common.update(carries)
    phases = {name: {**common, **terms} for name, terms in
              _phase_terms(d, e, r, tiled=tiled_mlp_tokens is not None, gdn_tile=gdn_tile,
                           mlp_keeps_h=mlp_keeps_h, gdn_whole_layer=gdn_whole_layer).items()}
    phases["loss (end of forward)"] = {
        f"checkpoint inputs ({d.L - k} of {d.L} layers on the GPU)": (d.L - k) * d.H * e,
        "final norm: input, output": 2 * d.H * e,
        "fused loss: dx (computed in forward)": d.H * e,
        "token ids, labels, positions, RoPE": common["token ids, labels, positions, RoPE"],
        **carries,
    }
    totals = {name: sum(terms.values()) for name, terms in phases.items()}
    phase = max(totals, key=totals.get)
    if loss_chunk_bytes is None:
        from .ops.linear_cross_entropy import CHUNK_BYTES
        loss_chunk_bytes = CHUNK_BYTES
    fixed = {
        "weights": parameter_count(config) * weight_bytes,
        "LoRA adapters + gradients + AdamW moments": lora_parameter_count(config, r) * (2 * adapter_bytes + 8),
        "fused loss: one chunk of logits": loss_chunk_bytes,
        "slack: workspaces, allocator rounding": slack_bytes,
    }
    if other_trainable_parameters:
        fixed["other trainable parameters: gradients + AdamW moments"] = other_trainable_parameters * (weight_bytes + 8)
    # a tile's input, gate/up output and dh (h rebuilt in it): the untiled MLP's terms, per token
    mlp_tile_terms = (d.H + (4 if mlp_keeps_h else 3) * d.I) * e
    if tiled_mlp_tokens is not None:
        fixed["MLP: one tile's working set"] = (_check_tile_tokens(tiled_mlp_tokens, "tiled_mlp_tokens") * batch
                                                * mlp_tile_terms)
    if gdn_tile is not None and "linear_attention" in d.layer_types:
        saved, backward = _gdn_terms(d, e, r)
        # the GatedDeltaNet's terms, saved and backward, the norms' inputs, the MLP's terms untiled, two carries
        # (the one handed on and its gradient), and the conv's input for a tile after the first: the carried
        # K−1 rows and the tile's, one new buffer
        layer_terms = 2 * (d.H * e + 4) + mlp_tile_terms + 3 * r * e if gdn_whole_layer else 0  # + the MLP's LoRA
        name = "GatedDeltaNet layer" if gdn_whole_layer else "GatedDeltaNet"
        fixed[f"{name}: one tile's working set"] = batch * (
            gdn_tile * (sum(saved.values()) + sum(backward.values()) + layer_terms)
            + 2 * _gdn_carry_bytes(d, e) + (gdn_tile + d.conv_kernel - 1) * d.conv_dim * e)
    terms = {name: value * batch for name, value in phases[phase].items()}
    return MemoryModel(terms=terms, phase=phase, phases={n: t * batch for n, t in totals.items()}, fixed=fixed,
                       host_per_token=k * d.H * e * batch, offloaded_layers=k, layers=d.L)


def plan_offload_layers(config, tokens: int, *, gpu_bytes: float = H200_USABLE_BYTES,
                        host_bytes: float | None = None, host_reserve_bytes: float = HOST_RESERVE_BYTES,
                        **model_settings) -> tuple[int, bool]:
    """The fewest decoder layers to offload for a step of ``tokens`` to fit ``gpu_bytes``, within the
    host memory.

    Args:
        config: a dense Qwen3.5 text config.
        tokens (int): the step's tokens (a row's).
        gpu_bytes (float): the GPU memory the step may use. Default: ``H200_USABLE_BYTES``.
        host_bytes (float, optional): the host memory free. Default: ``host_memory_available()``
            (where unknown, no limit).
        host_reserve_bytes (float): of that, what the offload leaves free. Default: ``HOST_RESERVE_BYTES``.
        **model_settings: ``bytes_per_token``'s other arguments.

    Returns:
        tuple[int, bool]: the layers, and whether the step is predicted to fit.

    Raises:
        TypeError, ValueError, NotImplementedError: as ``plan_long_context``.
    """
    tokens = _check_tile_tokens(tokens, "tokens", "the step's tokens")
    gpu_bytes = _memory_bytes(gpu_bytes, "gpu_bytes")
    host_reserve_bytes = _memory_bytes(host_reserve_bytes, "host_reserve_bytes")
    if host_bytes is None:
        host_bytes = host_memory_available()
    room = math.inf if host_bytes is None else max(0.0, _memory_bytes(host_bytes, "host_bytes") - host_reserve_bytes)
    layers = _dims(config).L
    for k in range(layers + 1):
        model = bytes_per_token(config, offload=k, **model_settings)
        if tokens * model.host_per_token > room:
            return max(0, k - 1), False
        if model.peak(tokens) <= gpu_bytes:
            return k, True
    return layers, False


#: The candidate tile sizes of ``plan_long_context``, largest first: a larger tile is fewer,
#: longer launches; below 4096 tokens a tile's kernels are too short to keep the GPU busy.
PLAN_TILES = tuple(2**k for k in range(20, 11, -1))


@dataclass(frozen=True)
class LongContextPlan:
    """What ``plan_long_context`` chose for a step of ``tokens``; ``print`` it for a summary.

    Attributes:
        tiled_mlp, tiled_gdn (int or None): the tiles (None: untiled).
        offload_layers (int): the decoder layers whose checkpoint inputs go to host memory.
        fits (bool): whether the step is predicted to fit with these options.
        model (MemoryModel): the prediction for them (``model.peak(tokens)`` against ``gpu_bytes``).
        untiled_up_to (int): where the plan tiles, the longest step (a multiple of 1024 tokens)
            predicted to fit untiled with the plan's offload; else 0.
    """

    tokens: int
    tiled_mlp: int | None
    tiled_gdn: int | None
    offload_layers: int
    fits: bool
    model: MemoryModel
    gpu_bytes: float
    host_known: bool = True
    expandable_segments: bool = False  # the CUDA caching allocator's setting when the plan was made
    untiled_up_to: int = 0

    def options(self) -> dict:
        """The plan as ``apply_to_qwen3_5``'s long-context keyword arguments."""
        return {"tiled_mlp": self.tiled_mlp, "tiled_gdn": self.tiled_gdn, "offload_checkpoints": self.offload_layers}

    def __str__(self) -> str:
        chosen = [f"checkpoints of {self.offload_layers} of {self.model.layers} decoder layers in host memory"
                  if self.offload_layers else None,
                  f"the MLP in tiles of {self.tiled_mlp:,} tokens" if self.tiled_mlp else None,
                  f"the GatedDeltaNet in tiles of {self.tiled_gdn:,} tokens" if self.tiled_gdn else None,
                  f"tiles only in steps over {self.untiled_up_to:,} tokens" if self.untiled_up_to else None]
        nothing = "nothing (the step fits as it is)" if self.fits else "no option that helps"
        chosen = "; ".join(c for c in chosen if c) or nothing
        verdict = "fits" if self.fits else "does not fit even so"
        host = f"{self.tokens * self.model.host_per_token / GiB:.1f} GiB" if self.host_known else "none (unknown)"
        advice = ""
        if (self.offload_layers or self.tiled_mlp or self.tiled_gdn) and not self.expandable_segments:
            # without expandable segments, free memory stranded in smaller blocks has ended long steps early
            advice = ("; the allocator's fragmentation may end such a step below the prediction: set "
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts")
        return (f"planned for {self.tokens:,} tokens: {chosen}; predicted peak "
                f"{self.model.peak(self.tokens) / GiB:.1f} of {self.gpu_bytes / GiB:.1f} GiB ({verdict}); "
                f"host memory for checkpoints: {host}{advice}")


def expandable_segments() -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` turns on the CUDA caching allocator's expandable segments,
    which map freed blocks into one range instead of stranding them (fragmentation)."""
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    return "expandable_segments:true" in settings.split(",")


def plan_long_context(config, tokens: int, *, gpu_bytes: float = H200_USABLE_BYTES, host_bytes: float | None = None,
                      host_reserve_bytes: float | None = None, **model_settings) -> LongContextPlan:
    """The cheapest long-context options under which a step of ``tokens`` is predicted to fit
    ``gpu_bytes``, by ``bytes_per_token``.

    Options are added cheapest first: none where the step fits as it is; else the checkpoint offload
    of the fewest layers that fit; else also the tiled MLP, then the tiled GatedDeltaNet, at the
    largest tile of ``PLAN_TILES`` below ``tokens`` that fits. Where nothing fits, the most frugal
    plan, with ``fits=False``. A plan serves every shorter step too: a module tiles only a sequence
    longer than its tile, and ``apply_to_qwen3_5`` runs steps up to ``untiled_up_to`` untiled.

    Args:
        config: a dense Qwen3.5 text config (``Qwen3_5TextConfig``, or a config holding one).
        tokens (int): the longest step's tokens (one row).
        gpu_bytes (float): the GPU memory the step may use. Default: ``H200_USABLE_BYTES``
            (``usable_gpu_bytes(device)`` gives a device's).
        host_bytes (float, optional): the host memory the offload may take. Default:
            ``host_memory_available()``; where that is unknown, the plan does not offload.
        host_reserve_bytes (float, optional): of ``host_bytes``, what the offload leaves free.
            Default: ``default_host_reserve()``.
        **model_settings: ``bytes_per_token``'s arguments (``lora_rank``, ``dtype_bytes``, ...).

    Returns:
        LongContextPlan: the options, and the prediction; ``options()`` gives them as
        ``apply_to_qwen3_5``'s arguments.

    Raises:
        TypeError: ``config`` not a dense Qwen3.5 config, an argument not a number (``tokens`` not an int).
        ValueError: ``tokens`` below 1, a number of bytes negative or not finite.
        NotImplementedError: a MoE config.
    """
    tokens = _check_tile_tokens(tokens, "tokens", "the longest step's tokens")
    gpu_bytes = _memory_bytes(gpu_bytes, "gpu_bytes")
    if host_bytes is None:
        host_bytes = host_memory_available()
    host_known = host_bytes is not None
    host_bytes = 0.0 if host_bytes is None else _memory_bytes(host_bytes, "host_bytes")
    if host_reserve_bytes is None:
        host_reserve_bytes = default_host_reserve()
    host_reserve_bytes = _memory_bytes(host_reserve_bytes, "host_reserve_bytes")
    tiles = [tile for tile in PLAN_TILES if tile < tokens]
    attempts = [{}] + [{"tiled_mlp_tokens": tile} for tile in tiles]
    if "linear_attention" in _dims(config).layer_types:
        attempts += [{"tiled_mlp_tokens": tile, "tiled_gdn_tokens": tile} for tile in tiles]
    for settings in attempts:
        layers, fits = plan_offload_layers(config, tokens, gpu_bytes=gpu_bytes, host_bytes=host_bytes,
                                           host_reserve_bytes=host_reserve_bytes, **settings, **model_settings)
        if fits:
            break
    model = bytes_per_token(config, offload=layers, **settings, **model_settings)
    untiled_up_to = 0
    if settings:  # the longest step that needs no tiles, by the same model and the same offload
        untiled_up_to = min(tokens - 1, bytes_per_token(config, offload=layers, **model_settings).longest_fit(gpu_bytes))
    return LongContextPlan(tokens=tokens, tiled_mlp=settings.get("tiled_mlp_tokens"),
                           tiled_gdn=settings.get("tiled_gdn_tokens"), offload_layers=layers, fits=fits, model=model,
                           gpu_bytes=gpu_bytes, host_known=host_known, expandable_segments=expandable_segments(),
                           untiled_up_to=untiled_up_to)


def longest_planned_step(config, *, gpu_bytes: float = H200_USABLE_BYTES, host_bytes: float | None = None,
                         host_reserve_bytes: float | None = None, multiple: int = 1024,
                         **model_settings) -> LongContextPlan:
    """The plan for the longest step, a multiple of ``multiple`` tokens, that ``plan_long_context``
    predicts to fit: how long a step can train here.

    Found by doubling, then bisection: a step shorter than one that fits is taken to fit too. The
    host memory is read once, so that every candidate is planned against the same.

    Args:
        config, gpu_bytes, host_bytes, host_reserve_bytes, **model_settings: as for ``plan_long_context``.
        multiple (int): the step's granularity in tokens. Default: 1024.

    Returns:
        LongContextPlan: that step's plan; where not even ``multiple`` tokens fit, theirs, with ``fits=False``.

    Raises:
        TypeError, ValueError, NotImplementedError: as ``plan_long_context``; ``multiple`` not an int
            (``TypeError``) or below 1 (``ValueError``).
    """
    multiple = _check_tile_tokens(multiple, "multiple", "the step's granularity in tokens")
    gpu_bytes = _memory_bytes(gpu_bytes, "gpu_bytes")
    if host_bytes is None:
        host_bytes = host_memory_available()
    if host_bytes is not None:
        host_bytes = _memory_bytes(host_bytes, "host_bytes")
    if host_reserve_bytes is not None:
        host_reserve_bytes = _memory_bytes(host_reserve_bytes, "host_reserve_bytes")
    _dims(config)
    settings = dict(gpu_bytes=gpu_bytes, host_bytes=host_bytes, host_reserve_bytes=host_reserve_bytes, **model_settings)

    def plan(units: int) -> LongContextPlan:  # a step of `units` multiples
        return plan_long_context(config, units * multiple, **settings)

    lo = max(1, bytes_per_token(config, **model_settings).longest_fit(gpu_bytes, multiple=multiple) // multiple)
    if not plan(lo).fits:
        return plan(1)
    hi = 2 * lo
    while plan(hi).fits:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # lo fits, hi does not
        middle = (lo + hi) // 2
        lo, hi = (middle, hi) if plan(middle).fits else (lo, middle)
    return plan(lo)


def _memory_bytes(value: object, name: str) -> float:
    """A memory size in bytes: a finite real number, not below zero."""
    return check_real(name, value, minimum=0, what="bytes")


def has_long_context_options(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a tiled MLP or GatedDeltaNet, or decoder-layer checkpoints offloaded."""
    if any(isinstance(vars(m).get("forward"), _TiledForward) for m in model.modules()):
        return True
    return any(bool(_guards(stack)) or any(isinstance(vars(layer).get("_gradient_checkpointing_func"), _OffloadedCheckpoint)
                                           for layer in _stack_layers(stack))
               for stack in _layer_stacks(model))


def usable_gpu_bytes(device: torch.device | str | None = None) -> float:
    """The memory a step on ``device`` may use, as ``plan_long_context`` counts it.

    Args:
        device (torch.device, str or int, optional): on a CUDA device, the memory still free plus what
            this process's allocator holds already (the model's weights are in it, and the plan
            counts them); elsewhere an H200's (a model on the CPU is planned for the reference GPU).
            Default: the CPU.

    Returns:
        float: the bytes.

    Raises:
        TypeError: ``device`` not a device, a string or an index.
        RuntimeError: an unknown device string (PyTorch's error).
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int, type(None))):
        raise TypeError(f"device: expected a torch.device, a string such as 'cuda' or None, got {device!r}")
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return float(H200_USABLE_BYTES)
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device))
