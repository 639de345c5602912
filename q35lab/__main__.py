"""Command line: ``python -m q35lab {bench,check,plots}``.

* ``bench [OPS...] [--quick]``: on a GPU, sweep the ops against their peers and write
  ``data/bench/<gpu>/<op>.csv``, the numerics at real sizes and the figures. Without a GPU, run
  the smoke correctness checks through the Triton interpreter instead (speed needs a GPU).
* ``check [OPS...]``: the numerics rule only (real sizes on a GPU, tiny ones on a CPU).
* ``plots``: redraw ``data/figures/`` from the committed CSVs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _numerics_table(rows) -> None:
    for r in rows:
        extra = ""
        if "frac_differ" in r and r["frac_differ"] == r["frac_differ"]:  # not NaN: an agreement row
            extra = (f"  vs {r.get('vs', 'transformers')}: {100 * r['frac_differ']:.3f}% differ, "
                     f"max {r['max_ulp']} ulp, rel {r['rel_err']:.1e}")
        elif "rel_err" in r:
            extra = f"  relative error against fp32: {r['rel_err']:.1e}"
        print(f"{r['op']:<18} {r.get('impl', ''):<7} T={r['T']:<7} {r['dtype']:<9} {r['tensor']:<3} err {r['kernel_err']:.2e} "
              f"<= {r['bound']:.2e} {'ok' if r['ok'] else 'FAIL'}{extra}")


def _check_and_record(ops, out) -> bool:
    """The numerics rule; on a GPU the rows are also written to data/bench/<gpu>/<op>_numerics.csv."""
    from . import bench as harness
    from . import runtime
    from .bench import core

    rows = []
    for op in ops or harness.discover():  # printed as each op finishes: a long check shows progress
        op_rows = harness.check([op])
        _numerics_table(op_rows)
        rows += op_rows
    if not runtime.smoke():
        data = harness.DATA if out is None else Path(out)
        for op in dict.fromkeys(r["op"] for r in rows):
            path = data / "bench" / core.gpu_slug() / f"{op}_numerics.csv"
            core.write_numerics_csv([r for r in rows if r["op"] == op], path)
    return all(r["ok"] for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m q35lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="sweep ops against peers (GPU) or smoke-check them (CPU)")
    bench.add_argument("ops", nargs="*", help="ops to run (default: all)")
    bench.add_argument("--quick", action="store_true", help="only the sizes the goals are stated at")
    bench.add_argument("--out", type=Path, default=None, help="data folder (default: the checkout's data/)")
    bench.add_argument("--T", type=int, nargs="+", default=None,
                       help="only these sizes; the CSV keeps its rows at other sizes (finishing a cut-short sweep)")
    check = sub.add_parser("check", help="numerics rule for forward and every gradient")
    check.add_argument("ops", nargs="*")
    plots = sub.add_parser("plots", help="redraw data/figures from the committed CSVs")
    plots.add_argument("--data", type=Path, default=None)
    args = parser.parse_args(argv)

    from . import bench as harness
    from . import plots as figures
    from . import runtime

    if args.command == "plots":
        for path in figures.render(args.data):
            print(path)
        return 0
    if args.command == "check" or runtime.smoke():
        if args.command == "bench":
            print("No CUDA GPU: running the correctness checks through the Triton interpreter at tiny "
                  "sizes. Speed needs a GPU (see README: results measured on an H200 are in data/).")
        return 0 if _check_and_record(args.ops or None, getattr(args, "out", None)) else 1
    written = harness.run(args.ops or None, quick=args.quick, sizes=args.T, out=args.out)
    import pandas as pd

    for op, path in written.items():
        _check_and_record([op], args.out)
        df = pd.read_csv(path)
        print(df.pivot_table(index=["pass", "T"], columns="impl", values="kernel_ms").round(4).to_string())
    for path in figures.render(args.out, list(written)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
