"""The GatedDeltaNet's short convolution: a depthwise causal conv1d + SiLU, channels last.

Forward, per channel ``c`` of width-``K`` filter ``w[c, :]`` (``K = 4`` in Qwen3.5)::

    z[b, t, c] = bias[c] + Σ_{k<K} w[c, k] · x[b, t-(K-1)+k, c]     # fp32; x before the start = 0
    y[b, t, c] = silu(z) = z · σ(z)                                  # or y = z; rounded once

``x`` is ``in_proj_qkv``'s output ``[B, T, C]`` (``C = 8192`` at 9B) read in its own layout:
transformers transposes it to ``[B, C, T]`` for ``nn.Conv1d`` and back, slices the padded output
and applies SiLU in a second kernel; here one pass reads ``x`` once and writes ``y`` once. With
``cu_seqlens`` (a packed batch, ``B = 1``) "the start" is each sequence's start: nothing crosses
a boundary. With ``initial_rows`` ``h`` (``[B, K-1, C]``: the K-1 input rows before x's first, as a
sequence cut into segments hands them on) "before the start" is ``h``, not 0: ``x[-j] = h[K-1-j]``;
``return_final_rows`` also gives the last K-1 rows of ``[h | x]``, what the next segment starts from.

Backward, with ``dz = dy · σ(z)·(1 + z·(1 − σ(z)))`` (``dz = dy`` without activation)::

    dx[t, c]   = Σ_k w[c, k] · dz[t + (K-1) - k, c]    # dz = 0 past the end of t's sequence
    dw[c, k]   = Σ_t dz[t, c] · x[t-(K-1)+k, c]         # fp32 partial per program, reduced once
    dbias[c]   = Σ_t dz[t, c]
    dh[j, c]   = Σ_{k<=j} w[c, k] · dz[j - k, c]             # j < K-1: the initial rows' gradient

``z`` is recomputed from ``x`` in the backward instead of being saved: the autograd node keeps
``x`` (``T·C·elem`` bytes — 16 KiB a token at C = 8192 in bf16 — and no copy when ``x`` is
channels-last, even as a column slice of a wider buffer), the weight and bias (views), and with
``cu_seqlens`` one int32 per token (each token's sequence start). transformers' fallback keeps
``x`` and the ``(T+K-1)·C`` conv output for SiLU: about twice as much.

Layering: ``_causal_conv1d_fwd_kernel`` / ``_causal_conv1d_bwd_kernel`` (Triton) →
``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` (host, launched as ``launch_config(C, K)`` says unless
given ``config=``) → the custom ops ``q35lab::causal_conv1d_fwd`` / ``_bwd`` (``causal_conv1d_fwd_op``,
with fake implementations and autograd, so ``torch.compile`` traces through) → ``causal_conv1d``
(functional); ``causal_conv1d_ref`` is transformers' ``causal_conv1d_fn`` in
PyTorch, per sequence, the reference every test compares against (with initial rows: on ``[h | x]``,
the first K-1 outputs dropped).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import runtime  # first: the interpreter is chosen before any kernel is defined
from ._autograd import first_order_only
from ._checks import check_bool, check_float_tensor, check_kernel_device
from ._compile import opaque_to_compile
from ._launch import persistent_programs
from ._reduce import sum_partials
from ._tuned import tuned_config

__all__ = [
    "causal_conv1d_ref",
    "causal_conv1d_fwd",
    "causal_conv1d_bwd",
    "causal_conv1d_fwd_op",
    "causal_conv1d_bwd_op",
    "causal_conv1d",
    "LaunchConfig",
    "launch_config",
    "MAX_KERNEL_SIZE",
]

#: Widest filter supported (the kernels unroll over it).
MAX_KERNEL_SIZE = 8
#: Tiles one backward program sums dW/dbias over, at most: each fp32 accumulator element adds one
#: value a tile in sequence, and a long sequential fp32 sum loses dbias' precision at long T; more
#: programs keep those sums short, and sum_partials reduces their partial rows.
MAX_TILES_PER_PROGRAM = 32
#: Activation names accepted, as transformers' ``config.hidden_act`` / fla spell them.
ACTIVATIONS = (None, "silu", "swish")


# --------------------------------------------------------------------------------------------
# Reference: transformers' causal_conv1d_fn (the fallback of Qwen3_5GatedDeltaNet), per sequence.
# --------------------------------------------------------------------------------------------
def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    initial_rows: torch.Tensor | None = None,
    return_final_rows: bool = False,
):
    """``act(conv1d(x.transpose(1, 2), groups=C, padding=K-1)[..., :T])`` transposed back.

    Line for line transformers' fallback: ``x`` cast to the weight's dtype, ``F.conv1d``, the
    activation in that dtype, cast to ``x.dtype``. With ``cu_seqlens`` each sequence is convolved
    alone. With fp64 inputs it is the exact reference of the numerics rule. ``initial_rows``: the
    convolution of ``[initial_rows | x]`` without its first K-1 outputs; ``return_final_rows``:
    ``(y, the last K-1 rows of [initial_rows | x])``, zeros standing in for absent initial rows.
    """
    C = x.shape[-1]
    w = weight.reshape(C, -1)
    K = w.shape[1]
    if initial_rows is not None or return_final_rows:
        h = x.new_zeros(x.shape[0], K - 1, C) if initial_rows is None else initial_rows.to(x.dtype)
        rows = torch.cat([h, x], dim=1)
        y = causal_conv1d_ref(rows, weight, bias, activation=activation)[:, K - 1:]
        return (y, rows[:, rows.shape[1] - (K - 1):]) if return_final_rows else y
    b = None if bias is None else bias.to(w.dtype)

    def one(xs: torch.Tensor) -> torch.Tensor:
        out = F.conv1d(xs.transpose(1, 2).to(w.dtype), w.unsqueeze(1), b, padding=K - 1, groups=C)
        out = out[..., : xs.shape[1]]
        if activation is not None:
            out = F.silu(out)
        return out.to(x.dtype).transpose(1, 2)

    if cu_seqlens is None:
        return one(x) if x.shape[1] > 0 else torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    parts = [one(x[:, a:e]) for a, e in zip(bounds[:-1], bounds[1:]) if e > a]
    return torch.cat(parts, dim=1) if parts else torch.empty_like(x)


# --------------------------------------------------------------------------------------------
# Kernels. A program owns a tile of BLOCK_T tokens × BLOCK_C channels (channels contiguous in
# memory). The K-1 tokens of halo before the tile are read by shifted loads of the same tile:
# they hit L1/L2, so HBM sees x about once. The backward's halo after the tile is dz's, moved
# within registers (tl.gather).
# SEQ_START[t] is the first token of t's sequence (0 without cu_seqlens): x[s] belongs to t's
# window iff s >= SEQ_START[t], and dz[s] reaches dx[t] (s >= t) iff SEQ_START[s] <= t.
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(base, stride_t, rows, ok, cols, col_mask):
    """``base[rows, cols]`` in fp32; 0 where ``ok`` is false (before the sequence, past T)."""
    mask = ok[:, None] & col_mask[None, :]
    return tl.load(base + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _filter_tap(W, stride_wc, stride_wk, cols, col_mask, k):
    """``w[cols, k]`` in fp32 (BLOCK_C values, cached: reloading is cheaper than keeping K)."""
    return tl.load(W + cols * stride_wc + k * stride_wk, mask=col_mask, other=0.0).to(tl.float32)


@triton.jit
def _input_rows(x_base, stride_xt, h_base, stride_ht, src, ok, start, cols, col_mask,
                K: tl.constexpr, HAS_INIT: tl.constexpr):
    """``x[src]`` in fp32 where ``ok``, 0 before ``start``; with initial rows (``start`` = 0: no
    packed sequences) ``h[K-1+src]`` for ``src < 0``."""
    xs = _load_tile(x_base, stride_xt, src, ok & (src >= start), cols, col_mask)
    if HAS_INIT:
        xs += _load_tile(h_base, stride_ht, src + (K - 1), ok & (src < 0), cols, col_mask)
    return xs


@triton.jit
def _pre_activation(
    x_base, stride_xt, h_base, stride_ht, W, stride_wc, stride_wk, bias, rows, start, row_ok, cols, col_mask,
    K: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``z[rows] = bias + Σ_k w[k]·x[rows-(K-1)+k]``, x taken as 0 before ``start`` (per row), or
    as the initial rows ``h`` before the first token (``HAS_INIT``)."""
    z = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + bias[None, :]
    for k in tl.static_range(K):
        src = rows - (K - 1) + k
        xk = _input_rows(x_base, stride_xt, h_base, stride_ht, src, row_ok, start, cols, col_mask, K, HAS_INIT)
        z += xk * _filter_tap(W, stride_wc, stride_wk, cols, col_mask, k)[None, :]
    return z


@triton.jit
def _causal_conv1d_fwd_kernel(
    X,  # [B, T, C] input, channels contiguous; token and batch strides free (column slices)
    W,  # [C, K] filter taps
    BIAS,  # [C] (unused without HAS_BIAS)
    SEQ_START,  # [T] int32, first token of each token's sequence (unused without HAS_SEQ)
    H,  # [B, K-1, C] initial rows, channels contiguous (unused without HAS_INIT)
    Y,  # [B, T, C] output, x.dtype
    T,
    C,
    stride_xb,
    stride_xt,
    stride_hb,
    stride_ht,
    stride_yb,
    stride_yt,
    stride_wc,
    stride_wk,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < T
    col_mask = cols < C
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_SEQ:
        start = tl.load(SEQ_START + rows, mask=row_ok, other=0)
    else:
        start = tl.zeros([BLOCK_T], dtype=tl.int32)
    z = _pre_activation(X + b * stride_xb, stride_xt, H + b * stride_hb, stride_ht, W, stride_wc, stride_wk, bias,
                        rows, start, row_ok, cols, col_mask, K, HAS_INIT, BLOCK_T, BLOCK_C)
    if SILU:
        z = z * tl.sigmoid(z)
    mask = row_ok[:, None] & col_mask[None, :]
    tl.store(Y + b * stride_yb + rows.to(tl.int64)[:, None] * stride_yt + cols[None, :],
             z.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _grad_pre_activation(
    x_base, stride_xt, h_base, stride_ht, dy_base, stride_dyt, W, stride_wc, stride_wk, bias, rows, start, row_ok,
    cols, col_mask, K: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``dz[rows] = dy·silu'(z)`` with ``z`` recomputed from x (``dy`` without activation);
    0 where ``row_ok`` is false."""
    dz = _load_tile(dy_base, stride_dyt, rows, row_ok, cols, col_mask)
    if SILU:
        z = _pre_activation(x_base, stride_xt, h_base, stride_ht, W, stride_wc, stride_wk, bias, rows, start, row_ok,
                            cols, col_mask, K, HAS_INIT, BLOCK_T, BLOCK_C)
        sig = tl.sigmoid(z)
        dz = dz * sig * (1.0 + z * (1.0 - sig))
    return dz


@triton.jit
def _rows_ahead(s: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row ``r + s`` for every row ``r`` of a tile, as an index for ``tl.gather`` along the rows
    (which moves values between a program's threads); the last ``s`` rows get the tile's last
    row, which callers mask."""
    return tl.minimum(tl.arange(0, BLOCK_T) + s, BLOCK_T - 1)


@triton.jit
def _tap_product(x_base, stride_xt, h_base, stride_ht, dz, rows, start, row_ok, cols, col_mask, k: tl.constexpr,
                 K: tl.constexpr, HAS_INIT: tl.constexpr):
    """``dz[t] · x[t-(K-1)+k]``: token t's share of ``dW[:, k]`` (x before the sequence = 0, or the
    initial rows)."""
    src = rows - (K - 1) + k
    return dz * _input_rows(x_base, stride_xt, h_base, stride_ht, src, row_ok, start, cols, col_mask, K, HAS_INIT)


@triton.jit
def _rows_behind(s: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row ``r - s`` for every row ``r`` of a tile, as a ``tl.gather`` index (the first ``s`` rows
    get row 0, which callers mask)."""
    return tl.maximum(tl.arange(0, BLOCK_T) - s, 0)


@triton.jit
def _initial_rows_grad(dz, W, stride_wc, stride_wk, cols, col_mask, K: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """``dh[j] = Σ_{k<=j} w[k]·dz[j-k]`` in rows ``j < K-1`` of the result (the rest are not
    the initial rows'), from the first tile's ``dz``: initial row j is input row j-(K-1), which
    output t reads through tap k where t = j-k."""
    local = tl.arange(0, BLOCK_T)
    dh = dz * _filter_tap(W, stride_wc, stride_wk, cols, col_mask, 0)[None, :]
    for k in tl.static_range(1, K):
        behind = _rows_behind(k, BLOCK_T)
        dz_k = tl.gather(dz, tl.broadcast_to(behind[:, None], (BLOCK_T, BLOCK_C)), axis=0)
        w_k = _filter_tap(W, stride_wc, stride_wk, cols, col_mask, k)
        dh += tl.where((local >= k)[:, None], dz_k, 0.0) * w_k[None, :]
    return dh


@triton.jit
def _causal_conv1d_bwd_kernel(
    X,  # [B, T, C] forward input
    W,  # [C, K]
    BIAS,  # [C] (unused without HAS_BIAS)
    SEQ_START,  # [T] int32 (unused without HAS_SEQ)
    H,  # [B, K-1, C] initial rows (unused without HAS_INIT)
    DY,  # [B, T, C] upstream gradient, channels contiguous
    DX,  # [B, T, C] input gradient, x.dtype (unused without COMPUTE_DX)
    DH,  # [B, K-1, C] the initial rows' gradient, their dtype (unused without COMPUTE_DH)
    DW_PARTIAL,  # [B·n_t_programs, C·K] fp32: this program's Σ dz·x per tap (unused without COMPUTE_DW)
    DB_PARTIAL,  # [B·n_t_programs, C] fp32: this program's Σ dz (unused without COMPUTE_DB)
    T,
    C,
    stride_xb,
    stride_xt,
    stride_hb,
    stride_ht,
    stride_dhb,
    stride_dht,
    stride_dyb,
    stride_dyt,
    stride_dxb,
    stride_dxt,
    stride_wc,
    stride_wk,
    tiles_per_program,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SILU: tl.constexpr,
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    COMPUTE_DH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """A program walks ``tiles_per_program`` consecutive token tiles of one channel block,
    keeping its share of dW and dbias in registers, and writes them once as fp32 partial rows.

    dx at token t needs dz at t..t+K-1. A tile computes dz once at its BLOCK_T tokens and
    *owns* the first ``BLOCK_T - (K-1)`` of them: the next tile starts at the first token it
    does not own, so the tile's last K-1 tokens are computed again there. dz at t+s is this
    tile's dz moved up s rows by ``tl.gather``, where recomputing it per shift would cost K
    pre-activations a token instead of one.
    """
    OWNED: tl.constexpr = BLOCK_T - (K - 1)
    pid_t = tl.program_id(0)
    b = tl.program_id(2)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    x_base = X + b.to(tl.int64) * stride_xb
    h_base = H + b.to(tl.int64) * stride_hb
    dy_base = DY + b.to(tl.int64) * stride_dyb
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    # dW and dbias build up as fp32 tiles, summed over tokens once after the loop (a sum per
    # tile and tap would cross warps every tile). One tile per tap, unrolled up to
    # MAX_KERNEL_SIZE = 8; the compiler drops those past K.
    zero = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    db_acc, dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7 = zero, zero, zero, zero, zero, zero, zero, zero, zero

    for i in range(tiles_per_program):
        local = tl.arange(0, BLOCK_T)
        rows = (pid_t * tiles_per_program + i) * OWNED + local
        row_ok = rows < T
        owned = row_ok & (local < OWNED)
        if HAS_SEQ:
            start = tl.load(SEQ_START + rows, mask=row_ok, other=0)
        else:
            start = tl.zeros([BLOCK_T], dtype=tl.int32)
        dz = _grad_pre_activation(x_base, stride_xt, h_base, stride_ht, dy_base, stride_dyt, W, stride_wc, stride_wk,
                                  bias, rows, start, row_ok, cols, col_mask, K, HAS_INIT, SILU, BLOCK_T, BLOCK_C)
        if COMPUTE_DH:
            if (pid_t == 0) & (i == 0):  # the first tile holds dz at tokens 0..K-2, all the initial rows reach
                dh = _initial_rows_grad(dz, W, stride_wc, stride_wk, cols, col_mask, K, BLOCK_T, BLOCK_C)
                mask = (local < K - 1)[:, None] & col_mask[None, :]
                tl.store(DH + b.to(tl.int64) * stride_dhb + local.to(tl.int64)[:, None] * stride_dht + cols[None, :],
                         dh.to(DH.dtype.element_ty), mask=mask)
        if COMPUTE_DB or COMPUTE_DW:
            dz_owned = tl.where(owned[:, None], dz, 0.0)  # each token counted by one tile only
        if COMPUTE_DB:
            db_acc += dz_owned
        if COMPUTE_DW:
            dw0 += _tap_product(x_base, stride_xt, h_base, stride_ht, dz_owned, rows, start, owned, cols,
                                col_mask, 0, K, HAS_INIT)
            if K > 1:
                dw1 += _tap_product(x_base, stride_xt, h_base, stride_ht, dz_owned, rows, start, owned, cols,
                                    col_mask, 1, K, HAS_INIT)
            if K > 2:
                dw2 += _tap_product(x_base, stride_xt, h_base, stride_ht, dz_owned, rows, start, owned, cols,
                                    col_mask, 2, K, HAS_INIT)
            if K > 3:
                dw3 += _tap_product(x_base, stride_xt, h_base, stride_ht, dz_owned, rows, start, owned, cols,
                                    col_mask, 3, K, HAS_INIT)
            if K > 4:
                dw4 += _tap_product(x_base, stride_xt, h_base, stride_ht, dz_owned, rows, start, owned, cols,
                                    col_mask, 4, K, HAS_INIT)
            if K > 5:
                dw5 += _tap_product(x_base, stride_xt, h_base, stride_ht, dz_owned, rows, start, owned, cols,
                                    col_mask, 5, K, HAS_INIT)
            if K > 6:
                dw6 += _tap_product(x_base, stride_xt, h_base, stride_ht, dz_owned, rows, start, owned, cols,
                                    col_mask, 6, K, HAS_INIT)
            if K > 7:
                dw7 += _tap_product(x_base, stride_xt, h_base, stride_ht, dz_owned, rows, start, owned, cols,
                                    col_mask, 7, K, HAS_INIT)
        if COMPUTE_DX:
            dx = dz * _filter_tap(W, stride_wc, stride_wk, cols, col_mask, K - 1)[None, :]
            for s in tl.static_range(1, K):
                ahead = _rows_ahead(s, BLOCK_T)
                dz_s = tl.gather(dz, tl.broadcast_to(ahead[:, None], (BLOCK_T, BLOCK_C)), axis=0)  # 0 past T
                if HAS_SEQ:  # dz at t+s belongs to a later sequence: it does not reach t
                    dz_s = tl.where((tl.gather(start, ahead, axis=0) <= rows)[:, None], dz_s, 0.0)
                dx += dz_s * _filter_tap(W, stride_wc, stride_wk, cols, col_mask, K - 1 - s)[None, :]
            mask = owned[:, None] & col_mask[None, :]
            tl.store(DX + b.to(tl.int64) * stride_dxb + rows.to(tl.int64)[:, None] * stride_dxt + cols[None, :],
                     dx.to(DX.dtype.element_ty), mask=mask)

    partial = (b * tl.num_programs(0) + pid_t).to(tl.int64)
    if COMPUTE_DW:
        dw_row = DW_PARTIAL + partial * C * K + cols * K  # [C, K] row-major, like the weight
        tl.store(dw_row, tl.sum(dw0, axis=0), mask=col_mask)
        if K > 1:
            tl.store(dw_row + 1, tl.sum(dw1, axis=0), mask=col_mask)
        if K > 2:
            tl.store(dw_row + 2, tl.sum(dw2, axis=0), mask=col_mask)
        if K > 3:
            tl.store(dw_row + 3, tl.sum(dw3, axis=0), mask=col_mask)
        if K > 4:
            tl.store(dw_row + 4, tl.sum(dw4, axis=0), mask=col_mask)
        if K > 5:
            tl.store(dw_row + 5, tl.sum(dw5, axis=0), mask=col_mask)
        if K > 6:
            tl.store(dw_row + 6, tl.sum(dw6, axis=0), mask=col_mask)
        if K > 7:
            tl.store(dw_row + 7, tl.sum(dw7, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PARTIAL + partial * C + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration: a default for any GPU; python -m q35lab tune causal_conv1d records a GPU's own
# in ops/tuned.json. Under the interpreter num_warps is ignored.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    block_t: int  # forward tile: tokens (power of two)
    block_c: int  # forward tile: channels (power of two)
    num_warps: int
    bwd_block_t: int  # backward, dx alone (a frozen conv weight, as in LoRA): tokens, >= K
    bwd_block_c: int
    bwd_warps: int
    dw_block_t: int  # backward with dW or dbias: it also holds K dW tiles, so smaller tiles win
    dw_block_c: int
    dw_warps: int
    dw_programs_per_sm: int  # with dW/dbias: programs per multiprocessor, each walking many tiles

    def __post_init__(self):
        for name in ("block_t", "block_c", "num_warps", "bwd_block_t", "bwd_block_c", "bwd_warps",
                     "dw_block_t", "dw_block_c", "dw_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name}: expected a power of two, got {value}")
        if self.dw_programs_per_sm < 1:
            raise ValueError(f"LaunchConfig.dw_programs_per_sm: expected >= 1, got {self.dw_programs_per_sm}")


@functools.lru_cache(maxsize=64)
def launch_config(C: int, K: int) -> LaunchConfig:
    """This GPU's ``tuned.json`` entry for ``C`` channels and a ``K``-tap filter (key ``"CxK"``,
    written by ``python -m q35lab tune causal_conv1d``) over the default's other fields, else the
    default. A tuning script passes ``config=`` to the host functions instead."""
    return tuned_config("causal_conv1d", f"{C}x{K}", _default_config(C, K))


def _default_config(C: int, K: int) -> LaunchConfig:
    """Tiles of 2,048 values at 2 warps (32 a thread), what tuning picks on Hopper for the
    Qwen3.5 widths: forward 16 tokens × 128 channels (256 contiguous bytes a token in bf16);
    dx 64 × 32, whose longer token run amortises the K − 1 halo each tile reloads; dW 16 × 64
    (it keeps K more fp32 tiles), 16 programs an SM so each sums few tiles. Narrower C shrinks
    the channel block. Larger tiles spill registers. The interpreter, which runs each program as
    a Python loop, gets forward tiles of 32 tokens: half the programs."""
    block_c = min(128, triton.next_power_of_2(max(C, 1)))
    return LaunchConfig(
        block_t=32 if runtime.INTERPRET else 16, block_c=block_c, num_warps=2,
        bwd_block_t=64, bwd_block_c=min(32, block_c), bwd_warps=2,
        dw_block_t=16, dw_block_c=min(64, block_c), dw_warps=2, dw_programs_per_sm=16,
    )


# --------------------------------------------------------------------------------------------
# Host functions: checked, channels-last tensors in, tensors out. No autograd here.
# --------------------------------------------------------------------------------------------
def _bias_and_seq(weight2d, bias, seq_start):
    """Pointers for the optional arguments: a real tensor stands in for an absent one."""
    return (weight2d if bias is None else bias), (weight2d if seq_start is None else seq_start)


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight2d: torch.Tensor,
    bias: torch.Tensor | None,
    seq_start: torch.Tensor | None,
    silu: bool,
    config: LaunchConfig | None = None,
    initial_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y`` for ``x`` ``[B, T, C]`` with ``x.stride(2) == 1``, ``weight2d`` ``[C, K]``,
    ``seq_start`` ``[T]`` int32 or None, ``initial_rows`` ``[B, K-1, C]`` channels-contiguous or
    None (not with ``seq_start``); a new contiguous tensor of ``x.dtype``."""
    B, T, C = x.shape
    K = weight2d.shape[1]
    y = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    config = config or launch_config(C, K)
    bias_arg, seq_arg = _bias_and_seq(weight2d, bias, seq_start)
    h = x if initial_rows is None else initial_rows
    grid = (triton.cdiv(T, config.block_t), triton.cdiv(C, config.block_c), B)
    _causal_conv1d_fwd_kernel[grid](
        x, weight2d, bias_arg, seq_arg, h, y, T, C,
        x.stride(0), x.stride(1), h.stride(0), h.stride(1), y.stride(0), y.stride(1),
        weight2d.stride(0), weight2d.stride(1),
        K=K, HAS_BIAS=bias is not None, HAS_SEQ=seq_start is not None, HAS_INIT=initial_rows is not None, SILU=silu,
        BLOCK_T=config.block_t, BLOCK_C=config.block_c, num_warps=config.num_warps,
    )
    return y


def causal_conv1d_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight2d: torch.Tensor,
    bias: torch.Tensor | None,
    seq_start: torch.Tensor | None,
    silu: bool,
    *,
    compute_dx: bool = True,
    compute_dw: bool = True,
    compute_db: bool = True,
    config: LaunchConfig | None = None,
    initial_rows: torch.Tensor | None = None,
    compute_dh: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight2d, dbias, dinitial_rows)``, each None unless asked for (``dbias`` also None
    without bias, ``dinitial_rows`` without ``initial_rows``).

    ``dy`` and ``x`` are ``[B, T, C]`` with unit channel stride. With dW or dbias the token
    axis is split over a few programs per SM, each walking a contiguous run of tiles and writing
    one fp32 partial row; the partials are summed once afterwards in a fixed order:
    deterministic, no atomics. dx alone gets one program per tile.
    """
    B, T, C = x.shape
    K = weight2d.shape[1]
    compute_db = compute_db and bias is not None
    compute_dh = compute_dh and initial_rows is not None
    dx = torch.empty((B, T, C), dtype=x.dtype, device=x.device) if compute_dx else None
    if not (compute_dx or compute_dw or compute_db or compute_dh):
        return None, None, None, None
    if B * T * C == 0:
        dw = torch.zeros_like(weight2d) if compute_dw else None
        db = torch.zeros_like(bias) if compute_db else None
        dh = torch.zeros_like(initial_rows) if compute_dh else None
        return dx, dw, db, dh
    # every initial row's gradient is written by the first tile of each channel block (K-1 rows)
    dh = torch.empty_like(initial_rows, memory_format=torch.contiguous_format) if compute_dh else None
    config = config or launch_config(C, K)
    with_partials = compute_dw or compute_db
    block_t, block_c, warps = ((config.dw_block_t, config.dw_block_c, config.dw_warps) if with_partials
                               else (config.bwd_block_t, config.bwd_block_c, config.bwd_warps))
    if block_t < K:
        field = "dw_block_t" if with_partials else "bwd_block_t"
        raise ValueError(f"config.{field}: expected at least K = {K} (a backward tile owns "
                         f"{field} - (K-1) of its tokens), got {block_t}")
    n_tiles = triton.cdiv(T, block_t - (K - 1))
    n_cblocks = triton.cdiv(C, block_c)
    if with_partials:
        programs = persistent_programs(x.device, config.dw_programs_per_sm)
        t_programs = max(1, min(n_tiles, programs // (n_cblocks * B)))
        tiles_per_program = min(MAX_TILES_PER_PROGRAM, triton.cdiv(n_tiles, t_programs))
        t_programs = triton.cdiv(n_tiles, tiles_per_program)
    else:
        t_programs, tiles_per_program = n_tiles, 1
    n_partials = B * t_programs
    f32 = dict(dtype=torch.float32, device=x.device)
    dw_partial = torch.empty((n_partials, C * K), **f32) if compute_dw else None
    db_partial = torch.empty((n_partials, C), **f32) if compute_db else None
    bias_arg, seq_arg = _bias_and_seq(weight2d, bias, seq_start)
    dummy = weight2d
    h = x if initial_rows is None else initial_rows
    dh_arg = dh if compute_dh else x
    _causal_conv1d_bwd_kernel[(t_programs, n_cblocks, B)](
        x, weight2d, bias_arg, seq_arg, h, dy,
        dx if compute_dx else dummy, dh_arg, dw_partial if compute_dw else dummy, db_partial if compute_db else dummy,
        T, C, x.stride(0), x.stride(1), h.stride(0), h.stride(1), dh_arg.stride(0), dh_arg.stride(1),
        dy.stride(0), dy.stride(1),
        dx.stride(0) if compute_dx else 0, dx.stride(1) if compute_dx else 0,
        weight2d.stride(0), weight2d.stride(1), tiles_per_program,
        K=K, HAS_BIAS=bias is not None, HAS_SEQ=seq_start is not None, HAS_INIT=initial_rows is not None,
        SILU=silu, COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, COMPUTE_DH=compute_dh,
        BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
    )
    dw = sum_partials(dw_partial, weight2d.dtype).view(C, K) if compute_dw else None
    db = sum_partials(db_partial, bias.dtype) if compute_db else None
    return dx, dw, db, dh


# --------------------------------------------------------------------------------------------
# Custom ops, autograd and functional form.
# --------------------------------------------------------------------------------------------
def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its channels are contiguous (any token/batch stride), else one copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


# Custom ops (torch.library): torch.compile traces through them with their fake implementations,
# and autograd connects the two. The real implementations choose the launch configuration at run
# time; an explicit one travels as its fields (a custom op takes no dataclass).
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(LaunchConfig))


def _config_arg(config: LaunchConfig | None) -> list[int] | None:
    return None if config is None else [getattr(config, name) for name in _CONFIG_FIELDS]


@torch.library.custom_op("q35lab::causal_conv1d_fwd", mutates_args=())
def causal_conv1d_fwd_op(
    x: torch.Tensor, weight2d: torch.Tensor, bias: torch.Tensor | None, seq_start: torch.Tensor | None,
    initial_rows: torch.Tensor | None, silu: bool, final: bool, config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, final rows)``: the final rows (the last K-1 rows of ``[h | x]``) a new ``[B, K-1, C]``
    tensor with ``final``, else empty (``[0]``: a custom op returns no None)."""
    x = _channels_last(x)  # the caller's already are; a compiled graph may hand the op other strides
    h = None if initial_rows is None else _channels_last(initial_rows)
    cfg = None if config is None else LaunchConfig(*config)
    y = causal_conv1d_fwd(x, weight2d, bias, seq_start, silu, cfg, initial_rows=h)
    return y, (_final_rows(x, h, weight2d.shape[1]) if final else x.new_empty(0))


@causal_conv1d_fwd_op.register_fake
def _(x, weight2d, bias, seq_start, initial_rows, silu, final, config):
    B, _, C = x.shape
    return x.new_empty(x.shape), x.new_empty((B, weight2d.shape[1] - 1, C) if final else (0,))


@torch.library.custom_op("q35lab::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight2d: torch.Tensor, bias: torch.Tensor | None,
    seq_start: torch.Tensor | None, initial_rows: torch.Tensor | None, dfinal: torch.Tensor | None, silu: bool,
    compute_dx: bool, compute_dw: bool, compute_db: bool, compute_dh: bool, config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight2d, dbias, dinitial_rows)``, each empty (``[0]``) unless asked for (``dbias``
    also without bias, ``dinitial_rows`` without initial rows); ``dfinal``, the final rows'
    gradient, is added where those rows came from."""
    x = _channels_last(x)
    h = None if initial_rows is None else _channels_last(initial_rows)
    dx, dw, db, dh = causal_conv1d_bwd(
        _channels_last(dy), x, weight2d, bias, seq_start, silu, compute_dx=compute_dx, compute_dw=compute_dw,
        compute_db=compute_db, config=None if config is None else LaunchConfig(*config), initial_rows=h,
        compute_dh=compute_dh,
    )
    if dfinal is not None:  # the final rows are the last K-1 rows of [h | x]: their gradient lands there
        T, kept = x.shape[1], dfinal.shape[1]
        if dx is not None and T:
            dx[:, max(T - kept, 0):] += dfinal[:, max(kept - T, 0):].to(dx.dtype)
        if dh is not None and T < kept:
            dh[:, T:] += dfinal[:, :kept - T].to(dh.dtype)
    # contiguous, as the fake implementation promises (the zero-size cases copy the inputs' strides)
    return tuple(x.new_empty(0) if g is None else g.contiguous() for g in (dx, dw, db, dh))


@causal_conv1d_bwd_op.register_fake
def _(dy, x, weight2d, bias, seq_start, initial_rows, dfinal, silu, compute_dx, compute_dw, compute_db, compute_dh,
      config):
    def grad(like, wanted):
        return like.new_empty(like.shape) if wanted and like is not None else x.new_empty(0)

    return (grad(x, compute_dx), grad(weight2d, compute_dw), grad(bias, compute_db),
            grad(initial_rows, compute_dh))


def _setup_context(ctx, inputs, output):
    """Saves ``x`` (a reference, no copy when channels-last), the weight and bias, with
    ``cu_seqlens`` the int32 sequence start of every token, and the initial rows if any; ``z`` is
    recomputed in the backward."""
    x, weight2d, bias, seq_start, initial_rows, ctx.silu, ctx.final, ctx.config = inputs
    ctx.save_for_backward(x, weight2d, bias, seq_start, initial_rows)


def _backward(ctx, dy, dfinal):
    x, weight2d, bias, seq_start, h = ctx.saved_tensors
    needs_dx, needs_dw, needs_db, _, needs_dh = ctx.needs_input_grad[:5]
    if dy is None:  # only the final rows were used
        dy = torch.zeros_like(x)
    dx, dw, db, dh = causal_conv1d_bwd_op(
        dy, x, weight2d, bias, seq_start, h, dfinal if ctx.final else None, ctx.silu,
        needs_dx, needs_dw, needs_db and bias is not None, needs_dh and h is not None, ctx.config,
    )
    return ((dx if needs_dx else None), (dw if needs_dw else None), (db if needs_db and bias is not None else None),
            None, (dh if needs_dh and h is not None else None), None, None, None)


causal_conv1d_fwd_op.register_autograd(first_order_only(_backward, op="causal_conv1d"), setup_context=_setup_context)


def _final_rows(x: torch.Tensor, h: torch.Tensor | None, K: int) -> torch.Tensor:
    """The last K-1 rows of ``[h | x]`` (zeros for an absent ``h``), a new ``[B, K-1, C]`` tensor:
    never a view of ``x``, which a carry kept for the backward would keep alive whole."""
    B, T, C = x.shape
    if T >= K - 1:
        return x[:, T - (K - 1):].clone(memory_format=torch.contiguous_format)
    before = x.new_zeros(B, K - 1 - T, C) if h is None else h[:, T:].to(x.dtype)
    return torch.cat([before, x], dim=1)


def _check_weight(weight: torch.Tensor, C: int) -> int:
    """The filter width ``K`` of a ``[C, K]`` or ``[C, 1, K]`` weight, else ``ValueError``."""
    shape = tuple(weight.shape)
    ok = (weight.dim() == 2 or (weight.dim() == 3 and shape[1] == 1)) and shape[0] == C
    if not ok:
        raise ValueError(
            f"weight: expected shape [C, K] or [C, 1, K] with C = {C} (the last dimension of x), got {shape}"
        )
    K = shape[-1]
    if not 1 <= K <= MAX_KERNEL_SIZE:
        raise ValueError(f"weight: kernel width K = {K} is not supported; expected 1 <= K <= {MAX_KERNEL_SIZE}")
    return K


@opaque_to_compile  # its checks read the values back to the host: a graph break with cu_seqlens only
def _sequence_starts(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Check ``cu_seqlens`` (one device sync) and return each token's sequence start, int32 [T]."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens: expected a 1-D tensor of N+1 >= 2 cumulative sequence starts, "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    if B != 1:
        raise ValueError(f"cu_seqlens: a packed batch needs x of batch size 1, got B = {B}")
    cu = cu_seqlens.to(torch.int64)
    first, last, decreasing = torch.stack([cu[0], cu[-1], (cu.diff() < 0).any().to(torch.int64)]).tolist()
    if first != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, got {first}")
    if last != T:
        raise ValueError(f"cu_seqlens: expected to end at T = {T} (x.shape[1]), got {last}")
    if decreasing:
        raise ValueError("cu_seqlens: expected non-decreasing values (cumulative sequence starts)")
    tokens = torch.arange(T, device=cu.device)
    return cu[torch.searchsorted(cu, tokens, right=True) - 1].to(torch.int32)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    initial_rows: torch.Tensor | None = None,
    return_final_rows: bool = False,
    config: LaunchConfig | None = None,
):
    """Depthwise causal conv1d over tokens + SiLU, channels last, fp32 inside, rounded once.

    ``y[b, t, c] = act(bias[c] + Σ_k weight[c, k] · x[b, t-(K-1)+k, c])``, x before the
    sequence start taken as 0 — what transformers' Qwen3.5 GatedDeltaNet computes with
    ``causal_conv1d_fn(mixed_qkv.transpose(1, 2), conv1d.weight.squeeze(1), conv1d.bias,
    activation)`` transposed back, without either transpose.

    Args:
        x: ``[B, T, C]``, bf16, fp16 or fp32; any token/batch strides when the channels are
            contiguous (a column slice of a wider in_proj output is read in place).
        weight: ``[C, K]`` (``conv1d.weight.squeeze(1)``) or ``[C, 1, K]`` (``conv1d.weight``),
            ``1 <= K <= 8``; any of the three float dtypes; its gradient has its dtype and shape.
        bias: ``[C]`` or None.
        activation: ``"silu"`` / ``"swish"`` (the same) or None.
        cu_seqlens: int32/int64 ``[N+1]`` cumulative sequence starts of a packed batch
            (``B = 1``, from 0 to T, non-decreasing); no value crosses a boundary. Checking it
            synchronises with the device once.
        initial_rows: ``[B, K-1, C]``, the K-1 input rows before x's first (a long sequence
            convolved segment by segment hands them on), read where x would be 0; not with
            ``cu_seqlens``. Its gradient flows back.
        return_final_rows: also return the last K-1 rows of ``[initial_rows | x]`` (zeros for
            absent initial rows), the next segment's ``initial_rows``; its gradient flows back
            into ``x`` (and ``initial_rows``) without the ``[K-1+T, C]`` concatenation.
        config: launch configuration; None for ``launch_config(C, K)``.

    Returns:
        ``y``, a new contiguous ``[B, T, C]`` tensor of ``x.dtype``; with ``return_final_rows``,
        ``(y, final_rows)``. Gradients flow to ``x``, ``weight``, ``bias`` and ``initial_rows``
        (each skipped when it does not require grad).

    Raises:
        TypeError: a tensor argument not a bf16/fp16/fp32 tensor, ``cu_seqlens`` not an int32/int64
            tensor, ``return_final_rows`` not a bool, ``config`` not a ``LaunchConfig``.
        ValueError: shapes that do not match, a filter wider than 8 taps, an unknown ``activation``,
            ``cu_seqlens`` not cumulative starts from 0 to T (or with ``B > 1`` or ``initial_rows``),
            tensors on different devices.
    """
    check_float_tensor("x", x)
    check_float_tensor("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x: expected a 3-D tensor [B, T, C] (channels last), got shape {tuple(x.shape)}")
    B, T, C = x.shape
    K = _check_weight(weight, C)
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        check_float_tensor("bias", bias)
        if bias.dim() != 1 or bias.shape[0] != C:
            raise ValueError(f"bias: expected a 1-D tensor of size {C} (the last dimension of x), "
                             f"got shape {tuple(bias.shape)}")
        tensors["bias"] = bias
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    if cu_seqlens is not None and isinstance(cu_seqlens, torch.Tensor):
        tensors["cu_seqlens"] = cu_seqlens
    if initial_rows is not None:
        check_float_tensor("initial_rows", initial_rows)
        if tuple(initial_rows.shape) != (B, K - 1, C):
            raise ValueError(f"initial_rows: expected shape {(B, K - 1, C)} ([B, K-1, C] for x {tuple(x.shape)} and a "
                             f"{K}-tap filter), got {tuple(initial_rows.shape)}")
        if cu_seqlens is not None:
            raise ValueError("initial_rows: not with cu_seqlens (a packed batch's sequences each start from zeros)")
        tensors["initial_rows"] = initial_rows
    if config is not None and not isinstance(config, LaunchConfig):
        raise TypeError(f"config: expected a LaunchConfig or None, got {type(config).__name__}")
    check_bool("return_final_rows", return_final_rows)
    check_kernel_device(**tensors)
    seq_start = None if cu_seqlens is None else _sequence_starts(cu_seqlens, B, T)
    # what the backward reads: x and the initial rows channels-last (no copy when they are), the weight [C, K]
    h = None if initial_rows is None else _channels_last(initial_rows)
    y, final = causal_conv1d_fwd_op(_channels_last(x), weight.reshape(C, K), bias, seq_start, h,
                                    activation is not None, return_final_rows, _config_arg(config))
    return (y, final) if return_final_rows else y
