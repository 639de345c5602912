"""Benchmark of the GatedDeltaNet's delta-rule core alone: the code no variant of the step changes.

One layer's core at Qwen3.5-9B dimensions (32 heads of width 128 after the key heads are repeated
for the value heads, as transformers does before the call), bf16 q/k/v/beta, fp32 log-decay g,
``use_qk_l2norm_in_kernel=True`` as the model calls it:

* ``fla``: flash-linear-attention's ``chunk_gated_delta_rule`` on its own Triton kernels (what
  transformers calls when fla is installed; on Hopper its backward needs Triton >= 3.7.1, see
  ../shared/GPU.md and fla#640), FlashQLA turned off for the call (``FLA_FLASH_QLA=0``, which fla
  reads at every call);
* ``fla (FlashQLA)``: the same call where fla 0.6 hands it to FlashQLA (``flash-qla``, TileLang
  kernels: SM90/SM100, 128-wide heads, bf16/fp16), forward and backward; its backward runs none
  of fla's Triton kernels, so no Triton version is refused. Skipped where flash_qla is missing;
  where fla turns the call down (another GPU), the row measures fla's Triton kernels again;
* ``transformers (PyTorch)``: transformers' ``torch_chunk_gated_delta_rule``, the fallback a
  model without fla runs.

The rows give the step's floor its delta-rule term and the patch report its "how much slower".
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .. import shapes
from ..numerics import rule_rows, with_grads
from .spec import OpBench, no_bytes_model

HEADS, WIDTH = shapes.GDN_VALUE_HEADS, shapes.GDN_HEAD_DIM
INPUTS = ("q", "k", "v", "g", "beta")


def make_inputs(T: int, device, dtype=torch.bfloat16) -> dict:
    """q, k, v [1, T, 32, 128]; g = log-decay < 0 [1, T, 32] (fp32); beta in (0, 1); dy like v."""
    shape = (1, T, HEADS, WIDTH)
    return {
        "q": torch.randn(shape, device=device, dtype=dtype),
        "k": torch.randn(shape, device=device, dtype=dtype),
        "v": torch.randn(shape, device=device, dtype=dtype),
        "g": -torch.nn.functional.softplus(torch.randn(1, T, HEADS, device=device)) * 0.5,
        "beta": torch.rand(1, T, HEADS, device=device).to(dtype),
        "dy": torch.randn(shape, device=device, dtype=dtype),
    }


def _torch_core():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    core = modeling_qwen3_5.torch_chunk_gated_delta_rule
    return getattr(core, "__wrapped__", core)  # transformers >= 5.20 wraps it with fla's, if installed


def _fla_core():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _with_flash_qla(core, on: bool):
    """``core`` called with fla's FlashQLA backend on or off (fla reads ``FLA_FLASH_QLA`` at each
    call; the backward is the autograd function the forward picked)."""

    def call(*args, **kwargs):
        before = os.environ.get("FLA_FLASH_QLA")
        os.environ["FLA_FLASH_QLA"] = "1" if on else "0"
        try:
            return core(*args, **kwargs)
        finally:
            if before is None:
                del os.environ["FLA_FLASH_QLA"]
            else:
                os.environ["FLA_FLASH_QLA"] = before

    return call


def _fla_triton_core():
    return _with_flash_qla(_fla_core(), on=False)


def _fla_flash_qla_core():
    return _with_flash_qla(_fla_core(), on=True)


def _core_impl(load):
    def make(data: dict, **_variant):
        core = load()
        args = {name: data[name].detach().clone().requires_grad_() for name in INPUTS}

        def forward():
            return core(args["q"], args["k"], args["v"], args["g"], args["beta"], use_qk_l2norm_in_kernel=True)[0]

        return forward, list(args.values()), data["dy"]

    return make


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """fla's output and five gradients by the rule against transformers' PyTorch core (same dtype
    and fp64), where fla is installed; no rows without it (there is no q35lab kernel here)."""
    try:
        fla_core = _fla_core()
    except ImportError:
        return []
    data = make_inputs(T, device, dtype)
    dy = data["dy"]

    def run(core, cast):
        args = [cast(data[name]).detach().requires_grad_() for name in INPUTS]
        return with_grads(core(*args, use_qk_l2norm_in_kernel=True)[0], args, cast(dy))

    ref = run(_torch_core(), lambda t: t)
    ref64 = run(_torch_core(), lambda t: t.double())
    cores = {"fla": _with_flash_qla(fla_core, on=False)}
    if importlib.util.find_spec("flash_qla") is not None:
        cores["fla (FlashQLA)"] = _with_flash_qla(fla_core, on=True)
    rows = []
    for name, core in cores.items():
        try:
            out = run(core, lambda t: t)
        except Exception as exc:  # fla#640's refusal (Hopper, Triton < 3.7.1) must not hide FlashQLA's rows
            print(f"delta_rule check: {name}: {type(exc).__name__}: {exc}"[:300])
            continue
        rows += rule_rows(name, ("o", "dq", "dk", "dv", "dg", "dbeta"), out, ref, ref64)
    return rows


BENCH = OpBench(
    name="delta_rule",
    title=f"Delta-rule core of one GatedDeltaNet, {HEADS} heads × {WIDTH}, bf16 (no q35lab kernel)",
    make_inputs=make_inputs,
    bytes_model=no_bytes_model,
    impls={
        "transformers (PyTorch)": (_core_impl(_torch_core), ("transformers",)),
        "fla": (_core_impl(_fla_triton_core), ("fla",)),
        "fla (FlashQLA)": (_core_impl(_fla_flash_qla_core), ("fla", "flash_qla")),
    },
    check=check,
    ours="fla",
    passes=("fwd+bwd",),
    sweep=[8 * 1024, 32 * 1024],
    quick=[32 * 1024],
    smoke=[64],
    check_sizes=[1024],
    metric="time",
)
