"""Launch configurations tried on this GPU: ``python -m q35lab tune OP``, one module an op.

Each times its op's candidate configurations (passed to the host functions as ``config=``) at
the real widths, writes every candidate's row to a CSV (``<data>/bench/<gpu>/<op>_tuning.csv``
unless ``--out`` says where) and, except ``offset_rms_norm``'s, records the fastest for this GPU
in ``q35lab/ops/tuned.json`` (``ops._tuned``), which the ops read at their first launch.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

#: The ops with a tuning module here.
TUNABLE = ("causal_conv1d", "gated_rms_norm", "linear_cross_entropy", "offset_rms_norm")


def parser(op: str, doc: str) -> argparse.ArgumentParser:
    """The tuning command line of ``op``, with the ``--out`` every one takes."""
    parser = argparse.ArgumentParser(prog=f"python -m q35lab tune {op}", description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the CSV of every candidate's times (default: <data>/bench/<gpu>/{op}_tuning.csv)")
    return parser


def parse(parser: argparse.ArgumentParser, argv, op: str) -> argparse.Namespace:
    """The arguments, with ``--out`` resolved (its folder made); a usage error off a CUDA GPU,
    since a tuning times compiled kernels."""
    import torch

    from .. import core, data_dir

    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning times compiled kernels: it needs a CUDA GPU (none is visible here)")
    if args.out is None:
        args.out = data_dir() / "bench" / core.gpu_slug() / f"{op}_tuning.csv"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return args


def main(op: str, argv=None) -> int:
    """Run ``op``'s tuning with the command-line arguments ``argv``."""
    if op not in TUNABLE:
        raise ValueError(f"op: expected one of {', '.join(TUNABLE)}, got {op!r}")
    return importlib.import_module(f"{__name__}.{op}").main(argv) or 0
