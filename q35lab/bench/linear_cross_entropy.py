"""Benchmark of the fused linear cross entropy: hidden 4096, vocabulary 248,320, bf16.

Implementations (each skipped, and said so, where not installed):

* ``transformers``: ``cross_entropy(linear(x, W).float(), t)`` — the model's loss path, logits
  materialised (and upcast);
* ``liger``: ``LigerFusedLinearCrossEntropyLoss``;
* ``cut-cross-entropy``: ``cut_cross_entropy.linear_cross_entropy`` with its defaults;
* ``torch``: ``torch.nn.functional.linear_cross_entropy`` where the installed torch has it;
* ``pytorch, chunked``: ``torch_chunked_cross_entropy`` below — chunking and nothing else, in
  plain PyTorch (what chunking buys without a kernel);
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


#: Rows a chunk of the PyTorch baseline: 1024 × 248,320 logits are 0.5 GB in bf16, 1 GB per fp32 copy.
TORCH_CHUNK_ROWS = 1024


def _chunk_loss_sum(x: torch.Tensor, W: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """transformers' path on one chunk: bf16 logits, upcast, cross entropy summed over its rows."""
    logits = torch.nn.functional.linear(x, W).float()
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")


def torch_chunked_cross_entropy(x: torch.Tensor, W: torch.Tensor, target: torch.Tensor,
                                chunk_rows: int = TORCH_CHUNK_ROWS) -> torch.Tensor:
    """``mean_i (lse(x_i·Wᵀ) − x_i·w_{t_i})`` over the rows whose target is not -100, a chunk of
    rows at a time, each chunk's loss under ``torch.utils.checkpoint``: no chunk's logits outlive
    its forward, and the backward makes them again (one more logits matmul than a loss that makes
    its gradients in its forward, and the fp32 upcasts of transformers' path, chunk by chunk)."""
    from torch.utils.checkpoint import checkpoint

    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        total = total + checkpoint(_chunk_loss_sum, x[rows], W, target[rows], use_reentrant=False)
    return total / (target != -100).sum()


def _loss_fn(kind: str):
    if kind == "transformers":
        return lambda x, w, t: linear_cross_entropy_ref(x, w, t)
    if kind == "q35lab":
        return lambda x, w, t: linear_cross_entropy(x, w, t)
    if kind == "q35lab-recompute":
        return lambda x, w, t: linear_cross_entropy(x, w, t, weight_grad="recompute")
    if kind == "torch":
        return lambda x, w, t: torch.nn.functional.linear_cross_entropy(x, w, t)
    if kind == "pytorch-chunked":
        return torch_chunked_cross_entropy
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


#: Tokens of fp64 (or fp32) logits the exact reference holds at once: 1024 × 248,320 × 8 bytes = 2 GB.
REFERENCE_CHUNK = 1024


def _reference(x, W, target, dtype, chunk: int = REFERENCE_CHUNK):
    """Loss and dx of the materialising loss computed in ``dtype``, ``chunk`` tokens at a time
    (all of T's fp64 logits at once would need T·V·8 bytes: 32 GB at T = 16k)."""
    W = W.to(dtype)
    n_valid = (target != -100).sum().to(dtype)
    total, dx = torch.zeros((), dtype=dtype, device=x.device), torch.empty(x.shape, dtype=dtype, device=x.device)
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        part = x[rows].detach().to(dtype).requires_grad_()
        loss = linear_cross_entropy_ref(part, W, target[rows], reduction="sum")
        (dx[rows],) = torch.autograd.grad(loss, [part])
        total += loss.detach()
    return total / n_valid, dx / n_valid


def _exact_dtype(T: int, device, dtype):
    """What the "exact" reference is computed in: fp64 where affordable (a CPU's small
    vocabulary; T ≤ 4096 on a GPU, about 2·T·H·V fp64 FLOPs twice); beyond that fp32, which is
    exact enough for 16-bit inputs only. None: no reference can judge fp32 there."""
    if device.type != "cuda" or T <= 4096:
        return torch.float64
    return torch.float32 if dtype != torch.float32 else None


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """The numerics rule for the loss and dx of every implementation that runs here: against
    the materialising loss in ``dtype`` (what transformers computes) and an exact one (fp64, or
    fp32 at GPU sizes for 16-bit inputs; see ``_exact_dtype``), the absolute slack scaled to the
    tensor's size (``numerics.scaled_atol``). With the norm-wise relative error against the
    exact reference beside it."""
    from ..numerics import compare, scaled_atol

    exact_dtype = _exact_dtype(T, device, dtype)
    if exact_dtype is None:
        return []
    vocab = VOCAB if device.type == "cuda" else 1000
    data = make_inputs(T, device, dtype, vocab)
    W, target = data["W"], data["target"]
    exact = _reference(data["x"], W, target, exact_dtype)
    x = data["x"].detach().requires_grad_()
    ref_loss = linear_cross_entropy_ref(x, W, target)
    same = (ref_loss.detach(), torch.autograd.grad(ref_loss, [x])[0])
    # the peers' kernels are GPU-only, and cut-cross-entropy's backward takes 16-bit inputs only
    peers = ["liger", "cut-cross-entropy", "torch"] if dtype != torch.float32 else ["liger", "torch"]
    rows = []
    for kind in ["q35lab", "pytorch-chunked"] + (peers if device.type == "cuda" else []):
        if not _available(kind):
            continue
        x = data["x"].detach().requires_grad_()
        loss = _loss_fn(kind)(x, W, target).float()
        outs = (loss.detach(), torch.autograd.grad(loss, [x])[0])
        for name, out, ref, hi in zip(("loss", "dx"), outs, same, exact):
            # dx is a mean over tokens, ~1e-5 a value at GPU sizes: the absolute atol is scaled to it
            result = compare(name, out.to(ref.dtype), ref, hi, atol=scaled_atol(hi, ref.dtype))
            rows.append({"impl": kind, "tensor": name, "kernel_err": result.kernel_err, "ref_err": result.ref_err,
                         "bound": result.bound, "ok": result.ok, "rel_err": _relative(out, hi),
                         "reference": str(exact_dtype).removeprefix("torch.").replace("float", "fp")})
    return rows


def _relative(out: torch.Tensor, exact: torch.Tensor) -> float:
    """‖out − exact‖ / ‖exact‖ in fp64."""
    exact = exact.double()
    return ((out.double() - exact).norm() / exact.norm()).item()


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
        "pytorch, chunked": (_setup("pytorch-chunked"), ()),
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
