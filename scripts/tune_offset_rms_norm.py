"""Try launch configurations of the offset RMSNorm kernels on this GPU; write a tuning CSV.

For each (BLOCK_ROWS, num_warps[, programs per SM]) the forward and the backward (with dW) are
timed with triton.testing.do_bench (median, L2 flushed) at hidden 4096, bf16. Run on a GPU:

    python scripts/tune_offset_rms_norm.py --out data/bench/<gpu>/offset_rms_norm_tuning.csv
"""

import argparse
import itertools

import pandas as pd
import torch
import triton
from triton.testing import do_bench

from q35lab.bench import core
from q35lab.ops import offset_rms_norm as op


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    copy = core.measure_ceilings().copy_gbps
    rows = []
    default_tile = op._tile
    for T in args.T:
        x = torch.randn(T, args.hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w = 0.1 * torch.randn(args.hidden, device="cuda", dtype=torch.bfloat16)
        block_cols = triton.next_power_of_2(args.hidden)
        for block_rows, warps in itertools.product([1, 2, 4], [4, 8, 16]):
            op._tile = lambda n, r=block_rows, w_=warps: (r, block_cols, w_)
            ms = do_bench(lambda: op.offset_rms_norm_fwd(x, w, 1e-6), return_mode="median")
            rows.append(dict(T=T, pass_="fwd", block_rows=block_rows, warps=warps, per_sm=0, ms=ms))
            _, rstd = op.offset_rms_norm_fwd(x, w, 1e-6)
            for per_sm in [1, 2, 4, 8]:
                op.BWD_PROGRAMS_PER_SM = per_sm
                ms = do_bench(lambda: op.offset_rms_norm_bwd(dy, x, w, rstd, True), return_mode="median")
                rows.append(dict(T=T, pass_="bwd", block_rows=block_rows, warps=warps, per_sm=per_sm, ms=ms))
            ms = do_bench(lambda: op.offset_rms_norm_bwd(dy, x, w, rstd, False), return_mode="median")
            rows.append(dict(T=T, pass_="bwd_frozen_w", block_rows=block_rows, warps=warps, per_sm=0, ms=ms))
        op._tile = default_tile
    df = pd.DataFrame(rows)
    df["gbps"] = [(2 if p == "fwd" else 3) * t * args.hidden * 2 / m / 1e6 for p, t, m in zip(df.pass_, df["T"], df.ms)]
    df["pct_copy"] = 100 * df.gbps / copy
    df["copy_gbps"] = copy
    df.to_csv(args.out, index=False, float_format="%.5g")
    best = df.loc[df.groupby(["T", "pass_"]).ms.idxmin()]
    print(f"copy {copy:.0f} GB/s; default tile {default_tile(args.hidden)}")
    print(best.to_string(index=False))


if __name__ == "__main__":
    main()
