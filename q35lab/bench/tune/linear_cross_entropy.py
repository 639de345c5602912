"""Time and memory of the fused linear cross entropy against its chunk size, on this GPU.

The chunk (rows of logits held at once) trades memory for GEMM size: small chunks make thin
GEMMs and, with a trainable head, one more read and write of the fp32 dW accumulator per chunk.
A trainable head's gradient can also be made block by block of the vocabulary in a second pass
(``weight_grad="recompute"``: a fourth matmul, but no fp32 [V, H] buffer). For the trainable head
(both ways) and the frozen head, each chunk size is measured (kernel time from the profiler,
extra peak memory) at hidden 4096, vocabulary 248,320, bf16, each passed as ``config=`` (the
other fields from this GPU's ``launch_config``). Recorded for this GPU (the user's tuned.json,
or with --shipped q35lab/ops/tuned.json): per head, the smallest chunk within 2% of the fastest; for the trainable head
"recompute" if its best time is within 5% of "accumulate"'s (then memory decides), else
"accumulate".

    python -m q35lab tune linear_cross_entropy [--out CSV] [--shipped] [--T T] [--chunks ROWS ...]
"""

import dataclasses

import pandas as pd
import torch

from ... import shapes
from ...ops import linear_cross_entropy as op
from .. import core
from . import parse, record
from . import parser as tuning_parser

#: A chunk within this factor of the fastest counts as fast: among those the smallest is kept.
WITHIN = 1.02
#: "recompute" (less memory) is chosen when its best time is within this factor of "accumulate"'s.
RECOMPUTE_WITHIN = 1.05


def main(argv=None):
    parser = tuning_parser("linear_cross_entropy", __doc__)
    parser.add_argument("--T", type=int, default=16 * 1024, help="tokens (default: %(default)s)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096],
                        help="chunk sizes (rows of logits at once) to try (default: 256 ... 4096)")
    args = parse(parser, argv, "linear_cross_entropy")
    hidden, vocab = shapes.HIDDEN, shapes.VOCAB
    matmul_tflops = core.measure_ceilings().matmul_tflops
    one_matmul_ms = 2 * args.T * hidden * vocab / (matmul_tflops * 1e12) * 1e3
    x = torch.randn(args.T, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (args.T,), device="cuda")
    default = op.launch_config(vocab, hidden, torch.bfloat16)
    rows, best = [], {}
    for head, weight_grad in (("trainable", "accumulate"), ("trainable", "recompute"), ("frozen", "accumulate")):
        w = (torch.randn(vocab, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
        w.requires_grad_(head == "trainable")
        wanted = [x, w] if head == "trainable" else [x]
        for chunk in args.chunks:
            config = dataclasses.replace(default, weight_grad=weight_grad, chunk_rows_trainable=chunk,
                                         chunk_rows_frozen=chunk)

            def step(config=config):
                loss = op.linear_cross_entropy(x, w, target, config=config)
                return torch.autograd.grad(loss, wanted)

            timing = core.measure([step])
            rows.append(dict(head=head, weight_grad=weight_grad, T=args.T, chunk_rows=chunk, status=timing.status,
                             kernel_ms=timing.kernel_ms, wall_ms=timing.wall_ms, extra_peak_mb=timing.extra_peak_mb,
                             matmuls=timing.kernel_ms / one_matmul_ms, matmul_tflops=matmul_tflops))
        w = wanted = None  # frees this head before the next is made: step's closure holds both
    table = pd.DataFrame(rows)
    ok = table[table.status == "ok"]
    fastest = {}
    for (head, weight_grad), runs in ok.groupby(["head", "weight_grad"]):
        fast = runs[runs.kernel_ms <= WITHIN * runs.kernel_ms.min()]
        fastest[head, weight_grad] = (int(fast.chunk_rows.min()), runs.kernel_ms.min())
    if ("frozen", "accumulate") in fastest:
        best["chunk_rows_frozen"] = fastest["frozen", "accumulate"][0]
    trainable = {weight_grad: v for (head, weight_grad), v in fastest.items() if head == "trainable"}
    if trainable:
        mode = "recompute" if ("recompute" in trainable and (
            "accumulate" not in trainable or trainable["recompute"][1] <= RECOMPUTE_WITHIN * trainable["accumulate"][1]
        )) else "accumulate"
        best["weight_grad"] = mode
        best["chunk_rows_trainable"] = trainable[mode][0]
    table.to_csv(args.out, index=False, float_format="%.5g")
    print(f"bf16 matmul {matmul_tflops:.0f} TFLOP/s; one logits matmul at T={args.T}: {one_matmul_ms:.1f} ms")
    if best:
        record(args, "linear_cross_entropy", f"{vocab}x{hidden}", best)
    else:
        print("no candidate finished: nothing saved")
    columns = ["head", "weight_grad", "chunk_rows", "status", "kernel_ms", "matmuls", "extra_peak_mb"]
    print(table[columns].to_string(index=False))


if __name__ == "__main__":
    main()
