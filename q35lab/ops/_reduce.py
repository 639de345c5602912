"""Deterministic reduction of per-program fp32 partials (weight gradients), shared by the norms."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_partials_kernel(
    PARTIAL,  # [n_partials, n_cols] fp32, one row per program of the backward
    OUT,  # [n_cols], the weight's dtype
    n_partials,
    n_cols,
    BLOCK_PARTIALS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """OUT[c] = Σ_p PARTIAL[p, c], summed in fp32 in a fixed order, rounded once."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_PARTIALS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_PARTIALS):
        rows = start + tl.arange(0, BLOCK_PARTIALS)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


def sum_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of a contiguous fp32 ``[n_partials, n_cols]`` matrix, in ``dtype``.

    One launch instead of ``partial.sum(0).to(dtype)``'s two; the same order every call.
    """
    n_partials, n_cols = partial.shape
    out = torch.empty(n_cols, dtype=dtype, device=partial.device)
    block_cols = min(64, triton.next_power_of_2(n_cols))
    _sum_partials_kernel[(triton.cdiv(n_cols, block_cols),)](
        partial, out, n_partials, n_cols, BLOCK_PARTIALS=32, BLOCK_COLS=block_cols, num_warps=4
    )
    return out
