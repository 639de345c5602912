"""One training step of a Qwen3.5 + PEFT model, patched or not: the end-to-end measurement.

A model is built from a config (no download), wrapped by PEFT with LoRA on every linear layer,
optionally patched (by q35lab, by Liger, or by axolotl's gated-norm kernel), and trained with
gradient checkpointing under bf16 autocast, as a fine-tuning run would. For each step we record

* the step's wall time (forward, backward and optimizer step, between CUDA events);
* the share of it spent in the delta-rule core and the causal convolution — code that is not
  ours and that no variant changes — timed by ``CoreTimer`` around those functions, forward
  (including checkpointing's recompute) and backward; the rest is the step "outside the core";
* the peak memory allocated, and the loss (equal across variants at the same seed).

Patching libraries replace classes module-wide (Liger does), so the CLI runs every variant in a
fresh process::

    python -m q35lab.e2e --variants peft peft+liger q35lab --T 8192 32768 --out data/bench/<gpu>/end_to_end.csv
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

#: What each variant does to the PEFT model: q35lab flags, or a peer's patch.
ALL_FLAGS = ("rms_norm", "gated_norm", "lora", "in_proj", "flce")
VARIANTS = {
    "peft": "PEFT with its defaults (fp32 adapters, input cast)",
    "peft+liger": "PEFT + apply_liger_kernel_to_qwen3_5 (RMSNorm, SwiGLU, fused linear cross entropy)",
    "peft+axolotl": "PEFT + axolotl's FusedRMSNormGated for the gated norm (its LoRA kernels need bitsandbytes)",
    "q35lab": "PEFT + q35lab.apply_to_qwen3_5, every optimization",
    **{f"q35lab:{flag}": f"PEFT + q35lab, only {flag}" for flag in ALL_FLAGS},
}

#: Names under which transformers' Qwen3.5 holds the delta-rule core and the causal convolution:
#: module functions (transformers ≥ 5.20) or GatedDeltaNet attributes (earlier versions).
CORE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule", "causal_conv1d_fn")


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
def config(size: str = "h200", layers: int = 4):
    """A Qwen3.5 text config: ``"h200"`` keeps transformers' default dimensions (hidden 4096,
    vocabulary 248,320, GatedDeltaNet 16×128 keys / 32×128 values) with ``layers`` decoder layers,
    every fourth full attention; ``"tiny"`` is a CPU-sized model with the same structure."""
    from transformers import Qwen3_5TextConfig

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if size == "h200":
        return Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=layer_types)
    if size == "tiny":
        return Qwen3_5TextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, layer_types=layer_types,
        )
    raise ValueError(f"size: expected 'h200' or 'tiny', got {size!r}")


def build(size: str = "h200", layers: int = 4, rank: int = 16, device=None, dtype=torch.bfloat16, seed: int = 0,
          checkpointing: bool = True):
    """``AutoModelForCausalLM.from_config`` (random weights, seeded), LoRA r=``rank`` on every
    linear layer (PEFT's defaults otherwise: fp32 adapters), gradient checkpointing."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(size, layers), dtype=dtype)
    if device is not None:
        model = model.to(device)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    with torch.no_grad():  # LoRA starts with B = 0; a non-zero B makes the adapters' path count
        generator = torch.Generator(device="cpu").manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.01)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def prepare(model, variant: str):
    """Apply ``variant`` to a PEFT model in place; returns what the patch reported (or None)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {sorted(VARIANTS)}, got {variant!r}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if variant == "peft":
        return None
    if variant == "peft+liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5

        apply_liger_kernel_to_qwen3_5(model=base)
        return None
    if variant == "peft+axolotl":
        return _axolotl_gated_norm(base)
    import q35lab

    flags = dict.fromkeys(ALL_FLAGS, True) if variant == "q35lab" else {f: f == variant.split(":")[1] for f in ALL_FLAGS}
    return q35lab.apply_to_qwen3_5(model, **flags)


def _axolotl_gated_norm(base) -> str:
    """axolotl's FusedRMSNormGated in place of every GatedDeltaNet's norm (weights shared)."""
    from axolotl.kernels.rms_norm_gated import FusedRMSNormGated

    count = 0
    for module in base.modules():
        norm = getattr(module, "norm", None)
        if type(norm).__name__ == "Qwen3_5RMSNormGated":
            fused = FusedRMSNormGated(norm.weight.shape[0], eps=norm.variance_epsilon).to(norm.weight.device)
            fused.weight = norm.weight
            module.norm = fused
            count += 1
    return f"replaced {count} gated norms by axolotl's FusedRMSNormGated"


# ----------------------------------------------------------------------------------------------
# Timing the delta-rule core
# ----------------------------------------------------------------------------------------------
class _Stamp:
    """A point in the GPU's stream (a CUDA event), or in host time on a CPU."""

    def __init__(self, device_type: str):
        self.event = torch.cuda.Event(enable_timing=True) if device_type == "cuda" else None
        if self.event is not None:
            self.event.record()
        else:
            self.time = time.perf_counter()

    def ms_until(self, end: "_Stamp") -> float:
        return self.event.elapsed_time(end.event) if self.event is not None else 1e3 * (end.time - self.time)


class CoreTimer:
    """Times every call of the delta-rule core and the causal convolution, forward and backward.

    Forward: a stamp before and after the call (a checkpointed layer's recompute is a call too).
    Backward: from the moment the gradient of the call's output arrives (a hook on the output)
    to the moment the gradients of all its differentiable inputs are done (hooks on the inputs) —
    autograd runs that region's nodes in between. ``total_ms()`` sums the intervals of one step.
    """

    def __init__(self):
        self.intervals: list[tuple[_Stamp, _Stamp]] = []
        self._undo: list = []

    def reset(self) -> None:
        self.intervals.clear()

    def total_ms(self) -> float:
        if self.intervals and self.intervals[0][0].event is not None:
            torch.cuda.synchronize()
        return sum(start.ms_until(end) for start, end in self.intervals)

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            device_type = tensors[0].device.type if tensors else "cpu"
            start = _Stamp(device_type)
            out = fn(*args, **kwargs)
            self.intervals.append((start, _Stamp(device_type)))
            if torch.is_grad_enabled():
                outputs = [o for o in (out if isinstance(out, tuple) else (out,))
                           if isinstance(o, torch.Tensor) and o.requires_grad]
                self._watch_backward([t for t in tensors if t.requires_grad], outputs, device_type)
            return out

        return timed

    def _watch_backward(self, inputs, outputs, device_type) -> None:
        if not inputs or not outputs:
            return
        state = {"start": None, "pending": len(inputs)}

        def output_grad_arrives(grad):
            if state["start"] is None:
                state["start"] = _Stamp(device_type)

        def input_grad_done(grad):
            state["pending"] -= 1
            if state["pending"] == 0 and state["start"] is not None:
                self.intervals.append((state["start"], _Stamp(device_type)))

        for o in outputs:
            o.register_hook(output_grad_arrives)
        for t in inputs:
            t.register_hook(input_grad_done)

    @contextlib.contextmanager
    def installed(self, model):
        """Wrap the core functions where this transformers version keeps them; undo on exit."""
        from transformers.models.qwen3_5 import modeling_qwen3_5

        targets = [(modeling_qwen3_5, name) for name in CORE_FUNCTIONS]
        targets += [(m, name) for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")
                    for name in CORE_FUNCTIONS if name in vars(m)]
        undo = []
        for owner, name in targets:
            fn = getattr(owner, name, None)
            if callable(fn):
                setattr(owner, name, self.wrap(fn))
                undo.append((owner, name, fn))
        try:
            yield len(undo)
        finally:
            for owner, name, fn in undo:
                setattr(owner, name, fn)


# ----------------------------------------------------------------------------------------------
# A training step and its measurement
# ----------------------------------------------------------------------------------------------
def toy_corpus(n_sequences: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[n_sequences, length]`` token ids a tiny model learns in a few hundred CPU steps.

    Each sequence is an arithmetic progression modulo the vocabulary, ``x_{t+1} = (x_t + k) mod V``,
    with a random start and a step ``k`` from {1, 2, 3, 5, 7}: the first token is a guess (ln V),
    the second one of five, the rest follow. A model that learns the rule brings the mean loss
    from ln V to about (ln V + ln 5) / length.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    start = torch.randint(0, vocab, (n_sequences, 1), generator=generator)
    steps = torch.tensor([1, 2, 3, 5, 7])[torch.randint(0, 5, (n_sequences, 1), generator=generator)]
    return (start + steps * torch.arange(length)) % vocab


def tokens(T: int, vocab: int, device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (1, T), generator=generator).to(device)


def train_step(model, optimizer, input_ids: torch.Tensor) -> float:
    """Forward with labels under bf16 autocast, backward, optimizer step; returns the loss."""
    with torch.autocast(device_type=input_ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().float().item()


def measure(model, T: int, steps: int = 3, warmup: int = 1, lr: float = 1e-4) -> dict:
    """Median step time and core time over ``steps`` steps after ``warmup``; peak memory; losses."""
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    timer = CoreTimer()
    losses, step_ms, core_ms = [], [], []
    on_gpu = device.type == "cuda"
    with timer.installed(model) as n_wrapped:
        for i in range(warmup + steps):
            ids = tokens(T, vocab, device, seed=i)
            if on_gpu:
                torch.cuda.synchronize()
                if i == warmup:
                    torch.cuda.reset_peak_memory_stats()
            timer.reset()
            start = _Stamp(device.type)
            losses.append(train_step(model, optimizer, ids))
            end = _Stamp(device.type)
            if on_gpu:
                torch.cuda.synchronize()
            if i >= warmup:
                step_ms.append(start.ms_until(end))
                core_ms.append(timer.total_ms())
    step, core = statistics.median(step_ms), statistics.median(core_ms)
    return {
        "step_ms": step, "core_ms": core, "outside_core_ms": step - core,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else math.nan,
        "loss_first": losses[0], "losses": json.dumps([round(v, 5) for v in losses]), "core_functions": n_wrapped,
    }


# ----------------------------------------------------------------------------------------------
# CLI: one process per variant
# ----------------------------------------------------------------------------------------------
def _one_variant(args) -> None:
    """Runs in its own process: build, patch, measure every T, append JSON lines to --out."""
    from .bench import core

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = core.run_info()
    model = build(args.size, args.layers, args.rank, device=device)
    report = prepare(model, args.variant)
    for T in args.T:
        row = {"variant": args.variant, "T": T, "size": args.size, "layers": args.layers, "rank": args.rank,
               "status": "ok", "note": "", "report": " ".join(str(report).split())[:300] if report else ""}
        try:
            row.update(measure(model, T, steps=args.steps, warmup=args.warmup))
        except torch.cuda.OutOfMemoryError:
            row.update(status="oom", note="out of memory")
        except Exception as exc:  # a variant failing is a result
            row.update(status="error", note=f"{type(exc).__name__}: {exc}"[:300])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row.update(info)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{args.variant:22s} T={T:6d} {row['status']:5s} step {row.get('step_ms', math.nan):9.1f} ms, "
              f"outside core {row.get('outside_core_ms', math.nan):9.1f} ms, peak {row.get('peak_gib', math.nan):6.1f} GiB",
              flush=True)
        if row["status"] == "oom":
            break  # longer sequences will not fit either


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["peft", "peft+liger", "q35lab"], choices=sorted(VARIANTS))
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--size", default="h200", choices=["h200", "tiny"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", required=True, help="CSV to write (a .jsonl of the same name collects the rows)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # the child process's one variant
    args = parser.parse_args(argv)
    if args.variant:
        _one_variant(args)
        return 0
    import pandas as pd

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = out.with_suffix(".jsonl")
    lines.unlink(missing_ok=True)
    for variant in args.variants:
        child = [sys.executable, "-m", "q35lab.e2e", "--variant", variant, "--out", str(lines), "--size", args.size,
                 "--layers", str(args.layers), "--rank", str(args.rank), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--T", *map(str, args.T)]
        if subprocess.run(child).returncode != 0:
            with open(lines, "a") as f:
                f.write(json.dumps({"variant": variant, "status": "error", "note": "the process failed"}) + "\n")
    rows = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
    pd.DataFrame(rows).to_csv(out, index=False, float_format="%.5g")
    lines.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
