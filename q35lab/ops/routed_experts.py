"""The routed experts of Qwen3.5's MoE layers: each token through its top-k experts' SwiGLU,
weighted by the router and summed.

transformers' ``Qwen3_5MoeExperts`` computes, for a token ``x_t`` routed to experts
``e_1 … e_K`` with weights ``w_1 … w_K`` (K = 8 of 256 in the 35B-A3B)::

    out_t = Σ_k w_k · down_{e_k}( silu(gate_{e_k}(x_t)) · up_{e_k}(x_t) )

Its grouped-GEMM path gathers the T·K (token, expert) pairs sorted by expert, runs two grouped
GEMMs, then weights, un-sorts and sums them with PyTorch ops on ``[T·K, hidden]`` tensors (and
applies masks meant for expert parallelism, even on one GPU): memory-bound passes over tensors K
times the size of the layer's input.

Here the same sum is computed in rows ``s = 0 … S−1`` (S = T·K), sorted by expert::

    xs[s]  = x[token[s]]                     gather_rows        (Triton)
    gu     = xs · W_gate_upᵀ  per expert     grouped GEMM       (torch._grouped_mm)
    h[s]   = w[s] · silu(g[s]) · u[s]        weighted_swiglu    (Triton; gu = [g | u])
    y      = h · W_downᵀ      per expert     grouped GEMM
    out[t] = Σ_k y[slot[t, k]]               sum_slots          (Triton, fp32 sum, one rounding)

The router's weight moves before the down projection (``w·(h·W) = (w·h)·W``: the projection is
linear), where a row is ``I`` = 512 wide instead of ``hidden`` = 2048, and it costs nothing
there: the SwiGLU kernel reads and writes those rows anyway. ``gather_rows`` and ``sum_slots``
are each other's adjoint, so each one's backward is the other's kernel::

    d x[t]  = Σ_k d xs[slot[t, k]]           (sum_slots: deterministic, no atomics)
    d y[s]  = d out[token[s]]                (gather_rows)
    d w[s]  = Σ_j d h[s, j] · silu(g[s, j]) · u[s, j]
    d g     = w · dh · u · σ(g) · (1 + g · (1 − σ(g)))     d u = w · dh · silu(g)

The expert weights are frozen (a LoRA fine-tune): the grouped GEMMs' backward makes the input
gradient only, and no node keeps ``xs`` or ``y`` (``[S, hidden]``) for the backward; the SwiGLU
node keeps ``gu`` (``[S, 2I]``) and the router's weights.

LoRA on the experts (``gate_up_lora``, ``down_lora``: per-expert factors ``A [E, r, in]``,
``B [E, out, r]`` and a scaling ``s``, what PEFT's ``target_parameters`` trains) adds a rank-r path
to a projection, on each expert's rows, without ever forming ``W + s·B·A``::

    ts     = xs · (s·A_e)ᵀ                   grouped GEMM, [S, r]
    y      = xs · W_eᵀ + ts · B_eᵀ           two grouped GEMMs, summed

    d ts   = dy · B_e                        grouped GEMM with a rank-r output
    d B_e  = Σ_{s ∈ e} dy[s]ᵀ ts[s]          d A_e = s · Σ_{s ∈ e} d ts[s]ᵀ xs[s]   (grouped over rows)
    d xs   = dy · W_e + d ts · (s·A_e)

The gate/up node keeps ``x`` (``[T, hidden]``, the layer's input, alive anyway) and gathers ``xs``
again in backward rather than keeping the K times larger ``xs``; the down node keeps ``h``
(``[S, I]``); both keep ``ts`` (``[S, r]``). The factors are cast to the expert weights' dtype, as
PEFT casts them before it adds the delta, and their gradients come back in the factors' dtype.

Layering: ``_gather_rows_kernel``, ``_sum_slots_kernel``, ``_weighted_swiglu_*_kernel`` (Triton)
→ host functions → ``GatherRows`` / ``SumSlots`` / ``WeightedSwiGLU`` / ``FrozenGroupedLinear`` /
``LoRAGroupedLinear`` (autograd) → ``routed_experts`` (functional), checked against
``routed_experts_ref`` (with LoRA: PEFT's dense ``W + s·B·A``, then transformers' loop).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._autograd import first_order_only
from ._checks import check_float_tensor, check_kernel_device, check_real, check_same_device
from ._compile import opaque_to_compile
from ._launch import RowTiles, row_tiles
from ._tuned import tuned_config

__all__ = ["ExpertLoRA", "Routing", "routing", "routed_experts", "routed_experts_ref", "gather_rows", "sum_slots",
           "weighted_swiglu", "LaunchConfig", "launch_config"]


class ExpertLoRA(NamedTuple):
    """One projection's LoRA on every expert: its delta is ``scaling · lora_B[e] · lora_A[e]``.

    ``lora_A``: ``[E, r, in]``; ``lora_B``: ``[E, out, r]`` (any strides: PEFT's ``ParamWrapper``
    gives views of its ``lora_A``/``lora_B`` weights); ``scaling``: ``lora_alpha / r`` (or rsLoRA's)."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float


# --------------------------------------------------------------------------------------------
# The reference: transformers' loop over experts, written out (any dtype, fp64 for the exact answer).
# --------------------------------------------------------------------------------------------
def routed_experts_ref(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, gate_up_lora: ExpertLoRA | None = None,
                       down_lora: ExpertLoRA | None = None) -> torch.Tensor:
    """``Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x))`` expert by expert, as transformers' eager
    ``Qwen3_5MoeExperts`` computes it (every product rounded to the input dtype); with LoRA, on the
    dense ``W + s·B·A`` that PEFT's ``ParamWrapper`` builds in the weights' dtype."""
    gate_up_proj, down_proj = _peft_dense(gate_up_proj, gate_up_lora), _peft_dense(down_proj, down_lora)
    out = torch.zeros_like(x)
    for expert in range(gate_up_proj.shape[0]):
        token, k = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(x[token], gate_up_proj[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_proj[expert])
        out = out.index_add(0, token, (y * top_k_weights[token, k, None]).to(out.dtype))
    return out


def _peft_dense(weight: torch.Tensor, lora: ExpertLoRA | None) -> torch.Tensor:
    """PEFT's parametrization of a targeted 3-D parameter: ``baddbmm(W, B, A, alpha=s)``, the factors
    cast to ``W``'s dtype, autocast off."""
    if lora is None:
        return weight
    with torch.autocast(device_type=weight.device.type, enabled=False):
        return torch.baddbmm(weight, lora.lora_B.to(weight.dtype), lora.lora_A.to(weight.dtype), alpha=lora.scaling)


# --------------------------------------------------------------------------------------------
# Routing: which row holds which (token, expert) pair. Integer bookkeeping, no gradient.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """The ``S = T·K`` (token, expert) pairs as rows sorted by expert.

    ``order[s]``: the flat slot ``t·K + k`` row ``s`` holds; ``token[s] = order[s] // K``;
    ``slots[t, k]``: the row holding token t's k-th expert (``order``'s inverse);
    ``offsets[e]``: the end of expert e's rows (int32, what ``torch._grouped_mm`` takes)."""

    order: torch.Tensor
    token: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor


def routing(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort the pairs by expert (stable: a token's rows keep their order within an expert)."""
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2:
        raise ValueError(f"top_k_index: expected a [tokens, k] integer tensor, got "
                         f"{getattr(top_k_index, 'shape', type(top_k_index).__name__)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index: expected an integer dtype, got {top_k_index.dtype}")
    with torch.no_grad():
        flat = top_k_index.reshape(-1).long()
        if flat.numel():  # one host sync: an id out of range would make a silently wrong sum
            low, high = torch.stack(torch.aminmax(flat)).tolist()
            if low < 0 or high >= num_experts:
                raise ValueError(f"top_k_index: expected expert ids in [0, {num_experts}), got ids in "
                                 f"[{low}, {high}] (expert parallelism's sentinel ids are not supported)")
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(
            0, flat, torch.ones_like(flat))
        order = torch.argsort(flat, stable=True)
        slots = torch.empty_like(order)
        slots[order] = torch.arange(order.numel(), device=order.device)
        return Routing(order=order, token=order // top_k_index.shape[1], slots=slots.view(top_k_index.shape),
                       offsets=counts.cumsum(0).to(torch.int32))


# --------------------------------------------------------------------------------------------
# Launch configuration: one tile size for the three streaming kernels.
# --------------------------------------------------------------------------------------------
LaunchConfig = RowTiles


@functools.lru_cache(maxsize=64)
def launch_config(width: int) -> LaunchConfig:
    """The launch for rows of ``width``: this GPU's ``tuned.json`` entry over ``row_tiles``'s
    default (a row wider than 1024 is walked by one program: the SwiGLU's weight gradient is a
    sum along the row)."""
    return tuned_config("routed_experts", width, row_tiles(width))


def _grid(n_rows: int, config: LaunchConfig) -> tuple[int]:
    return (triton.cdiv(n_rows, config.block_rows),)


# --------------------------------------------------------------------------------------------
# Kernels. One program = BLOCK_ROWS rows, walked in column blocks of BLOCK_COLS.
# --------------------------------------------------------------------------------------------
@triton.jit
def _rows(n_rows, BLOCK_ROWS: tl.constexpr):
    """This program's rows ``[BLOCK_ROWS, 1]`` (int64: row·stride passes 2³¹ at S = 262144 ×
    2048) and their mask."""
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]
    return rows, rows < n_rows


@triton.jit
def _gather_rows_kernel(SRC, INDEX, DST, n_rows, width, stride_src, stride_dst,
                        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """``DST[r] = SRC[INDEX[r]]``."""
    rows, row_mask = _rows(n_rows, BLOCK_ROWS)
    src_rows = tl.load(INDEX + rows, mask=row_mask, other=0).to(tl.int64)
    for col0 in range(0, width, BLOCK_COLS):
        cols = col0 + tl.arange(0, BLOCK_COLS)[None, :]
        mask = row_mask & (cols < width)
        value = tl.load(SRC + src_rows * stride_src + cols, mask=mask)
        tl.store(DST + rows * stride_dst + cols, value, mask=mask)


@triton.jit
def _sum_slots_kernel(SRC, SLOTS, DST, n_rows, width, stride_src, stride_dst,
                      K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """``DST[t] = Σ_k SRC[SLOTS[t, k]]``, summed in fp32 in the order k = 0 … K−1, rounded once."""
    rows, row_mask = _rows(n_rows, BLOCK_ROWS)
    for col0 in range(0, width, BLOCK_COLS):
        cols = col0 + tl.arange(0, BLOCK_COLS)[None, :]
        mask = row_mask & (cols < width)
        total = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for k in tl.static_range(K):
            src_rows = tl.load(SLOTS + rows * K + k, mask=row_mask, other=0).to(tl.int64)
            total += tl.load(SRC + src_rows * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DST + rows * stride_dst + cols, total.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_swiglu_fwd_kernel(GU, W, H, n_rows, width, stride_gu, stride_h,
                                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """``H[s] = W[s] · silu(G[s]) · U[s]`` with ``G = GU[:, :width]``, ``U = GU[:, width:]``, in
    fp32, rounded once."""
    rows, row_mask = _rows(n_rows, BLOCK_ROWS)
    w = tl.load(W + rows, mask=row_mask, other=0.0).to(tl.float32)
    for col0 in range(0, width, BLOCK_COLS):
        cols = col0 + tl.arange(0, BLOCK_COLS)[None, :]
        mask = row_mask & (cols < width)
        g = tl.load(GU + rows * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + rows * stride_gu + width + cols, mask=mask, other=0.0).to(tl.float32)
        h = w * (g * tl.sigmoid(g)) * u
        tl.store(H + rows * stride_h + cols, h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_swiglu_bwd_kernel(DH, GU, W, DGU, DW, n_rows, width, stride_dh, stride_gu, stride_dgu,
                                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """``DGU = [dg | du]`` and ``DW[s] = Σ_j dh·silu(g)·u`` (the formulas in the module docstring)."""
    rows, row_mask = _rows(n_rows, BLOCK_ROWS)
    w = tl.load(W + rows, mask=row_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_ROWS, 1], dtype=tl.float32)
    for col0 in range(0, width, BLOCK_COLS):
        cols = col0 + tl.arange(0, BLOCK_COLS)[None, :]
        mask = row_mask & (cols < width)
        dh = tl.load(DH + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(GU + rows * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + rows * stride_gu + width + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        a = g * s
        dw += tl.sum(dh * a * u, axis=1)[:, None]
        dg = w * dh * u * s * (1.0 + g * (1.0 - s))
        tl.store(DGU + rows * stride_dgu + cols, dg.to(DGU.dtype.element_ty), mask=mask)
        tl.store(DGU + rows * stride_dgu + width + cols, (w * dh * a).to(DGU.dtype.element_ty), mask=mask)
    tl.store(DW + rows, dw.to(DW.dtype.element_ty), mask=row_mask)


# --------------------------------------------------------------------------------------------
# Host functions: allocate, launch. Inputs are contiguous [rows, width] matrices.
# --------------------------------------------------------------------------------------------
def _gather(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = src.new_empty((index.numel(), src.shape[1]))
    if out.numel():
        config = launch_config(src.shape[1])
        _gather_rows_kernel[_grid(out.shape[0], config)](
            src, index, out, out.shape[0], src.shape[1], src.stride(0), out.stride(0),
            BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, num_warps=config.warps)
    return out


def _sum(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = src.new_empty((slots.shape[0], src.shape[1]))
    if out.numel():
        config = launch_config(src.shape[1])
        _sum_slots_kernel[_grid(out.shape[0], config)](
            src, slots, out, out.shape[0], src.shape[1], src.stride(0), out.stride(0), K=slots.shape[1],
            BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, num_warps=config.warps)
    return out


class GatherRows(torch.autograd.Function):
    """``x[token]`` (``[S, hidden]`` from ``[T, hidden]``); backward: ``Σ_k`` over each token's slots."""

    @staticmethod
    def forward(ctx, x, token, slots):
        ctx.save_for_backward(slots)
        return _gather(x, token)

    @staticmethod
    @first_order_only
    def backward(ctx, d_rows):
        (slots,) = ctx.saved_tensors
        return _sum(d_rows.contiguous(), slots), None, None


class SumSlots(torch.autograd.Function):
    """``out[t] = Σ_k y[slots[t, k]]`` (``[T, hidden]`` from ``[S, hidden]``); backward: gather."""

    @staticmethod
    def forward(ctx, y, slots, token):
        ctx.save_for_backward(token)
        return _sum(y, slots)

    @staticmethod
    @first_order_only
    def backward(ctx, d_out):
        (token,) = ctx.saved_tensors
        return _gather(d_out.contiguous(), token), None, None


class WeightedSwiGLU(torch.autograd.Function):
    """``w · silu(g) · u`` of ``gu = [g | u]`` (``[S, 2I]``) and ``w`` (``[S]``); keeps ``gu``, ``w``."""

    @staticmethod
    def forward(ctx, gu, w):
        width = gu.shape[1] // 2
        h = gu.new_empty((gu.shape[0], width))
        if h.numel():
            config = launch_config(width)
            _weighted_swiglu_fwd_kernel[_grid(h.shape[0], config)](
                gu, w, h, h.shape[0], width, gu.stride(0), h.stride(0),
                BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, num_warps=config.warps)
        ctx.save_for_backward(gu, w)
        return h

    @staticmethod
    @first_order_only
    def backward(ctx, dh):
        gu, w = ctx.saved_tensors
        dh = dh.contiguous()
        width = gu.shape[1] // 2
        dgu, dw = torch.empty_like(gu), torch.empty_like(w)
        if gu.shape[0]:
            config = launch_config(width)
            _weighted_swiglu_bwd_kernel[_grid(gu.shape[0], config)](
                dh, gu, w, dgu, dw, gu.shape[0], width, dh.stride(0), gu.stride(0), dgu.stride(0),
                BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, num_warps=config.warps)
        return dgu, dw


def _aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s address and every stride but its unit one are multiples of 16 bytes, as the
    grouped GEMM's tensor-memory loads require (Qwen3.5's widths, 2048 and 512, are; odd ones not)."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)


def _grouped() -> object:
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _use_grouped_gemm(a: torch.Tensor, b: torch.Tensor, out_width: int) -> bool:
    """Whether PyTorch's grouped GEMM runs ``a`` by ``b``: on a GPU in bf16 with 16-byte aligned
    operands and output rows (one launch for all experts, empty ones skipped). Elsewhere (fp32,
    fp16, odd widths, the CPU) one ``mm`` an expert runs, which reads the offsets on the host."""
    return (a.is_cuda and a.dtype == torch.bfloat16 and _grouped() is not None and _aligned(a) and _aligned(b)
            and out_width * a.element_size() % 16 == 0)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``a[rows of e] · b[e]`` for every expert e (``a``: ``[S, K]``; ``b``: ``[E, K, N]``)."""
    if _use_grouped_gemm(a, b, b.shape[2]):
        return _grouped()(a, b, offs=offsets)
    out = a.new_empty((a.shape[0], b.shape[2]))
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(a[start:end], b[expert], out=out[start:end])
        start = end
    return out


def _grouped_mm_over_rows(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``Σ_{s ∈ e} a[s]ᵀ b[s]`` for every expert e (``a``: ``[S, M]``; ``b``: ``[S, N]``): ``[E, M, N]``,
    zero for an expert without rows. A weight gradient: the grouped GEMM's inner dimension is the rows."""
    if _use_grouped_gemm(a, b, b.shape[1]):
        return _grouped()(a.t(), b, offs=offsets)  # a.t(): column-major [M, S], as the kernel takes it
    out = a.new_zeros((offsets.shape[0], a.shape[1], b.shape[1]))
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(a[start:end].t(), b[start:end], out=out[expert])
        start = end
    return out


class FrozenGroupedLinear(torch.autograd.Function):
    """``x · W[e]ᵀ`` for each expert's rows, with ``W`` (``[E, N, K]``) frozen: the backward
    makes ``dx = dy · W[e]`` only, and nothing but ``W`` is kept for it."""

    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(weight, offsets)
        return _grouped_mm(x, weight.transpose(-2, -1), offsets)

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        weight, offsets = ctx.saved_tensors
        return _grouped_mm(dy.contiguous(), weight, offsets), None, None


class LoRAGroupedLinear(torch.autograd.Function):
    """``y = xs · W[e]ᵀ + s·(xs · A[e]ᵀ) · B[e]ᵀ`` for each expert's rows ``xs``, with ``W``
    (``[E, N, K]``) frozen and the factors ``A`` (``[E, r, K]``), ``B`` (``[E, N, r]``) trained (the
    formulas in the module docstring). ``xs = x[token]`` gathered here when ``token`` is given (the
    gate/up projection, whose backward then sums over ``slots``), else ``x`` itself (the down one)."""

    @staticmethod
    def forward(ctx, x, weight, lora_A, lora_B, scaling, offsets, token, slots):
        # s·A and B in the weights' dtype, contiguous (PEFT's B is a strided view of its lora_B): the
        # scaling folded into A before its one rounding, so that no [S, r] product is rounded twice
        a = (lora_A * scaling).to(weight.dtype).contiguous()
        b = lora_B.to(weight.dtype).contiguous()
        rows = x if token is None else _gather(x, token)
        ts = _grouped_mm(rows, a.transpose(-2, -1), offsets)
        y = _grouped_mm(rows, weight.transpose(-2, -1), offsets)
        y += _grouped_mm(ts, b.transpose(-2, -1), offsets)
        ctx.save_for_backward(x, weight, a, b, ts, offsets, token, slots)
        ctx.scaling, ctx.dtypes = scaling, (lora_A.dtype, lora_B.dtype)
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x, weight, a, b, ts, offsets, token, slots = ctx.saved_tensors
        dy = dy.contiguous()
        need_x, _, need_a, need_b = ctx.needs_input_grad[:4]
        d_a = d_b = dx = None
        if need_b:
            d_b = _grouped_mm_over_rows(dy, ts, offsets).to(ctx.dtypes[1])
        if need_x or need_a:
            dts = _grouped_mm(dy, b, offsets)
        if need_a:  # d A = s · Σ d tsᵀ xs, scaled in the factor's dtype (no second rounding in bf16)
            rows = x if token is None else _gather(x, token)  # gathered again: cheaper than keeping [S, K]
            d_a = _grouped_mm_over_rows(dts, rows, offsets).to(ctx.dtypes[0]).mul_(ctx.scaling)
            del rows
        if need_x:
            d_rows = _grouped_mm(dy, weight, offsets)
            d_rows += _grouped_mm(dts, a, offsets)
            dx = d_rows if token is None else _sum(d_rows, slots)
        return dx, None, d_a, d_b, None, None, None, None


# --------------------------------------------------------------------------------------------
# Functional.
# --------------------------------------------------------------------------------------------
def gather_rows(x: torch.Tensor, route: Routing) -> torch.Tensor:
    """Each token's row once per expert it is routed to, in the routing's (expert-sorted) order."""
    return GatherRows.apply(x, route.token, route.slots)


def sum_slots(y: torch.Tensor, route: Routing) -> torch.Tensor:
    """Each token's rows summed (fp32 accumulation, one rounding): ``gather_rows``' adjoint."""
    return SumSlots.apply(y, route.slots, route.token)


def weighted_swiglu(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights[:, None] · silu(g) · u`` for ``gate_up = [g | u]``, rounded once."""
    return WeightedSwiGLU.apply(gate_up, weights)


def _check(x, top_k_index, top_k_weights, gate_up_proj, down_proj) -> None:
    check_float_tensor("x", x)
    if not isinstance(top_k_index, torch.Tensor):
        raise TypeError(f"top_k_index: expected an integer tensor, got {type(top_k_index).__name__}")
    check_float_tensor("top_k_weights", top_k_weights)
    check_float_tensor("gate_up_proj", gate_up_proj)
    check_float_tensor("down_proj", down_proj)
    if x.dim() != 2:
        raise ValueError(f"x: expected [tokens, hidden], got shape {tuple(x.shape)}")
    if top_k_weights.shape != top_k_index.shape or top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index and top_k_weights: expected both [{x.shape[0]}, k] (one row a token), got "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    experts, two_i, hidden = gate_up_proj.shape if gate_up_proj.dim() == 3 else (None, None, None)
    if hidden != x.shape[1] or two_i % 2:
        raise ValueError(f"gate_up_proj: expected [experts, 2·intermediate, {x.shape[1]}], "
                         f"got {tuple(gate_up_proj.shape)}")
    if down_proj.shape != (experts, x.shape[1], two_i // 2):
        raise ValueError(f"down_proj: expected {(experts, x.shape[1], two_i // 2)}, got {tuple(down_proj.shape)}")
    if gate_up_proj.requires_grad or down_proj.requires_grad:
        raise ValueError("gate_up_proj, down_proj: expected frozen expert weights (requires_grad=False); "
                         "routed_experts makes no weight gradient (use transformers' experts to train them)")
    check_kernel_device(x=x, top_k_index=top_k_index, top_k_weights=top_k_weights,
                        gate_up_proj=gate_up_proj, down_proj=down_proj)


def _check_lora(name: str, lora: object, weight: torch.Tensor) -> ExpertLoRA | None:
    """``lora`` as an ``ExpertLoRA`` whose factors fit ``weight`` (``[E, out, in]``), or None."""
    if lora is None:
        return None
    if not isinstance(lora, tuple) or len(lora) != 3:
        raise TypeError(f"{name}: expected None or (lora_A, lora_B, scaling) (an ExpertLoRA), got "
                        f"{type(lora).__name__}{f' of {len(lora)}' if isinstance(lora, tuple) else ''}")
    lora_A = check_float_tensor(f"{name}.lora_A", lora[0])
    lora_B = check_float_tensor(f"{name}.lora_B", lora[1])
    scaling = check_real(f"{name}.scaling", lora[2], what="the LoRA scaling (lora_alpha / r)")
    experts, out, inner = weight.shape
    rank = lora_A.shape[1] if lora_A.dim() == 3 else None
    if lora_A.dim() != 3 or lora_A.shape[0] != experts or lora_A.shape[2] != inner or rank == 0:
        raise ValueError(f"{name}.lora_A: expected [{experts}, r, {inner}] (experts, rank, in), "
                         f"got {tuple(lora_A.shape)}")
    if lora_B.shape != (experts, out, rank):
        raise ValueError(f"{name}.lora_B: expected {(experts, out, rank)} (experts, out, rank), "
                         f"got {tuple(lora_B.shape)}")
    check_same_device(**{f"{name}.lora_A": lora_A, f"{name}.lora_B": lora_B, "the expert weights": weight})
    return ExpertLoRA(lora_A, lora_B, scaling)


@opaque_to_compile
def routed_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, gate_up_lora: ExpertLoRA | None = None,
                   down_lora: ExpertLoRA | None = None) -> torch.Tensor:
    """A MoE layer's routed experts: ``y_t = Σ_k w_tk · down_e(silu(gate_e(x_t)) · up_e(x_t))``,
    ``e = top_k_index[t, k]``; with LoRA, each projection ``x·W_eᵀ + s·(x·A_eᵀ)·B_eᵀ``.

    Grouped GEMMs over tokens sorted by expert; computes in the weights' dtype (as transformers
    casts to it). The expert weights are frozen: gradients flow to ``x``, ``top_k_weights`` and the
    LoRA factors (never through a dense ``W + s·B·A``).

    Args:
        x (Tensor): ``[T, hidden]``; bf16, fp16 or fp32.
        top_k_index (Tensor): ``[T, K]`` integer expert ids in ``[0, E)``, from the router.
        top_k_weights (Tensor): ``[T, K]``, the router's weights; bf16, fp16 or fp32.
        gate_up_proj (Tensor): ``[E, 2I, hidden]``, gate rows first; frozen.
        down_proj (Tensor): ``[E, hidden, I]``; frozen.
        gate_up_lora (ExpertLoRA, optional): ``(lora_A [E, r, hidden], lora_B [E, 2I, r], scaling)``.
        down_lora (ExpertLoRA, optional): ``(lora_A [E, r, I], lora_B [E, hidden, r], scaling)``.

    Returns:
        Tensor: ``[T, hidden]`` of ``x``'s dtype.

    Raises:
        TypeError: a float argument not a bf16/fp16/fp32 tensor, ``top_k_index`` not an integer tensor,
            a LoRA not ``(lora_A, lora_B, scaling)`` or its scaling not a number.
        ValueError: shapes that do not match, an expert id out of range (checked with one host sync),
            trainable expert weights, tensors on different devices.
    """
    _check(x, top_k_index, top_k_weights, gate_up_proj, down_proj)
    gate_up_lora = _check_lora("gate_up_lora", gate_up_lora, gate_up_proj)
    down_lora = _check_lora("down_lora", down_lora, down_proj)
    route = routing(top_k_index, gate_up_proj.shape[0])
    dtype = gate_up_proj.dtype
    x_in = x.to(dtype).contiguous()
    weights = top_k_weights.reshape(-1)[route.order].to(dtype).contiguous()
    if gate_up_lora is None:
        gate_up = FrozenGroupedLinear.apply(gather_rows(x_in, route), gate_up_proj, route.offsets)
    else:  # the gather inside the node: its backward gathers again instead of keeping the rows
        gate_up = LoRAGroupedLinear.apply(x_in, gate_up_proj, *gate_up_lora, route.offsets, route.token, route.slots)
    h = weighted_swiglu(gate_up, weights)
    if down_lora is None:
        y = FrozenGroupedLinear.apply(h, down_proj, route.offsets)
    else:
        y = LoRAGroupedLinear.apply(h, down_proj, *down_lora, route.offsets, None, None)
    return sum_slots(y, route).to(x.dtype)
