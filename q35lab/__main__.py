"""Command line: python -m q35lab {demo,bench,check,plots,plan,tune}.

  demo                      the first command to run: a tiny model trained unpatched and patched, a short
                            summary (on a GPU, also one step at the 9B's dimensions against PEFT)

  bench [OPS...] [--quick]  on a GPU, sweep the ops against their peers and write
                            data/bench/<gpu>/<op>.csv, the numerics at real sizes and the figures;
                            without a GPU, run the smoke correctness checks through the Triton
                            interpreter instead (speed needs a GPU)
  check [OPS...]            the numerics rule only (real sizes on a GPU, tiny ones on a CPU)
  plots [--data FOLDER]     redraw data/figures/ from the committed CSVs
  plan [--size S | --config C] [--tokens T] [--gpu-gib G] [--host-gib H]
                            how long a Qwen3.5 LoRA step can be here: the longest step the memory
                            model predicts to fit, or with --tokens (524288, 512k, 1e6) the plan for
                            that step and, where it does not fit, the longest that does; and the
                            apply_to_qwen3_5(model, long_context=...) call that turns it on. Says
                            which GPU and host memory it assumed where no option gave them
  tune OP [OPTIONS...]      on a GPU, time OP's launch configurations and record the fastest for
                            this GPU in the user's file (~/.cache/q35lab/tuned.json, or
                            $Q35LAB_TUNED_FILE), whose entries override the shipped
                            q35lab/ops/tuned.json; --shipped writes that one instead
                            (python -m q35lab tune OP --help)

The results folder is --out / --data when given, else $Q35LAB_DATA, else the checkout's data/
(or ./data when q35lab is installed rather than run from a checkout).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ._argtypes import folder, output_folder, real_number, tokens, whole_number


def _numerics_table(rows) -> None:
    for r in rows:
        extra = ""
        if _number(r.get("frac_differ")):  # an agreement row
            extra = (f"  vs {r.get('vs') or 'transformers'}: {100 * r['frac_differ']:.3f}% differ, "
                     f"max {r['max_ulp']} ulp, rel {r['rel_err']:.1e}")
        elif _number(r.get("rel_err")):
            extra = f"  relative error against {r.get('reference', 'fp64')}: {r['rel_err']:.1e}"
        print(f"{r['op']:<20} {r.get('impl', ''):<14} T={r['T']:<7} {r['dtype']:<9} {r['tensor']:<4} "
              f"err {r['kernel_err']:.2e} <= {r['bound']:.2e} {'ok' if r['ok'] else 'FAIL'}{extra}")


def _number(value) -> bool:
    """A real number (rows of different ops carry different columns; NaN marks a missing one)."""
    return isinstance(value, (int, float)) and not math.isnan(value)


def _label(row: dict) -> str:
    return f"{row['op']} {row.get('impl', '')} {row['tensor']} ({row['dtype']}, T={row['T']})"


def verdict(rows: list[dict]) -> tuple[str, bool]:
    """The closing line of a check and whether it passed. Only q35lab's own rows decide: a peer
    outside the bound is a finding about the peer, reported on the same line."""
    mine = [str(r.get("impl", "q35lab")).startswith("q35lab") for r in rows]
    ours = [r for r, m in zip(rows, mine) if m]
    peers = [r for r, m in zip(rows, mine) if not m]
    failed = [r for r in ours if not r["ok"]]
    if not ours:
        line = "no checks of q35lab ran"
    elif failed:
        line = f"{len(failed)} of {len(ours)} checks failed: " + "; ".join(map(_label, failed))
    else:
        line = f"all {len(ours)} checks passed"
    outside = [r for r in peers if not r["ok"]]
    if peers:
        line += f" (peers: {len(peers) - len(outside)} of {len(peers)} within the bound"
        line += (": outside " + "; ".join(map(_label, outside)) + ")") if outside else ")"
    return line, bool(ours) and not failed


def _check_and_record(ops, out) -> bool:
    """The numerics rule; on a GPU the rows are also written to data/bench/<gpu>/<op>_numerics.csv.
    Ends with the verdict line; returns whether it passed."""
    from . import bench as harness
    from . import runtime
    from .bench import core

    rows = []
    for op in ops or harness.discover():  # printed as each op finishes: a long check shows progress
        op_rows = harness.check([op])
        _numerics_table(op_rows)
        rows += op_rows
    if not runtime.smoke():
        data = harness.data_dir(out)
        for op in dict.fromkeys(r["op"] for r in rows):
            path = data / "bench" / core.gpu_slug() / f"{op}_numerics.csv"
            core.write_numerics_csv([r for r in rows if r["op"] == op], path)
    line, passed = verdict(rows)
    print(line)
    return passed


def _op_name(known: list[str]):
    """An argparse type: an op this harness knows (a usage error, exit code 2, otherwise)."""

    def parse(text: str) -> str:
        if text not in known:
            raise argparse.ArgumentTypeError(f"unknown op {text!r}; known ops: {', '.join(known)}")
        return text

    return parse


def _config_source(text: str) -> str:
    """An argparse type: a config.json, a folder holding one, or a hub id ("Qwen/Qwen3.5-9B").
    A name that can only be a local path (absolute, relative with ./ or ../, ~, a .json file,
    more than one /) must exist: transformers would take it for a hub id and answer about that."""
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"expected a Qwen3.5 config.json, or a folder or hub id holding one: "
                                             f"no config.json in the folder {text}")
        return str(path)
    if path.is_file():
        return str(path)
    if (path.is_absolute() or text.startswith((".", "~")) or text.endswith(".json")
            or text.strip("/").count("/") != 1 and "/" in text):
        raise argparse.ArgumentTypeError(f"no such file or folder: {text}")
    return text  # a hub id: transformers fetches it, or says why it cannot


def _parser(known: list[str]) -> argparse.ArgumentParser:
    from .demo import __doc__ as demo_doc
    from .demo import add_arguments as demo_arguments

    parser = argparse.ArgumentParser(prog="python -m q35lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"ops: {', '.join(known)}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,check,plots,plan,tune}")
    demo_arguments(sub.add_parser("demo", help="train a tiny model unpatched and patched: the first command to run",
                                  description=demo_doc, formatter_class=argparse.RawDescriptionHelpFormatter))
    ops_help = f"ops to run (default: all): {', '.join(known)}"
    bench = sub.add_parser("bench", help="sweep ops against peers (GPU) or smoke-check them (CPU)",
                           description="Sweep ops against their peers on a GPU; without one, run the "
                                       "smoke correctness checks through the Triton interpreter.")
    bench.add_argument("ops", nargs="*", type=_op_name(known), metavar="OP", help=ops_help)
    bench.add_argument("--quick", action="store_true", help="only the sizes the goals are stated at")
    bench.add_argument("--out", type=output_folder, default=None,
                       help="results folder (default: $Q35LAB_DATA, else the checkout's data/, else ./data)")
    bench.add_argument("--T", type=tokens(), nargs="+", default=None, metavar="TOKENS",
                       help="only these sizes (in tokens: 4096, 4k); the CSV keeps its rows at other sizes "
                            "(finishing a cut-short sweep)")
    check = sub.add_parser("check", help="numerics rule for forward and every gradient",
                           description="The numerics rule for the forward and every gradient; "
                                       "exits 1 when a check of q35lab fails.")
    check.add_argument("ops", nargs="*", type=_op_name(known), metavar="OP", help=ops_help)
    plots = sub.add_parser("plots", help="redraw data/figures from the committed CSVs",
                           description="Redraw <data>/figures from the CSVs under <data>/bench.")
    plots.add_argument("--data", type=folder, default=None,
                       help="results folder to read (default: $Q35LAB_DATA, else the checkout's data/, else ./data)")
    plan = sub.add_parser("plan", help="how long a Qwen3.5 LoRA step can be on this GPU (or another)",
                          description="The long-context plan of the memory model (q35lab.long_context): "
                                      "without --tokens the longest step predicted to fit, with it the "
                                      "options a step of that length needs; exits 1 when it does not fit.")
    model = plan.add_mutually_exclusive_group()
    model.add_argument("--size", choices=_dense_sizes(), default=None,
                       help="a dense Qwen3.5 checkpoint's dimensions (default: 9b; the memory model "
                            "does not cover the MoE)")
    model.add_argument("--config", type=_config_source, default=None, metavar="PATH",
                       help="a Qwen3.5 config instead: a config.json, or the folder or hub id holding it")
    plan.add_argument("--tokens", type=tokens(), default=None,
                      help="plan for a step of this many tokens: 524288, 524_288, 512k (k = 1024), 1M (1024²) or 1e6")
    plan.add_argument("--gpu-gib", type=real_number(0, above=True, what="a size in GiB"), default=None,
                      help="the GPU memory a step may use (default: this machine's CUDA device; "
                           "without one, an H200's 139 GiB)")
    plan.add_argument("--host-gib", type=real_number(0, above=False, what="a size in GiB"), default=None,
                      help="the host memory the checkpoint offload may take, of which it leaves "
                           "min(16 GiB, a quarter) free (default: what this machine has available; 0: no offload)")
    plan.add_argument("--rank", type=whole_number(1), default=16,
                      help="the LoRA rank on every linear layer (default: 16)")
    from .bench.tune import TUNABLE

    tune = sub.add_parser("tune", help="time an op's launch configurations on this GPU and record the fastest",
                          description="Time an op's launch configurations on this GPU (a CUDA GPU: compiled "
                                      "kernels) and record the fastest in the user's tuned.json (--shipped: the "
                                      "package's q35lab/ops/tuned.json); it prints where.")
    tune.add_argument("op", type=_op_name(list(TUNABLE)), metavar="OP", help=f"the op to tune: {', '.join(TUNABLE)}")
    tune.add_argument("options", nargs=argparse.REMAINDER,
                      help="the op's own options (python -m q35lab tune OP --help)")
    for command in sub.choices.values():  # a command's own errors print its usage, as argparse's do
        command.set_defaults(command_parser=command)
    return parser


def _dense_sizes() -> list[str]:
    from .bench.e2e.model import SIZES

    return sorted(size for size, dims in SIZES.items() if not dims.get("moe"))


def _plan(parser: argparse.ArgumentParser, args) -> int:
    """Print what the plan assumes where no option said (this machine's GPU, or an H200's without
    one; this machine's host memory), the plan, and the call that turns it on, or where a step of
    --tokens does not fit, the longest that does; 0 when it is predicted to fit."""
    import torch

    from . import long_context

    if args.config is None:
        from .bench.e2e.model import config as sized_config

        config = sized_config(args.size or "9b")
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(args.config)
        except (OSError, ValueError) as error:
            parser.error(f"argument --config: expected a Qwen3.5 config.json, or a folder or hub id holding one: "
                         f"{error}")
        text = config.get_text_config()
        if getattr(text, "num_experts", None) or not hasattr(text, "linear_num_key_heads"):
            parser.error(f"argument --config: expected a dense Qwen3.5 config (the memory model covers those, not "
                         f"the MoE), got {type(text).__name__}")
    if args.gpu_gib is not None:
        gpu = args.gpu_gib * 2**30
    else:  # without CUDA, usable_gpu_bytes plans for an H200
        on_gpu = torch.cuda.is_available()
        gpu = long_context.usable_gpu_bytes("cuda" if on_gpu else None)
        if on_gpu:
            print(f"Planning for this machine's GPU ({gpu / 2**30:.1f} GiB usable); --gpu-gib plans for another.")
        else:
            print(f"No CUDA GPU here: planning for an H200 ({gpu / 2**30:.0f} GiB); --gpu-gib plans for another.")
    if args.host_gib is not None:  # another machine's: its reserve by the rule the offload keeps on this one
        host = args.host_gib * 2**30
        reserve = long_context.default_host_reserve(host)
    else:  # read once: the plan and the longest step that fits are planned against the same
        host, reserve = long_context.host_memory_available(), long_context.default_host_reserve()
        print(_host_assumed(host, reserve, h200=args.gpu_gib is None and not torch.cuda.is_available()))
    settings = dict(gpu_bytes=gpu, host_bytes=host, host_reserve_bytes=reserve, lora_rank=args.rank)
    plan = (long_context.longest_planned_step(config, **settings) if args.tokens is None
            else long_context.plan_long_context(config, args.tokens, **settings))
    print(plan)
    if plan.fits:
        print(f"turn it on with: q35lab.apply_to_qwen3_5(model, long_context={plan.tokens})")
        return 0
    longest = plan if args.tokens is None else long_context.longest_planned_step(config, **settings)
    if longest.fits:
        print(f"the longest step predicted to fit: {longest.tokens:,} tokens (plan it with --tokens {longest.tokens})")
    else:
        print(f"not even a step of {longest.tokens:,} tokens fits this GPU")
    return 1


def _host_assumed(host: float | None, reserve: float, h200: bool) -> str:
    """The line that says which host memory a plan without --host-gib assumed."""
    if host is None:
        return "Host memory: unknown here, so the plan offloads nothing; --host-gib gives it."
    gpu = " (while the GPU is an H200's)" if h200 else ""
    return (f"Host memory: this machine's{gpu}, {host / 2**30:.1f} GiB available, of which the offload leaves "
            f"{reserve / 2**30:.1f} GiB free; --host-gib plans for another host.")


def _plots(parser: argparse.ArgumentParser, data: Path | None) -> int:
    from . import bench as harness
    from . import plots as figures

    data = harness.data_dir(data)
    if not data.is_dir():
        parser.error(f"no results folder {data} (give one with plots --data)")
    written = figures.render(data)
    for path in written:
        print(path)
    if not written:
        print(f"no results to draw: no <gpu>/<op>.csv of a known op under {data / 'bench'}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    from . import bench as harness
    from . import runtime

    parser = _parser(sorted(harness.discover()))
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args)
    if args.command == "plots":
        return _plots(args.command_parser, args.data)
    if args.command == "plan":
        return _plan(args.command_parser, args)
    if args.command == "tune":
        from .bench import tune

        return tune.main(args.op, args.options)
    if args.command == "check" or runtime.smoke():
        if args.command == "bench":
            print("No CUDA GPU: running the correctness checks through the Triton interpreter at tiny "
                  "sizes. Speed needs a GPU (see README: results measured on an H200 are in data/).")
        elif runtime.interpreter_notice():
            print(runtime.interpreter_notice(), file=sys.stderr)
        return 0 if _check_and_record(args.ops or None, getattr(args, "out", None)) else 1
    return _bench_on_gpu(harness, args)


def _bench_on_gpu(harness, args) -> int:
    """Sweep, then the numerics rule per op and its kernel times; exit 1 when a check failed."""
    import pandas as pd

    from . import plots as figures

    written = harness.run(args.ops or None, quick=args.quick, sizes=args.T, out=args.out)
    passed = True
    for op, path in written.items():
        passed = _check_and_record([op], args.out) and passed
        df = pd.read_csv(path)
        print(df.pivot_table(index=["pass", "T"], columns="impl", values="kernel_ms").round(4).to_string())
    for path in figures.render(harness.data_dir(args.out), list(written)):
        print(path)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
