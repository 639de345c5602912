"""Deterministic reduction of per-program fp32 partials (weight gradients), shared by the norms."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Partial rows one program sums. Taller inputs are first reduced in chunks of this many rows
#: by parallel programs (a narrow weight, e.g. 128 columns, would otherwise leave one program
#: walking thousands of rows).
CHUNK = 256


@triton.jit
def _sum_partials_kernel(
    PARTIAL,  # [n_partials, n_cols] fp32, one row per program of the backward
    OUT,  # [n_chunks, n_cols]: fp32 for an intermediate level, the weight's dtype for the last
    n_partials,
    n_cols,
    rows_per_chunk,
    BLOCK_PARTIALS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """OUT[k, c] = Σ_{p in chunk k} PARTIAL[p, c], summed in fp32 in a fixed order, rounded once."""
    chunk = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    first = chunk * rows_per_chunk
    last = tl.minimum(first + rows_per_chunk, n_partials)
    acc = tl.zeros([BLOCK_PARTIALS, BLOCK_COLS], dtype=tl.float32)
    for start in range(first, last, BLOCK_PARTIALS):
        rows = start + tl.arange(0, BLOCK_PARTIALS)
        mask = (rows < last)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + chunk * n_cols + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


def _sum_chunks(partial: torch.Tensor, rows_per_chunk: int, dtype: torch.dtype) -> torch.Tensor:
    n_partials, n_cols = partial.shape
    n_chunks = triton.cdiv(n_partials, rows_per_chunk)
    out = torch.empty((n_chunks, n_cols), dtype=dtype, device=partial.device)
    block_cols = min(64, triton.next_power_of_2(n_cols))
    _sum_partials_kernel[(triton.cdiv(n_cols, block_cols), n_chunks)](
        partial, out, n_partials, n_cols, rows_per_chunk, BLOCK_PARTIALS=32, BLOCK_COLS=block_cols, num_warps=4
    )
    return out


def sum_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of a contiguous fp32 ``[n_partials, n_cols]`` matrix, in ``dtype``.

    Up to ``CHUNK`` rows: one launch (instead of ``partial.sum(0).to(dtype)``'s two). Taller:
    chunks of ``CHUNK`` rows are summed in parallel first. The order of additions depends only
    on the shape, so the result is the same every call.
    """
    while partial.shape[0] > CHUNK:
        partial = _sum_chunks(partial, CHUNK, torch.float32)
    return _sum_chunks(partial, partial.shape[0], dtype)[0]
