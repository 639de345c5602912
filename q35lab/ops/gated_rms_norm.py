"""Gated RMSNorm, the output norm of every Qwen3.5 GatedDeltaNet, fused with its SiLU gate.

Per row ``x`` of width ``N`` (one value head: rows = tokens × 32 heads, N = 128), with the
gate ``g`` (the ``in_proj_z`` projection of the layer input)::

    rstd = 1 / sqrt(mean(x²) + eps)                 # fp32
    x̂    = x · rstd
    y    = x̂ · w · silu(g),   silu(g) = g · σ(g)

Two rounding modes, because the two implementations a Qwen3.5 model may run disagree:

* ``rounding="hf"`` reproduces transformers' ``Qwen3_5RMSNormGated``: ``x̂`` is rounded to the
  input dtype, ``w · x̂`` is rounded to ``promote(w.dtype, x.dtype)``, the product with
  ``silu(g)`` (fp32) is rounded once more at the end: three roundings in bf16;
* ``rounding="fused"`` keeps fp32 to the end and rounds once, as flash-linear-attention's
  ``FusedRMSNormGated`` does (``((x̂ · w) · g) · σ(g)``).

Backward (both modes compute the exact fp32 gradient of the formula above), with
``a = silu(g)``, ``s = σ(g)`` and ``gx = dy · w · a`` the gradient reaching ``x̂``::

    dx = rstd · (gx − x̂ · mean(gx · x̂))
    dg = dy · x̂ · w · s · (1 + g · (1 − s))
    dw = Σ_rows dy · x̂ · a                          # fp32 partial per program, reduced once

Nothing is saved but the inputs: ``rstd`` is recomputed in the backward, which reads ``x``
anyway (saving it would add 4 bytes a row to rows of 256 bytes a tensor in bf16).

Layering: ``_gated_rms_norm_fwd_kernel`` / ``_gated_rms_norm_bwd_kernel`` → ``gated_rms_norm_fwd``
/ ``gated_rms_norm_bwd`` (host, launched as ``launch_config(width)`` says unless given
``config=``) → the custom ops ``q35lab::gated_rms_norm_fwd`` / ``_bwd`` (``gated_rms_norm_fwd_op``,
with fake implementations and autograd, so ``torch.compile`` traces through) → ``gated_rms_norm``
→ ``GatedRMSNorm``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import runtime
from ._autograd import first_order_only
from ._checks import check_eps, check_float_tensor, check_int, check_kernel_device, check_like, check_weight
from ._launch import as_rows
from ._reduce import sum_partials
from ._tuned import tuned_config

__all__ = [
    "ROUNDINGS",
    "gated_rms_norm_ref",
    "LaunchConfig",
    "launch_config",
    "gated_rms_norm_fwd",
    "gated_rms_norm_bwd",
    "gated_rms_norm_fwd_op",
    "gated_rms_norm_bwd_op",
    "gated_rms_norm",
    "GatedRMSNorm",
]

ROUNDINGS = ("hf", "fused")
#: Widest row one tile holds; GatedDeltaNet's is 128.
MAX_WIDTH = 8192


# --------------------------------------------------------------------------------------------
# References: transformers' Qwen3_5RMSNormGated ("hf") and fla's FusedRMSNormGated ("fused").
# --------------------------------------------------------------------------------------------
def gated_rms_norm_ref(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, rounding: str = "hf"
) -> torch.Tensor:
    """The PyTorch reference of both modes; with fp64 inputs, the exact answer (no rounding)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    act = torch.nn.functional.silu(gate.to(compute))
    if rounding == "hf":  # transformers, line for line
        h = weight * x_hat.to(x.dtype)
        return (h * act).to(x.dtype)
    return (x_hat * weight.to(compute) * act).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernels. A program owns BLOCK_ROWS whole rows (rows are only 128 wide: one row per program
# would move 256 bytes, far too little to hide memory latency).
# --------------------------------------------------------------------------------------------
@triton.jit
def _silu(g, HF_ROUNDING: tl.constexpr):
    """silu(g) as each reference computes it: torch's g / (1 + e^-g), or fla's g · σ(g)."""
    if HF_ROUNDING:
        return tl.div_rn(g, 1.0 + tl.exp(-g))
    else:
        return g * tl.sigmoid(g)


@triton.jit
def _rstd(x, n_cols, eps, HF_ROUNDING: tl.constexpr):
    """1/sqrt(mean(x²) + eps) per row, as each reference computes it."""
    mean_sq = tl.sum(x * x, axis=1) / n_cols  # masked columns load as 0
    if HF_ROUNDING:
        return tl.math.rsqrt(mean_sq + eps)
    else:
        return 1.0 / tl.sqrt(mean_sq + eps)


@triton.jit
def _gated_rms_norm_fwd_kernel(
    X,  # [n_rows, n_cols] normalised input (GatedDeltaNet's core output)
    G,  # [n_rows, n_cols] gate
    W,  # [n_cols] weight
    Y,  # [n_rows, n_cols] output, x.dtype
    n_rows,
    n_cols,
    stride_x,
    stride_g,
    stride_y,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HF_ROUNDING: tl.constexpr,
    ROUND_AFTER_WEIGHT: tl.constexpr,  # "hf" with a 16-bit weight: w·x̂ is rounded too
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]

    x_hat = x * _rstd(x, n_cols, eps, HF_ROUNDING)[:, None]
    if HF_ROUNDING:
        x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)  # hidden_states.to(input_dtype)
        h = w * x_hat
        if ROUND_AFTER_WEIGHT:
            h = h.to(X.dtype.element_ty).to(tl.float32)  # weight * (bf16) stays bf16
        y = h * _silu(g, HF_ROUNDING)
    else:
        y = ((x_hat * w) * g) * tl.sigmoid(g)  # fla's order
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _tile_backward(x, g, dy, w, n_cols, eps, HF_ROUNDING: tl.constexpr):
    """One tile of rows: returns (dx, dg, dy·x̂·silu(g)), the last one summed into dW.

    The gradient is the exact fp32 one in both modes, so silu is g·σ(g) here (no IEEE
    division: the forward needs torch's bits, the backward only the value)."""
    rstd = _rstd(x, n_cols, eps, HF_ROUNDING)[:, None]
    x_hat = x * rstd
    sig = tl.sigmoid(g)
    act = g * sig
    gx = dy * w * act  # dL/dx̂
    c = tl.sum(gx * x_hat, axis=1)[:, None] / n_cols
    dx = (gx - x_hat * c) * rstd
    dg = dy * x_hat * w * (sig * (1.0 + g * (1.0 - sig)))
    return dx, dg, dy * x_hat * act


@triton.jit
def _gated_rms_norm_bwd_kernel(
    DY, X, G, W, DX, DG,  # [n_rows, n_cols] each, W [n_cols]
    DW_PARTIAL,  # [n_programs, n_cols] fp32 (unused when COMPUTE_DW is False)
    n_rows,
    n_cols,
    stride,  # one row stride for all six (the host makes them contiguous)
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    HF_ROUNDING: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    """A program owns TILES_PER_PROGRAM consecutive tiles (unrolled, so the loads of one tile
    overlap the math of the previous) and, with a trainable weight, writes one fp32 partial
    row of dW. Many small programs rather than one persistent program per SM slot: as fast with
    a trainable weight, and no loop."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for t in tl.static_range(TILES_PER_PROGRAM):
        rows = (pid * TILES_PER_PROGRAM + t).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        offsets = rows[:, None] * stride + cols[None, :]
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
        dx, dg, dw_part = _tile_backward(x, g, dy, w, n_cols, eps, HF_ROUNDING)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DG + offsets, dg.to(DG.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += dw_part  # masked rows and columns contribute dy = 0
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration (tuned per GPU by python -m q35lab tune gated_rms_norm into ops/tuned.json).
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    fwd_block_rows: int
    fwd_warps: int
    bwd_block_rows: int
    bwd_warps: int
    bwd_tiles_per_program: int
    frozen_block_rows: int
    frozen_warps: int


@functools.lru_cache(maxsize=64)  # host time matters at small T: decide once per width
def launch_config(n_cols: int) -> LaunchConfig:
    """The configuration rows of width ``n_cols`` launch with on this GPU: its tuned.json entry,
    else ``_default_config``."""
    return tuned_config("gated_rms_norm", n_cols, _default_config(n_cols))


def _default_config(n_cols: int) -> LaunchConfig:
    """Tiles of ~1k elements (8 rows of 128) at 2 warps, 16 values a thread per tensor, and two
    tiles a backward program (4 warps without dW): what tuning picks on Hopper for the 128-wide
    heads, where 32·T short rows give programs enough to fill every SM many times over. The
    interpreter, which runs each program as a Python loop, gets tiles of ~4k: a quarter of them."""
    block_cols = triton.next_power_of_2(n_cols)
    rows = max(1, (4096 if runtime.INTERPRET else 1024) // block_cols)
    warps = max(1, min(8, rows * block_cols // 512))
    return LaunchConfig(
        fwd_block_rows=rows, fwd_warps=warps,
        bwd_block_rows=rows, bwd_warps=warps, bwd_tiles_per_program=2,
        frozen_block_rows=rows, frozen_warps=min(8, 2 * warps),
    )


# --------------------------------------------------------------------------------------------
# Host functions.
# --------------------------------------------------------------------------------------------
def gated_rms_norm_fwd(
    x2d: torch.Tensor, g2d: torch.Tensor, weight: torch.Tensor, eps: float, rounding: str, *,
    config: LaunchConfig | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward over contiguous ``[rows, width]`` matrices; writes into ``out`` (contiguous
    ``[rows, width]``) if given. ``config``: None for ``launch_config(width)``."""
    n_rows, n_cols = x2d.shape
    y = torch.empty_like(x2d) if out is None else out
    if x2d.numel() == 0:  # no rows, or rows of width 0
        return y
    config = launch_config(n_cols) if config is None else config
    round_after_weight = torch.promote_types(weight.dtype, x2d.dtype).itemsize < 4
    _gated_rms_norm_fwd_kernel[(triton.cdiv(n_rows, config.fwd_block_rows),)](
        x2d, g2d, weight, y, n_rows, n_cols, x2d.stride(0), g2d.stride(0), y.stride(0), eps,
        BLOCK_ROWS=config.fwd_block_rows, BLOCK_COLS=triton.next_power_of_2(n_cols),
        HF_ROUNDING=rounding == "hf", ROUND_AFTER_WEIGHT=round_after_weight, num_warps=config.fwd_warps,
    )
    return y


def gated_rms_norm_bwd(
    dy2d: torch.Tensor, x2d: torch.Tensor, g2d: torch.Tensor, weight: torch.Tensor, eps: float,
    rounding: str, compute_dw: bool, *, config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward over contiguous ``[rows, width]`` matrices: ``(dx, dgate, dw or None)``."""
    n_rows, n_cols = x2d.shape
    dx, dg = torch.empty_like(x2d), torch.empty_like(g2d)
    if x2d.numel() == 0:  # no rows: dW is an empty sum; width 0: everything is empty
        return dx, dg, (torch.zeros_like(weight) if compute_dw else None)
    config = launch_config(n_cols) if config is None else config
    if compute_dw:
        block_rows, warps, tiles = config.bwd_block_rows, config.bwd_warps, config.bwd_tiles_per_program
    else:
        block_rows, warps, tiles = config.frozen_block_rows, config.frozen_warps, 1
    tiles = min(tiles, triton.cdiv(n_rows, block_rows))
    n_programs = triton.cdiv(n_rows, block_rows * tiles)
    dw_partial = torch.empty((n_programs if compute_dw else 1, n_cols), dtype=torch.float32, device=x2d.device)
    _gated_rms_norm_bwd_kernel[(n_programs,)](
        dy2d, x2d, g2d, weight, dx, dg, dw_partial, n_rows, n_cols, x2d.stride(0), eps,
        BLOCK_ROWS=block_rows, BLOCK_COLS=triton.next_power_of_2(n_cols), TILES_PER_PROGRAM=tiles,
        HF_ROUNDING=rounding == "hf", COMPUTE_DW=compute_dw, num_warps=warps,
    )
    return dx, dg, (sum_partials(dw_partial, weight.dtype) if compute_dw else None)


# --------------------------------------------------------------------------------------------
# Custom ops (torch.library): torch.compile traces through them with their fake implementations,
# and autograd connects the two. The real implementations choose the launch configuration at run time.
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("q35lab::gated_rms_norm_fwd", mutates_args=())
def gated_rms_norm_fwd_op(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, rounding: str
) -> torch.Tensor:
    """``y`` of ``x``'s shape and dtype, allocated whole (the kernel writes a ``[rows, width]`` view
    of it), so it is no view made inside the autograd node and may be edited in place."""
    x2d = as_rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    gated_rms_norm_fwd(x2d, as_rows(gate), weight, eps, rounding, out=y.view(x2d.shape))
    return y


@gated_rms_norm_fwd_op.register_fake
def _(x, gate, weight, eps, rounding):
    return x.new_empty(x.shape)


@torch.library.custom_op("q35lab::gated_rms_norm_bwd", mutates_args=())
def gated_rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, rounding: str,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dgate, dw)`` over ``[rows, width]`` matrices; ``dw`` is empty (``[0]``) unless
    ``compute_dw`` (a custom op returns no None)."""
    dx, dg, dw = gated_rms_norm_bwd(as_rows(dy), as_rows(x), as_rows(gate), weight, eps, rounding, compute_dw)
    return dx, dg, (dw if compute_dw else weight.new_empty(0))


@gated_rms_norm_bwd_op.register_fake
def _(dy, x, gate, weight, eps, rounding, compute_dw):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape if compute_dw else (0,))


def _setup_context(ctx, inputs, output):
    """Saves x, gate and w (the layer keeps them alive anyway), nothing else."""
    x, gate, weight, ctx.eps, ctx.rounding = inputs
    ctx.save_for_backward(x, gate, weight)


def _backward(ctx, dy):
    x, gate, weight = ctx.saved_tensors
    needs_dx, needs_dg, needs_dw = ctx.needs_input_grad[:3]
    dx, dg, dw = gated_rms_norm_bwd_op(as_rows(dy), as_rows(x), as_rows(gate), weight, ctx.eps, ctx.rounding, needs_dw)
    return ((dx.view(dy.shape) if needs_dx else None), (dg.view(dy.shape) if needs_dg else None),
            (dw if needs_dw else None), None, None)


gated_rms_norm_fwd_op.register_autograd(first_order_only(_backward, op="gated_rms_norm"), setup_context=_setup_context)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, rounding: str = "hf"
) -> torch.Tensor:
    """Gated RMSNorm: ``y = weight · x·rsqrt(mean(x²) + eps) · silu(gate)``, fused.

    Args:
        x (Tensor): ``[..., width]``; bf16, fp16 or fp32.
        gate (Tensor): of ``x``'s shape and dtype.
        weight (Tensor): ``[width]``; bf16, fp16 or fp32. Its gradient is skipped when it does not
            require grad.
        eps (float): added to the mean square. Default: ``1e-6``.
        rounding (str): ``"hf"`` (transformers' cast order) or ``"fused"`` (one rounding, fla's).
            Default: ``"hf"``.

    Returns:
        Tensor: of ``x``'s shape and dtype (a width of 0 gives an empty one).

    Raises:
        TypeError: a tensor argument not a bf16/fp16/fp32 tensor, ``gate`` of another dtype than
            ``x``, ``eps`` not a real number.
        ValueError: ``gate`` of another shape, ``weight`` not ``[width]``, a width above 8192, the
            tensors on different devices, ``eps`` not finite and > 0, an unknown ``rounding``.
    """
    check_float_tensor("x", x)
    check_float_tensor("gate", gate)
    check_float_tensor("weight", weight)
    check_like("gate", gate, "x", x)
    check_weight("weight", weight, x.shape[-1])
    eps = check_eps(eps)
    _check_rounding(rounding)
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"x: last dimension {x.shape[-1]} exceeds the supported width {MAX_WIDTH}")
    check_kernel_device(x=x, gate=gate, weight=weight)
    return gated_rms_norm_fwd_op(x.contiguous(), gate.contiguous(), weight, eps, rounding)  # what backward reads


def _check_rounding(rounding: object) -> None:
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {rounding!r}")


class GatedRMSNorm(torch.nn.Module):
    """Drop-in for transformers' ``Qwen3_5RMSNormGated``: ``forward(x, gate)`` is
    ``gated_rms_norm(x, gate, self.weight, self.eps, self.rounding)``, weight initialised to ones.

    Args:
        hidden_size (int): the width, at least 1.
        eps (float): added to the mean square, finite and > 0. Default: ``1e-6``.
        rounding (str): ``"hf"`` or ``"fused"``, as for ``gated_rms_norm``. Default: ``"hf"``.
        device, dtype: of ``weight``, as for any ``torch.nn`` module.

    Raises:
        TypeError: ``hidden_size`` not an int, ``eps`` not a real number.
        ValueError: ``hidden_size`` below 1, ``eps`` not finite and > 0, an unknown ``rounding``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, rounding: str = "hf", *, device=None, dtype=None):
        super().__init__()
        hidden_size = check_int("hidden_size", hidden_size, minimum=1, what="the width")
        self.eps = check_eps(eps)
        _check_rounding(rounding)
        self.rounding = rounding
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, self.rounding)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, rounding={self.rounding!r}"
