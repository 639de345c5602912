"""Benchmark of the offset RMSNorm: sizes, bytes model, peers, numerics check.

Peers (each skipped, and said so, when it is not installed):

* ``transformers``: ``Qwen3_5RMSNorm``, eager — what a Qwen3.5 model runs out of the box;
* ``torch.compile``: the same module compiled by Inductor;
* ``liger``: ``LigerRMSNormForQwen3Next`` (offset 1.0, casting mode "gemma", zero init), the
  class Liger's ``apply_liger_kernel_to_qwen3_5`` installs;
* ``q35lab`` and ``q35lab (frozen w)``: ours, with a trainable weight and a frozen one (LoRA).
"""

from __future__ import annotations

import importlib.util

import torch

from .. import shapes
from ..numerics import agreement, compare, rule_rows, with_grads
from ..ops.offset_rms_norm import OffsetRMSNorm, offset_rms_norm, offset_rms_norm_ref
from .spec import OpBench, module_impl

HIDDEN = shapes.HIDDEN


def make_inputs(T: int, device, dtype=torch.bfloat16, hidden: int = HIDDEN) -> dict:
    """Batch 1, ``T`` tokens: x and dy of shape [1, T, hidden], a small random weight."""
    return {
        "x": torch.randn(1, T, hidden, device=device, dtype=dtype),
        "w": (0.1 * torch.randn(hidden, device=device)).to(dtype),
        "dy": torch.randn(1, T, hidden, device=device, dtype=dtype),
    }


def bytes_model(T: int, pass_: str, hidden: int = HIDDEN, elem: int = 2) -> int:
    """Minimal traffic: forward reads x, writes y; backward reads x and dy, writes dx.

    The weight, its gradient and the 4-byte-a-row rstd are < 0.1 % at hidden 4096 and left out.
    """
    per_tensor = T * hidden * elem
    return {"fwd": 2 * per_tensor, "bwd": 3 * per_tensor, "fwd+bwd": 5 * per_tensor}[pass_]


def _hf_class():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    return Qwen3_5RMSNorm


def _liger_class():
    from liger_kernel.transformers.rms_norm import LigerRMSNormForQwen3Next

    return LigerRMSNormForQwen3Next


def _hf_output(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    hf = _hf_class()(x.shape[-1]).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        return hf(x)


def _liger_output(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    liger = _liger_class()(x.shape[-1]).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        liger.weight.copy_(w)
        return liger(x)


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """Numerics at size ``T``: the rule for y, dx and dw; bf16 agreement with transformers.

    Peers that run here (Liger needs a GPU) get the same rule and agreement for their output,
    so the fidelity of ours is read beside theirs.
    """
    inputs = make_inputs(T, device, dtype)
    x = inputs["x"].requires_grad_()
    w = inputs["w"].clone().requires_grad_()
    dy = inputs["dy"]

    out = with_grads(offset_rms_norm(x, w), [x, w], dy)
    ref = with_grads(offset_rms_norm_ref(x, w), [x, w], dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref64 = with_grads(offset_rms_norm_ref(x64, w64), [x64, w64], dy.double())
    rows = rule_rows("q35lab", ("y", "dx", "dw"), out, ref, ref64)
    try:
        hf_y = _hf_output(x.detach(), w.detach())
    except ImportError:
        rows[0]["note"] = "transformers has no Qwen3_5RMSNorm: agreement not measured"
        return rows
    rows[0].update(agreement(out[0].detach(), hf_y))
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel"):
        peer_y = _liger_output(x.detach(), w.detach())
        result = compare("y", peer_y, ref[0].detach(), ref64[0].detach())
        rows.append({"impl": "liger", "tensor": "y", "kernel_err": result.kernel_err, "ref_err": result.ref_err,
                     "bound": result.bound, "ok": result.ok, **agreement(peer_y, hf_y)})
    return rows


BENCH = OpBench(
    name="offset_rms_norm",
    title=f"Offset RMSNorm, hidden {HIDDEN}, bf16",
    make_inputs=make_inputs,
    bytes_model=bytes_model,
    impls={
        "transformers": (module_impl(_hf_class), ("transformers",)),
        "torch.compile": (module_impl(_hf_class, compile=True), ("transformers",)),
        "liger": (module_impl(_liger_class), ("liger_kernel",)),
        "q35lab (frozen w)": (module_impl(lambda: OffsetRMSNorm, frozen=True), ()),
        "q35lab": (module_impl(lambda: OffsetRMSNorm), ()),
    },
    check=check,
    ours="q35lab",
)
