"""``swiglu_down``: an MLP's SwiGLU and its down projection as two autograd nodes.

``y = h·Wᵀ + b + s · (h·Aᵀ)·Bᵀ`` with ``h = silu(g)·u``, a frozen ``W`` and an optional LoRA
adapter without dropout: the values and gradients of ``lora_linear(swiglu(g, u), ...)``, split so
that

* the first node (``SwiGLUDownFunction``) keeps ``g``, ``u`` and the adapter's ``[T, r]`` input,
  not ``h`` (``[T, I]``): its backward rebuilds ``h`` bit for bit where the adapter's ``dA``
  needs it;
* the second node (``DownProjectionFunction``), the down GEMM, saves nothing, so a gradient
  checkpoint's recompute, which stops at the layer's last saved tensor, stops before it.

``unread_down_outputs`` is for a recompute whose output only roots a backward
(``q35lab.long_context``'s tiled MLP): inside it, the down GEMM is skipped altogether.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ._autograd import first_order_only
from ._checks import check_float_tensor, check_kernel_device, check_like
from ._compile import opaque_to_compile
from ._launch import row_view
from ._linear import check_projection_args, check_scaling, input_grad, project_into, row_count, scaled_product
from ._ownership import bump_version, inplace_mode, overwrite_plan, ownership
from .fp8 import fp8_matmul
from .swiglu import LaunchConfig, check_rounding, swiglu_bwd, swiglu_fwd

__all__ = ["swiglu_down", "SwiGLUDownFunction", "DownProjectionFunction", "unread_down_outputs", "is_unread"]


class SwiGLUDownFunction(torch.autograd.Function):
    """The first of ``swiglu_down``'s two nodes: ``h = silu(g)·u`` and the adapter's term
    ``t = s·(h·Aᵀ)·Bᵀ + b`` (without an adapter ``t`` is a zero-stride placeholder and the bias
    goes to the second node).

    Saves ``g``, ``u`` and the adapter's ``[T, r]`` ``xa = h·Aᵀ``, not ``h``: ``h`` is needed again
    only for the adapter's ``dA = dxaᵀ·h``, and the backward rebuilds it, bit for bit, in the
    buffer of ``dh`` once the SwiGLU kernel has read ``dh`` there.

    The backward is split otherwise than the forward: the second node passes ``dt = dy`` on and
    gives ``h`` no gradient, and this node computes ``h``'s whole gradient,
    ``dh = dxa·A + dy·W`` with ``dxa = s·dy·B`` (``lora_linear``'s order: its bits). So ``dh`` is
    made after this node's saved tensors are unpacked (under checkpointing: after the layer's
    recompute) and never meets the recompute's ``h``. One SwiGLU kernel then writes ``dg``, ``du``
    (over ``g``, ``u`` when ``may_overwrite`` allows) and ``h`` (over ``dh``)."""

    @staticmethod
    def forward(ctx, gate, up, weight, lora_A, lora_B, bias, scaling: float, rounding: str,
                config: LaunchConfig | None, inplace: str, weight_scale=None):
        g2d, g_copied = row_view(gate)
        u2d, u_copied = row_view(up)
        dtype, rows, N = gate.dtype, g2d.shape[0], weight.shape[0]
        h = swiglu_fwd(g2d, u2d, rounding, config=config)
        xa = None
        if lora_A is not None:
            xa = h @ lora_A.to(dtype).t()  # [T, r]
            t = torch.empty(rows, N, dtype=dtype, device=h.device)
            project_into(t, xa, (lora_B * scaling).to(dtype), bias, None, None)  # the thin GEMM (+ bias)
        else:  # nothing to add: t only carries dy back to this node
            t = torch.zeros((), dtype=dtype, device=h.device).expand(rows, N)
        ctx.set_materialize_grads(False)  # h gets no gradient from the second node: no [T, I] of zeros
        # W is saved as well (a detached view of the parameter: its gradient is the second node's); saving
        # it keeps autograd's check that nothing edits it in place before the backward
        ctx.save_for_backward(g2d if g_copied else gate, u2d if u_copied else up, weight, lora_A, lora_B, xa,
                              weight_scale)
        ctx.owned, ctx.scaling, ctx.rounding = (g_copied, u_copied), scaling, rounding
        ctx.config, ctx.inplace = config, inplace
        ctx.shape, ctx.bias_dtype = gate.shape, None if bias is None else bias.dtype
        return h, t

    @staticmethod
    @first_order_only
    def backward(ctx, _, dt):
        if dt is None:  # y reached nothing that needs a gradient
            return (None,) * 11
        gate, up, weight, lora_A, lora_B, xa, weight_scale = ctx.saved_tensors
        g_counts = ownership(gate)  # first: nothing below may hold extra references yet
        u_counts = ownership(up)
        need_dg, need_du, _, need_a, need_bm, need_b = ctx.needs_input_grad[:6]
        dtype = gate.dtype  # dt's too: the second node casts dy to it
        dA = dB = db = None
        if need_bm:
            dB = scaled_product(dt.t(), xa, ctx.scaling).to(lora_B.dtype)
        if need_b:
            db = dt.sum(0).to(ctx.bias_dtype)
        if not (need_dg or need_du or need_a):  # only B or the bias: no dh, no SwiGLU backward
            return None, None, None, None, dB, db, None, None, None, None, None
        dxa = None if lora_A is None else dt @ (lora_B * ctx.scaling).to(dtype)  # [T, r]: s · dy·B
        # h's whole gradient, made after the unpacking above
        dh = input_grad(dt, weight, dxa, lora_A, weight_scale=weight_scale)
        g2d, u2d, into_g, into_u = overwrite_plan(ctx, gate, up, g_counts, u_counts, need_dg, need_du, dh)
        dg, du = swiglu_bwd(dh, g2d, u2d, need_dg=need_dg, need_du=need_du, dg=g2d if into_g else None,
                            du=u2d if into_u else None, h_out=dh if need_a else None, rounding=ctx.rounding,
                            config=ctx.config)
        h = dh if need_a else None  # dh's buffer now holds h
        if ctx.inplace == "auto":
            if into_g:
                bump_version(gate)
            if into_u:
                bump_version(up)
        if need_a:
            dA = (dxa.t() @ h).to(lora_A.dtype)
        return (dg.detach().view(ctx.shape) if dg is not None else None,
                du.detach().view(ctx.shape) if du is not None else None,
                None, dA, dB, db, None, None, None, None, None)


class _UnreadOutputs(threading.local):
    """Per thread (autograd's backward runs on its own): the list that ``unread_down_outputs``
    collects skipped outputs into, or None outside it."""

    skipped: list | None = None


_UNREAD = _UnreadOutputs()


@contextlib.contextmanager
def unread_down_outputs():
    """While active on this thread, ``swiglu_down``'s frozen down projection leaves its output
    uncomputed (``torch.empty``) and records it in the yielded list, with its version.

    For a recompute whose output only roots a backward, ``autograd.grad(y, inputs, dy)`` (a tiled
    MLP's, ``q35lab.long_context``): the down node's backward reads ``dy``, never ``y``, so its GEMM
    need not run. The caller must check that what it roots the backward on is one of the skipped
    outputs, unmodified (``is_unread``), and otherwise recompute without the context: an op that
    read the uncomputed values would have read garbage."""
    outer = _UNREAD.skipped
    _UNREAD.skipped = skipped = []
    try:
        yield skipped
    finally:
        _UNREAD.skipped = outer


def is_unread(y: torch.Tensor, skipped: list) -> bool:
    """Whether ``y`` is (a view of the whole of) one output ``unread_down_outputs`` skipped, not
    written since (its version counter: a write through ``.data`` or by a kernel that does not bump
    it goes unseen). With one output skipped, nothing computed from its values then reaches ``y``;
    with several, one could have fed another (the caller counts them)."""
    return any(y.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and y.numel() == out.numel()
               and out._version == version for out, version in skipped)


class DownProjectionFunction(torch.autograd.Function):
    """The second of ``swiglu_down``'s nodes: ``y = t + h·Wᵀ`` (without an adapter ``y = h·Wᵀ + b``,
    ``t`` a placeholder).

    With a frozen ``W`` it saves nothing; its backward only passes ``dy`` on as ``t``'s gradient.
    PyTorch's non-reentrant checkpoint (transformers') stops a layer's recompute once the layer's
    last saved tensor is made again, so the recompute stops before this GEMM, the largest of the
    layer. A trainable ``W`` needs ``h`` for ``dW = dyᵀ·h``: then ``h`` is saved (and recomputed)."""

    @staticmethod
    def forward(ctx, h, t, weight, bias, out_shape: tuple, adapter: bool, weight_scale=None):
        dtype, N = h.dtype, weight.shape[0]
        y = torch.empty(*out_shape[:-1], N, dtype=dtype, device=h.device)  # its own tensor, not a view
        y2d = y.view(h.shape[0], N)
        skipped = _UNREAD.skipped
        if skipped is not None and not ctx.needs_input_grad[2]:  # nobody reads y (unread_down_outputs)
            skipped.append((y, y._version))
        elif adapter and weight_scale is not None:  # an FP8 GEMM cannot accumulate: it writes y, t is added
            fp8_matmul(h, weight, weight_scale, out=y2d).add_(t)
        elif adapter:
            torch.addmm(t, h, weight.to(dtype).t(), out=y2d)  # the base GEMM accumulates onto the adapter's term
        else:
            project_into(y2d, h, weight, bias, None, None, weight_scale)
        ctx.dtype, ctx.weight_dtype = dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(h if ctx.needs_input_grad[2] else None)
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        need_w, need_b = ctx.needs_input_grad[2:4]
        dy2d = dy.reshape(row_count(dy), dy.shape[-1]).to(ctx.dtype)
        dW = (dy2d.t() @ h).to(ctx.weight_dtype) if need_w else None  # a trainable base: supported, not optimised
        db = dy2d.sum(0).to(ctx.bias_dtype) if need_b else None
        return None, dy2d, dW, db, None, None, None


@opaque_to_compile
def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor | None = None,
                lora_B: torch.Tensor | None = None, scaling: float = 1.0, bias: torch.Tensor | None = None, *,
                rounding: str = "hf", inplace_backward: bool = True,
                weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """An MLP's last two steps as two nodes: ``down(swiglu(gate, up))`` with ``down`` a frozen
    projection and an optional LoRA adapter without dropout,
    ``y = h·Wᵀ + b + scaling · (h·Aᵀ)·Bᵀ``, ``h = silu(gate)·up``.

    The same values and gradients as ``lora_linear(swiglu(gate, up), ...)``: the same GEMMs and
    formulas, ``h`` rebuilt bit for bit (through the interpreter every result is the same bits;
    compiled, the backward kernel's variant may round its products otherwise), without keeping
    ``h`` for the backward (``SwiGLUDownFunction``).

    Args:
        gate, up: as for ``swiglu`` (the column blocks of a fused gate/up output are fine).
        weight: ``[N, I]``; lora_A: ``[r, I]``; lora_B: ``[N, r]`` (both or neither); any float
            dtype (cast to ``gate``'s for the GEMMs; fp32 master adapters get fp32 gradients).
        scaling: the adapter scale, a finite real number. bias: optional ``[N]``.
        rounding, inplace_backward: as for ``swiglu``.
        weight_scale: optional ``[N]`` fp32: ``weight`` is a frozen FP8 (e4m3) base with these
            per-output-channel scales, its GEMMs (the down projection, ``dh``'s) run on FP8
            (``ops/fp8.py``). Default: None.
    """
    check_float_tensor("gate", gate)
    check_float_tensor("up", up)
    check_like("up", up, "gate", gate)
    check_projection_args("gate", gate.shape[-1] if gate.dim() else "?", weight, lora_A, lora_B, bias, weight_scale)
    scaling = check_scaling("scaling", scaling)
    check_rounding(rounding)
    inplace = inplace_mode(inplace_backward)
    check_kernel_device(gate=gate, up=up, weight=weight, **{name: t for name, t in
                                                           (("lora_A", lora_A), ("lora_B", lora_B), ("bias", bias),
                                                            ("weight_scale", weight_scale))
                                                           if t is not None})
    adapter = lora_A is not None  # the bias joins the adapter's term, or else the base GEMM, as lora_linear adds it
    with torch.autocast(device_type=gate.device.type, enabled=False):
        # the first node reads W for h's gradient but returns none for it (the second node's dW): it gets W
        # detached, so that a gradient wanted for W alone does not run the first node's backward
        h, t = SwiGLUDownFunction.apply(gate, up, weight.detach(), lora_A, lora_B, bias if adapter else None, scaling,
                                        rounding, None, inplace, weight_scale)
        return DownProjectionFunction.apply(h, t, weight, None if adapter else bias, tuple(gate.shape), adapter,
                                            weight_scale)
