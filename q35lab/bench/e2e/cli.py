"""One training step of a Qwen3.5 + PEFT model, patched or not: the end-to-end measurement.

A model is built from a config (no download), wrapped by PEFT with LoRA on every linear layer,
optionally patched (by q35lab, by Liger, or as axolotl patches it), and trained with
gradient checkpointing under bf16 autocast, as a fine-tuning run would. For each step we record

* the step's wall time (forward, backward and optimizer step, between CUDA events);
* the share of it spent in the delta-rule core and the causal convolution — code that is not
  ours and that no variant changes — timed by ``RegionTimer`` around those functions, forward
  (including checkpointing's recompute) and backward; the rest is the step "outside the core";
* the peak memory allocated, and the loss (equal across variants at the same seed);
* with ``--memory-at-peak``, one more step with the allocator's history recorded: what is alive at
  that step's highest point, by the code that allocated it (``peak_breakdown``);
* with ``--breakdown``, one more step under the profiler: its device time by kernel category and
  the code that launched it (``breakdown``), beside the step's floor (``step_floor``), in
  ``step_breakdown.csv`` next to ``--out``; the step's row gets its device time and floor.

Patching libraries replace classes module-wide (Liger does), so the CLI runs every variant in a
fresh process::

    python -m q35lab.e2e --variants peft peft+liger q35lab --T 8192 32768 --out data/bench/<gpu>/end_to_end.csv
    python -m q35lab.e2e --what layer --layers 1 --variants peft q35lab --T 8192 32768 \
        --out data/bench/<gpu>/gdn_layer.csv        # one GatedDeltaNet, its in_proj share
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from ... import runtime
from ..._argtypes import output_file, real_number, tokens, whole_number
from ..core import read_csv, run_info
from . import peers
from .floor import floor_inputs, step_floor
from .kernels import breakdown, profile_step
from .memory import is_out_of_memory, memory_at_peak, out_of_memory_note
from .model import SIZES, build, config
from .step import measure, measure_layer
from .variants import VARIANTS, expert_lora, prepare, report_text


def _sizes(args, seen: dict | None = None, budget: float | None = None):
    """The requested T, then with --fit the search for the longest T that fits.

    ``seen`` maps each T measured so far to ``(status, peak bytes)``, filled by the caller before
    it asks for the next T (the search reads it between yields); ``budget``, the bytes a step may
    reach on the device. After --T the search brackets the limit, each T a multiple of 4096:

    * no step has run out of memory yet: the line through the two longest fits' peaks
      (``peak(T) = a + b·T``, which gradient checkpointing makes exact up to the allocator's
      rounding) says where the peak meets ``budget``: the next guess is that T (or --fit-from,
      where given), at least a step above the longest fit (without a line: twice it);
    * a step ran out of memory at ``hi`` and the longest fit is far below it (more than 8 steps):
      down from ``hi`` in strides that double with each out-of-memory (one step of ``hi``, two,
      four...; halfway to the longest fit where a stride would reach it): a guess from the line
      usually misses by a step or two, and a line that is far off is crossed in a few strides;
    * a fit lies within 8 steps below ``hi``: halve the gap until one step is left.

    A step is ``--fit-step − 1`` of the longest fit (at least 4096 tokens): the limit is known to
    that fraction, and near a limit a step is a few minutes (at 500k tokens), so a good first
    guess is most of the search's cost. Nothing beyond --fit-max is tried; an error ends it."""
    yield from args.T
    if not args.fit:
        return
    seen = {} if seen is None else seen
    while True:
        if any(status not in ("ok", "oom") for status, _ in seen.values()):
            return  # an error is not a limit
        fits = {T: peak for T, (status, peak) in seen.items() if status == "ok"}
        lo = max(fits, default=0)
        hi = min((T for T, (status, _) in seen.items() if status == "oom"), default=None)
        step = max(4096, int(lo * (args.fit_step - 1)) // 4096 * 4096)
        if hi is not None:
            if hi - lo <= step:
                return  # bracketed: lo fits, a step above it does not
            if hi - lo <= 8 * step:  # near: halve the bracket
                T = lo + (hi - lo) // 2 // 4096 * 4096
            else:  # far: down from the out-of-memory in doubling strides, halfway where a stride reaches lo
                misses = sum(status == "oom" and T > lo for T, (status, _) in seen.items())
                stride = max(4096, int(hi * (args.fit_step - 1)) // 4096 * 4096) * 2 ** (misses - 1)
                T = hi - stride if hi - stride > lo else (lo + hi) // 2 // 4096 * 4096
        elif lo >= args.fit_max // 4096 * 4096:
            return
        elif args.fit_from > lo and args.fit_from not in seen:
            T = args.fit_from // 4096 * 4096
        else:
            T = _line_guess(fits, budget)
            T = 2 * lo if T is None else max(lo + step, T)  # no line: twice the longest fit
        T = min(T, args.fit_max // 4096 * 4096)
        if T in seen or T <= lo:
            return
        yield T


def _line_guess(fits: dict, budget: float | None) -> int | None:
    """Where the line through the two longest fits' peaks meets ``budget`` (a multiple of 4096),
    or None without a budget, two fits or a rising line."""
    line = sorted(fits)[-2:]
    if not budget or len(line) < 2 or math.isnan(fits[line[0]] + fits[line[1]]):
        return None
    slope = (fits[line[1]] - fits[line[0]]) / (line[1] - line[0])
    if slope <= 0:
        return None
    return int(line[1] + (budget - fits[line[1]]) / slope) // 4096 * 4096


def _longest_asked(args) -> int:
    """The longest T this run may train: what a variant plans its memory for (offload, tiles)."""
    return max(args.fit_max, *args.T) if args.fit else max(args.T)


def _measured(model, T: int, args) -> dict:
    """The row's measurements, or its status when the variant runs out of memory or fails."""
    steps, warmup = (args.steps, args.warmup) if T in args.T else (1, 0)  # --fit asks only: does it fit?
    try:
        if args.what == "layer":
            return dict(what="layer", **measure_layer(model, T, steps=steps, warmup=warmup))
        row = dict(what="step", **measure(model, T, steps=steps, warmup=warmup, compile=args.compile, batch=args.batch,
                                            progress=True))
        if args.memory_at_peak and T in args.T and torch.cuda.is_available():
            try:  # an extra, optional look: its failure must not cost the measured row
                row.update(memory_at_peak(model, T))
            except Exception as exc:  # (memory_at_peak has stopped the recording itself)
                where = " < ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})"
                                   for f in reversed(traceback.extract_tb(exc.__traceback__)[-3:]))
                row["note"] = f"memory-at-peak failed in {where}: {type(exc).__name__}: {exc}"[:400]
        return row
    except Exception as exc:  # a variant failing is a result, and running out of memory the one --fit looks for
        if is_out_of_memory(exc):
            return dict(status="oom", note=out_of_memory_note(exc))
        return dict(status="error", note=f"{type(exc).__name__}: {exc}"[:300])


def _step_budget(device: torch.device) -> float | None:
    """The bytes a step's peak may reach, as the --fit search aims: what the allocator can still
    get (``long_context.usable_gpu_bytes``), less 2% for its block rounding and fragmentation;
    None off a GPU."""
    if device.type != "cuda":
        return None
    from ...long_context import usable_gpu_bytes

    return 0.98 * usable_gpu_bytes(device)


def _breakdown_lines(out) -> Path:
    """Where the children collect the breakdown's rows: beside the step rows' lines (or CSV)."""
    return Path(out).with_name("step_breakdown.jsonl")


def _breakdown(model, T: int, args, key: dict, step_ms: float) -> dict:
    """``--breakdown``: one more step profiled, its categories and the floor's terms appended as
    rows to ``step_breakdown.jsonl`` with the timed step (``step_ms``) of the same process; returns
    what the step's row records of them: the device time, the floor, the kernels launched and the
    GPU's busy fraction (device time over the timed step: below 1, the host or the launches leave
    the GPU idle)."""
    try:  # an extra, optional look: its failure must not cost the measured row
        rows = breakdown(profile_step(model, T, compile=args.compile))
        rates = floor_inputs(model, T)
        floor = step_floor(model.config.get_text_config(), T, args.rank, **rates)
    except Exception as exc:  # out of memory included
        return {"note": f"breakdown failed: {type(exc).__name__}: {exc}"[:300]}
    device_ms = sum(row["ms"] for row in rows)
    # (floor_gemm_at_shapes_ms is among the floor's terms)
    beside = {"step_ms": step_ms, "device_ms": device_ms, **{f"floor_{term}": value for term, value in floor.items()},
              "matmul_tflops": rates["matmul_tflops"], "copy_gbps": rates["copy_gbps"],
              "sdpa_layer_ms": rates["sdpa_ms"], "core_layer_ms": rates["core_ms"]}
    with open(_breakdown_lines(args.out), "a") as f:
        for row in rows:
            f.write(json.dumps({**key, **row, **beside}) + "\n")
    return {"device_ms": device_ms, "floor_ms": floor["total_ms"], "kernels": sum(row["kernels"] for row in rows),
            "busy": device_ms / step_ms}


def _write_line(path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _built(args, device):
    """The variant's LoRA model: ``build``'s, or for "unsloth" the same weights through Unsloth's loader
    (``benchmarks/peers/unsloth.py``)."""
    if args.variant != "unsloth":
        return build(args.size, args.layers, args.rank, device=device, attention=args.attention,
                     expert_lora=expert_lora(args.variant))
    if device.type != "cuda":
        raise ImportError("unsloth: its training path needs a CUDA GPU", name="unsloth (needs a CUDA GPU)")
    return peers.recipe("unsloth").build(args.size, args.layers, args.rank, _longest_asked(args))


def _one_variant(args) -> None:
    """Runs in its own process: build, patch, measure every T, append JSON lines to --out."""
    # a time limit ends a run with SIGTERM: say where it was (then die as SIGTERM would)
    faulthandler.register(signal.SIGTERM, all_threads=False, chain=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:  # (before transformers is imported here: Unsloth patches it as it is imported)
        model = _built(args, device)
        report, missing = prepare(model, args.variant, tokens=_longest_asked(args), batch=args.batch), ""
    except ImportError as exc:  # a peer that is not installed is a row that says so
        model, report, missing = None, None, f"not installed: {exc.name or exc}"
    import transformers

    # a step's rows name the transformers that ran and the CUDA caching allocator's settings: expandable segments
    # change where a long step runs out of memory (fragmentation), so a search's rows must say which allocator ran
    info = {**run_info(), "transformers": transformers.__version__,
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"}
    seen = {}  # T -> (status, peak bytes): what the --fit search reads
    budget = _step_budget(device) if args.fit else None
    for T in _sizes(args, seen, budget):
        key = {"variant": args.variant + ("+compile" if args.compile else ""), "T": T,
               **_row_key(args, None if model is None else model.config.get_text_config().num_hidden_layers),
               "rank": args.rank}
        row = {**key, "status": "skipped" if missing else "ok", "note": missing,
               "report": report_text(report)}
        if not missing:
            row.update(_measured(model, T, args))
        row.update(info)
        if args.breakdown and args.what == "step" and T in args.T and row["status"] == "ok":
            _write_line(args.out, row)  # the step's row first: a breakdown cut short must not take it along
            looked = _breakdown(model, T, args, {**key, **info}, row["step_ms"])
            row.update(looked, note="; ".join(filter(None, (row["note"], looked.get("note")))))
        seen[T] = (row["status"], row.get("peak_gib", math.nan) * 2**30)
        if device.type == "cuda":
            gc.collect()  # an out-of-memory step's tensors, before the next T (the search goes on after one)
            torch.cuda.empty_cache()
        _write_line(args.out, row)  # (merge_rows keeps the last line of a key)
        if args.what == "layer":
            print(f"{args.variant:22s} T={T:6d} {row['status']:5s} "
                  f"GatedDeltaNet fwd+bwd {row.get('layer_ms', math.nan):8.2f} ms, "
                  f"in_proj {row.get('in_proj_ms', math.nan):8.2f} ms, core {row.get('core_ms', math.nan):8.2f} ms",
                  flush=True)
        else:
            print(f"{args.variant:22s} T={T:6d} {row['status']:5s} step {row.get('step_ms', math.nan):9.1f} ms, "
                  f"outside core {row.get('outside_core_ms', math.nan):9.1f} ms, "
                  f"peak {row.get('peak_gib', math.nan):6.1f} GiB"
                  + (f", floor {row['floor_ms']:9.1f} ms" if "floor_ms" in row else ""), flush=True)
        if row["status"] == "oom" and not args.fit:
            break  # longer sequences will not fit either


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m q35lab.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["peft", "peft+liger", "q35lab"], choices=sorted(VARIANTS),
                        metavar="VARIANT",
                        help="what to train, each in a fresh process (default: peft peft+liger q35lab): "
                        + ", ".join(sorted(VARIANTS)))
    parser.add_argument("--T", type=tokens(), nargs="+", default=[8192, 32768], metavar="TOKENS",
                        help="sequence lengths in tokens (8192, 8k), batch 1 (default: 8192 32768)")
    parser.add_argument("--what", default="step", choices=["step", "layer"],
                        help="a whole training step, or one GatedDeltaNet layer forward + backward")
    parser.add_argument("--size", default="h200", choices=[*SIZES, "h200", "tiny", "tiny-moe"],
                        help="model dimensions: a real Qwen3.5 size, 'h200' (the 9B's dims, --layers layers), 'tiny' "
                        "or 'tiny-moe' (CPU-sized, dense or with 4 routed experts)")
    parser.add_argument("--layers", type=whole_number(1), default=None,
                        help="decoder layers (default: all of a real size's, 4 for 'h200' and 'tiny')")
    parser.add_argument("--compile", action="store_true", help="train torch.compile(model) (variant label +compile)")
    parser.add_argument("--rank", type=whole_number(1), default=16,
                        help="LoRA rank on every linear layer (default: %(default)s)")
    parser.add_argument("--steps", type=whole_number(1), default=3,
                        help="measured training steps per size (default: %(default)s)")
    parser.add_argument("--warmup", type=whole_number(0), default=1,
                        help="unmeasured steps before them (default: %(default)s)")
    parser.add_argument("--fit", action="store_true",
                        help="after --T, search the longest T that fits: from the line through the measured peaks (or "
                        "--fit-from), up a step while it fits, down a step from one that runs out of memory")
    parser.add_argument("--fit-max", type=tokens(4096), default=512 * 1024, metavar="TOKENS",
                        help="with --fit: the longest size tried, and what variants plan their memory for "
                        "(default: %(default)s)")
    parser.add_argument("--fit-from", type=tokens(0), default=0, metavar="TOKENS",
                        help="with --fit: the first guess (default: where the line through the last two fits' peaks "
                        "meets the GPU's memory)")
    parser.add_argument("--fit-step", type=real_number(1, above=True, what="a step factor"), default=1.03,
                        help="with --fit: the search's step, a factor of the longest fit (at least 4096 tokens; "
                        "default: %(default)s)")
    parser.add_argument("--batch", choices=["packed", "padded"], default=None,
                        help="T tokens of an SFT length mix (LMSYS-Chat-1M's mean, log-normal) packed into one row or "
                        "padded per micro-batch, instead of one sequence of T tokens; rows get a batch column")
    parser.add_argument("--attention", choices=["sdpa", "flex_attention", "eager"], default=None,
                        help="transformers' attn_implementation (default: its own, sdpa); the rows record it")
    parser.add_argument("--memory-at-peak", action="store_true",
                        help="at each --T, one more step recorded by the allocator: what is alive at its peak, "
                        "by source")
    parser.add_argument("--breakdown", action="store_true",
                        help="at each --T, one more step profiled: device time by kernel category and its sources, "
                        "beside the step's floor, in step_breakdown.csv next to --out (steps only)")
    parser.add_argument("--out", type=output_file, required=True,
                        help="CSV to write; rows of a variant and T measured again replace theirs, others are kept "
                        "(a .jsonl of the same name collects the rows)")
    parser.add_argument("--merge-leftovers", action="store_true",
                        help="only merge the rows that children wrote beside --out (its .jsonl, and the breakdown's) "
                        "and that a parent killed by a time limit left unmerged, then stop")
    # the child process's one variant
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.size in SIZES and args.layers and args.layers > SIZES[args.size]["layers"]:
        parser.error(f"argument --layers: expected at most {SIZES[args.size]['layers']} ({args.size} has that many), "
                     f"got {args.layers}")
    if args.variant:
        _one_variant(args)
        return 0
    absent = peers.missing(args.variants)
    if absent and not args.merge_leftovers:
        parser.error(f"--variants {' '.join(absent)}: run from a checkout of the repository: peers' recipes live "
                     "in benchmarks/peers/, not in the wheel")
    if not args.merge_leftovers and runtime.interpreter_notice():  # once, here: the variants' processes say nothing
        print(runtime.interpreter_notice(), file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines, breakdown_lines = out.with_suffix(".jsonl"), _breakdown_lines(out)
    if args.merge_leftovers:  # a child's row is whole once written: keep what a killed run measured
        _merge_all(lines, breakdown_lines, out)
        return 0
    lines.unlink(missing_ok=True)
    breakdown_lines.unlink(missing_ok=True)
    for variant in args.variants:
        child = [sys.executable, "-m", "q35lab.e2e", "--variant", variant, "--out", str(lines), "--what", args.what,
                 "--size", args.size,
                 *(["--layers", str(args.layers)] if args.layers else []), *(["--compile"] if args.compile else []),
                 "--rank", str(args.rank), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--fit-max", str(args.fit_max), "--fit-from", str(args.fit_from),
                 "--fit-step", str(args.fit_step), *(["--fit"] if args.fit else []),
                 *(["--memory-at-peak"] if args.memory_at_peak else []),
                 *(["--batch", args.batch] if args.batch else []),
                 *(["--attention", args.attention] if args.attention else []),
                 *(["--breakdown"] if args.breakdown else []),
                 "--T", *map(str, args.T)]
        if subprocess.run(child).returncode != 0:  # one row per size asked for, so that it replaces theirs
            with open(lines, "a") as f:
                for T in args.T:
                    f.write(json.dumps({**_row_key(args), "variant": variant, "T": T, "status": "error",
                                        "note": "the process failed"}) + "\n")
    _merge_all(lines, breakdown_lines, out)
    return 0


def _merge_all(lines: Path, breakdown_lines: Path, out: Path) -> None:
    """The children's rows into ``out`` (a later row of a variant and T replacing an earlier),
    their breakdown rows into ``step_breakdown.csv`` beside it."""
    if lines.exists():
        _merge_lines(lines, out, last_line_wins=True)
    if breakdown_lines.exists():
        _merge_lines(breakdown_lines, out.with_name("step_breakdown.csv"))


def _row_key(args, layers: int | None = None) -> dict:
    """A row's key columns besides variant and T: its model's size and layers (``layers``, else
    from the config the child builds), its batch and attention. A failed child's stand-in row
    carries them too, so that it replaces only the rows the child would have written: a row
    without them matched every row of its variant and T, of any size, and replaced them all."""
    layers = config(args.size, args.layers).num_hidden_layers if layers is None else layers
    return {"size": args.size, "layers": layers, **({"batch": args.batch} if args.batch else {}),
            **({"attention": args.attention} if args.attention else {})}


def _merge_lines(lines: Path, csv: Path, last_line_wins: bool = False) -> None:
    """The children's JSON lines merged into ``csv`` (``merge_rows``); the lines removed."""
    rows = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
    merge_rows(csv, rows, last_line_wins).to_csv(csv, index=False, float_format="%.5g")
    lines.unlink(missing_ok=True)


#: Columns of a row's key beyond (variant, T, size, layers) that only some rows set.
KEY_EXTRAS = ("batch", "attention")
#: A row's key: the rows of one key replace each other.
KEY = ("variant", "T", "size", "layers", *KEY_EXTRAS)


def merge_rows(path: Path, rows: list[dict], last_line_wins: bool = False):
    """This run's rows, after the rows already in ``path`` that it did not measure again (another
    variant, or another T of the same variant): results gathered over several device calls.
    ``last_line_wins``: of this run's rows with the same key, only the last (a step's row written
    before its breakdown and again after it); the breakdown's own rows share a key per category."""
    import pandas as pd

    def integer_sizes(frame):  # a row without T would make the column float, written as 1.3107e+05
        if "T" in frame.columns:
            frame["T"] = frame["T"].astype("Int64")
        return frame

    def with_key_columns(frame):  # a packed or padded row (or another attention's) never replaces a row of one sequence
        for column in KEY_EXTRAS:
            if column not in frame.columns:
                frame[column] = math.nan
        return frame

    new = with_key_columns(integer_sizes(pd.DataFrame(rows)))
    own = [c for c in KEY if c in new.columns]
    if last_line_wins:
        new = new.loc[~new[own].astype(str).duplicated(keep="last")]
    if not path.exists() or path.stat().st_size == 0:
        return new.reset_index(drop=True)
    old = with_key_columns(integer_sizes(read_csv(path)))
    # a row is (variant, T, batch, attention) of one model: its size and layers where both frames record them
    key = [c for c in KEY if c in old.columns and c in new.columns]
    if {"variant", "T"} <= set(key):
        measured = set(new[key].astype(str).itertuples(index=False, name=None))
        old = old[[k not in measured for k in old[key].astype(str).itertuples(index=False, name=None)]]
    return integer_sizes(pd.concat([old, new], ignore_index=True))
