"""LoRA linear without PEFT's cast tax: one autograd node, activations kept in their dtype.

The computation (PEFT's ``lora.Linear`` with one active adapter)::

    y = x·Wᵀ + b + s · (d(x)·Aᵀ)·Bᵀ          d = dropout (mask m, keep probability q = 1 − p)

PEFT runs it as separate modules and first casts ``x`` to the adapters' dtype: with a bf16 model
and PEFT's default fp32 adapters that is a bf16 → fp32 copy of the whole activation in the
forward, kept alive for the backward, made again by a gradient-checkpointing recompute, and an
fp32 → bf16 cast of every adapter output. Here the activations stay in the compute dtype (bf16
under autocast); only the rank-r adapter matrices are cast, which costs nothing (r·(K + N)
values). The gradients of fp32 adapters are returned in fp32.

Backward, with ``dy`` given, ``xa = d(x)·Aᵀ`` (saved, [T, r]) and ``dxa = s · dy·B``::

    dx = dy·W + m/q ⊙ (dxa·A)
    dA = dxaᵀ·d(x)
    dB = s · dyᵀ·xa
    db = Σ_rows dy

Saved for backward: ``x`` (the caller keeps it anyway), ``xa`` (r values a row) and the dropout
seed — the mask is regenerated, never stored.

Order of the work: the rank-r term is computed first, into the output buffer, and the base GEMM
then accumulates onto it (``addmm_`` with β = 1). The GEMM is compute-bound, so reading that
buffer in its epilogue is nearly free; adding the term afterwards would read and write the
whole ``[T, N]`` output once more at memory speed. The same holds for ``dx`` in the backward.
Either way the peak holds one ``[T, N]`` output, as the base alone.

The output is allocated in its final shape ``[..., N]`` and the GEMMs write its ``[T, N]`` view,
so the Function returns a tensor of its own, not a view made inside it: autograd forbids in-place
edits of such views, and callers (transformers' modules) edit a linear's output in place.
"""

from __future__ import annotations

import math
import numbers

import torch

from ._autograd import first_order_only
from ._checks import check_float_tensor, check_same_device
from ._compile import opaque_to_compile
from ._prepared import prepared

__all__ = ["lora_linear", "lora_linear_ref", "dropout_mask", "LoRALinearFunction"]


def dropout_mask(like: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """The keep-mask (bool, shape of ``like``) that ``lora_linear`` uses for dropout ``p``.

    Drawn from a generator seeded with ``seed``, so the backward regenerates the exact mask of the
    forward instead of storing it. ``p``: a real number in [0, 1) (``TypeError`` / ``ValueError`` else).
    """
    p = _check_dropout("p", p)
    generator = torch.Generator(device=like.device).manual_seed(seed)
    return torch.empty(like.shape, dtype=torch.float32, device=like.device).bernoulli_(1.0 - p, generator=generator).bool()


def _real_number(name: str, value: object) -> float:
    """``value`` as a float if it is a real number, else ``TypeError`` naming it. A bool is refused
    (``dropout=True`` is a slip, not a probability), and so is a tensor (its ``float`` would sync)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number (int or float), got {type(value).__name__}")
    return float(value)


def _check_scaling(name: str, value: object) -> float:
    """The adapter scale as a float: a finite real number (``TypeError`` / ``ValueError`` else)."""
    scaling = _real_number(name, value)
    if not math.isfinite(scaling):
        raise ValueError(f"{name}: expected a finite real number, got {value!r}")
    return scaling


def _check_dropout(name: str, value: object) -> float:
    """The dropout probability as a float: a real number in [0, 1) (``TypeError`` / ``ValueError`` else)."""
    p = _real_number(name, value)
    if not 0.0 <= p < 1.0:  # also refuses NaN
        raise ValueError(f"{name}: expected a probability in [0, 1), got {value!r}")
    return p


def _rows(x: torch.Tensor) -> int:
    """The number of rows of ``x`` as a ``[rows, x.shape[-1]]`` matrix. Spelled out because
    ``reshape(-1, 0)`` (zero features) is ambiguous and raises."""
    return math.prod(x.shape[:-1])


def _dropped(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    if p == 0.0:
        return x
    return x * dropout_mask(x, p, seed) / (1.0 - p)


def lora_linear_ref(x, weight, lora_A, lora_B, scaling, bias=None, dropout=0.0, seed=0):
    """The same math in plain PyTorch, every operand in ``x.dtype`` (the test reference)."""
    scaling, dropout = _check_scaling("scaling", scaling), _check_dropout("dropout", dropout)
    dtype = x.dtype
    y = torch.nn.functional.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))
    xa = torch.nn.functional.linear(_dropped(x, dropout, seed), lora_A.to(dtype))
    return y + torch.nn.functional.linear(xa, lora_B.to(dtype)) * scaling


def _project_into(y2d, x2d, weight, bias, xa, b_scaled) -> None:
    """``y2d = x·Wᵀ + b + xa·b_scaledᵀ`` (``xa`` None: no adapter), in ``x2d``'s dtype: the adapter's
    thin GEMM written first, then the base GEMM accumulates onto it (its epilogue adds the adapter
    term rather than a memory-bound pass over y)."""
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


def _input_grad(dy2d, weight, dxa, lora_A, dropout: float = 0.0, seed: int = 0) -> torch.Tensor:
    """``dx = dy·W + (dxa·A) ⊙ m/(1 − p)`` (``dxa`` None: no adapter): the adapter's term first
    (the dropout mask applies to it alone), then the base GEMM accumulates onto it."""
    dtype = dy2d.dtype
    if dxa is None:
        return dy2d @ weight.to(dtype)
    dx = dxa @ _cast(lora_A, dtype)
    if dropout:
        dx.mul_(dropout_mask(dx, dropout, seed)).div_(1.0 - dropout)
    return dx.addmm_(dy2d, weight.to(dtype))


def _check_projection_args(input_name: str, in_features: int, weight, lora_A, lora_B, bias) -> None:
    """``weight [N, in_features]``, ``lora_A [r, in_features]`` with ``lora_B [N, r]`` (both or
    neither), ``bias [N]``: float tensors, errors naming the argument."""
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


class LoRALinearFunction(torch.autograd.Function):
    """One node for base projection + adapter; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scaling: float, dropout: float, seed: int):
        dtype, T = x.dtype, _rows(x)
        x2d = x.reshape(T, x.shape[-1])
        a, b_scaled = _cast(lora_A, dtype), _scaled(lora_B, scaling, dtype)  # rank-r: cheap casts
        xa = _dropped(x2d, dropout, seed) @ a.t()  # [T, r]
        # Returned in its final shape (written through a [T, N] view): a view made here could not
        # be edited in place by the caller.
        y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=dtype, device=x.device)
        _project_into(y.view(T, weight.shape[0]), x2d, weight, bias, xa, b_scaled)
        ctx.save_for_backward(x2d, weight, lora_A, lora_B, xa)
        ctx.scaling, ctx.dropout, ctx.seed, ctx.has_bias = scaling, dropout, seed, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_shape = x.shape
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x2d, weight, lora_A, lora_B, xa = ctx.saved_tensors
        needs_x, needs_w, needs_b, needs_a, needs_bm = ctx.needs_input_grad[:5]
        dtype = x2d.dtype
        dy2d = dy.reshape(x2d.shape[0], dy.shape[-1]).to(dtype)
        dxa = dy2d @ _scaled(lora_B, ctx.scaling, dtype)  # [T, r]: s · dy·B
        dx = dA = dB = dW = db = None
        if needs_x:
            dx = _input_grad(dy2d, weight, dxa, lora_A, ctx.dropout, ctx.seed).view(ctx.x_shape)
        if needs_a:
            dA = (dxa.t() @ _dropped(x2d, ctx.dropout, ctx.seed)).to(lora_A.dtype)
        if needs_bm:
            dB = _scaled_product(dy2d.t(), xa, ctx.scaling).to(lora_B.dtype)
        if needs_w:  # a trainable base weight (not LoRA's usual case) is supported, not optimised
            dW = (dy2d.t() @ x2d).to(weight.dtype)
        if needs_b:
            db = dy2d.sum(0).to(ctx.bias_dtype)
        return dx, dW, db, dA, dB, None, None, None


def _cast(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A LoRA factor in the activations' dtype (shared by a tiled call's tiles: ``_prepared``)."""
    return prepared(lambda: factor.to(dtype), "cast", factor, dtype)


def _scaled(lora_B: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """``s·B`` in the activations' dtype (shared by a tiled call's tiles: ``_prepared``)."""
    return prepared(lambda: (lora_B * scaling).to(dtype), "scaled", lora_B, scaling, dtype)


def _scaled_product(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · a·b`` rounded once: the GEMM applies the scale to its fp32 accumulator (alpha).
    Scaling the product after the GEMM would round a bf16 result twice."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return torch.addmm(out, a, b, beta=0, alpha=scale)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What F.linear would compute in: the autocast dtype when autocast is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


@opaque_to_compile  # a graph break under torch.compile (see _compile.py)
def lora_linear(x, weight, lora_A, lora_B, scaling, bias=None, dropout=0.0):
    """``x·Wᵀ + b + scaling · dropout(x)·Aᵀ·Bᵀ`` as one autograd node, without casting ``x``.

    Args:
        x (Tensor): ``[..., in_features]``; bf16, fp16 or fp32 (cast to the autocast dtype under
            autocast, as ``F.linear`` would).
        weight (Tensor): ``[out_features, in_features]``, the base projection (usually frozen).
        lora_A (Tensor): ``[r, in_features]``; bf16, fp16 or fp32 (fp32 adapters get fp32 gradients).
        lora_B (Tensor): ``[out_features, r]``; likewise.
        scaling (float): the adapter scale (``lora_alpha / r``), a finite real number.
        bias (Tensor, optional): ``[out_features]``. Default: None.
        dropout (float): probability in [0, 1) applied to the adapter's input only (as PEFT); 0
            outside training. Default: 0.

    Returns:
        Tensor: ``[..., out_features]``, a tensor of its own (not a view: it may be edited in place).
        Any size may be zero; the result is then what ``F.linear`` gives.

    Raises:
        TypeError: a tensor argument not a bf16/fp16/fp32 tensor; ``scaling`` or ``dropout`` not a
            real number (a bool, a string or a tensor).
        ValueError: shapes that do not match, ``lora_A`` without ``lora_B``, tensors on different
            devices, ``scaling`` not finite, ``dropout`` outside [0, 1).
    """
    check_float_tensor("x", x)
    for name, t in (("lora_A", lora_A), ("lora_B", lora_B)):
        check_float_tensor(name, t)  # required here (None would read as "no adapter")
    _check_projection_args("x", x.shape[-1] if x.dim() else "?", weight, lora_A, lora_B, bias)
    scaling, dropout = _check_scaling("scaling", scaling), _check_dropout("dropout", dropout)
    check_same_device(x=x, weight=weight, lora_A=lora_A, lora_B=lora_B, **({} if bias is None else {"bias": bias}))
    dtype = _compute_dtype(x)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout else 0  # the global RNG decides
    with torch.autocast(device_type=x.device.type, enabled=False):
        return LoRALinearFunction.apply(x.to(dtype), weight, bias, lora_A, lora_B, scaling, dropout, seed)
