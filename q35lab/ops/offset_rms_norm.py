"""Offset ("zero-centred") RMSNorm, the norm of every Qwen3.5 decoder layer.

Forward, per row ``x`` of width ``N`` (transformers' ``Qwen3_5RMSNorm``)::

    rstd = 1 / sqrt(mean(x²) + eps)          # fp32
    x̂    = x · rstd                          # fp32
    y    = x̂ · (1 + w)                       # fp32, rounded once to x.dtype

The weight starts at zero, so the layer starts as a plain RMSNorm and ``w`` learns the
*deviation* from a unit scale (Gemma's convention). Everything is computed in fp32 and cast once,
as transformers does (Gemma-style casting; Llama-style casting would round ``x̂`` before the
multiply).

Backward, with ``g = dy · (1 + w)`` and ``c = mean(g · x̂)`` per row::

    dx = rstd · (g − x̂ · c)
    dw = Σ_rows dy · x̂                        # fp32 partial per program, reduced once

Layering: ``_offset_rms_norm_fwd_kernel`` / ``_offset_rms_norm_bwd_kernel`` (Triton) →
``offset_rms_norm_fwd`` / ``offset_rms_norm_bwd`` (host, launched as ``launch_config(width)``
says unless given ``config=``) → the custom ops ``q35lab::offset_rms_norm_fwd`` / ``_bwd``
(``offset_rms_norm_fwd_op``, with fake implementations and autograd, so ``torch.compile`` traces
through) → ``offset_rms_norm`` (functional) → ``OffsetRMSNorm`` (module); ``offset_rms_norm_ref``
is the transformers math in PyTorch, the reference every test compares against.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._autograd import first_order_only
from ._checks import check_eps, check_float_tensor, check_int, check_kernel_device, check_weight
from ._launch import as_rows, persistent_programs
from ._reduce import sum_partials
from ._tuned import tuned_config

__all__ = [
    "offset_rms_norm_ref",
    "LaunchConfig",
    "launch_config",
    "offset_rms_norm_fwd",
    "offset_rms_norm_bwd",
    "offset_rms_norm_fwd_op",
    "offset_rms_norm_bwd_op",
    "offset_rms_norm",
    "OffsetRMSNorm",
]

#: Widest row held in registers by one program (one row = one tile).
MAX_WIDTH = 65536


# --------------------------------------------------------------------------------------------
# Reference: transformers' Qwen3_5RMSNorm, line for line.
# --------------------------------------------------------------------------------------------
def offset_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x̂·(1+w)`` in fp32, cast once to ``x.dtype`` (transformers' ``Qwen3_5RMSNorm``).

    With fp64 inputs it is the exact reference the numerics rule measures against.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (x_hat * (1.0 + weight.to(compute))).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernels. Each row is one 1-D block of BLOCK_COLS lanes: a row never spans two programs, so the
# row statistics need no communication between programs.
# --------------------------------------------------------------------------------------------
@triton.jit
def _offset_rms_norm_fwd_kernel(
    X,  # [n_rows, n_cols] input
    W,  # [n_cols] weight, the offset from 1
    Y,  # [n_rows, n_cols] output, x.dtype
    RSTD,  # [n_rows] fp32, 1/sqrt(mean(x²)+eps), kept for backward
    n_rows,
    n_cols,
    stride_x,
    stride_y,
    eps,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w_plus_1 = 1.0 + tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)  # offset added in fp32
    # Unrolled: the loads of every row are independent, so they are all in flight at once.
    for i in tl.static_range(ROWS_PER_PROGRAM):
        row = tl.program_id(0) * ROWS_PER_PROGRAM + i
        if row < n_rows:
            row64 = row.to(tl.int64)  # row·stride overflows int32 past 2³¹ elements
            x = tl.load(X + row64 * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
            # Masked columns load as 0, so they add nothing to Σx²; divide by the true width.
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)  # as torch.rsqrt computes it
            y = (x * rstd) * w_plus_1
            tl.store(Y + row64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=col_mask)
            tl.store(RSTD + row, rstd)


@triton.jit
def _row_backward(dy, x, rstd, w_plus_1, n_cols):
    """One row: ``dx = rstd·(g − x̂·mean(g·x̂))`` with ``g = dy·(1+w)``; also ``dy·x̂`` for dW."""
    x_hat = x * rstd
    g = dy * w_plus_1
    c = tl.sum(g * x_hat, axis=0) / n_cols
    return (g - x_hat * c) * rstd, dy * x_hat


@triton.jit
def _offset_rms_norm_bwd_dx_kernel(
    DY,  # [n_rows, n_cols] upstream gradient
    X,  # [n_rows, n_cols] forward input
    W,  # [n_cols] weight (frozen: no dW)
    RSTD,  # [n_rows] fp32 from the forward
    DX,  # [n_rows, n_cols] input gradient, x.dtype
    n_cols,
    stride_dy,
    stride_x,
    stride_dx,
    BLOCK_COLS: tl.constexpr,
):
    """Frozen weight: one row per program and nothing to reduce across rows."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w_plus_1 = 1.0 + tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=col_mask, other=0.0).to(tl.float32)
    x = tl.load(X + row * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
    dx, _ = _row_backward(dy, x, tl.load(RSTD + row), w_plus_1, n_cols)
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_mask)


@triton.jit
def _offset_rms_norm_bwd_kernel(
    DY,  # [n_rows, n_cols] upstream gradient
    X,  # [n_rows, n_cols] forward input
    W,  # [n_cols] weight
    RSTD,  # [n_rows] fp32 from the forward
    DX,  # [n_rows, n_cols] input gradient, x.dtype
    DW_PARTIAL,  # [n_programs, n_cols] fp32: this program's Σ dy·x̂
    n_rows,
    n_cols,
    rows_per_program,
    stride_dy,
    stride_x,
    stride_dx,
    BLOCK_COLS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Trainable weight: a persistent program walks ``rows_per_program`` consecutive rows,
    accumulating its share of dW in registers, and writes it once as an fp32 partial row."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w_plus_1 = 1.0 + tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)

    first_row = pid * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    # Software pipelining by hand: row r+1 is loaded before row r is reduced, so a program
    # always has the next row's bytes in flight while it computes (its rows are sequential).
    # "cols < width, or none at all": one comparison against a width that is 0 past the end.
    mask = cols < tl.where(first_row < last_row, n_cols, 0)
    first64 = first_row.to(tl.int64)  # row·stride overflows int32 past 2³¹ elements
    dy_ptrs = DY + first64 * stride_dy + cols
    x_ptrs = X + first64 * stride_x + cols
    dx_ptrs = DX + first64 * stride_dx + cols
    dy_next = tl.load(dy_ptrs, mask=mask, other=0.0)
    x_next = tl.load(x_ptrs, mask=mask, other=0.0)
    for row in tl.range(first_row, last_row, num_stages=NUM_STAGES):
        dy = dy_next.to(tl.float32)
        x = x_next.to(tl.float32)
        mask_next = cols < tl.where(row + 1 < last_row, n_cols, 0)
        dy_next = tl.load(dy_ptrs + stride_dy, mask=mask_next, other=0.0)
        x_next = tl.load(x_ptrs + stride_x, mask=mask_next, other=0.0)

        dx, dy_x_hat = _row_backward(dy, x, tl.load(RSTD + row), w_plus_1, n_cols)
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=col_mask)
        dw_acc += dy_x_hat  # masked columns contribute dy = 0
        dy_ptrs += stride_dy
        x_ptrs += stride_x
        dx_ptrs += stride_dx

    tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc, mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration: this GPU's entry in ops/tuned.json if there is one, else the heuristic
# below (python -m q35lab tune offset_rms_norm sweeps the choices; its results live in data/bench/).
# Under the interpreter num_warps is ignored.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    fwd_rows_per_program: int  # rows one forward program normalises (unrolled)
    fwd_warps: int
    bwd_warps: int
    bwd_programs_per_sm: int  # persistent backward with dW: programs per multiprocessor
    bwd_stages: int = 1  # tl.range software-pipelining depth of the persistent backward loop
    frozen_warps: int = 8  # backward without dW: one row per program


@functools.lru_cache(maxsize=64)  # host time matters at small T: decide once per width
def launch_config(n_cols: int) -> LaunchConfig:
    """The configuration rows of width ``n_cols`` launch with on this GPU: its tuned.json entry,
    else ``_default_config``."""
    return tuned_config("offset_rms_norm", n_cols, _default_config(n_cols))


def _default_config(n_cols: int) -> LaunchConfig:
    """Row-wise kernels want ~16 values per thread: 8 warps for a 4096-wide row; narrow rows
    pack several rows into one program so each program still moves a few KB."""
    block_cols = triton.next_power_of_2(n_cols)
    warps = max(1, min(16, block_cols // 512))
    return LaunchConfig(
        fwd_rows_per_program=max(1, min(16, 4096 // block_cols)),
        fwd_warps=warps,
        bwd_warps=warps,
        bwd_programs_per_sm=2,  # 2 resident programs of 8 warps; 3 leaves a ragged last wave
        bwd_stages=3,
        frozen_warps=max(1, min(16, block_cols // 256)),
    )


# --------------------------------------------------------------------------------------------
# Host functions: [rows, width] in, tensors out. No autograd here.
# --------------------------------------------------------------------------------------------
def offset_rms_norm_fwd(
    x2d: torch.Tensor, weight: torch.Tensor, eps: float, *, config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over a contiguous ``[rows, width]`` matrix; returns ``(y, rstd)``.

    ``out``: a contiguous ``[rows, width]`` tensor to write ``y`` into (the autograd Function
    passes a view of its final-shape output), else one is allocated. ``config``: None for
    ``launch_config(width)``.
    """
    n_rows, n_cols = x2d.shape
    y = torch.empty_like(x2d) if out is None else out
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    if x2d.numel() == 0:  # no rows, or rows of width 0: nothing to normalise
        return y, rstd
    config = launch_config(n_cols) if config is None else config
    grid = (triton.cdiv(n_rows, config.fwd_rows_per_program),)
    _offset_rms_norm_fwd_kernel[grid](
        x2d, weight, y, rstd, n_rows, n_cols, x2d.stride(0), y.stride(0), eps,
        ROWS_PER_PROGRAM=config.fwd_rows_per_program, BLOCK_COLS=triton.next_power_of_2(n_cols),
        num_warps=config.fwd_warps,
    )
    return y, rstd


def offset_rms_norm_bwd(
    dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool,
    *, config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward over ``[rows, width]``; returns ``(dx, dw)`` with ``dw=None`` unless ``compute_dw``.

    With ``compute_dw`` the grid is persistent (a few programs per SM), each walking a
    contiguous run of rows and writing one fp32 partial row of dW; the partials are summed
    once afterwards, in a fixed order: deterministic, no atomics. Without it, every row gets
    its own program.
    """
    n_rows, n_cols = x2d.shape
    dx = torch.empty_like(x2d)
    if x2d.numel() == 0:  # no rows: dW is an empty sum; width 0: dx and dW are empty
        return dx, (torch.zeros_like(weight) if compute_dw else None)
    config = launch_config(n_cols) if config is None else config
    block_cols = triton.next_power_of_2(n_cols)
    strides = (dy2d.stride(0), x2d.stride(0), dx.stride(0))
    if not compute_dw:
        _offset_rms_norm_bwd_dx_kernel[(n_rows,)](
            dy2d, x2d, weight, rstd, dx, n_cols, *strides, BLOCK_COLS=block_cols, num_warps=config.frozen_warps
        )
        return dx, None
    rows_per_program = triton.cdiv(n_rows, min(n_rows, persistent_programs(x2d.device, config.bwd_programs_per_sm)))
    n_programs = triton.cdiv(n_rows, rows_per_program)
    dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x2d.device)
    _offset_rms_norm_bwd_kernel[(n_programs,)](
        dy2d, x2d, weight, rstd, dx, dw_partial, n_rows, n_cols, rows_per_program, *strides,
        BLOCK_COLS=block_cols, NUM_STAGES=config.bwd_stages, num_warps=config.bwd_warps,
    )
    dw = sum_partials(dw_partial, weight.dtype)
    return dx, dw


# --------------------------------------------------------------------------------------------
# Custom ops (torch.library): torch.compile traces through them with their fake implementations,
# and autograd connects the two. The real implementations choose the launch configuration at run time.
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("q35lab::offset_rms_norm_fwd", mutates_args=())
def offset_rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: ``y`` of ``x``'s shape and dtype, ``rstd`` fp32 ``[rows]``.

    ``y`` is allocated whole and the kernel writes it through a ``[rows, width]`` view: an output
    that is a view made inside the autograd node is one autograd forbids editing in place
    (``y.mul_(2)``), which transformers' module allows.
    """
    x2d = as_rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _, rstd = offset_rms_norm_fwd(x2d, weight, eps, out=y.view(x2d.shape))
    return y, rstd


@offset_rms_norm_fwd_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@torch.library.custom_op("q35lab::offset_rms_norm_bwd", mutates_args=())
def offset_rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` over ``[rows, width]`` matrices; ``dw`` is empty (``[0]``) unless ``compute_dw``
    (a custom op returns no None)."""
    dx, dw = offset_rms_norm_bwd(as_rows(dy), as_rows(x), weight, rstd, compute_dw)
    return dx, (dw if compute_dw else weight.new_empty(0))


@offset_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, compute_dw):
    return x.new_empty(x.shape), weight.new_empty(weight.shape if compute_dw else (0,))


def _setup_context(ctx, inputs, output):
    """Saves ``x``, ``w`` and the fp32 ``rstd`` (4 bytes a row), nothing more."""
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)  # no zeros made for rstd's gradient
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    needs_dx, needs_dw, _ = ctx.needs_input_grad
    dx, dw = offset_rms_norm_bwd_op(as_rows(dy), as_rows(x), weight, rstd, needs_dw)
    return (dx.view(dy.shape) if needs_dx else None), (dw if needs_dw else None), None


offset_rms_norm_fwd_op.register_autograd(first_order_only(_backward, op="offset_rms_norm"),
                                         setup_context=_setup_context)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Offset RMSNorm: ``y = x·rsqrt(mean(x²)+eps)·(1+w)`` in fp32, rounded once to ``x.dtype``.

    Args:
        x (Tensor): ``[..., width]``; bf16, fp16 or fp32.
        weight (Tensor): ``[width]``, the offset from a unit scale (zero-initialised in Qwen3.5);
            bf16, fp16 or fp32. Its gradient is skipped when it does not require grad.
        eps (float): added to the mean square. Default: ``1e-6``.

    Returns:
        Tensor: of ``x``'s shape and dtype (a width of 0 gives an empty one).

    Raises:
        TypeError: ``x`` or ``weight`` not a bf16/fp16/fp32 tensor, ``eps`` not a real number.
        ValueError: ``x`` a scalar or wider than 65536, ``weight`` not ``[width]``, the tensors on
            different devices (or not on the GPU where kernels run compiled), ``eps`` not finite and > 0.
    """
    check_float_tensor("x", x)
    check_float_tensor("weight", weight)
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension (the hidden width), got a scalar")
    check_weight("weight", weight, x.shape[-1])
    eps = check_eps(eps)
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"x: last dimension {x.shape[-1]} exceeds the supported width {MAX_WIDTH}")
    check_kernel_device(x=x, weight=weight)
    y, _ = offset_rms_norm_fwd_op(x.contiguous(), weight, eps)  # the contiguous x is what backward reads
    return y


class OffsetRMSNorm(torch.nn.Module):
    """Drop-in for transformers' ``Qwen3_5RMSNorm``: ``offset_rms_norm(x, self.weight, self.eps)``,
    with the same ``weight`` key, zero-initialised.

    Args:
        hidden_size (int): the width, at least 1.
        eps (float): added to the mean square, finite and > 0. Default: ``1e-6``.
        device, dtype: of ``weight``, as for any ``torch.nn`` module.

    Raises:
        TypeError: ``hidden_size`` not an int, ``eps`` not a real number.
        ValueError: ``hidden_size`` below 1, ``eps`` not finite and > 0.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        hidden_size = check_int("hidden_size", hidden_size, minimum=1, what="the width")
        self.eps = check_eps(eps)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return offset_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
