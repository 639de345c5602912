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
``offset_rms_norm_fwd`` / ``offset_rms_norm_bwd`` (host) → ``OffsetRMSNormFunction`` →
``offset_rms_norm`` (functional) → ``OffsetRMSNorm`` (module); ``offset_rms_norm_ref`` is the
transformers math in PyTorch, the reference every test compares against.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime
from ._checks import check_eps, check_float_tensor, check_same_device, check_weight, rows_view

__all__ = [
    "offset_rms_norm_ref",
    "offset_rms_norm_fwd",
    "offset_rms_norm_bwd",
    "OffsetRMSNormFunction",
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
# Kernels. A program owns a tile of BLOCK_ROWS whole rows; a row never spans two programs, so
# the row statistics need no communication between programs.
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
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)  # rows·stride overflows int32 past 2³¹ elements

    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)

    # Masked columns load as 0, so they add nothing to Σx²; divide by the true width.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = (x * rstd[:, None]) * (1.0 + w)[None, :]  # the offset is added in fp32, never rounded

    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _offset_rms_norm_bwd_kernel(
    DY,  # [n_rows, n_cols] upstream gradient
    X,  # [n_rows, n_cols] forward input
    W,  # [n_cols] weight
    RSTD,  # [n_rows] fp32 from the forward
    DX,  # [n_rows, n_cols] input gradient, x.dtype
    DW_PARTIAL,  # [n_programs, n_cols] fp32: this program's Σ dy·x̂ (unused if not COMPUTE_DW)
    n_rows,
    n_cols,
    rows_per_program,
    stride_dy,
    stride_x,
    stride_dx,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w_plus_1 = 1.0 + tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)

    first_row = pid * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    for tile_start in range(first_row, last_row, BLOCK_ROWS):
        rows = tile_start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < last_row
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)

        x_hat = x * rstd[:, None]
        g = dy * w_plus_1[None, :]
        c = tl.sum(g * x_hat, axis=1) / n_cols
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

        if COMPUTE_DW:
            dw_acc += dy * x_hat  # masked rows and columns contribute dy = 0

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration. Tuned on an H200 (data/bench/nvidia-h200/offset_rms_norm_tuning.csv);
# under the interpreter num_warps is ignored.
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs_for_device(device: torch.device) -> int:
    """How many programs the persistent backward launches: a few per multiprocessor."""
    if device.type != "cuda":
        return 4  # the interpreter: a handful of programs exercises the partial-dW reduction
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * BWD_PROGRAMS_PER_SM


#: Programs per SM in the backward with dW (each keeps a BLOCK_ROWS×BLOCK_COLS fp32 dW tile).
BWD_PROGRAMS_PER_SM = 4


def _tile(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) for rows of width ``n_cols``.

    A tile of about 8k elements keeps ~16 values per thread at 16 warps: enough bytes in
    flight per program to cover memory latency, few enough registers for 2+ programs per SM.
    """
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = max(1, min(64, 8192 // block_cols))
    num_warps = max(1, min(16, block_rows * block_cols // 512))
    return block_rows, block_cols, num_warps


# --------------------------------------------------------------------------------------------
# Host functions: [rows, width] in, tensors out. No autograd here.
# --------------------------------------------------------------------------------------------
def offset_rms_norm_fwd(x2d: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over a contiguous ``[rows, width]`` matrix; returns ``(y, rstd)``."""
    n_rows, n_cols = x2d.shape
    y = torch.empty_like(x2d)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    if n_rows == 0:
        return y, rstd
    block_rows, block_cols, num_warps = _tile(n_cols)
    grid = (triton.cdiv(n_rows, block_rows),)
    _offset_rms_norm_fwd_kernel[grid](
        x2d, weight, y, rstd, n_rows, n_cols, x2d.stride(0), y.stride(0), eps,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
    )
    return y, rstd


def offset_rms_norm_bwd(
    dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward over ``[rows, width]``; returns ``(dx, dw)`` with ``dw=None`` unless ``compute_dw``.

    With ``compute_dw`` the grid is persistent (a few programs per SM), each walking a
    contiguous run of rows and writing one fp32 partial row of dW; the partials are summed
    once afterwards, in a fixed order: deterministic, no atomics. Without it, every tile of rows
    gets its own program.
    """
    n_rows, n_cols = x2d.shape
    dx = torch.empty_like(x2d)
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw else None
        return dx, dw
    block_rows, block_cols, num_warps = _tile(n_cols)
    n_tiles = triton.cdiv(n_rows, block_rows)
    n_programs = min(n_tiles, _programs_for_device(x2d.device)) if compute_dw else n_tiles
    rows_per_program = triton.cdiv(n_tiles, n_programs) * block_rows
    n_programs = triton.cdiv(n_rows, rows_per_program)
    dw_partial = (
        torch.empty((n_programs, n_cols), dtype=torch.float32, device=x2d.device) if compute_dw else dx
    )
    _offset_rms_norm_bwd_kernel[(n_programs,)](
        dy2d, x2d, weight, rstd, dx, dw_partial, n_rows, n_cols, rows_per_program,
        dy2d.stride(0), x2d.stride(0), dx.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, COMPUTE_DW=compute_dw, num_warps=num_warps,
    )
    dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else None
    return dx, dw


# --------------------------------------------------------------------------------------------
# Autograd, functional form, module.
# --------------------------------------------------------------------------------------------
class OffsetRMSNormFunction(torch.autograd.Function):
    """Autograd node: saves ``x``, ``w`` and the fp32 ``rstd`` (4 bytes a row), nothing more."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2d = rows_view(x)
        y, rstd = offset_rms_norm_fwd(x2d, weight, eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight, rstd = ctx.saved_tensors
        needs_dx, needs_dw, _ = ctx.needs_input_grad
        dx, dw = offset_rms_norm_bwd(rows_view(dy), x2d, weight, rstd, compute_dw=needs_dw)
        return (dx.view(dy.shape) if needs_dx else None), dw, None


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Offset RMSNorm: ``y = x·rsqrt(mean(x²)+eps)·(1+w)`` in fp32, rounded once to ``x.dtype``.

    Args:
        x: activations of any leading shape; last dimension = width; bf16, fp16 or fp32.
        weight: ``[width]``, the offset from a unit scale (zero-initialised in Qwen3.5);
            any float dtype; its gradient is skipped when it does not require grad.
        eps: added to the mean square before the square root.
    """
    check_float_tensor("x", x)
    check_float_tensor("weight", weight)
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension (the hidden width), got a scalar")
    check_weight("weight", weight, x.shape[-1])
    check_same_device(x=x, weight=weight)
    eps = check_eps(eps)
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"x: last dimension {x.shape[-1]} exceeds the supported width {MAX_WIDTH}")
    return OffsetRMSNormFunction.apply(x, weight, eps)


class OffsetRMSNorm(torch.nn.Module):
    """Drop-in for transformers' ``Qwen3_5RMSNorm``: same ``weight`` key, zero-initialised."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return offset_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
