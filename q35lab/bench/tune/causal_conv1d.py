"""Tune the causal conv1d kernels on this GPU and record the best (``bench.tune.record``).

The GatedDeltaNet's convolution at the real widths (C = 8192 for Qwen3.5-9B and the 35B-A3B,
10240 for the 27B; K = 4 taps; SiLU; bf16; T = 32k tokens), three passes timed apart with
``triton.testing.do_bench`` (median, L2 flushed), each candidate passed to the host functions
as ``config=`` (the other fields from the heuristic default):

* ``fwd``: y = silu(conv(x)), reading x and writing y once (2·T·C elements at the least);
* ``bwd_dx``: dx alone, the LoRA fine-tune's case (the conv weight is frozen): dy and x read,
  dx written (3·T·C);
* ``bwd_dw``: dx, dW and the partial sums of a trainable conv (same bytes, plus the partials),
  with tiles of its own (``dw_*``: it keeps K more fp32 tiles, and the dx-only tiles spill).

Each pass's fastest configuration is saved for this GPU under the key ``"CxK"``.
Candidates that spill registers are measured like the others (they lose).

    python -m q35lab tune causal_conv1d [--out CSV] [--shipped] [--T T] [--channels C ...]
"""

import ast
import dataclasses
import itertools

import pandas as pd
import torch
from triton.testing import do_bench

from ...ops import causal_conv1d as op
from .. import core
from . import parse, record
from . import parser as tuning_parser

KERNEL_SIZE = 4

TILES = list(itertools.product([16, 32, 64], [32, 64, 128], [2, 4, 8]))  # tokens, channels, warps
CANDIDATES = {
    "fwd": [dict(block_t=t, block_c=c, num_warps=w)
            for t, c, w in itertools.product([16, 32, 64], [64, 128, 256], [2, 4, 8])],
    "bwd_dx": [dict(bwd_block_t=t, bwd_block_c=c, bwd_warps=w) for t, c, w in TILES],
    # each tile (one compile) split over a few programs per SM: a runtime argument
    "bwd_dw": [dict(dw_block_t=t, dw_block_c=c, dw_warps=w, dw_programs_per_sm=p)
               for t, c, w in TILES for p in (4, 8, 16)],
}
#: Elements of [T, C] each pass must read and write at the least.
TRAFFIC = {"fwd": 2, "bwd_dx": 3, "bwd_dw": 3}


def calls(T: int, C: int):
    """The three passes at ``T`` tokens and ``C`` channels, each a function of a config."""
    x, dy = (torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = 0.3 * torch.randn(C, KERNEL_SIZE, device="cuda", dtype=torch.bfloat16)
    return {
        "fwd": lambda config: op.causal_conv1d_fwd(x, w, None, None, True, config),
        "bwd_dx": lambda config: op.causal_conv1d_bwd(dy, x, w, None, None, True, compute_dw=False,
                                                      compute_db=False, config=config),
        "bwd_dw": lambda config: op.causal_conv1d_bwd(dy, x, w, None, None, True, config=config),
    }


def measure(T: int, C: int, copy_gbps: float) -> pd.DataFrame:
    """Every candidate of every pass at ``T`` tokens and ``C`` channels."""
    base = op._default_config(C, KERNEL_SIZE)
    passes = calls(T, C)
    rows = []
    for pass_, options in CANDIDATES.items():
        for fields in options:
            config = dataclasses.replace(base, **fields)
            ms = do_bench(lambda: passes[pass_](config), return_mode="median")
            gbps = TRAFFIC[pass_] * T * C * 2 / ms / 1e6
            rows.append(dict(C=C, K=KERNEL_SIZE, T=T, pass_=pass_, ms=ms, gbps=gbps, pct_copy=100 * gbps / copy_gbps,
                             copy_gbps=copy_gbps, config=str(fields),
                             default=all(getattr(base, k) == v for k, v in fields.items()), **fields))
    return pd.DataFrame(rows)


def best_fields(at_width: pd.DataFrame) -> dict:
    """The fastest configuration of each pass, merged: the three passes set disjoint fields."""
    best = {}
    for pass_ in CANDIDATES:
        times = at_width[at_width.pass_ == pass_].set_index("config").ms
        best.update(ast.literal_eval(times.idxmin()))
    return best


def main(argv=None):
    parser = tuning_parser("causal_conv1d", __doc__)
    parser.add_argument("--T", type=int, default=32768, help="tokens (default: %(default)s)")
    parser.add_argument("--channels", type=int, nargs="+", default=[8192, 10240],
                        help="conv widths, each tuned and saved on its own (default: the 9B's and the 27B's)")
    args = parse(parser, argv, "causal_conv1d")
    copy = core.measure_ceilings().copy_gbps
    print(f"copy {copy:.0f} GB/s")
    frames = []
    for C in args.channels:  # each width saved as soon as it is measured: a call cut short keeps it
        at_width = measure(args.T, C, copy)
        frames.append(at_width)
        pd.concat(frames).to_csv(args.out, index=False, float_format="%.5g")
        best = best_fields(at_width)
        record(args, "causal_conv1d", f"{C}x{KERNEL_SIZE}", best)
        top = at_width.loc[at_width.groupby("pass_").ms.idxmin()].set_index("pass_")
        top["default ms"] = at_width[at_width.default].groupby("pass_").ms.min()
        print(top[["config", "ms", "default ms", "pct_copy"]].to_string())


if __name__ == "__main__":
    main()
