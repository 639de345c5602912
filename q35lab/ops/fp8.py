"""FP8 (e4m3) GEMMs against a frozen weight quantized once: LoRA's base projections at FP8 speed.

A frozen base weight ``W`` ``[N, K]`` is quantized once, per output channel::

    s_W[n] = max_k |W[n, k]| / 448          Ŵ[n, k] = rne_e4m3(W[n, k] / s_W[n])      (1 byte a value)

and the activations are quantized on the fly, per row, by the same rule (``quantize_rows``). Each
base GEMM then runs on FP8 operands with fp32 accumulation (``torch._scaled_mm``) and rounds once
to bf16:

    forward, recompute   y  = x·Wᵀ    ≈ s_x[t] · s_W[n] · (x̂·Ŵᵀ)[t, n]
    input gradient       dx = dy·W    ≈ s_d[t] · (d̂·Ŵ)[t, k],   d = dy ⊙ s_W (per column n),
                                                               d̂, s_d = d quantized per row

The input gradient contracts over ``n``, the index of the weight's scales, so ``s_W`` cannot stay
outside the GEMM: it is folded into ``dy``'s columns (in fp32, exactly as many roundings as
quantizing ``dy`` alone) before ``dy`` is quantized per row. So one FP8 copy of ``W`` serves every
GEMM; the alternative, a second copy of ``Wᵀ`` quantized per input channel, would cost as much
memory as the bf16 weight saved. FP8 GEMMs take one layout on Hopper (A row-major, B
column-major): the forward reads ``Ŵ`` as stored; the backward reads a transposed copy of ``Ŵ``
(``N·K`` bytes) that lives for its GEMM only.

Error model. e4m3 keeps 3 mantissa bits: a value in the normal range rounds with relative error at
most ``u = 2⁻⁴``; below ``2⁻⁶`` (subnormals, spacing ``2⁻⁹``) the error is at most ``η = 2⁻¹⁰``
times the scale. An operand ``v`` quantized with scale ``s`` has ``|v̂·s − v| ≤ e(v) = u·|v| + η·s``,
so for ``c = a·b`` over ``K`` terms::

    |ĉ − c| ≤ |a|·e(b) + e(a)·|b| + e(a)·e(b)                 (≈ 2u·(|a|·|b|), per element)
              + (K + 2)·2⁻²⁴ · (|a| + e(a))·(|b| + e(b))     the fp32 accumulation and the scales
              + 2⁻⁸ · |ĉ|                                     the one rounding to bf16

(``tests/test_fp8.py`` checks each GEMM against this bound computed in fp64.) Compared with a
bf16 GEMM (about ``2⁻⁸·|c|`` for the output rounding and 2⁻⁸ per operand rounding) the error is
about sixteen times larger; LoRA's adapters, which stay in the compute dtype, learn on top of it.

Shapes: the FP8 GEMM needs ``K`` and ``N`` (for the input gradient ``N`` and ``K``) multiples of
16. Otherwise (and for empty operands) the weight is dequantized to the compute dtype and an
ordinary GEMM runs: only the weight is quantized, within the same bound. Outputs are bf16 before
they are cast to the activations' dtype (the FP8 GEMM's row-wise scaling writes bf16 only), so
fp16 and fp32 activations get bf16's rounding.
"""

from __future__ import annotations

import math

import torch

from ._autograd import first_order_only
from ._checks import check_float_tensor, check_same_device
from ._compile import opaque_to_compile

__all__ = ["FP8_DTYPE", "E4M3_MAX", "UNIT_ROUNDOFF", "SUBNORMAL_ERROR", "ALIGNMENT", "quantize_weight",
           "dequantize_weight", "quantize_rows", "fp8_gemm_runs", "fp8_matmul", "fp8_input_grad", "fp8_linear",
           "fp8_supported", "check_fp8_device", "check_fp8_weight", "is_fp8"]

FP8_DTYPE = torch.float8_e4m3fn
#: e4m3fn's largest finite value: a row's largest magnitude is scaled onto it.
E4M3_MAX = 448.0
#: Relative rounding error of e4m3 in its normal range (3 mantissa bits, round to nearest).
UNIT_ROUNDOFF = 2.0**-4
#: Absolute rounding error of e4m3's subnormals (spacing 2⁻⁹), in units of the scale.
SUBNORMAL_ERROR = 2.0**-10
#: ``torch._scaled_mm`` needs the inner and the output dimension to be multiples of this.
ALIGNMENT = 16
#: Rows quantized at a time: bounds the fp32 temporary of ``quantize_rows`` to this many rows.
QUANTIZE_ROWS = 2048


def is_fp8(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == FP8_DTYPE


def fp8_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 GEMMs on ``device``: a CUDA GPU of compute capability
    8.9 or more (Ada, Hopper and later), or the CPU (PyTorch's reference path: correct, not fast)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


def check_fp8_device(name: str, device: torch.device) -> None:
    """``ValueError`` naming ``name`` unless ``device`` runs FP8 GEMMs (``fp8_supported``)."""
    device = torch.device(device)
    if fp8_supported(device):
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        what = f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}"
    else:
        what = f"device {device} has no FP8 GEMM"
    raise ValueError(f"{name}: FP8 base weights need a GPU with FP8 tensor cores (compute capability 8.9 or "
                     f"more: Ada, Hopper or later) or the CPU; {what}")


def quantize_rows(t: torch.Tensor, column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t̂, s)``: each row of ``t`` ``[M, K]`` (times ``column_scale`` ``[K]`` first, in fp32, when
    given) scaled by ``s[m] = max|row| / 448`` and rounded to e4m3; ``s`` fp32 ``[M]``. A row of
    zeros gets scale 1. Computed ``QUANTIZE_ROWS`` rows at a time, so the fp32 temporary stays small."""
    M, K = t.shape
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=t.device)
    scale = torch.empty(M, dtype=torch.float32, device=t.device)
    for start in range(0, M, QUANTIZE_ROWS):
        rows = t[start:start + QUANTIZE_ROWS].to(torch.float32)
        if column_scale is not None:
            rows = rows * column_scale
        amax = torch.linalg.vector_norm(rows, float("inf"), dim=1)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        # the clamp: a row's maximum divided by its scale may land one fp32 ulp above 448, which
        # a non-saturating conversion would turn into NaN
        q[start:start + QUANTIZE_ROWS] = (rows / s[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        scale[start:start + QUANTIZE_ROWS] = s
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Ŵ, s_W)``: ``weight`` ``[N, K]`` in e4m3 with one fp32 scale per output channel (row)."""
    check_float_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [out_features, in_features], got {tuple(weight.shape)}")
    return quantize_rows(weight.detach())


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Ŵ · s_W`` in ``dtype`` (``[N, K]``): the weight the FP8 GEMMs compute with."""
    return (weight.to(torch.float32) * scale[:, None]).to(dtype)


def check_fp8_weight(name: str, weight: object, scale: object, in_features: int | str) -> None:
    """``weight`` an e4m3 ``[N, in_features]`` tensor and ``scale`` its fp32 ``[N]`` scales
    (``TypeError`` / ``ValueError`` naming the argument)."""
    for what, t, dtype in ((name, weight, FP8_DTYPE), (f"{name}_scale", scale, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{what}: expected dtype {dtype} (an FP8 base weight and its scales, "
                            f"q35lab.ops.fp8.quantize_weight), got {t.dtype}")
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"{name}: expected [out_features, {in_features}], got {tuple(weight.shape)}")
    if tuple(scale.shape) != (weight.shape[0],):
        raise ValueError(f"{name}_scale: expected [{weight.shape[0]}] (one scale an output channel), "
                         f"got {tuple(scale.shape)}")


def fp8_gemm_runs(rows: int, inner: int, cols: int) -> bool:
    """Whether a ``[rows, inner] × [inner, cols]`` product runs as an FP8 GEMM (else the dequantized
    weight's ordinary GEMM): dimensions multiples of ``ALIGNMENT``, none empty."""
    return rows > 0 and inner > 0 and cols > 0 and inner % ALIGNMENT == 0 and cols % ALIGNMENT == 0


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    return out.copy_(result)


def fp8_matmul(x2d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``x·Wᵀ (+ bias)`` ``[T, N]`` in ``x2d``'s dtype, ``W = Ŵ·s_W``: ``x`` quantized per row, one
    FP8 GEMM (the dequantized weight's GEMM where ``fp8_gemm_runs`` says no). ``out``: written there."""
    dtype = x2d.dtype
    T, K = x2d.shape
    N = weight.shape[0]
    if not fp8_gemm_runs(T, K, N):
        w = dequantize_weight(weight, scale, dtype)
        if bias is None:
            return torch.mm(x2d, w.t(), out=out) if out is not None else x2d @ w.t()
        return torch.addmm(bias.to(dtype), x2d, w.t(), out=out) if out is not None else \
            torch.addmm(bias.to(dtype), x2d, w.t())
    xq, xs = quantize_rows(x2d)
    direct = out is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
    y = torch._scaled_mm(xq, weight.t(), xs[:, None], scale[None, :], out_dtype=torch.bfloat16,
                         out=out if direct else None)
    if bias is not None:  # Qwen3.5's projections have none: kept out of the GEMM for its dtype rules
        y.add_(bias.to(y.dtype))
    return y if direct else _into(y.to(dtype), out)


def fp8_input_grad(dy2d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``dy·W`` ``[T, K]`` in ``dy2d``'s dtype, ``W = Ŵ·s_W``: ``s_W`` folded into ``dy``'s columns,
    ``dy`` quantized per row, one FP8 GEMM against a transient transpose of ``Ŵ`` (see the module
    docstring); the dequantized weight's GEMM where ``fp8_gemm_runs`` says no."""
    dtype = dy2d.dtype
    T, N = dy2d.shape
    K = weight.shape[1]
    if not fp8_gemm_runs(T, N, K):
        return dy2d @ dequantize_weight(weight, scale, dtype)
    dq, ds = quantize_rows(dy2d, column_scale=scale)
    w_t = weight.t().contiguous()  # [K, N]: B column-major for the FP8 GEMM; freed after it
    ones = torch.ones(1, K, dtype=torch.float32, device=dy2d.device)
    return torch._scaled_mm(dq, w_t.t(), ds[:, None], ones, out_dtype=torch.bfloat16).to(dtype)


class FP8LinearFunction(torch.autograd.Function):
    """``y = x·Wᵀ + b`` against a frozen FP8 weight: saves nothing but the weight (no ``x``)."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias):
        rows = math.prod(x.shape[:-1])
        y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
        fp8_matmul(x.reshape(rows, x.shape[-1]), weight, scale, bias, out=y.view(rows, weight.shape[0]))
        ctx.save_for_backward(weight, scale)
        ctx.x_shape, ctx.bias_dtype = x.shape, None if bias is None else bias.dtype
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        weight, scale = ctx.saved_tensors
        dy2d = dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1])
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = fp8_input_grad(dy2d.contiguous(), weight, scale).view(ctx.x_shape)
        if ctx.needs_input_grad[3]:
            db = dy2d.sum(0).to(ctx.bias_dtype)
        return dx, None, None, db


@opaque_to_compile
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, Ŵ·s_W, bias)`` on FP8 GEMMs, for a frozen base weight (``quantize_weight``).

    Args:
        x (Tensor): ``[..., K]``; bf16, fp16 or fp32 (cast to the autocast dtype under autocast).
        weight (Tensor): ``[N, K]`` in ``torch.float8_e4m3fn``, frozen.
        weight_scale (Tensor): ``[N]`` fp32, one scale an output channel.
        bias (Tensor, optional): ``[N]``. Default: None.

    Returns:
        Tensor: ``[..., N]`` in ``x``'s (compute) dtype; error within the module docstring's bound.
    """
    check_float_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x: expected [..., K] (at least one dimension), got a 0-dimensional tensor")
    check_fp8_weight("weight", weight, weight_scale, x.shape[-1])
    if bias is not None:
        check_float_tensor("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected [{weight.shape[0]}], got {tuple(bias.shape)}")
    check_same_device(x=x, weight=weight, weight_scale=weight_scale, **({} if bias is None else {"bias": bias}))
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(device_type=x.device.type, enabled=False):
        return FP8LinearFunction.apply(x.to(dtype), weight, weight_scale, bias)
