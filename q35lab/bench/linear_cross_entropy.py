"""Benchmark of the fused linear cross entropy: hidden 4096, vocabulary 248,320, bf16.

Implementations (each skipped, and said so, where not installed):

* ``transformers``: ``cross_entropy(linear(x, W).float(), t)`` — the model's loss path, logits
  materialised (and upcast);
* ``liger``: ``LigerFusedLinearCrossEntropyLoss``;
* ``cut-cross-entropy``: ``cut_cross_entropy.linear_cross_entropy`` with its defaults;
* ``torch``: ``torch.nn.functional.linear_cross_entropy`` where the installed torch has it;
* ``q35lab``: ``q35lab.linear_cross_entropy``; and, for a trainable head, the same with
  ``weight_grad="recompute"`` (dW block by block of the vocabulary).

Variants: trainable head and frozen head (LoRA). Only the training pass (forward + backward) is
timed: fused implementations do the backward's work in the forward. GEMM-bound: reported as
time; "one logits matmul" (2·T·H·V FLOPs) is the unit the goals use.
"""

from __future__ import annotations

import importlib.util

import torch

from .. import shapes
from ..ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from .spec import NotApplicable, OpBench, no_bytes_model

HIDDEN, VOCAB = shapes.HIDDEN, shapes.VOCAB


def make_inputs(T: int, device, dtype=torch.bfloat16, vocab: int = VOCAB) -> dict:
    target = torch.randint(0, vocab, (T,), device=device)
    target[torch.rand(T, device=device) < 0.05] = -100  # some ignored tokens, as with padding
    return {
        "x": torch.randn(T, HIDDEN, device=device, dtype=dtype),
        "W": (torch.randn(vocab, HIDDEN, device=device) / HIDDEN**0.5).to(dtype),
        "target": target,
        "dy": torch.tensor(1.0, device=device, dtype=torch.float32),
    }


def _loss_fn(kind: str):
    if kind == "transformers":
        return lambda x, w, t: linear_cross_entropy_ref(x, w, t)
    if kind == "q35lab":
        return lambda x, w, t: linear_cross_entropy(x, w, t)
    if kind == "q35lab-recompute":
        return lambda x, w, t: linear_cross_entropy(x, w, t, weight_grad="recompute")
    if kind == "torch":
        return lambda x, w, t: torch.nn.functional.linear_cross_entropy(x, w, t)
    if kind == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda x, w, t: loss(w, x, t)
    if kind == "cut-cross-entropy":
        from cut_cross_entropy import linear_cross_entropy as cce

        return lambda x, w, t: cce(x, w, t, ignore_index=-100)
    raise ValueError(kind)


def _setup(kind: str):
    def make(data: dict, frozen: bool = False):
        if frozen and kind == "q35lab-recompute":
            raise NotApplicable("a frozen head has no weight gradient to make another way")
        x = data["x"].detach().requires_grad_()
        w = data["W"].detach().requires_grad_(not frozen)
        fn = _loss_fn(kind)
        return (lambda: fn(x, w, data["target"]).float()), ([x] if frozen else [x, w]), data["dy"]

    return make


def _available(kind: str) -> bool:
    if kind == "torch":
        return hasattr(torch.nn.functional, "linear_cross_entropy")
    module = {"liger": "liger_kernel", "cut-cross-entropy": "cut_cross_entropy"}.get(kind)
    return module is None or importlib.util.find_spec(module) is not None


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """Relative error of the loss and of dx against an fp32 reference (logits in fp32), for
    every implementation that runs here; ours also by the numerics rule (fp64)."""
    from ..numerics import rule_rows, with_grads

    vocab = VOCAB if device.type == "cuda" else 1000
    data = make_inputs(T, device, dtype, vocab)
    x32 = data["x"].float().requires_grad_()
    w32 = data["W"].float()
    ref_loss = linear_cross_entropy_ref(x32, w32, data["target"])
    (ref_dx,) = torch.autograd.grad(ref_loss, [x32])
    rows = []
    # the peers' kernels are GPU-only, and cut-cross-entropy's backward takes 16-bit inputs only
    peers = ["liger", "cut-cross-entropy", "torch"] if dtype != torch.float32 else ["liger", "torch"]
    kinds = ["q35lab", "transformers"] + (peers if device.type == "cuda" else [])
    for kind in kinds:
        if not _available(kind):
            continue
        x = data["x"].detach().requires_grad_()
        loss = _loss_fn(kind)(x, data["W"], data["target"]).float()
        (dx,) = torch.autograd.grad(loss, [x])
        rows.append({"impl": kind, "tensor": "loss", "rel_err": (abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())),
                     "ok": True})
        rows.append({"impl": kind, "tensor": "dx", "rel_err": ((dx.float() - ref_dx).norm() / ref_dx.norm()).item(),
                     "ok": True})
    if device.type != "cuda" or T <= 4096:  # the rule needs fp64 logits: small sizes only
        x, w, t = data["x"].detach().requires_grad_(), data["W"], data["target"]
        one = torch.tensor(1.0, device=device)
        out = with_grads(linear_cross_entropy(x, w, t), [x], one)
        ref = with_grads(linear_cross_entropy_ref(x, w, t), [x], one)
        x64 = data["x"].double().requires_grad_()
        ref64 = with_grads(linear_cross_entropy_ref(x64, w.double(), t), [x64], one.double())
        rows += rule_rows("q35lab", ("loss", "dx"), out, ref, ref64)
    for row in rows:
        row.setdefault("kernel_err", float("nan"))
        row.setdefault("bound", float("nan"))
    return rows


BENCH = OpBench(
    name="linear_cross_entropy",
    title=f"Linear cross entropy, hidden {HIDDEN}, vocabulary {VOCAB:,}, bf16",
    make_inputs=make_inputs,
    bytes_model=no_bytes_model,
    impls={
        "transformers": (_setup("transformers"), ()),
        "liger": (_setup("liger"), ("liger_kernel",)),
        "cut-cross-entropy": (_setup("cut-cross-entropy"), ("cut_cross_entropy",)),
        # torch's own, where the installed version has it (PyTorch ≥ 2.13)
        **({"torch": (_setup("torch"), ())} if hasattr(torch.nn.functional, "linear_cross_entropy") else {}),
        # the trainable head's gradient made block by block of the vocabulary (less memory)
        "q35lab (dW by vocabulary blocks)": (_setup("q35lab-recompute"), ()),
        "q35lab": (_setup("q35lab"), ()),
    },
    check=check,
    ours="q35lab",
    passes=shapes.TRAINING_PASS,
    sweep=[1024, 4096, 16 * 1024, 32 * 1024, 64 * 1024, 128 * 1024],
    quick=[16 * 1024],
    smoke=[5],
    check_sizes=[4096, 16 * 1024],
    variants={"trainable head": {}, "frozen head": {"frozen": True}},
    metric="time",
)
