"""Tune the gated RMSNorm kernels on this GPU and record the best (``bench.tune.record``).

Forward, backward with dW and backward with a frozen weight are timed separately with
``triton.testing.do_bench`` (median, L2 flushed) at width 128, rows = 32·T, bf16, "hf"
rounding, each candidate passed to the host functions as ``config=`` (the other fields from the
heuristic default); the configuration with the least summed time over the sizes is saved for
this GPU.

    python -m q35lab tune gated_rms_norm [--out CSV] [--shipped] [--T T ...]
"""

import ast
import dataclasses
import itertools

import pandas as pd
import torch
from triton.testing import do_bench

from ...ops import gated_rms_norm as op
from .. import core
from . import parse, record
from . import parser as tuning_parser

WIDTH, HEADS = 128, 32


def main(argv=None):
    parser = tuning_parser("gated_rms_norm", __doc__)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768],
                        help="tokens (rows = 32·T); the least summed time wins (default: 8192 32768)")
    args = parse(parser, argv, "gated_rms_norm")
    copy = core.measure_ceilings().copy_gbps
    base = op._default_config(WIDTH)
    candidates = {
        "fwd": [dict(fwd_block_rows=r, fwd_warps=w) for r, w in itertools.product([8, 16, 32, 64], [1, 2, 4, 8])],
        "bwd": [dict(bwd_block_rows=r, bwd_warps=w, bwd_tiles_per_program=t)
                for r, w, t in itertools.product([8, 16, 32], [2, 4, 8], [1, 2, 4, 8])],
        "bwd_frozen_w": [dict(frozen_block_rows=r, frozen_warps=w)
                         for r, w in itertools.product([8, 16, 32, 64], [1, 2, 4, 8])],
    }
    rows = []
    for T in args.T:
        n = T * HEADS
        x, g, dy = (torch.randn(n, WIDTH, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        w = torch.ones(WIDTH, device="cuda", dtype=torch.bfloat16)
        calls = {
            "fwd": lambda config: op.gated_rms_norm_fwd(x, g, w, 1e-6, "hf", config=config),
            "bwd": lambda config: op.gated_rms_norm_bwd(dy, x, g, w, 1e-6, "hf", True, config=config),
            "bwd_frozen_w": lambda config: op.gated_rms_norm_bwd(dy, x, g, w, 1e-6, "hf", False, config=config),
        }
        traffic = {"fwd": 3, "bwd": 5, "bwd_frozen_w": 5}
        for pass_, options in candidates.items():
            for fields in options:
                config = dataclasses.replace(base, **fields)
                ms = do_bench(lambda: calls[pass_](config), return_mode="median")
                gbps = traffic[pass_] * n * WIDTH * 2 / ms / 1e6
                rows.append(dict(T=T, pass_=pass_, ms=ms, gbps=gbps, pct_copy=100 * gbps / copy, copy_gbps=copy,
                                 config=str(fields), **fields))
    df = pd.DataFrame(rows)
    df.to_csv(args.out, index=False, float_format="%.5g")
    best = dataclasses.asdict(base)
    for pass_ in candidates:
        total = df[df.pass_ == pass_].groupby("config").ms.sum()
        best.update(ast.literal_eval(total.idxmin()))
    print(f"copy {copy:.0f} GB/s")
    record(args, "gated_rms_norm", WIDTH, best)
    top = df.loc[df.groupby(["T", "pass_"]).ms.idxmin()]
    print(top[["T", "pass_", "config", "ms", "pct_copy"]].to_string(index=False))


if __name__ == "__main__":
    main()
