"""A training step, and its measurement: wall time, the delta-rule core's share, peak memory, losses;
one GatedDeltaNet layer alone with its in_proj share."""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch

from ...hf.modules import IN_PROJ_NAMES
from .packing import sft_batch
from .timer import RegionTimer, _Stamp


def toy_corpus(n_sequences: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[n_sequences, length]`` token ids a tiny model learns in a few hundred CPU steps.

    Each sequence is an arithmetic progression modulo the vocabulary, ``x_{t+1} = (x_t + k) mod V``,
    with a random start and a step ``k`` from {1, 2, 3, 5, 7}. A causal LM never predicts the first
    token; the second is one of five, the rest follow. A model that learns the rule brings the mean
    loss from ln V to about ln 5 / (length − 1).
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    start = torch.randint(0, vocab, (n_sequences, 1), generator=generator)
    steps = torch.tensor([1, 2, 3, 5, 7])[torch.randint(0, 5, (n_sequences, 1), generator=generator)]
    return (start + steps * torch.arange(length)) % vocab


def tokens(T: int, vocab: int, device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (1, T), generator=generator).to(device)


def train_step(model, optimizer, batch) -> float:
    """Forward with labels under bf16 autocast, backward, optimizer step; returns the loss.
    ``batch``: token ids ``[B, T]`` (their own labels), or micro-batches (``packing.sft_batch``:
    the model's keyword arguments and a weight each) accumulated into one optimizer step."""
    if torch.is_tensor(batch):
        batch = [{"kwargs": {"input_ids": batch, "labels": batch}, "weight": 1.0}]
    total = 0.0
    for micro in batch:
        device = micro["kwargs"]["input_ids"].device
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model(**micro["kwargs"]).loss * micro["weight"]
        loss.backward()
        total += loss.detach().float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def _training_setup(model, lr: float):
    """The model's device, its vocabulary size (for random tokens) and a fresh AdamW over its
    trainable parameters: what every measured step starts from. The fused AdamW is what
    transformers' ``Trainer`` runs by default (``optim="adamw_torch_fused"``); torch's own default
    (``foreach``) is slower, by the same time in every variant."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=True)
    return next(model.parameters()).device, model.get_input_embeddings().weight.shape[0], optimizer


def _batch_seed(batch: str, step: int) -> int:
    """The seed of a step's SFT mix. A padded step trains the same micro-batches every step: their
    row counts and widths are compile-time constants of some of fla's kernels (its chunked cumsum's
    and output backward's batch size), so a new mix compiles new kernels, which a training run pays
    once per shape and a short measurement would pay in every step (a padded step with a new mix
    each step is then mostly compilation, inside the core's region). The warm-up compiles the shapes
    the measured steps then reuse. A packed step is one row of T tokens whatever its mix: each step
    its own."""
    return 0 if batch == "padded" else step


def measure(model, T: int, steps: int = 3, warmup: int = 1, lr: float = 1e-4, compile: bool = False,
            batch: str | None = None, progress: bool = False) -> dict:
    """Median step time and core time over ``steps`` steps after ``warmup``; peak memory; losses.
    ``compile``: the steps run ``torch.compile(model)`` (its compilation falls in the warm-up).
    ``batch``: one sequence of ``T`` random tokens (None), or ``T`` tokens of the SFT length mix
    "packed" into one row or "padded" per micro-batch (``packing``, ``_batch_seed``); their rows
    count the real (non-pad) tokens a second. ``progress``: each step's wall time on stderr as it ends (a run
    cut short by a time limit still says how far it got)."""
    device, vocab, optimizer = _training_setup(model, lr)
    step_model = torch.compile(model) if compile else model
    timer = RegionTimer()
    losses, step_ms, core_ms = [], [], []
    on_gpu = device.type == "cuda"
    with timer.functions(model) as n_wrapped:
        for i in range(warmup + steps):
            if batch is None:
                ids = tokens(T, vocab, device, seed=i)
            else:
                ids = sft_batch(batch, T, vocab, device, seed=_batch_seed(batch, i))
            if on_gpu:
                torch.cuda.synchronize()
                if i == warmup:
                    torch.cuda.reset_peak_memory_stats()
            timer.start(device.type)
            start = _Stamp(device.type)
            losses.append(train_step(step_model, optimizer, ids))
            end = _Stamp(device.type)
            if i >= warmup:
                step_ms.append(start.ms_until(end))
                core_ms.append(timer.total_ms())
            if progress:
                print(f"  T={T} step {i + 1}/{warmup + steps} ({'measured' if i >= warmup else 'warm-up'}): "
                      f"{start.ms_until(end):.0f} ms", file=sys.stderr, flush=True)
    step, core = statistics.median(step_ms), statistics.median(core_ms)
    if core == 0:  # none of the timed core functions ran (Unsloth's and axolotl's patches call the delta rule their
        # own way, and so may a MoE's): unknown, not 0
        core = math.nan
    shape = {}
    if batch is not None:  # the last step's batch: every step has T real tokens, only the padding differs
        real, padded = sum(m["real_tokens"] for m in ids), sum(m["tokens"] for m in ids)
        shape = {"batch": batch, "micro_batches": len(ids), "real_tokens": real, "padded_tokens": padded,
                 "real_tokens_per_s": real / step * 1e3}
    return {**shape,
        "step_ms": step, "core_ms": core, "outside_core_ms": step - core,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else math.nan,
        "loss_first": losses[0], "losses": json.dumps([round(v, 5) for v in losses]), "core_functions": n_wrapped,
    }


def measure_layer(model, T: int, steps: int = 3, warmup: int = 1) -> dict:
    """The model's first GatedDeltaNet alone, forward + backward under bf16 autocast at ``T``
    tokens: its time, and how much of it its four in_proj projections and its delta-rule core
    (with the causal convolution) take, each timed as regions (see ``RegionTimer``)."""
    device = next(model.parameters()).device
    gdn = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    hidden = gdn.in_proj_qkv.in_features
    in_proj, core = RegionTimer(), RegionTimer()
    layer_ms, in_proj_ms, core_ms = [], [], []
    with in_proj.modules([getattr(gdn, name) for name in IN_PROJ_NAMES]), core.functions(model):
        for i in range(warmup + steps):
            generator = torch.Generator(device="cpu").manual_seed(i)
            x = torch.randn(1, T, hidden, generator=generator).to(device, torch.bfloat16).requires_grad_()
            dy = torch.randn(1, T, hidden, generator=generator).to(device, torch.bfloat16)
            if device.type == "cuda":
                torch.cuda.synchronize()
            in_proj.start(device.type)
            core.start(device.type)
            start = _Stamp(device.type)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                out = gdn(x)
            (out[0] if isinstance(out, tuple) else out).backward(dy)
            end = _Stamp(device.type)
            model.zero_grad(set_to_none=True)
            if i >= warmup:
                layer_ms.append(start.ms_until(end))
                in_proj_ms.append(in_proj.total_ms())
                core_ms.append(core.total_ms())
    layer, proj, delta = (statistics.median(v) for v in (layer_ms, in_proj_ms, core_ms))
    return {"layer_ms": layer, "in_proj_ms": proj, "in_proj_share": proj / layer, "core_ms": delta,
            "core_share": delta / layer}
