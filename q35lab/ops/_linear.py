"""Pieces of a linear projection with a LoRA adapter, shared by the ops that compute one
(``lora_linear``, ``fused_lora_projections``, ``swiglu_down``, ``linear_cross_entropy``).

The adapter's term is ``s · d(x)·Aᵀ·Bᵀ`` with ``d`` a dropout whose mask is regenerated from a
seed, never stored. Only the rank-r factors are cast to the activations' dtype; the activations
keep theirs.
"""

from __future__ import annotations

import math
import numbers

import torch

from ._checks import check_float_tensor
from ._prepared import prepared
from .fp8 import check_fp8_weight, fp8_input_grad, fp8_matmul

__all__ = ["compute_dtype", "row_count", "dropout_mask", "dropped", "cast_factor", "scaled_b", "scaled_product",
           "project_into", "input_grad", "check_scaling", "check_dropout", "check_projection_args"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What F.linear would compute in: the autocast dtype when autocast is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def row_count(x: torch.Tensor) -> int:
    """The number of rows of ``x`` as a ``[rows, x.shape[-1]]`` matrix. Spelled out because
    ``reshape(-1, 0)`` (zero features) is ambiguous and raises."""
    return math.prod(x.shape[:-1])


def dropout_mask(like: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """The keep-mask (bool, shape of ``like``) that ``lora_linear`` uses for dropout ``p``.

    Drawn from a generator seeded with ``seed``, so the backward regenerates the exact mask of the
    forward instead of storing it. ``p``: a real number in [0, 1) (``TypeError`` / ``ValueError`` else).
    """
    p = check_dropout("p", p)
    generator = torch.Generator(device=like.device).manual_seed(seed)
    keep = torch.empty(like.shape, dtype=torch.float32, device=like.device).bernoulli_(1.0 - p, generator=generator)
    return keep.bool()


def dropped(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """``x`` after the dropout of probability ``p`` drawn from ``seed`` (``x`` itself when ``p`` is 0)."""
    if p == 0.0:
        return x
    return x * dropout_mask(x, p, seed) / (1.0 - p)


def cast_factor(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A LoRA factor in the activations' dtype (shared by a tiled call's tiles: ``_prepared``)."""
    return prepared(lambda: factor.to(dtype), "cast", factor, dtype)


def scaled_b(lora_B: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """``s·B`` in the activations' dtype (shared by a tiled call's tiles: ``_prepared``)."""
    return prepared(lambda: (lora_B * scaling).to(dtype), "scaled", lora_B, scaling, dtype)


def scaled_product(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · a·b`` rounded once: the GEMM applies the scale to its fp32 accumulator (alpha).
    Scaling the product after the GEMM would round a bf16 result twice."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return torch.addmm(out, a, b, beta=0, alpha=scale)


def project_into(y2d, x2d, weight, bias, xa, b_scaled, weight_scale=None) -> None:
    """``y2d = x·Wᵀ + b + xa·b_scaledᵀ`` (``xa`` None: no adapter), in ``x2d``'s dtype.

    The adapter's thin GEMM is written first and the base GEMM accumulates onto it (β = 1): the
    compute-bound GEMM reads ``y`` in its epilogue, where a separate addition would be another
    memory-bound pass over it. With ``weight_scale`` (an FP8 base, ``fp8.py``) the order turns: the
    FP8 GEMM cannot accumulate, so it writes ``y`` and the thin GEMM accumulates onto it.
    """
    if weight_scale is not None:
        fp8_matmul(x2d, weight, weight_scale, bias, out=y2d)
        if xa is not None:
            y2d.addmm_(xa, b_scaled.t())
        return
    dtype = x2d.dtype
    bias = None if bias is None else bias.to(dtype)
    if xa is None:
        left, right = x2d, weight.to(dtype).t()
    else:
        left, right = xa, b_scaled.t()
    if bias is None:
        torch.mm(left, right, out=y2d)
    else:
        torch.addmm(bias, left, right, out=y2d)
    if xa is not None:
        y2d.addmm_(x2d, weight.to(dtype).t())


def input_grad(dy2d, weight, dxa, lora_A, dropout: float = 0.0, seed: int = 0, weight_scale=None) -> torch.Tensor:
    """``dx = dy·W + (dxa·A) ⊙ m/(1 − p)`` (``dxa`` None: no adapter): the adapter's term first
    (the dropout mask applies to it alone), then the base GEMM accumulates onto it. With
    ``weight_scale`` (an FP8 base) the FP8 GEMM writes ``dx`` first and the adapter's term is added."""
    dtype = dy2d.dtype
    if weight_scale is not None:
        dx = fp8_input_grad(dy2d, weight, weight_scale)
        if dxa is None:
            return dx
        if not dropout:
            return dx.addmm_(dxa, cast_factor(lora_A, dtype))
        lora_dx = dxa @ cast_factor(lora_A, dtype)
        return dx.add_(lora_dx.mul_(dropout_mask(lora_dx, dropout, seed)).div_(1.0 - dropout))
    if dxa is None:
        return dy2d @ weight.to(dtype)
    dx = dxa @ cast_factor(lora_A, dtype)
    if dropout:
        dx.mul_(dropout_mask(dx, dropout, seed)).div_(1.0 - dropout)
    return dx.addmm_(dy2d, weight.to(dtype))


def _real_number(name: str, value: object) -> float:
    """``value`` as a float if it is a real number, else ``TypeError`` naming it. A bool is refused
    (``dropout=True`` is a slip, not a probability), and so is a tensor (its ``float`` would sync)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number (int or float), got {type(value).__name__}")
    return float(value)


def check_scaling(name: str, value: object) -> float:
    """The adapter scale as a float: a finite real number (``TypeError`` / ``ValueError`` else)."""
    scaling = _real_number(name, value)
    if not math.isfinite(scaling):
        raise ValueError(f"{name}: expected a finite real number, got {value!r}")
    return scaling


def check_dropout(name: str, value: object) -> float:
    """The dropout probability as a float: a real number in [0, 1) (``TypeError`` / ``ValueError`` else)."""
    p = _real_number(name, value)
    if not 0.0 <= p < 1.0:  # also refuses NaN
        raise ValueError(f"{name}: expected a probability in [0, 1), got {value!r}")
    return p


def check_projection_args(input_name: str, in_features: int, weight, lora_A, lora_B, bias,
                          weight_scale=None) -> None:
    """``weight [N, in_features]``, ``lora_A [r, in_features]`` with ``lora_B [N, r]`` (both or
    neither), ``bias [N]``: float tensors, errors naming the argument. With ``weight_scale``:
    ``weight`` an FP8 e4m3 base and ``weight_scale`` its fp32 ``[N]`` scales, frozen."""
    if weight_scale is not None:
        check_fp8_weight("weight", weight, weight_scale, in_features)
        if weight.requires_grad:
            raise ValueError("weight: an FP8 base weight is frozen (requires_grad=False); train it in bf16")
    else:
        check_float_tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"weight: expected [out_features, {in_features}] (in_features = last dimension of "
                         f"{input_name}), got {tuple(weight.shape)}")
    if (lora_A is None) != (lora_B is None):
        raise ValueError("lora_A, lora_B: expected both or neither")
    out_features = weight.shape[0]
    if lora_A is not None:
        check_float_tensor("lora_A", lora_A)
        check_float_tensor("lora_B", lora_B)
        if lora_A.dim() != 2 or lora_A.shape[1] != in_features:
            raise ValueError(f"lora_A: expected [r, {in_features}], got {tuple(lora_A.shape)}")
        rank = lora_A.shape[0]
        if lora_B.dim() != 2 or tuple(lora_B.shape) != (out_features, rank):
            raise ValueError(f"lora_B: expected [{out_features}, {rank}] (out_features, rank of lora_A), "
                             f"got {tuple(lora_B.shape)}")
    if bias is not None:
        check_float_tensor("bias", bias)
        if tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias: expected [{out_features}], got {tuple(bias.shape)}")
