"""Strided rows copied into contiguous memory: ``y = x.contiguous()``, one tile of rows a program.

Where it is needed: transformers' GatedDeltaNet splits q, k and v out of the convolution's
``[B, T, C]`` output as column blocks, views whose rows (one token's heads) are contiguous but lie
``C`` elements apart. flash-linear-attention's core needs each contiguous and copies it. torch's
copy of such a view moves its elements a few at a time, well below a plain copy's rate; here a row
is read and written in wide blocks, as a contiguous copy is.

    rows, width = the leading dimensions (one stride), the trailing ones (contiguous)
    y[r, c] = x[r · stride, c]

The backward is the identity (the gradient of a copy), so double backward works as for torch's.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .. import runtime
from ._compile import opaque_to_compile
from ._launch import RowTiles, row_tiles
from ._tuned import tuned_config

__all__ = ["contiguous_rows", "strided_rows", "LaunchConfig", "launch_config"]


LaunchConfig = RowTiles


@functools.lru_cache(maxsize=64)
def launch_config(width: int) -> LaunchConfig:
    """The launch for rows of ``width``: this GPU's tuned entry, or ``row_tiles``."""
    return tuned_config("contiguous_rows", width, row_tiles(width))


@triton.jit
def _copy_rows_kernel(SRC, DST, n_rows, width, stride_src, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """``DST[r, :] = SRC[r · stride_src, :]`` for this program's ``BLOCK_ROWS`` rows."""
    # int64 rows: r · stride passes 2³¹ at T = 262144 and C = 8192
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]
    row_mask = rows < n_rows
    for col0 in range(0, width, BLOCK_COLS):
        cols = col0 + tl.arange(0, BLOCK_COLS)[None, :]
        mask = row_mask & (cols < width)
        tl.store(DST + rows * width + cols, tl.load(SRC + rows * stride_src + cols, mask=mask), mask=mask)


def strided_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a ``[rows, width]`` view with unit column stride: its trailing dimensions that are
    contiguous together make the row, its leading ones must merge into one row stride. None when
    they do not (then no row copy applies)."""
    width, dims = 1, x.dim()
    while dims > 0 and (x.shape[dims - 1] == 1 or x.stride(dims - 1) == width):
        width *= x.shape[dims - 1]
        dims -= 1
    try:
        return x.view(math.prod(x.shape[:dims]), width)
    except RuntimeError:  # leading dimensions whose strides do not merge (e.g. a transpose)
        return None


def _copy(x: torch.Tensor, config: LaunchConfig | None = None) -> torch.Tensor:
    """``x.contiguous()``: one Triton copy of its rows, or torch's copy where ``x`` has none."""
    rows = strided_rows(x)
    if rows is None or not (runtime.INTERPRET or x.is_cuda):  # compiled Triton reads CUDA memory only
        return x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        config = config or launch_config(rows.shape[1])
        _copy_rows_kernel[(triton.cdiv(rows.shape[0], config.block_rows),)](
            rows, out, rows.shape[0], rows.shape[1], rows.stride(0),
            BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, num_warps=config.warps)
    return out


class ContiguousRowsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _copy(x)

    @staticmethod
    def backward(ctx, grad):
        return grad  # a copy's gradient: torch ops only, so it differentiates again


@opaque_to_compile
def contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()``, by one Triton copy of its rows when ``x`` is a view of strided rows
    (``strided_rows``); ``x`` itself when it is contiguous already, torch's copy otherwise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    return x if x.is_contiguous() else ContiguousRowsFunction.apply(x)
