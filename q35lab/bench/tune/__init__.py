"""Launch configurations tried on this GPU: ``python -m q35lab tune OP``, one module an op.

Each times its op's candidate configurations (passed to the host functions as ``config=``) at
the real widths, writes every candidate's row to a CSV (``<data>/bench/<gpu>/<op>_tuning.csv``
unless ``--out`` says where) and, except ``offset_rms_norm``'s, records the fastest for this GPU
in the user's tuned file (``~/.cache/q35lab/tuned.json``; ``ops._tuned.user_file``), or with
``--shipped`` in the package's ``q35lab/ops/tuned.json`` (for a commit); the ops read both at
their first launch, the user's entries over the package's.
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
    parser.add_argument("--shipped", action="store_true",
                        help="record the fastest in the package's q35lab/ops/tuned.json (the shipped table, for "
                             "maintainers who commit it) instead of the user's file ($Q35LAB_TUNED_FILE, else "
                             "$XDG_CACHE_HOME/q35lab/tuned.json, else ~/.cache/q35lab/tuned.json)")
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


def record(args: argparse.Namespace, op: str, key: int | str, fields: dict) -> None:
    """Save ``fields`` as this GPU's configuration of ``op`` at ``key`` (the package's file with
    ``--shipped``, else the user's) and say where."""
    import torch

    from ...ops import _tuned

    path = _tuned.save(op, key, fields, torch.cuda.get_device_name(), shipped=args.shipped)
    print(f"{op} at {key}: saved {fields} in {path}")


def main(op: str, argv=None) -> int:
    """Run ``op``'s tuning with the command-line arguments ``argv``."""
    if op not in TUNABLE:
        raise ValueError(f"op: expected one of {', '.join(TUNABLE)}, got {op!r}")
    return importlib.import_module(f"{__name__}.{op}").main(argv) or 0
