"""Where the whole-layer tiled GatedDeltaNet's cost goes (run on a GPU).

The 9B's dimensions with ``--layers`` decoder layers (4: three GatedDeltaNet layers and one
attention layer), LoRA r=16 on every linear, gradient checkpointing, at ``--T`` tokens: q35lab
untiled, then ``apply_to_qwen3_5(tiled_gdn=N)`` for each ``--tiles`` N, each in turn in this
process (one model at a time). For each: the median step (``measure``), then one step under
torch.profiler, its kernels grouped by (category, launching source, aten op) with their count and
device time, and the step's span on the device against the time some kernel ran (the rest is
the device waiting on the host); and where a step makes the host wait for the device. One CSV
row per group and variant; the groups whose time moved most against the untiled step are
printed last.

    python benchmarks/profile_tiled_layer.py --out data/bench/<gpu>/tiled_layer_profile.csv
"""

from __future__ import annotations

import argparse
import collections
import gc
import traceback
import warnings
from pathlib import Path

import pandas as pd
import torch

from q35lab import apply_to_qwen3_5
from q35lab.bench import core
from q35lab.bench.e2e.kernels import _category, _kernels, profile_step, source
from q35lab.bench.e2e.model import build
from q35lab.bench.e2e.step import measure


def busy_ms(events) -> tuple[float, float]:
    """(span, busy) of a profile's device kernels in ms: first start to last end, and the union of
    the intervals in which a kernel ran (the span less the device's idle gaps)."""
    from torch.autograd import DeviceType

    intervals = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type != DeviceType.CPU)
    if not intervals:
        return 0.0, 0.0
    busy, (run_start, run_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > run_end:
            busy += run_end - run_start
            run_start = start
        run_end = max(run_end, end)
    busy += run_end - run_start
    return (intervals[-1][1] - intervals[0][0]) / 1e3, busy / 1e3


def kernel_groups(events) -> pd.DataFrame:
    """Device time and kernel count by (category, source, aten op without its shapes)."""
    time, count = collections.Counter(), collections.Counter()
    for name, us, frames, node, call in _kernels(events):
        category = _category(name, frames)
        # copies keep their operands' shapes (which tensor was copied); the rest are grouped by op
        key = (category, source(frames, node), call if category == "copies/casts" else call.split(" [")[0])
        time[key] += us
        count[key] += 1
    rows = [{"category": c, "source": s, "op": o, "kernels": count[c, s, o], "ms": us / 1e3}
            for (c, s, o), us in time.items()]
    return pd.DataFrame(rows)


def synchronizing_calls(model, T: int) -> str:
    """Where one more step makes the host wait for the device (``torch.cuda.set_sync_debug_mode``
    warns at each synchronizing call), each place as its innermost Python frames "file:line <
    file:line < ..." with its count, most frequent first. A wait inside a tile's loop drains the
    device's queue once a tile."""
    from q35lab.bench.e2e.step import _training_setup, tokens, train_step

    device, vocab, optimizer = _training_setup(model, 1e-4)
    ids = tokens(T, vocab, device, seed=0)
    places = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = traceback.extract_stack()[:-1][-4:]  # the warning's own frames left out
            places[" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(model, optimizer, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return "; ".join(f"{place} ({n})" for place, n in places.most_common())


def one_variant(tile: int | None, args) -> pd.DataFrame:
    model = build(args.size, layers=args.layers, device="cuda" if torch.cuda.is_available() else "cpu")
    apply_to_qwen3_5(model, **({"tiled_gdn": tile} if tile else {}))
    timed = measure(model, args.T, steps=args.steps, warmup=1)
    syncs = synchronizing_calls(model, args.T) if torch.cuda.is_available() else ""
    events = profile_step(model, args.T)
    span, busy = busy_ms(events)
    groups = kernel_groups(events)
    del events, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    name = f"q35lab+tiled_gdn={tile}" if tile else "q35lab"
    return groups.assign(variant=name, tile=tile or 0, T=args.T, layers=args.layers, step_ms=timed["step_ms"],
                         loss_first=timed["loss_first"], device_span_ms=span, device_busy_ms=busy, syncs=syncs,
                         device_ms=groups.ms.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="h200", help="the model's dimensions (q35lab.bench.e2e.model.config)")
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tiles", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    frames = [one_variant(tile, args) for tile in (None, *args.tiles)]
    table = pd.concat(frames, ignore_index=True).assign(**core.run_info())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)

    steps = table.groupby("variant", sort=False)[["step_ms", "device_span_ms", "device_busy_ms", "device_ms",
                                                  "loss_first"]].first()
    print(steps.round(2).to_string())
    for variant, syncs in table.groupby("variant", sort=False).syncs.first().items():
        print(f"{variant}: the host waits for the device at {syncs or 'no call'}")
    key = ["category", "source", "op"]
    base = table[table.tile == 0].set_index(key)[["kernels", "ms"]]
    for tile in args.tiles:
        tiled = table[table.tile == tile].set_index(key)[["kernels", "ms"]]
        diff = tiled.join(base, how="outer", lsuffix="_tiled", rsuffix="_untiled").fillna(0)
        diff["delta_ms"] = diff.ms_tiled - diff.ms_untiled
        diff = diff.reindex(diff.delta_ms.abs().sort_values(ascending=False).index)
        print(f"\ntiles of {tile}: by category\n",
              diff.groupby(level="category")[["ms_untiled", "ms_tiled", "delta_ms"]].sum().round(2).to_string())
        copies = diff.xs("copies/casts", level="category")
        print(f"\ntiles of {tile}: the copies that moved most (ms)")
        with pd.option_context("display.width", 250, "display.max_colwidth", 120):
            print(copies.head(12).round(2).to_string())
        print(f"\ntiles of {tile}: the 25 groups that moved most (ms)")
        with pd.option_context("display.width", 250, "display.max_colwidth", 70):
            print(diff.head(25).round(2).to_string())


if __name__ == "__main__":
    main()
