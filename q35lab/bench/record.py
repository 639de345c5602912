"""RESULTS.md, the measured record, written from the committed CSVs under ``data/bench/<gpu>/``.

    python -m q35lab.bench.record            # rewrite RESULTS.md from data/
    python -m q35lab.bench.record --check    # exit 1 when RESULTS.md differs from what the CSVs give

Every figure in the record is read or computed here from a CSV row, and every table names its
file and the call (commit, date) of each row, so the record cannot drift from the data: the tests
regenerate it and compare. Rows are chosen by rules, not by name: the newest call that ran every
variant a table compares, the newest row of each size, length and variant. A new run that is
committed changes the record the next time it is generated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

H200, H100 = "nvidia-h200", "nvidia-h100-80gb-hbm3"

#: What each training variant of ``python -m q35lab.e2e`` is called in the record.
NAMES = {
    "peft": "PEFT",
    "peft+liger": "PEFT + Liger",
    "peft+liger+axolotl": "axolotl's recipe",
    "unsloth": "Unsloth",
    "q35lab": "PEFT + q35lab",
    "q35lab+tiled": "q35lab + tiled MLP",
    "q35lab+tiled_gdn": "q35lab + tiled GatedDeltaNet",
    "q35lab+offload": "q35lab + checkpoint offload",
    "q35lab+long": "q35lab + all three options",
    "q35lab+long_context": "q35lab + `long_context=` plan",
    "q35lab+ckpt_auto": "q35lab + `checkpointing='auto'` plan",
    "q35lab+fp8": "q35lab + FP8 base weights",
    "q35lab+no_ckpt": "q35lab without checkpointing",
    "peft+no_ckpt": "PEFT without checkpointing",
}
#: The whole-step comparison: the peers, then q35lab, whose speed-up over each is shown.
PEERS = ("peft", "peft+liger", "peft+liger+axolotl")
HEADLINE = (*PEERS, "q35lab")
#: The op benchmarks shown one by one (``data/bench/<gpu>/<op>.csv``), with their notebooks.
OPS = {
    "offset_rms_norm": "offset RMSNorm ([01](notebooks/01_offset_rmsnorm.ipynb))",
    "gated_rms_norm": "gated RMSNorm + SiLU ([02](notebooks/02_gated_rmsnorm.ipynb))",
    "lora": "LoRA projection ([03](notebooks/03_peft_cast_tax.ipynb))",
    "in_proj": "the four in_proj projections as one node ([04](notebooks/04_in_proj_fusion.ipynb))",
    "linear_cross_entropy": "linear cross entropy ([05](notebooks/05_fused_linear_cross_entropy.ipynb))",
    "swiglu": "SwiGLU ([06](notebooks/06_qwen3_5_end_to_end.ipynb))",
    "causal_conv1d": "causal conv1d + SiLU ([07](notebooks/07_causal_conv1d.ipynb))",
}
KERNEL_T = 32768  # the length the kernels are compared at: a long fine-tuning sequence


class RecordError(ValueError):
    """The CSVs do not hold what a table of the record needs."""


# --- reading ---------------------------------------------------------------------------------


def _read(data: Path, gpu: str, name: str):
    from .core import read_csv

    path = Path(data) / "bench" / gpu / name
    if not path.is_file():
        raise RecordError(f"{path}: not found (the record reads data/bench/<gpu>/<file>; pass the data folder)")
    frame = read_csv(path)
    frame["order"] = range(len(frame))  # a later row is a later measurement
    return frame


def _calls(frame):
    """The frame's calls (rows of one commit), newest first: by date, then by their last row."""
    keys = frame.groupby("commit").agg(date=("date", "max"), order=("order", "max"))
    return list(keys.sort_values(["date", "order"], ascending=False).index)


def _newest_call_with(frame, variants, source: str):
    """The rows of the newest call that ran every one of ``variants`` (status ok or not)."""
    for commit in _calls(frame):
        rows = frame[frame.commit.eq(commit)]
        if set(variants) <= set(rows.variant):
            return rows
    raise RecordError(f"{source}: no call ran all of {', '.join(variants)}")


def _full_depth(frame):
    """Rows of the real models at their real depth (the e2e sizes), one sequence per step."""
    from .e2e.model import SIZES

    depth = frame["size"].map(lambda size: SIZES.get(size, {}).get("layers"))
    batch = frame["batch"].fillna("") if "batch" in frame else ""
    return frame[depth.eq(frame["layers"]) & (batch == "")]


def _size_order(size: str) -> tuple:
    """The e2e sizes in their own order (smallest dense first, the MoE last), any other after them."""
    from .e2e.model import SIZES

    known = list(SIZES)
    return (known.index(size), "") if size in known else (len(known), size)


def _one(rows, source: str, **where):
    for column, value in where.items():
        rows = rows[rows[column].eq(value)]
    if len(rows) != 1:
        raise RecordError(f"{source}: expected one row where {where}, found {len(rows)}")
    return rows.iloc[0]


# --- formatting ------------------------------------------------------------------------------


def _seconds(ms: float) -> str:
    return f"{ms / 1e3:.2f} s"


def _ms(ms: float) -> str:
    return f"{ms:,.1f} ms"


def _gib(gib: float) -> str:
    return f"{gib:.1f} GiB"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}×"


def _count(n: float) -> str:
    return f"{n:,.0f}"


def _short_ms(ms: float) -> str:
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def _table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """A markdown table; ``align``: one letter a column, l or r."""
    rule = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(line) + " |" for line in (header, rule, *rows)]


def _stack(row) -> str:
    """What a row ran on: the GPU and the software."""
    parts = [row.gpu, f"torch {row.torch.split('+')[0]}", f"Triton {row.triton}"]
    if isinstance(row.get("transformers"), str) and row.transformers:
        parts.append(f"transformers {row.transformers}")
    return ", ".join(parts)


def _call(rows) -> str:
    first = rows.iloc[0]
    return f"commit {first.commit}, {first.date}"


def _outcome(row) -> str:
    """What stopped a row that has no measurement."""
    if row.status == "oom" or "out of memory" in row.note:
        return "out of memory"
    status = row.status if isinstance(row.status, str) else "not applicable"  # "n/a" reads as a missing value
    return f"{status}: {row.note}" if row.note else status


# --- the tables ------------------------------------------------------------------------------


def headline(data: Path, gpu: str = H200) -> list[str]:
    """The 9B step at 32k against the peers, all from one call, with the step's floor (README's table)."""
    source = f"data/bench/{gpu}/end_to_end.csv"
    frame = _full_depth(_read(data, gpu, "end_to_end.csv"))
    frame = frame[frame["size"].eq("9b") & frame["T"].eq(32768)]
    rows = _newest_call_with(frame, HEADLINE, source)
    ours = _one(rows, source, variant="q35lab")
    lines = []
    for variant in HEADLINE:
        row = _one(rows, source, variant=variant)
        name = f"**{NAMES[variant]}**" if variant == "q35lab" else NAMES[variant]
        speedup = "" if variant == "q35lab" else _times(row.step_ms / ours.step_ms)
        lines.append([name, _seconds(row.step_ms), _count(row["T"] / row.step_ms * 1e3), _gib(row.peak_gib), speedup])
    floor = ours.get("floor_ms")
    if floor == floor and floor:  # NaN when the call did not profile the step
        lines.append(["the step's floor (the same work at the GPU's measured rates)", _seconds(floor), "", "", ""])
    return _table(["variant", "step", "tokens / s", "peak memory", "q35lab's speed-up"], lines, "lrrrr")


def headline_source(data: Path, gpu: str = H200) -> str:
    """The line under the headline table: which call, on what."""
    frame = _full_depth(_read(data, gpu, "end_to_end.csv"))
    frame = frame[frame["size"].eq("9b") & frame["T"].eq(32768)]
    rows = _newest_call_with(frame, HEADLINE, f"data/bench/{gpu}/end_to_end.csv")
    ours = rows[rows.variant.eq("q35lab")].iloc[0]
    fla = isinstance(ours.report, str) and "core: flash-linear-attention" in ours.report
    core = ", flash-linear-attention's delta-rule core" if fla else ""
    return (f"Qwen3.5-9B, all {ours.layers} layers, LoRA r = {ours['rank']:.0f} on every linear layer, "
            f"T = {ours['T']:,} tokens, batch 1{core}; one call on {_stack(ours)} ({_call(rows)}), each variant in "
            f"a fresh process; [`end_to_end.csv`](data/bench/{gpu}/end_to_end.csv).")


def _headline_section(data: Path) -> list[str]:
    frame = _full_depth(_read(data, H200, "end_to_end.csv"))
    rows = _newest_call_with(frame[frame["size"].eq("9b") & frame["T"].eq(32768)], HEADLINE, "end_to_end.csv")
    losses = ", ".join(f"{NAMES[v]} {_one(rows, 'end_to_end.csv', variant=v).loss_first:.3f}" for v in HEADLINE)
    return ["## The 9B training step against its peers", "", headline_source(data), "", *headline(data), "",
            f"First losses, from the same seeded weights and tokens: {losses}.", ""]


def _unsloth_section(data: Path) -> list[str]:
    source = f"data/bench/{H200}/unsloth.csv"
    frame = _read(data, H200, "unsloth.csv")
    rows = _newest_call_with(frame, ("unsloth", "q35lab"), source)
    ours = _one(rows, source, variant="q35lab")
    table = []
    for _, row in rows.iterrows():
        gap = max(abs(a - b) for a, b in zip(json.loads(row.losses), json.loads(ours.losses)))
        mine = row.variant == "q35lab"
        table.append([NAMES.get(row.variant, row.variant), _seconds(row.step_ms), _count(row["T"] / row.step_ms * 1e3),
                      _gib(row.peak_gib), "" if mine else _times(row.step_ms / ours.step_ms),
                      "" if mine else f"{gap:.1e}"])
    return ["### Unsloth", "",
            f"Unsloth as its users run it: the same seeded 9B weights saved and loaded by `FastLanguageModel`, "
            f"`get_peft_model` on every linear layer, its offloaded checkpointing; T = {ours['T']:,}. One call on "
            f"{_stack(ours)} ({_call(rows)}); [`unsloth.csv`](data/bench/{H200}/unsloth.csv).", "",
            *_table(["variant", "step", "tokens / s", "peak memory", "q35lab's speed-up",
                     "largest loss difference from q35lab's, any step"],
                    table, "lrrrrr"), ""]


def _sizes_section(data: Path) -> list[str]:
    source = f"data/bench/{H200}/end_to_end.csv"
    frame = _full_depth(_read(data, H200, "end_to_end.csv"))
    frame = frame[frame.variant.isin(HEADLINE)]
    newest = frame.sort_values(["date", "order"]).groupby(["size", "T", "variant"]).tail(1)
    table = []
    for size in sorted(newest["size"].unique(), key=_size_order):
        for T in sorted(newest[newest["size"].eq(size)]["T"].unique()):
            here = newest[newest["size"].eq(size) & newest["T"].eq(T)]
            ours = here[here.variant.eq("q35lab") & here.status.eq("ok")]
            for variant in HEADLINE:
                match = here[here.variant.eq(variant)]
                if match.empty:
                    continue
                row = match.iloc[0]
                if row.status != "ok":
                    table.append([size, f"{T:,}", NAMES[variant], _outcome(row), "", "", "",
                                  f"{row.commit}, {row.date}"])
                    continue
                speedup = "" if ours.empty or variant == "q35lab" else _times(row.step_ms / ours.iloc[0].step_ms)
                table.append([size, f"{T:,}", NAMES[variant], _seconds(row.step_ms),
                              _count(T / row.step_ms * 1e3), _gib(row.peak_gib), speedup, f"{row.commit}, {row.date}"])
    return ["## Every size", "",
            f"The newest row of each model, length and variant (one sequence a step, all layers); a speed-up may "
            f"set rows of two calls side by side: the last column says which. Sizes are `SIZES` in "
            f"[`q35lab/bench/e2e/model.py`](q35lab/bench/e2e/model.py); [`end_to_end.csv`]({source}).",
            "", *_table(["model", "T", "variant", "step", "tokens / s", "peak memory", "q35lab's speed-up", "call"],
                        table, "lrlrrrrl"), ""]


def _breakdown_section(data: Path) -> list[str]:
    frame = _read(data, H200, "step_breakdown.csv")
    newest = frame.sort_values(["date", "order"]).groupby("size").tail(1)
    categories = list(dict.fromkeys(frame.category))
    table, floors = [], []
    for size in sorted(newest["size"], key=_size_order):
        commit = newest[newest["size"].eq(size)].commit.iloc[0]
        rows = frame[frame["size"].eq(size) & frame.commit.eq(commit)].set_index("category")
        top = rows.iloc[0]
        parts = [_short_ms(rows.ms.get(category, 0.0)) for category in categories]
        table.append([size, f"{top['T']:,}", _short_ms(top.device_ms), *parts,
                      f"{commit}, {top.date}"])
        floors.append([size, _short_ms(top.floor_gemm_ms), _short_ms(top.floor_attention_ms),
                       _short_ms(top.floor_core_ms), _short_ms(top.floor_streaming_ms), _short_ms(top.floor_total_ms),
                       _short_ms(top.step_ms), _times(top.step_ms / top.floor_total_ms)])
    return ["## Where the step goes", "",
            "One more step profiled in the process of each size's timed step: its device time by kernel "
            f"category, and its floor: each part's work at the rates measured in the same process (the GEMMs' FLOPs "
            f"at a square bf16 matmul's rate, attention and the delta rule as their kernels alone on the layer's "
            f"shapes, the streaming ops at copy speed); [`step_breakdown.csv`](data/bench/{H200}/step_breakdown.csv).",
            "", *_table(["model", "T", "device time", *categories, "call"], table,
                        "l" + "r" * (len(categories) + 2) + "l"),
            "", *_table(["model", "GEMM floor", "attention floor", "delta-rule floor", "streaming floor", "floor",
                         "timed step", "step / floor"], floors, "lrrrrrrr"),
            "", f"![q35lab's 9B step at 32k against its floor](data/figures/step_breakdown-9b_{H200}.png)", ""]


def _longest_section(data: Path) -> list[str]:
    source = f"data/bench/{H200}/end_to_end.csv"
    frame = _full_depth(_read(data, H200, "end_to_end.csv"))
    frame = frame[frame["size"].eq("9b")]
    out_of_memory = frame.status.eq("oom") | frame.note.str.contains("out of memory")
    table, bound = [], None
    for variant in [v for v in NAMES if v in set(frame.variant)]:
        rows = frame[frame.variant.eq(variant)]
        fits = rows[rows.status.eq("ok")].sort_values("T")
        if fits.empty:
            continue
        longest = fits.iloc[-1]
        above = rows[out_of_memory.loc[rows.index] & rows["T"].gt(longest["T"])].sort_values("T")
        oom = above.iloc[0] if not above.empty else None
        if variant == "peft+liger" and oom is not None:
            bound = oom
        table.append([NAMES[variant], _count(longest["T"]), _gib(longest.peak_gib), f"{longest.commit}, {longest.date}",
                      "not reached" if oom is None else _count(oom["T"]),
                      "" if oom is None else f"{oom.commit}, {oom.date}"])
    lines = ["## Long context", "", "### The longest steps measured on the H200", "",
             f"The 9B, one sequence a step: each variant's longest step that ran and the shortest longer one that ran "
             f"out of memory, over every call in [`end_to_end.csv`]({source}).", "",
             *_table(["variant", "longest step run", "its peak", "call", "out of memory at", "call"], table, "lrrlrl"),
             ""]
    if bound is not None:
        longest = frame[frame.status.eq("ok")].sort_values("T").iloc[-1]
        lines += [f"The longest step run, {longest['T']:,} tokens ({NAMES[longest.variant]}), is "
                  f"{_times(longest['T'] / bound['T'])} the length at which {NAMES['peft+liger']} ran out of memory.",
                  ""]
    return lines


def _option_costs(data: Path, gpu: str) -> list[str]:
    frame = _read(data, gpu, "long_context.csv")
    table = []
    for commit in reversed(_calls(frame)):
        rows = frame[frame.commit.eq(commit)]
        plain = rows[rows.variant.eq("q35lab")]
        for _, row in rows.iterrows():
            cost = ("" if row.variant == "q35lab" or plain.empty
                    else f"{100 * (row.step_ms / plain.iloc[0].step_ms - 1):+.1f}%")
            table.append([f"{commit}, {row.date}", NAMES.get(row.variant, row.variant), f"{row['T']:,}",
                          _ms(row.step_ms), cost, _gib(row.peak_gib)])
    first = frame.iloc[0]
    return [f"**{first.gpu}** ([`long_context.csv`](data/bench/{gpu}/long_context.csv)):", "",
            *_table(["call", "variant", "T", "step", "cost against q35lab in the call", "peak memory"], table,
                    "llrrrr"),
            ""]


def _fit_section(data: Path, gpu: str = H100) -> list[str]:
    frame = _read(data, gpu, "long_fit.csv")
    out_of_memory = frame.status.eq("oom") | frame.note.str.contains("out of memory")
    found = {}
    for variant in [v for v in NAMES if v in set(frame.variant)]:
        rows = frame[frame.variant.eq(variant)]
        fits = rows[rows.status.eq("ok")].sort_values("T")
        longest = fits.iloc[-1]
        above = rows[out_of_memory.loc[rows.index] & rows["T"].gt(longest["T"])].sort_values("T")
        found[variant] = (longest, above.iloc[0] if not above.empty else None, sorted(set(rows.commit)))
    bound = found.get("peft+liger", (None, None))[1]
    table = []
    for variant, (longest, oom, commits) in found.items():
        ratio = "" if bound is None or variant == "peft+liger" else "≥ " + _times(longest["T"] / bound["T"])
        table.append([NAMES[variant], _count(longest["T"]), "not reached" if oom is None else _count(oom["T"]),
                      _gib(longest.peak_gib), ratio, ", ".join(commits)])
    lines = ["### The longest step that fits, searched on the H100", "",
             f"`python -m q35lab.e2e --fit` on {_stack(frame.iloc[0])}: the longest step that fits and the length, "
             f"one search step or more above it, that ran out of memory; the ratio sets the fit against the length at "
             f"which {NAMES['peft+liger']} ran out (ratios may cross calls); "
             f"[`long_fit.csv`](data/bench/{gpu}/long_fit.csv).", "",
             *_table(["variant", "fits", "runs out at", "peak at the fit",
                      f"fit / {NAMES['peft+liger']}'s out of memory", "calls"], table, "lrrrrl"), ""]
    all_three = found.get("q35lab+long")
    if all_three and all_three[1] is not None:
        lines += [f"Where all three options ran out of memory, the allocator's account: *{all_three[1].note}*", ""]
    return lines


def _long_section(data: Path) -> list[str]:
    return [*_longest_section(data), "### What each option costs a step that needs none", "",
            "Each long-context option beside plain q35lab in the same call, at a length that needs none of them.", "",
            *_option_costs(data, H200), *_option_costs(data, H100), *_fit_section(data)]


def _packed_section(data: Path) -> list[str]:
    import pandas as pd

    lines = ["## Packed batches", "",
             "The 9B, a step of an SFT length mix's real tokens: packed into one row (`DataCollatorWithFlattening`), "
             "or padded per micro-batch. Real tokens a second; ratios within one call.",
             ""]
    for gpu in (H200, H100):
        parts = [_read(data, gpu, "packed_vs_padded.csv")]
        if gpu == H200:
            e2e = _read(data, gpu, "end_to_end.csv")
            parts.insert(0, e2e[e2e["batch"].fillna("").ne("")])
        frame = pd.concat(parts, ignore_index=True)
        table = []
        for commit in dict.fromkeys(frame.commit):
            rows = frame[frame.commit.eq(commit)]
            for _, row in rows.iterrows():
                other = rows[rows.variant.eq(row.variant) & rows["batch"].ne(row["batch"]) & rows.status.eq("ok")]
                ours = rows[rows.variant.eq("q35lab") & rows["batch"].eq(row["batch"]) & rows.status.eq("ok")]
                if row.status != "ok":
                    table.append([f"{commit}, {row.date}", NAMES[row.variant], row["batch"], "", _outcome(row),
                                  "", "", "", ""])
                    continue
                packing = (_times(row.real_tokens_per_s / other.iloc[0].real_tokens_per_s)
                           if row["batch"] == "packed" and not other.empty else "")
                vs = "" if row.variant == "q35lab" or ours.empty else _times(ours.iloc[0].real_tokens_per_s
                                                                             / row.real_tokens_per_s)
                table.append([f"{commit}, {row.date}", NAMES[row.variant], row["batch"], _count(row.real_tokens),
                              _count(row.real_tokens_per_s),
                              _seconds(row.step_ms), _gib(row.peak_gib), packing, vs])
        sources = ", ".join(f"[`{name}`](data/bench/{gpu}/{name})"
                            for name in (["end_to_end.csv"] if gpu == H200 else []) + ["packed_vs_padded.csv"])
        lines += [f"**{frame.gpu.iloc[0]}** ({sources}):", "",
                  *_table(["call", "variant", "batch", "real tokens", "real tokens / s", "step", "peak memory",
                           "packed / padded", "q35lab's speed-up"], table, "lllrrrrrr"), ""]
    return lines


def _kernels_section(data: Path) -> list[str]:
    lines = ["## The kernels one by one", "",
             f"Forward + backward kernel time (the profiler's) and wall time at T = {KERNEL_T:,}, bf16, every "
             "implementation in one run of `python -m q35lab bench`; extra peak: memory allocated above the inputs. "
             "`time / q35lab's`: this row's kernel time over q35lab's in the same setting (above 1: q35lab is "
             "faster). "
             "The notebooks hold the sweeps over T.", ""]
    for op, title in OPS.items():
        frame = _read(data, H200, f"{op}.csv")
        commit = _calls(frame)[0]
        rows = frame[frame.commit.eq(commit) & frame["T"].eq(KERNEL_T) & frame["pass"].eq("fwd+bwd")]
        rows = rows.assign(variant=rows.variant.fillna(""))
        table = []
        for variant in dict.fromkeys(rows.variant):
            same = rows[rows.variant.eq(variant)]
            ours = same[same.impl.eq("q35lab") & same.status.eq("ok")]
            for _, row in same.sort_values("kernel_ms", na_position="last").iterrows():
                if row.status != "ok":
                    table.append([row.impl, variant, _outcome(row), "", "", ""])
                    continue
                ratio = "" if ours.empty or row.impl == "q35lab" else _times(row.kernel_ms / ours.iloc[0].kernel_ms)
                table.append([row.impl, variant, f"{row.kernel_ms:.3f} ms", f"{row.wall_ms:.3f} ms",
                              f"{row.extra_peak_mb:,.0f} MB", ratio])
        first = rows.iloc[0]
        lines += [f"### {title}", "", f"{_stack(first)}, {_call(rows)}; [`{op}.csv`](data/bench/{H200}/{op}.csv).", "",
                  *_table(["implementation", "setting", "kernel time", "wall time", "extra peak", "time / q35lab's"],
                          table, "llrrrr"), ""]
    return lines


def _fsdp2_section(data: Path) -> list[str]:
    path = Path(data) / "bench" / H200 / "fsdp2_step.jsonl"
    if not path.is_file():
        raise RecordError(f"{path}: not found")
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    table = [[NAMES.get(r["variant"], r["variant"]), str(r["world_size"]), f"{r['T']:,}", r["status"],
              _seconds(r["step_ms"]) if r["status"] == "ok" else "", _gib(r["peak_gib"]) if r["status"] == "ok" else "",
              f"{r.get('commit', '')}, {r.get('date', '')}"] for r in runs]
    return ["## Several GPUs (FSDP2)", "",
            f"`benchmarks/fsdp2_step.py`: the 9B patched first, then each decoder layer and the root sharded with "
            f"`fully_shard`; [`fsdp2_step.jsonl`](data/bench/{H200}/fsdp2_step.jsonl).", "",
            *_table(["variant", "GPUs", "T", "status", "step", "peak memory (a GPU)", "call"], table, "lrrlrrl"), ""]


def _gpu_tests_section(data: Path) -> list[str]:
    lines = ["## The tests on GPUs", "",
             "`dev/gpu_tests.py`: test files run with compiled Triton on a lent GPU; the newest run of each file.",
             ""]
    for gpu in (H200, H100):
        frame = _read(data, gpu, "gpu_tests.csv")
        newest = frame.sort_values(["date", "order"]).groupby("file").tail(1).sort_values("file")
        table = [[row.file, _count(row.passed), _count(row.failed), _count(row.errors), _count(row.skipped), row.status,
                  f"{row.commit}, {row.date}"] for _, row in newest.iterrows()]
        lines += [f"**{frame.gpu.iloc[0]}** ([`gpu_tests.csv`](data/bench/{gpu}/gpu_tests.csv)):", "",
                  *_table(["file", "passed", "failed", "errors", "skipped", "status", "call"], table, "lrrrrll"), ""]
    return lines


def render(data: Path) -> str:
    """The whole record, from the CSVs under ``data``."""
    lines = ["# q35lab — the measured record", "",
             "Written by `python -m q35lab.bench.record` from the CSVs under `data/bench/<gpu>/`; "
             "`tests/test_results_record.py` fails when this file and the CSVs disagree, so edit the generator, "
             "not this file. Each table names its file and each row its call: the commit of the code that ran and "
             "the date. How a step is measured: `python -m q35lab.e2e` (wall time between CUDA events, the median "
             "step after a warm-up, bf16 autocast, gradient checkpointing, the fused AdamW that `Trainer` runs by "
             "default); how a kernel is measured: notebook 00. The "
             "peers' versions are those `dev/offline/device_wheels.sh` installs.", "",
             *_headline_section(data), *_unsloth_section(data), *_sizes_section(data), *_breakdown_section(data),
             *_long_section(data), *_packed_section(data), *_kernels_section(data), *_fsdp2_section(data),
             *_gpu_tests_section(data)]
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from . import data_dir

    parser = argparse.ArgumentParser(prog="python -m q35lab.bench.record", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from what the CSVs give")
    parser.add_argument("--data", type=Path, default=None, help="the results folder (default: the checkout's data/)")
    parser.add_argument("--out", type=Path, default=None, help="the record (default: RESULTS.md beside data/)")
    args = parser.parse_args(argv)
    data = data_dir(args.data)
    out = args.out or data.resolve().parent / "RESULTS.md"
    text = render(data)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} differs from what {data / 'bench'} gives: run python -m q35lab.bench.record", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
