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
then accumulates onto it (``addmm_`` with β = 1): the compute-bound GEMM reads that buffer in its
epilogue, where adding the term afterwards would be one more memory-bound pass over ``[T, N]``.
The same holds for ``dx``.

The output is allocated in its final shape ``[..., N]`` and the GEMMs write its ``[T, N]`` view,
so the node returns a tensor of its own, not a view made inside it: autograd forbids in-place
edits of such views, and callers (transformers' modules) edit a linear's output in place.

The node is a pair of ``torch.library`` custom ops (``q35lab::lora_linear_fwd`` / ``_bwd``, see
``_compile.py``): ``torch.compile`` traces through it. ``lora_linear`` draws the dropout seed
from the global RNG and hands it to the ops as a one-element int64 tensor, read on the host only
inside them: no ``.item()`` in a compiled graph.
"""

from __future__ import annotations

import torch

from ._autograd import first_order_only
from ._checks import check_float_tensor, check_same_device
from ._compile import torch_bodies
from ._linear import (
    cast_factor,
    check_dropout,
    check_projection_args,
    check_scaling,
    compute_dtype,
    dropout_mask,
    dropped,
    input_grad,
    project_into,
    row_count,
    scaled_b,
    scaled_product,
)
from .fp8 import dequantize_weight

__all__ = ["lora_linear", "lora_linear_ref", "dropout_mask", "lora_linear_fwd", "lora_linear_bwd"]


def lora_linear_ref(x, weight, lora_A, lora_B, scaling, bias=None, dropout=0.0, seed=0, weight_scale=None):
    """The same math in plain PyTorch, every operand in ``x.dtype`` (the test reference); an FP8
    base (``weight_scale`` given) is dequantized first."""
    scaling, dropout = check_scaling("scaling", scaling), check_dropout("dropout", dropout)
    dtype = x.dtype
    if weight_scale is not None:
        weight = dequantize_weight(weight, weight_scale, dtype)
    y = torch.nn.functional.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))
    xa = torch.nn.functional.linear(dropped(x, dropout, seed), lora_A.to(dtype))
    return y + torch.nn.functional.linear(xa, lora_B.to(dtype)) * scaling


# read on the host inside the op (never under a compiled graph): it breaks no graph
def _seed_value(seed: torch.Tensor | None) -> int:
    return 0 if seed is None else int(seed.item())


def lora_linear_fwd(x, weight, bias, lora_A, lora_B, scaling: float, dropout: float, seed: torch.Tensor | None,
                    weight_scale: torch.Tensor | None = None):
    """``(y, xa)``: the output, a new ``[..., N]`` tensor, and ``xa = d(x)·Aᵀ`` ``[T, r]`` (saved
    for the backward); see the module docstring for the math. ``seed``: the dropout mask's, a
    one-element int64 CPU tensor (None without dropout). ``weight_scale``: ``weight`` is an FP8
    base with these scales (``fp8.py``). The forward custom op runs this."""
    dtype, T, seed = x.dtype, row_count(x), _seed_value(seed)
    x2d = x.reshape(T, x.shape[-1])
    a, b_scaled = cast_factor(lora_A, dtype), scaled_b(lora_B, scaling, dtype)  # rank-r: cheap casts
    xa = dropped(x2d, dropout, seed) @ a.t()  # [T, r]
    # Returned in its final shape (written through a [T, N] view): a view made here could not be
    # edited in place by the caller.
    y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=dtype, device=x.device)
    project_into(y.view(T, weight.shape[0]), x2d, weight, bias, xa, b_scaled, weight_scale)
    return y, xa


def lora_linear_bwd(dy, x, weight, lora_A, lora_B, xa, scaling: float, dropout: float, seed: torch.Tensor | None,
                    bias_dtype: torch.dtype, needs_x: bool, needs_w: bool, needs_b: bool, needs_a: bool,
                    needs_bm: bool, weight_scale: torch.Tensor | None = None):
    """``(dx, dweight, dbias, dlora_A, dlora_B)``, each empty (``[0]``) unless asked for (a custom
    op returns no None); ``dbias`` ``[N]`` in ``bias_dtype``. The backward custom op runs this."""
    dtype, T, seed = x.dtype, row_count(x), _seed_value(seed)
    x2d = x.reshape(T, x.shape[-1])
    dy2d = dy.reshape(T, dy.shape[-1]).to(dtype)
    dxa = dy2d @ scaled_b(lora_B, scaling, dtype)  # [T, r]: s · dy·B
    dx = dA = dB = dW = db = None
    if needs_x:
        dx = input_grad(dy2d, weight, dxa, lora_A, dropout, seed, weight_scale).view(x.shape)
    if needs_a:
        dA = (dxa.t() @ dropped(x2d, dropout, seed)).to(lora_A.dtype)
    if needs_bm:
        dB = scaled_product(dy2d.t(), xa, scaling).to(lora_B.dtype)
    if needs_w:  # a trainable base weight (not LoRA's usual case) is supported, not optimised
        dW = (dy2d.t() @ x2d).to(weight.dtype)
    if needs_b:
        db = dy2d.sum(0).to(bias_dtype)
    # contiguous, as the fake implementation promises
    return tuple(x.new_empty(0) if g is None else g.contiguous() for g in (dx, dW, db, dA, dB))


# Custom ops (torch.library): torch.compile traces through them with their fake implementations,
# and autograd connects the two. Each runs the public function of its name, argument for argument.
@torch.library.custom_op("q35lab::lora_linear_fwd", mutates_args=())
def lora_linear_fwd_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor, lora_B: torch.Tensor,
    scaling: float, dropout: float, seed: torch.Tensor | None, weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, xa)``: ``y`` ``[..., N]`` in ``x``'s dtype, ``xa`` ``[T, r]``; ``seed`` None without dropout;
    ``weight_scale`` None for a base in a float dtype."""
    return lora_linear_fwd(x, weight, bias, lora_A, lora_B, scaling, dropout, seed, weight_scale)


@lora_linear_fwd_op.register_fake
def _(x, weight, bias, lora_A, lora_B, scaling, dropout, seed, weight_scale=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((row_count(x), lora_A.shape[0]))


@torch.library.custom_op("q35lab::lora_linear_bwd", mutates_args=())
def lora_linear_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
    xa: torch.Tensor, scaling: float, dropout: float, seed: torch.Tensor | None, bias_dtype: torch.dtype,
    compute_dx: bool, compute_dweight: bool, compute_dbias: bool, compute_dlora_A: bool, compute_dlora_B: bool,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias, dlora_A, dlora_B)``, each empty (``[0]``) unless asked for (a custom
    op returns no None); ``dbias`` ``[N]`` in ``bias_dtype``."""
    return lora_linear_bwd(dy, x, weight, lora_A, lora_B, xa, scaling, dropout, seed, bias_dtype,
                           compute_dx, compute_dweight, compute_dbias, compute_dlora_A, compute_dlora_B, weight_scale)


@lora_linear_bwd_op.register_fake
def _(dy, x, weight, lora_A, lora_B, xa, scaling, dropout, seed, bias_dtype, compute_dx, compute_dweight,
      compute_dbias, compute_dlora_A, compute_dlora_B, weight_scale=None):
    def grad(shape, dtype, wanted):
        return x.new_empty(shape if wanted else (0,), dtype=dtype if wanted else x.dtype)

    return (grad(x.shape, x.dtype, compute_dx), grad(weight.shape, weight.dtype, compute_dweight),
            grad((weight.shape[0],), bias_dtype, compute_dbias), grad(lora_A.shape, lora_A.dtype, compute_dlora_A),
            grad(lora_B.shape, lora_B.dtype, compute_dlora_B))


def _setup_context(ctx, inputs, output):
    """Saves ``x`` (the caller keeps it anyway), the weights, ``xa`` (r values a row) and the seed:
    the dropout mask is regenerated, never stored."""
    x, weight, bias, lora_A, lora_B, ctx.scaling, ctx.dropout, seed, weight_scale = inputs
    _, xa = output
    ctx.mark_non_differentiable(xa)
    ctx.set_materialize_grads(False)  # no zeros made for xa's gradient
    ctx.bias_dtype = x.dtype if bias is None else bias.dtype
    ctx.save_for_backward(x, weight, lora_A, lora_B, xa, seed, weight_scale)


def _backward(ctx, dy, _dxa):
    x, weight, lora_A, lora_B, xa, seed, weight_scale = ctx.saved_tensors
    needs = ctx.needs_input_grad[:5]  # x, weight, bias, lora_A, lora_B
    grads = lora_linear_bwd_op(dy, x, weight, lora_A, lora_B, xa, ctx.scaling, ctx.dropout, seed, ctx.bias_dtype,
                               *needs, weight_scale)
    return (*(g if wanted else None for g, wanted in zip(grads, needs)), None, None, None, None)


lora_linear_fwd_op.register_autograd(first_order_only(_backward, op="lora_linear"), setup_context=_setup_context)
torch_bodies((lora_linear_fwd_op, lora_linear_fwd), (lora_linear_bwd_op, lora_linear_bwd))


def lora_linear(x, weight, lora_A, lora_B, scaling, bias=None, dropout=0.0, *, weight_scale=None):
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
        weight_scale (Tensor, optional): ``[out_features]`` fp32: ``weight`` is a frozen FP8 (e4m3)
            base with these per-output-channel scales (``q35lab.ops.fp8.quantize_weight``), and the
            base GEMMs of the forward and of ``dx`` run on FP8 (the error bound: ``ops/fp8.py``).
            Default: None (``weight`` in a float dtype).

    Returns:
        Tensor: ``[..., out_features]``, a tensor of its own (not a view: it may be edited in place).
        Any size may be zero; the result is then what ``F.linear`` gives.

    Raises:
        TypeError: a tensor argument not a bf16/fp16/fp32 tensor (with ``weight_scale``: ``weight``
            not e4m3, ``weight_scale`` not fp32); ``scaling`` or ``dropout`` not a real number (a
            bool, a string or a tensor).
        ValueError: shapes that do not match, ``lora_A`` without ``lora_B``, tensors on different
            devices, ``scaling`` not finite, ``dropout`` outside [0, 1), an FP8 ``weight`` that
            requires grad.
    """
    check_float_tensor("x", x)
    for name, t in (("lora_A", lora_A), ("lora_B", lora_B)):
        check_float_tensor(name, t)  # required here (None would read as "no adapter")
    check_projection_args("x", x.shape[-1] if x.dim() else "?", weight, lora_A, lora_B, bias, weight_scale)
    scaling, dropout = check_scaling("scaling", scaling), check_dropout("dropout", dropout)
    optional = {name: t for name, t in (("bias", bias), ("weight_scale", weight_scale)) if t is not None}
    check_same_device(x=x, weight=weight, lora_A=lora_A, lora_B=lora_B, **optional)
    dtype = compute_dtype(x)
    # the global RNG decides (the draw of an int seed before); kept a tensor, it is no host read in a compiled graph
    seed = torch.randint(0, 2**62, (1,)) if dropout else None
    with torch.autocast(device_type=x.device.type, enabled=False):
        y, _ = lora_linear_fwd_op(x.to(dtype), weight, bias, lora_A, lora_B, scaling, dropout, seed, weight_scale)
    return y


_compute_dtype = compute_dtype  # the name q35lab.patch imports
