"""Benchmark of the PEFT cast tax: one 4096→4096 LoRA projection (r = 16), bf16 base model.

Implementations (each a PEFT-wrapped ``nn.Linear`` with the same weights, except the floor):

* ``base (frozen)``: the frozen bf16 projection alone — the floor every LoRA path is held to;
* ``peft``: PEFT's defaults — fp32 adapters, the input cast to fp32 before them;
* ``peft (bf16 adapters)``: ``get_peft_model(..., autocast_adapter_dtype=False)``;
* ``peft (no input cast)``: defaults with ``cast_input_dtype_enabled = False`` (what
  ``peft.helpers.disable_input_dtype_casting`` sets); without autocast, fp32 adapters then meet
  bf16 activations and PEFT raises — recorded as an error, which is the finding;
* ``axolotl``: axolotl's ``apply_lora_linear`` (LoRA_O) on the PEFT layer (needs bitsandbytes);
* ``q35lab``: the PEFT layer routed through ``q35lab.lora_linear`` by ``route_lora`` (as ``apply_to_qwen3_5`` does).

Variants: with and without bf16 autocast (how ``Trainer`` runs with ``bf16=True``), with and
without non-reentrant gradient checkpointing of the projection (the forward runs again in the
backward). GEMM-bound: reported as time, not bandwidth.
"""

from __future__ import annotations

import torch

from .. import shapes
from ..numerics import rule_rows, with_grads
from ..ops.lora import lora_linear, lora_linear_ref
from .spec import NotApplicable, OpBench, autocast_if, no_bytes_model

IN_FEATURES = OUT_FEATURES = shapes.HIDDEN
RANK, ALPHA = 16, 32


def make_inputs(T: int, device, dtype=torch.bfloat16) -> dict:
    """x and dy of [1, T, 4096] in bf16; the base weight and the adapters' values."""
    return {
        "x": torch.randn(1, T, IN_FEATURES, device=device, dtype=dtype),
        "dy": torch.randn(1, T, OUT_FEATURES, device=device, dtype=dtype),
        "W": (0.02 * torch.randn(OUT_FEATURES, IN_FEATURES, device=device)).to(dtype),
        "A": 0.02 * torch.randn(RANK, IN_FEATURES, device=device),
        "B": 0.02 * torch.randn(OUT_FEATURES, RANK, device=device),
    }


def _peft_layer(data: dict, adapter_fp32: bool = True):
    import peft

    base = torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False))
    base = base.to(device=data["x"].device, dtype=data["x"].dtype)
    with torch.no_grad():
        base[0].weight.copy_(data["W"])
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["0"])
    model = peft.get_peft_model(base, config, autocast_adapter_dtype=adapter_fp32)
    layer = model.base_model.model[0]
    load_adapter(layer, data["A"], data["B"])
    return model, layer


def load_adapter(layer, A: torch.Tensor, B: torch.Tensor) -> list[torch.Tensor]:
    """Give a PEFT LoRA layer's default adapter these values; returns its (A, B) parameters."""
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    with torch.no_grad():
        for param, value in zip(params, (A, B)):
            param.copy_(value)
    return params


def _setup(kind: str):
    """An Impl for one kind of projection; variants choose autocast and checkpointing."""

    def make(data: dict, autocast: bool = False, checkpoint: bool = False):
        if kind == "peft_no_cast" and not autocast:
            raise NotApplicable("without autocast a bf16 input cannot meet fp32 adapters uncast")
        x = data["x"].detach().requires_grad_()
        if kind == "base":
            module = torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False).to(device=x.device, dtype=x.dtype)
            with torch.no_grad():
                module.weight.copy_(data["W"])
            module.weight.requires_grad_(False)
            grads = [x]
        else:
            model, layer = _peft_layer(data, adapter_fp32=(kind != "peft_bf16"))
            grads = [x, layer.lora_A["default"].weight, layer.lora_B["default"].weight]
            if kind == "peft_no_cast":
                layer.cast_input_dtype_enabled = False
            if kind == "q35lab":
                from ..patch import route_lora  # the LoRA part of apply_to_qwen3_5, for a model of one layer

                route_lora(model)
            if kind == "axolotl":
                from axolotl.kernels.lora import apply_lora_linear

                module = lambda t: apply_lora_linear(layer, t)  # noqa: E731
            else:
                module = model

        def forward():
            with autocast_if(autocast, x.device.type):
                if checkpoint:
                    return torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
                return module(x)

        return forward, grads, data["dy"]

    return make


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """The rule for y, dx, dA, dB of lora_linear with fp32 adapters (PEFT's default) and
    activations in ``dtype``, against the same math in ``dtype`` and in fp64."""
    data = make_inputs(T, device, dtype)
    x = data["x"].requires_grad_()
    A, B = data["A"].clone().requires_grad_(), data["B"].clone().requires_grad_()
    scaling = ALPHA / RANK

    W, dy = data["W"], data["dy"]
    out = with_grads(lora_linear(x, W, A, B, scaling), [x, A, B], dy)
    ref = with_grads(lora_linear_ref(x, W, A, B, scaling), [x, A, B], dy)
    x64, A64, B64 = (t.detach().double().requires_grad_() for t in (x, A, B))
    ref64 = with_grads(lora_linear_ref(x64, W.double(), A64, B64, scaling), [x64, A64, B64], dy.double())
    return rule_rows("q35lab", ("y", "dx", "dA", "dB"), out, ref, ref64)


BENCH = OpBench(
    name="lora",
    title=f"LoRA projection {IN_FEATURES}→{OUT_FEATURES}, r = {RANK}, bf16 base",
    make_inputs=make_inputs,
    bytes_model=no_bytes_model,
    impls={
        "base (frozen)": (_setup("base"), ()),
        "peft": (_setup("peft"), ("peft",)),
        "peft (bf16 adapters)": (_setup("peft_bf16"), ("peft",)),
        "peft (no input cast)": (_setup("peft_no_cast"), ("peft",)),
        "axolotl": (_setup("axolotl"), ("peft", "axolotl", "bitsandbytes")),
        "q35lab": (_setup("q35lab"), ("peft",)),
    },
    check=check,
    ours="q35lab",
    passes=shapes.TRAINING_PASS,
    sweep=shapes.LORA_SWEEP_T,
    quick=shapes.LORA_QUICK_T,
    variants={
        "": {},
        "autocast": {"autocast": True},
        "checkpoint": {"checkpoint": True},
        "autocast+checkpoint": {"autocast": True, "checkpoint": True},
    },
    metric="time",
)
