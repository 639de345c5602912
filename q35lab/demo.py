"""``python -m q35lab demo``: the first command to run. It trains a tiny Qwen3.5 + PEFT LoRA model a
few steps unpatched, then patched, from the same seed and data, and prints a short summary: the
patch's report, the two loss curves side by side, whether they agree, and how long each run took.

On a GPU it then times one training step at the 9B's dimensions (four of its layers, the real
vocabulary) with PEFT alone and with q35lab: step time, tokens a second and peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import warnings

import torch

#: The curves agree when every step's loss is within this relative distance of the unpatched one.
#: Both runs train under bf16 autocast, and the kernels round in other places than PyTorch's ops.
LOSS_RTOL = 2e-2
TINY_LAYERS = 4  # three GatedDeltaNets and one full-attention layer, the real models' pattern
REAL_LAYERS = 4  # at the 9B's dimensions: the same pattern, a few GiB of weights


def _train(model, steps: int, seq: int, seed: int) -> list[float]:
    """A plain loop over one batch of two toy sequences, which the model learns (the loss falls):
    bf16 autocast, gradient checkpointing (on from ``build``), AdamW; the losses."""
    from .bench.e2e import toy_corpus, train_step

    device = next(model.parameters()).device
    batch = toy_corpus(2, seq, model.get_input_embeddings().weight.shape[0], seed=seed).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    return [train_step(model, optimizer, batch) for _ in range(steps)]


def compare(steps: int = 4, seq: int = 32, seed: int = 0) -> dict:
    """The tiny model trained ``steps`` steps unpatched and patched: the report, both loss curves,
    their largest relative difference and each run's seconds."""
    import q35lab

    from .bench.e2e import build
    from .runtime import device

    runs = {}
    for name in ("unpatched", "patched"):
        model = build("tiny", TINY_LAYERS, rank=8, device=device(), dtype=torch.float32, seed=seed)
        report = q35lab.apply_to_qwen3_5(model) if name == "patched" else None
        start = time.perf_counter()
        runs[name] = _train(model, steps, seq, seed)
        runs[name + "_s"] = time.perf_counter() - start
        runs["report"] = report or runs.get("report")
    difference = max(abs(p - u) / abs(u) for u, p in zip(runs["unpatched"], runs["patched"]))
    return {**runs, "max_rel_difference": difference, "agree": difference <= LOSS_RTOL}


def real_size_step(size: str = "h200", tokens: int = 8192, layers: int = REAL_LAYERS) -> dict:
    """One measured step (after one warm-up) with PEFT alone and with q35lab, each on a fresh model of
    ``size`` (``"h200"``: the 9B's dimensions): variant → its step's numbers, or the error that stopped it."""
    import q35lab

    from .bench.e2e import build, measure
    from .bench.e2e.memory import is_out_of_memory
    from .runtime import device

    results = {}
    for variant in ("PEFT", "PEFT + q35lab"):
        model = None
        try:
            model = build(size, layers, device=device())
            if variant != "PEFT":
                q35lab.apply_to_qwen3_5(model)
            row = measure(model, tokens, steps=1, warmup=1)
            results[variant] = {"step_ms": row["step_ms"], "tokens_per_s": tokens / row["step_ms"] * 1e3,
                                "peak_gib": row["peak_gib"], "loss": row["loss_first"]}
        except Exception as error:  # noqa: BLE001 - a peer's failure is a result to report, not a crash
            if not is_out_of_memory(error):
                raise
            results[variant] = {"error": "out of memory"}
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


@contextlib.contextmanager
def _quiet():
    """Hide transformers' log lines and deprecation warnings while the models build and train: the
    report says what runs instead, and the summary should be the whole output."""
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        transformers_logging.set_verbosity(level)


def _where() -> str:
    from . import runtime

    if runtime.smoke():
        return "CPU, kernels through the Triton interpreter (correct, not fast)"
    return f"{torch.cuda.get_device_name()}, compiled Triton kernels"


def summary(result: dict, steps: int) -> list[str]:
    """The lines ``demo`` prints for a ``compare`` result."""
    lines = [str(result["report"]), "step   unpatched loss   patched loss   relative difference"]
    for step, (u, p) in enumerate(zip(result["unpatched"], result["patched"]), 1):
        lines.append(f"{step:>4}   {u:>14.5f}   {p:>12.5f}   {abs(p - u) / abs(u):>19.1e}")
    verdict = "agree" if result["agree"] else "DO NOT agree"
    lines.append(f"the curves {verdict}: largest relative difference {result['max_rel_difference']:.1e} "
                 f"(bound {LOSS_RTOL:g}, as both train under bf16 autocast)")
    lines.append(f"time: unpatched {result['unpatched_s']:.1f} s, patched {result['patched_s']:.1f} s "
                 f"for {steps} steps")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options, on its own parser or on ``python -m q35lab``'s ``demo`` subcommand."""
    parser.add_argument("--steps", type=_positive_int, default=4, help="training steps of the tiny model (default: 4)")
    parser.add_argument("--tokens", type=_positive_int, default=8192,
                        help="tokens of the step at the 9B's dimensions, on a GPU only (default: 8192)")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """Print the summary; 0 when the patched curve agrees with the unpatched one, else 1."""
    from . import runtime

    print(f"q35lab demo on {_where()}:")
    print(f"a tiny Qwen3.5 ({TINY_LAYERS} layers) with PEFT LoRA r=8, {args.steps} steps on one batch, "
          "unpatched then patched, same seed")
    with _quiet():
        result = compare(args.steps)
    print("\n".join(summary(result, args.steps)))
    if runtime.smoke():
        print("speed needs a GPU: there this command also times a step at the 9B's dimensions. "
              "Measured results: RESULTS.md")
    else:
        print(f"\none step at the 9B's dimensions ({REAL_LAYERS} of its layers, the real vocabulary), "
              f"{args.tokens:,} tokens, LoRA r=16, gradient checkpointing:")
        with _quiet():
            rows = real_size_step(tokens=args.tokens)
        for variant, row in rows.items():
            print(f"  {variant:<14} " + (row["error"] if "error" in row else
                  f"{row['step_ms']:8.1f} ms  {row['tokens_per_s']:9,.0f} tokens/s  peak {row['peak_gib']:5.1f} GiB"))
    return 0 if result["agree"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m q35lab demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
