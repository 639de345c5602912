"""Benchmark of the GatedDeltaNet in_proj fusion: four LoRA projections (r = 16) of one input.

transformers' default Qwen3.5 dims: hidden 4096 → in_proj_qkv 8192, in_proj_z 4096, in_proj_b
32, in_proj_a 32. Implementations:

* ``4 bases (frozen)``: the four frozen projections alone, called one after another — the floor;
* ``peft`` / ``peft (bf16 adapters)``: four PEFT LoRA layers, defaults / bf16 adapters;
* ``axolotl``: axolotl's fused ``apply_lora_gdn_in_proj`` over the PEFT layers (needs bitsandbytes);
* ``q35lab``: ``fused_lora_projections`` over the same PEFT parameters, the four outputs column
  blocks of one buffer (one base GEMM);
* ``q35lab (z own buffer)``: the patch's arrangement: z last and in a buffer of its own, so that
  the GatedDeltaNet's ``z.reshape(-1, head_dim)`` is a view, not a copy (two base GEMMs).

Variants: with and without bf16 autocast. GEMM-bound: reported as time.
"""

from __future__ import annotations

import torch

from .. import shapes
from ..numerics import rule_rows, with_grads
from ..ops.fused_projections import ConcatCache, Projection, fused_lora_projections, fused_lora_projections_ref
from .lora import load_adapter
from .spec import OpBench, autocast_if, no_bytes_model

HIDDEN = shapes.HIDDEN
KEY_DIM = shapes.GDN_KEY_HEADS * shapes.GDN_HEAD_DIM  # 2048
VALUE_DIM = shapes.GDN_VALUE_HEADS * shapes.GDN_HEAD_DIM  # 4096
OUT_FEATURES = {"in_proj_qkv": 2 * KEY_DIM + VALUE_DIM, "in_proj_z": VALUE_DIM,
                "in_proj_b": shapes.GDN_VALUE_HEADS, "in_proj_a": shapes.GDN_VALUE_HEADS}
RANK, ALPHA = 16, 32


class _InProjections(torch.nn.Module):
    """The four projections of a GatedDeltaNet, and nothing else."""

    def __init__(self):
        super().__init__()
        for name, n in OUT_FEATURES.items():
            setattr(self, name, torch.nn.Linear(HIDDEN, n, bias=False))

    def forward(self, x):
        return tuple(getattr(self, name)(x) for name in OUT_FEATURES)


def make_inputs(T: int, device, dtype=torch.bfloat16) -> dict:
    data = {"x": torch.randn(1, T, HIDDEN, device=device, dtype=dtype)}
    data["dy"] = tuple(torch.randn(1, T, n, device=device, dtype=dtype) for n in OUT_FEATURES.values())
    for name, n in OUT_FEATURES.items():
        data[f"W.{name}"] = (0.02 * torch.randn(n, HIDDEN, device=device)).to(dtype)
        data[f"A.{name}"] = 0.02 * torch.randn(RANK, HIDDEN, device=device)
        data[f"B.{name}"] = 0.02 * torch.randn(n, RANK, device=device)
    return data


def _build(data: dict, adapters: bool, adapter_fp32: bool = True):
    module = _InProjections().to(device=data["x"].device, dtype=data["x"].dtype).requires_grad_(False)
    with torch.no_grad():
        for name in OUT_FEATURES:
            getattr(module, name).weight.copy_(data[f"W.{name}"])
    if not adapters:
        return module, []
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(OUT_FEATURES))
    model = peft.get_peft_model(module, config, autocast_adapter_dtype=adapter_fp32)
    inner = model.base_model.model
    params = [p for name in OUT_FEATURES
              for p in load_adapter(getattr(inner, name), data[f"A.{name}"], data[f"B.{name}"])]
    return inner, params


def _setup(kind: str):
    def make(data: dict, autocast: bool = False):
        x = data["x"].detach().requires_grad_()
        inner, params = _build(data, adapters=(kind != "base"), adapter_fp32=(kind != "peft_bf16"))
        if kind in ("q35lab", "q35lab_own_z"):
            from ..patch.in_proj import IN_PROJ_GROUP, IN_PROJ_OWN_BUFFER

            order, own = (IN_PROJ_GROUP, IN_PROJ_OWN_BUFFER) if kind == "q35lab_own_z" else (tuple(OUT_FEATURES), ())
            layers = [getattr(inner, name) for name in order]
            projections = [Projection(l.base_layer.weight, None, l.lora_A["default"].weight, l.lora_B["default"].weight,
                                      l.scaling["default"]) for l in layers]
            cache = ConcatCache()

            def run(t):  # the outputs in OUT_FEATURES' order, as the other implementations give them
                outputs = dict(zip(order, fused_lora_projections(t, projections, cache=cache, own_buffer=own)))
                return tuple(outputs[name] for name in OUT_FEATURES)
        elif kind == "axolotl":
            from axolotl.kernels.lora import apply_lora_gdn_in_proj

            names = tuple(OUT_FEATURES)

            def run(t):  # axolotl 0.21: (module, X, proj_names) -> {name: output}, one call for all four
                outputs = apply_lora_gdn_in_proj(inner, t, names)
                return tuple(outputs[n] for n in names)
        else:
            run = inner

        def forward():
            with autocast_if(autocast, x.device.type):
                return tuple(run(x))

        return forward, [x, *params], data["dy"]

    return make


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """The rule for the four outputs, dx and every adapter gradient (fp32 adapters, activations
    in ``dtype``), against the unfused computation in ``dtype`` and in fp64."""
    data = make_inputs(T, device, dtype)

    def projections(cast):
        return [Projection(cast(data[f"W.{n}"]), None, cast(data[f"A.{n}"]).clone().requires_grad_(),
                           cast(data[f"B.{n}"]).clone().requires_grad_(), ALPHA / RANK) for n in OUT_FEATURES]

    def run(fn, x, ps, dys):
        return with_grads(fn(x, ps), [x] + [t for p in ps for t in (p.lora_A, p.lora_B)], dys)

    x = data["x"].requires_grad_()
    same = projections(lambda t: t)
    out = run(fused_lora_projections, x, same, data["dy"])
    ref = run(fused_lora_projections_ref, x, same, data["dy"])
    x64 = x.detach().double().requires_grad_()
    ref64 = run(fused_lora_projections_ref, x64, projections(lambda t: t.double()), [d.double() for d in data["dy"]])
    names = [f"y.{n}" for n in OUT_FEATURES] + ["dx"] + [f"d{m}.{n}" for n in OUT_FEATURES for m in ("A", "B")]
    return rule_rows("q35lab", names, out, ref, ref64)


BENCH = OpBench(
    name="in_proj",
    title=f"GatedDeltaNet in_proj: 4 projections of hidden {HIDDEN}, r = {RANK}, bf16 base",
    make_inputs=make_inputs,
    bytes_model=no_bytes_model,
    impls={
        "4 bases (frozen)": (_setup("base"), ()),
        "peft": (_setup("peft"), ("peft",)),
        "peft (bf16 adapters)": (_setup("peft_bf16"), ("peft",)),
        "axolotl": (_setup("axolotl"), ("peft", "axolotl", "bitsandbytes")),
        "q35lab": (_setup("q35lab"), ("peft",)),
        "q35lab (z own buffer)": (_setup("q35lab_own_z"), ("peft",)),
    },
    check=check,
    ours="q35lab",
    passes=shapes.TRAINING_PASS,
    sweep=shapes.LORA_SWEEP_T,
    quick=shapes.LORA_QUICK_T,
    variants={"": {}, "autocast": {"autocast": True}},
    metric="time",
)
