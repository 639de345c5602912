"""Benchmark of the GatedDeltaNet's short convolution: depthwise causal conv1d + SiLU, bf16.

Real Qwen3.5-9B dims: ``C = 2·key_dim + value_dim = 8192`` channels (the in_proj_qkv output),
filter width ``K = 4`` (``linear_conv_kernel_dim``), no bias, batch 1, x ``[1, T, C]`` as
in_proj_qkv writes it. Peers (each skipped, and said so, when it is not installed):

* ``transformers``: the fallback a Qwen3.5 model runs without the ``causal-conv1d`` package —
  transformers' ``causal_conv1d_fn`` (``F.conv1d`` with ``padding=K-1``, the slice, SiLU, the
  cast) between the model's two transposes, written out here so that an installed package or a
  hub kernel cannot be swapped in behind the name;
* ``torch.compile``: the same function compiled by Inductor;
* ``fla``: flash-linear-attention's ``causal_conv1d`` (Triton, channels last);
* ``causal-conv1d``: the CUDA package's ``causal_conv1d_fn`` on ``x.transpose(1, 2)`` (a
  channels-last view it reads in place);
* ``q35lab``: ``q35lab.ops.causal_conv1d``.

Variants: the weight trainable (full fine-tuning: dW computed) and frozen (LoRA leaves conv1d
frozen: only dx).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .. import runtime, shapes
from ..numerics import agreement, rule_rows, with_grads
from ..ops.causal_conv1d import causal_conv1d, causal_conv1d_ref
from .spec import NotApplicable, OpBench

CHANNELS = 2 * shapes.GDN_KEY_HEADS * shapes.GDN_HEAD_DIM + shapes.GDN_VALUE_HEADS * shapes.GDN_HEAD_DIM  # 8192
KERNEL = 4  # Qwen3_5TextConfig.linear_conv_kernel_dim
#: Smoke checks (interpreter) use fewer channels: C = 8192 is slow through the interpreter, and so is
#: the references' CPU conv1d.
SMOKE_CHANNELS = 64


def make_inputs(T: int, device, dtype=torch.bfloat16, channels: int = CHANNELS, kernel: int = KERNEL) -> dict:
    """x and dy ``[1, T, C]``, the ``[C, K]`` filter (``conv1d.weight.squeeze(1)``), bias None."""
    return {
        "x": torch.randn(1, T, channels, device=device, dtype=dtype),
        "w": (0.5 * torch.randn(channels, kernel, device=device)).to(dtype),
        "dy": torch.randn(1, T, channels, device=device, dtype=dtype),
    }


def bytes_model(T: int, pass_: str, channels: int = CHANNELS, elem: int = 2) -> int:
    """Minimal traffic: forward reads x and writes y; backward reads x and dy and writes dx.

    The filter and its gradient (C·K values) and the halo re-reads (K-1 tokens a tile) are
    left out."""
    per_tensor = T * channels * elem
    return {"fwd": 2 * per_tensor, "bwd": 3 * per_tensor, "fwd+bwd": 5 * per_tensor}[pass_]


def transformers_fallback(x: torch.Tensor, weight: torch.Tensor, bias=None, activation: str | None = "silu"):
    """What Qwen3_5GatedDeltaNet runs without the causal-conv1d package (transformers 5.24):
    ``mixed_qkv.transpose(1, 2)``, ``causal_conv1d_fn``'s body, ``.transpose(1, 2)``."""
    hidden_states = x.transpose(1, 2)
    _, hidden_size, seq_len = hidden_states.shape
    out = F.conv1d(hidden_states.to(weight.dtype), weight=weight.unsqueeze(1), bias=bias,
                   padding=weight.shape[-1] - 1, groups=hidden_size)[:, :, :seq_len]
    if activation is not None:
        out = F.silu(out)
    return out.to(hidden_states.dtype).transpose(1, 2)


def _fla_fn():
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d

    if "residual" not in inspect.signature(fla_causal_conv1d).parameters:
        raise NotApplicable("this fla's causal_conv1d is the old head-first [B, D, T] one")
    return lambda x, w: fla_causal_conv1d(x, weight=w, bias=None, activation="silu")[0]


def _cuda_package_fn():
    from causal_conv1d import causal_conv1d_fn

    return lambda x, w: causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)


def _compiled_fallback():
    compiled = torch.compile(transformers_fallback, dynamic=False)
    return lambda x, w: compiled(x, w)


def _setup(build):
    """An Impl: ``build()`` gives ``fn(x, w) -> y`` (imported lazily: a missing peer is only
    imported when measured)."""

    def make(data: dict, frozen: bool = False):
        fn = build()
        x = data["x"].detach().requires_grad_()
        w = data["w"].detach().clone().requires_grad_(not frozen)
        return (lambda: fn(x, w)), ([x] if frozen else [x, w]), data["dy"]

    return make


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """The rule for y, dx and dw at ``T`` (C = 8192 on a GPU, SMOKE_CHANNELS through the
    interpreter); bf16 agreement of y with transformers' fallback (which rounds twice)."""
    channels = SMOKE_CHANNELS if runtime.smoke() else CHANNELS
    data = make_inputs(T, device, dtype, channels)
    x, w, dy = data["x"].requires_grad_(), data["w"].requires_grad_(), data["dy"]
    out = with_grads(causal_conv1d(x, w), [x, w], dy)
    ref = with_grads(causal_conv1d_ref(x, w), [x, w], dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref64 = with_grads(causal_conv1d_ref(x64, w64), [x64, w64], dy.double())
    rows = rule_rows("q35lab", ("y", "dx", "dw"), out, ref, ref64)
    with torch.no_grad():
        hf_y = transformers_fallback(x, w).contiguous()
    rows[0].update({"vs": "transformers", **agreement(out[0].detach(), hf_y)})
    return rows


BENCH = OpBench(
    name="causal_conv1d",
    title=f"GatedDeltaNet short conv: depthwise causal conv1d + SiLU, C = {CHANNELS}, K = {KERNEL}, bf16",
    make_inputs=make_inputs,
    bytes_model=bytes_model,
    impls={
        "transformers": (_setup(lambda: transformers_fallback), ()),
        "torch.compile": (_setup(_compiled_fallback), ()),
        "fla": (_setup(_fla_fn), ("fla",)),
        "causal-conv1d": (_setup(_cuda_package_fn), ("causal_conv1d",)),
        "q35lab": (_setup(lambda: causal_conv1d), ()),
    },
    check=check,
    ours="q35lab",
    check_sizes=[8 * 1024, 32 * 1024],  # fp64 references of [T, 8192]: 2 GiB a tensor at 32k
    variants={"": {}, "frozen w": {"frozen": True}},
)
