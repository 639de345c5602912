"""Try launch configurations of the offset RMSNorm kernels on this GPU; write a tuning CSV.

Forward, backward with dW and backward with a frozen weight are timed with
``triton.testing.do_bench`` (median, L2 flushed) at hidden 4096, bf16, for each configuration;
each candidate is passed to the host functions as ``config=`` (the fields not tried keep this
GPU's ``launch_config``). Liger's kernels are timed the same way as a yardstick. Run on a GPU:

    python -m q35lab tune offset_rms_norm [--out CSV] [--T T ...] [--hidden H]
"""

import dataclasses
import importlib.util
import itertools

import pandas as pd
import torch
from triton.testing import do_bench

from ...ops import offset_rms_norm as op
from .. import core
from . import parse
from . import parser as tuning_parser


def main(argv=None):
    parser = tuning_parser("offset_rms_norm", __doc__)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072],
                        help="tokens (default: 8192 32768 131072)")
    parser.add_argument("--hidden", type=int, default=4096, help="row width (default: %(default)s)")
    args = parse(parser, argv, "offset_rms_norm")
    copy = core.measure_ceilings().copy_gbps
    default = op.launch_config(args.hidden)
    rows = []

    def record(T, pass_, impl, ms, **config):
        traffic = (2 if pass_ == "fwd" else 3) * T * args.hidden * 2
        rows.append(dict(T=T, pass_=pass_, impl=impl, ms=ms, gbps=traffic / ms / 1e6,
                         pct_copy=100 * traffic / ms / 1e6 / copy, copy_gbps=copy, **config))

    for T in args.T:
        x = torch.randn(T, args.hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w = 0.1 * torch.randn(args.hidden, device="cuda", dtype=torch.bfloat16)
        _, rstd = op.offset_rms_norm_fwd(x, w, 1e-6)
        for rows_per_program, warps in itertools.product([1, 2, 4], [4, 8, 16]):
            config = dataclasses.replace(default, fwd_rows_per_program=rows_per_program, fwd_warps=warps)
            ms = do_bench(lambda: op.offset_rms_norm_fwd(x, w, 1e-6, config=config), return_mode="median")
            record(T, "fwd", "q35lab", ms, rows_per_program=rows_per_program, warps=warps)
        for warps, per_sm, stages in itertools.product([4, 8], [2, 4, 8], [1, 2, 3]):
            config = dataclasses.replace(default, bwd_warps=warps, bwd_programs_per_sm=per_sm, bwd_stages=stages)
            ms = do_bench(lambda: op.offset_rms_norm_bwd(dy, x, w, rstd, True, config=config), return_mode="median")
            record(T, "bwd", "q35lab", ms, warps=warps, per_sm=per_sm, stages=stages)
        for warps in [4, 8, 16]:
            config = dataclasses.replace(default, frozen_warps=warps)
            ms = do_bench(lambda: op.offset_rms_norm_bwd(dy, x, w, rstd, False, config=config), return_mode="median")
            record(T, "bwd_frozen_w", "q35lab", ms, warps=warps)
        if importlib.util.find_spec("liger_kernel"):
            from liger_kernel.ops.rms_norm import rms_norm_backward, rms_norm_forward

            ms = do_bench(lambda: rms_norm_forward(x, w, 1e-6, 1.0, "gemma", None), return_mode="median")
            record(T, "fwd", "liger", ms)
            _, _, lrstd, block, warps, mode = rms_norm_forward(x, w, 1e-6, 1.0, "gemma", None)
            ms = do_bench(lambda: rms_norm_backward(dy, x, w, lrstd, 1.0, mode, block, warps, False, None),
                          return_mode="median")
            record(T, "bwd", "liger", ms)
    df = pd.DataFrame(rows)
    df.to_csv(args.out, index=False, float_format="%.5g")
    ours = df[df.impl == "q35lab"]
    best = ours.loc[ours.groupby(["T", "pass_"]).ms.idxmin()]
    print(f"copy {copy:.0f} GB/s; default config {default}")
    print(best.to_string(index=False))
    print(df[df.impl == "liger"].to_string(index=False))


if __name__ == "__main__":
    main()
