"""Loss curves of LoRA training with a bf16 and an FP8 frozen base (``apply_to_qwen3_5(base_precision="fp8")``),
run on a GPU with FP8 tensor cores (compute capability 8.9 or more).

The same seeded model (``q35lab.e2e.build``: random weights, LoRA on every linear layer, fp32 adapters,
gradient checkpointing) is trained twice on the same batches of ``e2e.toy_corpus`` (arithmetic progressions a
model learns in a few hundred steps), bf16 autocast, AdamW: once patched with the bf16 base, once with the FP8
base. Each step's loss is one row; the last lines print both final losses (the mean of the last 20 steps) and
their gap. The CPU version of this check is ``tests/test_fp8.py::test_training_with_an_fp8_base_follows_the_bf16_base``.

    python benchmarks/fp8_base_training.py                     # writes data/bench/<gpu>/fp8_base_training.csv
    python benchmarks/fp8_base_training.py --size tiny --layers 4 --steps 200 --seq 256 --batch 8
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import pandas as pd
import torch

import q35lab
from q35lab import e2e
from q35lab.bench.core import gpu_slug, run_info


def train(model, data: torch.Tensor, steps: int, batch: int, lr: float) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        ids = data[step * batch:(step + 1) * batch].cuda()
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", *sorted(e2e.SIZES)])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: data/bench/<gpu>/fp8_base_training.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_base_training: needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or more)")
    out = args.out or Path("data/bench") / gpu_slug() / "fp8_base_training.csv"
    model = e2e.build(args.size, args.layers, rank=args.rank, device="cuda", dtype=torch.bfloat16, seed=args.seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    data = e2e.toy_corpus(args.steps * args.batch, args.seq, vocab, seed=args.seed + 1)
    rows, finals = [], {}
    for precision in ("bf16", "fp8"):
        trained = copy.deepcopy(model)
        report = q35lab.apply_to_qwen3_5(trained, base_precision=precision)
        torch.manual_seed(args.seed)
        losses = train(trained, data, args.steps, args.batch, args.lr)
        finals[precision] = sum(losses[-20:]) / len(losses[-20:])
        rows += [{"base_precision": precision, "step": step, "loss": loss, "size": args.size, "layers": args.layers,
                  "rank": args.rank, "seq": args.seq, "batch": args.batch, "lr": args.lr, "seed": args.seed,
                  "fp8_projections": report.runs.get("base precision", ""), **run_info()}
                 for step, loss in enumerate(losses)]
        del trained
        torch.cuda.empty_cache()
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out, index=False)
    gap = finals["fp8"] - finals["bf16"]
    print(f"final loss (mean of the last 20 steps): bf16 {finals['bf16']:.4f}, fp8 {finals['fp8']:.4f}, "
          f"gap {gap:+.4f} ({gap / finals['bf16']:+.2%}); rows in {out}")


if __name__ == "__main__":
    main()
