"""Benchmark of the gated RMSNorm: rows = 32·T value heads of width 128, bf16.

Peers (each skipped, and said so, when it is not installed):

* ``transformers``: ``Qwen3_5RMSNormGated``, eager — what a Qwen3.5 model runs without fla;
* ``torch.compile``: the same module compiled by Inductor;
* ``fla``: flash-linear-attention's ``FusedRMSNormGated`` (activation "silu") — what older
  transformers builds when fla is installed, one rounding;
* ``axolotl``: axolotl's ``FusedRMSNormGated`` (axolotl.kernels.rms_norm_gated);
* ``q35lab`` ("hf" rounding, trainable weight), ``q35lab fused`` and ``q35lab (frozen w)``.
"""

from __future__ import annotations

import importlib.util

import torch

from .. import shapes
from ..numerics import agreement, rule_rows, with_grads
from ..ops.gated_rms_norm import GatedRMSNorm, gated_rms_norm, gated_rms_norm_ref
from .spec import OpBench, module_impl

WIDTH = shapes.GDN_HEAD_DIM
HEADS = shapes.GDN_VALUE_HEADS


def make_inputs(T: int, device, dtype=torch.bfloat16, width: int = WIDTH) -> dict:
    """``T`` tokens × 32 heads rows of width 128: x (the delta rule's output), gate, dy, weight."""
    rows = T * HEADS
    return {
        "x": torch.randn(rows, width, device=device, dtype=dtype),
        "gate": (2 * torch.randn(rows, width, device=device)).to(dtype),
        "w": (1 + 0.2 * torch.randn(width, device=device)).to(dtype),
        "dy": torch.randn(rows, width, device=device, dtype=dtype),
    }


def bytes_model(T: int, pass_: str, width: int = WIDTH, elem: int = 2) -> int:
    """Minimal traffic: forward reads x, gate and writes y; backward reads x, gate, dy and
    writes dx, dgate. The weight and its gradient (128 values) are left out."""
    per_tensor = T * HEADS * width * elem
    return {"fwd": 3 * per_tensor, "bwd": 5 * per_tensor, "fwd+bwd": 8 * per_tensor}[pass_]


def _hf_class():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    return Qwen3_5RMSNormGated


def _fla_class():
    from fla.modules import FusedRMSNormGated

    return lambda width: FusedRMSNormGated(width, eps=1e-6, activation="silu")


def _axolotl_class():
    from axolotl.kernels.rms_norm_gated import FusedRMSNormGated

    return FusedRMSNormGated


def _ours(rounding: str):
    return lambda: (lambda width: GatedRMSNorm(width, eps=1e-6, rounding=rounding))


def _module_output(build, x, gate, w):
    module = build()(x.shape[-1]).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        module.weight.copy_(w)
        return module(x, gate)


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """Per rounding mode: the rule for y, dx, dgate, dw; agreement of y with the module it
    reproduces ("hf": transformers; "fused": fla, where installed on a GPU)."""
    data = make_inputs(T, device, dtype)
    rows = []
    for rounding in ("hf", "fused"):
        x, g = data["x"].clone().requires_grad_(), data["gate"].clone().requires_grad_()
        w = data["w"].clone().requires_grad_()

        dy = data["dy"]
        out = with_grads(gated_rms_norm(x, g, w, 1e-6, rounding), [x, g, w], dy)
        ref = with_grads(gated_rms_norm_ref(x, g, w, 1e-6, rounding), [x, g, w], dy)
        x64, g64, w64 = (t.detach().double().requires_grad_() for t in (x, g, w))
        ref64 = with_grads(gated_rms_norm_ref(x64, g64, w64, 1e-6, rounding), [x64, g64, w64], dy.double())
        rows += rule_rows(f"q35lab {rounding}", ("y", "dx", "dgate", "dw"), out, ref, ref64)
        peer = {"hf": (_hf_class, "transformers"), "fused": (_fla_class, "fla")}[rounding]
        available = importlib.util.find_spec(peer[1]) is not None and (rounding == "hf" or device.type == "cuda")
        if available:
            peer_y = _module_output(peer[0], x.detach(), g.detach(), w.detach())
            rows[-4].update({"vs": peer[1], **agreement(out[0].detach(), peer_y)})
    return rows


BENCH = OpBench(
    name="gated_rms_norm",
    title=f"Gated RMSNorm (GatedDeltaNet output), rows = {HEADS}·T, width {WIDTH}, bf16",
    make_inputs=make_inputs,
    bytes_model=bytes_model,
    impls={
        "transformers": (module_impl(_hf_class, ("x", "gate")), ("transformers",)),
        "torch.compile": (module_impl(_hf_class, ("x", "gate"), compile=True), ("transformers",)),
        "fla": (module_impl(_fla_class, ("x", "gate")), ("fla",)),
        "axolotl": (module_impl(_axolotl_class, ("x", "gate")), ("axolotl", "liger_kernel")),
        "q35lab (frozen w)": (module_impl(_ours("hf"), ("x", "gate"), frozen=True), ()),
        "q35lab fused": (module_impl(_ours("fused"), ("x", "gate")), ()),
        "q35lab": (module_impl(_ours("hf"), ("x", "gate")), ()),
    },
    check=check,
    ours="q35lab",
    check_sizes=[8 * 1024, 32 * 1024],  # 1M rows in fp64 references already; 4M would cost minutes
)
