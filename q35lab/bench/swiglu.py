"""Benchmark of SwiGLU, the Qwen3.5 MLP activation ``silu(g)·u``: T tokens × I = 12288 (9B), bf16.

Implementations (each skipped, and said so, when it is not installed):

* ``transformers``: ``act_fn(g) * u`` eager (``ACT2FN["silu"]``), the line of ``Qwen3_5MLP``;
* ``torch.compile``: the same line compiled by Inductor;
* ``liger``: ``LigerSiLUMulFunction`` (what ``apply_liger_kernel_to_qwen3_5`` installs); its
  backward always writes the gradients over its inputs;
* ``liger (packed)``: ``LigerFusedGateUpSiLUMulFunction`` over one ``[T, 2I]`` buffer (a new
  ``[T, 2I]`` gradient: its ``in_place`` defaults to False);
* ``q35lab``: ``swiglu`` (``rounding="hf"``). The inputs here are leaves the caller holds, so
  its backward allocates ``dg`` and ``du`` — what any caller that keeps its inputs gets;
* ``q35lab fused (in place)``: ``rounding="fused"`` with the backward forced to write over ``g``
  and ``u`` — the memory a training step gets, where ``g`` and ``u`` are projections' outputs
  nothing else holds (``swiglu`` decides that per call; forced here because these inputs are held);
* ``q35lab fused``: ``rounding="fused"``; ``q35lab packed``: ``swiglu_packed`` over ``[T, 2I]``.

Forced in-place backwards (Liger's, ours) read gradients as activations on the next repetition:
the same bytes move through the same kernels, but the values drift to infinities and subnormals.
That is why ours is timed in the "fused" mode there: the "hf" forward's IEEE division takes its
slow path on such values, which would time the garbage, not the kernel.
"""

from __future__ import annotations

import importlib.util

import torch

from ..numerics import agreement, rule_rows, with_grads
from ..ops.swiglu import ROUNDINGS, SwiGLUFunction, swiglu, swiglu_packed, swiglu_packed_ref, swiglu_ref
from .spec import NotApplicable, OpBench

#: Qwen3.5-9B ``intermediate_size`` (transformers' ``Qwen3_5TextConfig`` default); 27B: 17408.
WIDTH = 12288


def make_inputs(T: int, device, dtype=torch.bfloat16, width: int = WIDTH) -> dict:
    """Batch 1, ``T`` tokens: gate g, up u and dy of shape [1, T, I], and a packed gate-up [1, T, 2I]."""
    return {
        "g": (2 * torch.randn(1, T, width, device=device)).to(dtype),
        "u": torch.randn(1, T, width, device=device, dtype=dtype),
        "gu": torch.cat([(2 * torch.randn(1, T, width, device=device)).to(dtype),
                         torch.randn(1, T, width, device=device, dtype=dtype)], dim=-1),
        "dy": torch.randn(1, T, width, device=device, dtype=dtype),
    }


def bytes_model(T: int, pass_: str, width: int = WIDTH, elem: int = 2) -> int:
    """Minimal traffic: forward reads g, u and writes h; backward reads dh, g, u and writes dg, du."""
    per_tensor = T * width * elem
    return {"fwd": 3 * per_tensor, "bwd": 5 * per_tensor, "fwd+bwd": 8 * per_tensor}[pass_]


def _silu_mul():
    from transformers.activations import ACT2FN

    act_fn = ACT2FN["silu"]
    return lambda g, u: act_fn(g) * u


def _liger_separate():
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply


def _liger_packed():
    try:
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except ImportError:
        raise NotApplicable("this Liger has no LigerFusedGateUpSiLUMulFunction") from None
    return LigerFusedGateUpSiLUMulFunction.apply


def _separate(build, compile: bool = False):
    """An Impl over separate g and u (both differentiated); ``build()`` returns ``fn(g, u)``."""

    def make(data: dict, **_variant):
        fn = build()
        if compile:
            fn = torch.compile(fn, dynamic=False)
        g, u = data["g"].detach().requires_grad_(), data["u"].detach().requires_grad_()
        return (lambda: fn(g, u)), [g, u], data["dy"]

    return make


def _packed(build):
    """An Impl over one [T, 2I] gate-up buffer; ``build()`` returns ``fn(gu)``. Two-dimensional:
    Liger 0.8.5's packed backward returns a [T, 2I] gradient for a [1, T, 2I] input, which
    autograd rejects."""

    def make(data: dict, **_variant):
        fn = build()
        gu = data["gu"].view(-1, data["gu"].shape[-1]).detach().requires_grad_()
        return (lambda: fn(gu)), [gu], data["dy"].view(-1, data["dy"].shape[-1])

    return make


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """Per rounding mode, the rule for h, dgate and dup, and the agreement of h with
    transformers' ``act_fn(g) * u`` (bit-exact expected for "hf"); the rule for the packed form."""
    data = make_inputs(T, device, dtype)
    dy = data["dy"]
    rows = []
    hf_h = None
    if importlib.util.find_spec("transformers") is not None:
        with torch.no_grad():
            hf_h = _silu_mul()(data["g"], data["u"])
    for rounding in ROUNDINGS:
        g, u = data["g"].clone().requires_grad_(), data["u"].clone().requires_grad_()
        out = with_grads(swiglu(g, u, rounding=rounding), [g, u], dy)
        ref = with_grads(swiglu_ref(g, u, rounding), [g, u], dy)
        g64, u64 = (t.detach().double().requires_grad_() for t in (g, u))
        ref64 = with_grads(swiglu_ref(g64, u64, rounding), [g64, u64], dy.double())
        rows += rule_rows(f"q35lab {rounding}", ("h", "dgate", "dup"), out, ref, ref64)
        if hf_h is not None:
            rows[-3].update({"vs": "transformers", **agreement(out[0].detach(), hf_h)})
        del out, ref, ref64, g64, u64
    gu = data["gu"].clone().requires_grad_()
    out = with_grads(swiglu_packed(gu), [gu], dy)
    ref = with_grads(swiglu_packed_ref(gu), [gu], dy)
    gu64 = gu.detach().double().requires_grad_()
    ref64 = with_grads(swiglu_packed_ref(gu64), [gu64], dy.double())
    rows += rule_rows("q35lab packed", ("h", "dgate_up"), out, ref, ref64)
    return rows


BENCH = OpBench(
    name="swiglu",
    title=f"SwiGLU silu(g)·u (Qwen3.5 MLP), width {WIDTH}, bf16",
    make_inputs=make_inputs,
    bytes_model=bytes_model,
    impls={
        "transformers": (_separate(_silu_mul), ("transformers",)),
        "torch.compile": (_separate(_silu_mul, compile=True), ("transformers",)),
        "liger": (_separate(_liger_separate), ("liger_kernel",)),
        "liger (packed)": (_packed(_liger_packed), ("liger_kernel",)),
        "q35lab fused": (_separate(lambda: lambda g, u: swiglu(g, u, rounding="fused")), ()),
        "q35lab packed": (_packed(lambda: swiglu_packed), ()),
        "q35lab fused (in place)": (
            _separate(lambda: lambda g, u: SwiGLUFunction.apply(g, u, "fused", None, "always")), ()),
        "q35lab": (_separate(lambda: swiglu), ()),
    },
    check=check,
    ours="q35lab",
    check_sizes=[1024, 8 * 1024],  # 8k × 12288 in fp64 is 0.8 GB a tensor already
)
