"""Figures drawn from the committed CSVs: bandwidth and extra memory against tokens T.

Every figure reads ``data/bench/<gpu>/<op>.csv``, so a notebook on a CPU draws the real GPU
curves. One colour per implementation across all figures; ours is drawn last, on top.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
    matplotlib.use("Agg")  # headless: a PNG needs no display

import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:  # annotations only: the frames come from bench.core.read_csv, which imports pandas
    import pandas

__all__ = ["COLORS", "color_of", "plot_bandwidth", "plot_time", "plot_memory", "op_figure", "ablation_waterfall",
           "step_breakdown_figure", "figure_name", "render"]

COLORS = {
    "transformers": "#7f7f7f",
    "torch.compile": "#ff7f0e",
    "liger": "#2ca02c",
    "fla": "#9467bd",
    "axolotl": "#8c564b",
    "cut-cross-entropy": "#e377c2",
    "peft": "#bcbd22",
    "peft (bf16 adapters)": "#17becf",
    "q35lab (frozen w)": "#6baed6",
    "q35lab fused": "#08519c",
    "q35lab": "#1f4e9c",
}
_EXTRA = ["#d62728", "#aec7e8", "#98df8a", "#c5b0d5", "#c49c94"]


def color_of(impl: str, others: list[str] | None = None) -> str:
    if impl in COLORS:
        return COLORS[impl]
    others = sorted(set(others or []) - set(COLORS))
    return _EXTRA[others.index(impl) % len(_EXTRA)] if impl in others else "#000000"


def _ordered_impls(df, ours: str) -> list[str]:
    impls = [i for i in dict.fromkeys(df["impl"]) if i != ours]
    return impls + ([ours] if ours in set(df["impl"]) else [])


def _log2_tokens_axis(ax, Ts) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(Ts)))
    ax.set_xticklabels([f"{t // 1024}k" if t >= 1024 else str(t) for t in sorted(set(Ts))])
    ax.set_xlabel("tokens T (batch 1)")
    ax.grid(True, which="major", ls=":", alpha=0.6)


def _kernel_and_wall_lines(ax, sub, ours: str, kernel_col: str, wall_col: str) -> None:
    """One colour per implementation: kernel-time metric solid with markers, wall-time dotted."""
    impls = _ordered_impls(sub, ours)
    for impl in impls:
        rows = sub[(sub["impl"] == impl) & (sub["status"] == "ok")].sort_values("T")
        if rows.empty:
            continue
        color, mine = color_of(impl, impls), impl == ours
        ax.plot(rows["T"], rows[kernel_col], "-o", color=color, lw=2.4 if mine else 1.4, ms=4, label=impl,
                zorder=3 if mine else 2)
        ax.plot(rows["T"], rows[wall_col], ":", color=color, lw=1.0, zorder=1)


def plot_bandwidth(ax, df, pass_: str, ours: str, copy_gbps: float) -> None:
    """GB/s of the minimal traffic (kernel time solid, wall time dotted); the copy ceiling dashed."""
    sub = df[df["pass"] == pass_]
    _kernel_and_wall_lines(ax, sub, ours, "gbps_kernel", "gbps_wall")
    ax.axhline(copy_gbps, color="black", ls="--", lw=1)
    ax.text(sub["T"].min(), copy_gbps * 1.01, f" copy {copy_gbps:.0f} GB/s", va="bottom", fontsize=8)
    ax.set_ylim(0, copy_gbps * 1.12)
    ax.set_ylabel("GB/s (solid: kernel time, dotted: wall)")
    right = ax.secondary_yaxis("right", functions=(lambda g: 100 * g / copy_gbps, lambda p: p * copy_gbps / 100))
    right.set_ylabel("% of measured copy")
    _log2_tokens_axis(ax, sub["T"])
    ax.set_title(pass_)


def plot_time(ax, df, pass_: str, ours: str) -> None:
    """Time per call against T for GEMM-bound ops (kernel time solid, wall time dotted)."""
    sub = df[df["pass"] == pass_]
    _kernel_and_wall_lines(ax, sub, ours, "kernel_ms", "wall_ms")
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (solid: kernel time, dotted: wall)")
    _log2_tokens_axis(ax, sub["T"])
    ax.set_title(pass_)


def plot_memory(ax, df, pass_: str, ours: str) -> None:
    """Extra peak memory (MB) during the call; out-of-memory points marked at the top, not dropped."""
    sub = df[df["pass"] == pass_]
    impls = _ordered_impls(sub, ours)
    ok = sub[sub["status"] == "ok"]
    top = (ok["extra_peak_mb"].max() if not ok.empty else 1.0) * 1.15
    for impl in impls:
        color = color_of(impl, impls)
        rows = sub[sub["impl"] == impl].sort_values("T")
        good = rows[rows["status"] == "ok"]
        ax.plot(good["T"], good["extra_peak_mb"], "-o", color=color, ms=4, lw=2.4 if impl == ours else 1.4, label=impl)
        oom = rows[rows["status"] == "oom"]
        if not oom.empty:
            ax.scatter(oom["T"], [top] * len(oom), marker="x", s=60, color=color, zorder=4)
            for t in oom["T"]:
                ax.annotate("OOM", (t, top), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7,
                            color=color)
    ax.set_yscale("log")
    ax.set_ylabel("extra peak memory (MB)")
    _log2_tokens_axis(ax, sub["T"])
    ax.set_title(pass_)


def op_figure(df, title: str, ours: str, metric: str = "bandwidth"):
    """Bandwidth or time (top row) and memory (bottom row) for each pass, the GPU in the title."""
    passes = list(dict.fromkeys(df["pass"]))
    width = max(5.2 * len(passes), 10.0)  # one pass alone is too narrow for the title and legend
    fig, axes = plt.subplots(2, len(passes), figsize=(width, 8.5), squeeze=False)
    copy = float(df["copy_gbps"].dropna().iloc[0])
    for j, pass_ in enumerate(passes):
        if metric == "time":
            plot_time(axes[0][j], df, pass_, ours)
        else:
            plot_bandwidth(axes[0][j], df, pass_, ours, copy)
        plot_memory(axes[1][j], df, pass_, ours)
    handles, labels = axes[0][0].get_legend_handles_labels()
    columns = min(len(labels), int(width // 2.3))  # wrap the legend into rows rather than cut it
    legend_rows = -(-len(labels) // columns)
    fig.legend(handles, labels, loc="upper center", ncol=columns, bbox_to_anchor=(0.5, 0.955), frameon=False)
    gpu = df["gpu"].iloc[0]
    fig.suptitle(f"{title} — {gpu}, {df['date'].iloc[0]}", fontsize=13 if len(passes) > 1 else 11)
    fig.tight_layout(rect=(0, 0, 1, 0.93 - 0.03 * (legend_rows - 1)))
    return fig


def ablation_waterfall(at, baseline: str = "peft", full: str = "q35lab", column: str = "outside_core_ms"):
    """Which optimization buys what: ``column`` of ``baseline``, each ``full:<flag>`` variant's
    saving alone as a step down (largest first), then what switching all on together adds or
    gives back beyond the sum of the parts, ending at ``full``.

    ``at``: one row per variant (index: variant names) at one T. Returns the figure, or None when
    the baseline, the full variant or every single-flag variant is missing."""
    singles = [v for v in at.index if v.startswith(f"{full}:")]
    if baseline not in at.index or full not in at.index or not singles:
        return None
    savings = (at.loc[baseline, column] - at.loc[singles, column]).sort_values(ascending=False)
    interaction = (at.loc[baseline, column] - savings.sum()) - at.loc[full, column]
    labels = [baseline] + [v.split(":", 1)[1] for v in savings.index] + ["together", full]
    level, bottoms, heights, colors = at.loc[baseline, column], [0.0], [at.loc[baseline, column]], ["0.6"]
    for step in (*savings.values, interaction):
        level -= step
        bottoms.append(level if step >= 0 else level + step)
        heights.append(abs(step))
        colors.append(color_of(full) if step >= 0 else "0.8")
    bottoms.append(0.0)
    heights.append(at.loc[full, column])
    colors.append(color_of(full))
    fig, ax = plt.subplots(figsize=(1.1 * len(labels) + 2, 3.6))
    ax.bar(labels, heights, bottom=bottoms, color=colors, edgecolor="black", linewidth=0.5)
    ax.set_ylabel(column.replace("_", " "))
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


def _step_key() -> tuple[str, ...]:
    """The columns that tell one recorded step from another in step_breakdown.csv: the e2e
    harness's row key (``e2e.cli.KEY``) and the commit that ran."""
    from .bench.e2e.cli import KEY

    return (*KEY, "commit")


def _as_text(columns: pandas.DataFrame) -> pandas.DataFrame:
    """Key columns compared as text, an empty cell as "" (NaN equals nothing, itself included)."""
    return columns.astype(object).fillna("").astype(str)


def step_breakdown_figure(breakdown: pandas.DataFrame):
    """One step's kernels against its floor: for the whole step and for each kind of work, the
    device time its kernels took (ours' colour) beside the floor's term for that work (grey), the
    milliseconds at each bar and measured / floor at the end of each pair.

    ``breakdown``: the rows of ``step_breakdown.csv`` for one step (one row a category; the floor's
    columns repeat on every row). The categories meet the floor's terms as the floor counts the
    work: GEMM the GEMM term, attention the attention term, delta rule and conv the core term,
    q35lab kernels, copies/casts and other elementwise the streaming term. Returns the figure."""
    keys = [c for c in _step_key() if c in breakdown]
    if breakdown.empty or len(_as_text(breakdown[keys]).drop_duplicates()) != 1:
        raise ValueError(f"breakdown: expected the rows of one step (one {'/'.join(keys)}), got {len(breakdown)} rows")
    groups = (("GEMM", ("GEMM",), "floor_gemm_ms"),
              ("attention", ("attention",), "floor_attention_ms"),
              ("delta rule + conv", ("delta rule", "conv"), "floor_core_ms"),
              ("streaming: q35lab kernels,\ncopies/casts, other elementwise",
               ("q35lab kernels", "copies/casts", "other elementwise"), "floor_streaming_ms"))
    ms = breakdown.groupby("category")["ms"].sum()
    missing = {c for _, categories, _ in groups for c in categories} - set(ms.index)
    if missing:
        raise ValueError(f"breakdown: no row for {sorted(missing)}")
    row = breakdown.iloc[0]
    labels = ["whole step"] + [label for label, _, _ in groups]
    measured = [float(ms.sum())] + [float(ms.loc[list(categories)].sum()) for _, categories, _ in groups]
    floor = [float(row["floor_total_ms"])] + [float(row[term]) for _, _, term in groups]
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    height, ys = 0.38, range(len(labels))
    mine = ax.barh([y - height / 2 for y in ys], measured, height, color=color_of("q35lab"),
                   label="measured: device time of its kernels")
    least = ax.barh([y + height / 2 for y in ys], floor, height, color="0.7",
                    label="floor: the same work at this GPU's measured rates")
    for bars, values in ((mine, measured), (least, floor)):
        ax.bar_label(bars, labels=[f"{v:.0f} ms" for v in values], padding=3, fontsize=8)
    for y, m, f in zip(ys, measured, floor):
        ax.annotate(f"{m / f:.2f}× its floor", (0.99, y), xycoords=("axes fraction", "data"), ha="right",
                    va="center", fontsize=9, fontweight="bold" if y == 0 else "normal")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, max(measured + floor) * 1.42)
    ax.set_xlabel("ms per step")
    ax.legend(loc="lower right", bbox_to_anchor=(0.86, 0.0), frameon=False, fontsize=8)
    size = f"{row['size']}, " if "size" in breakdown else ""
    ax.set_title(f"{row.get('variant', 'step')}, {size}T = {int(row['T']) // 1024}k: kernels against the floor"
                 f" — {row.get('gpu', '')}, {row.get('date', '')}", fontsize=10)
    fig.tight_layout()
    return fig


def figure_name(op: str, variant: str, gpu_slug: str) -> str:
    """data/figures/ file name: ``<op>_<gpu>.png``, or ``<op>-<variant>_<gpu>.png``."""
    tag = "".join(c if c.isalnum() else "-" for c in variant)
    return f"{op}-{tag}_{gpu_slug}.png" if variant else f"{op}_{gpu_slug}.png"


def render(data: Path | None = None, ops=None) -> list[Path]:
    """Redraw data/figures/ from every committed CSV, one figure per variant; returns the files."""
    from .bench import core, data_dir, discover

    data = data_dir(data)
    benches = discover()
    written = []
    for csv_path in sorted((data / "bench").glob("*/*.csv")):
        op = csv_path.stem
        if op not in benches or (ops and op not in ops):
            continue
        df = core.read_csv(csv_path)
        spec = benches[op]
        for variant in dict.fromkeys(df["variant"]):
            title = f"{spec.title}, {variant}" if variant else spec.title
            fig = op_figure(df[df["variant"] == variant], title, spec.ours, spec.metric)
            out = data / "figures" / figure_name(op, variant, csv_path.parent.name)
            out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(out, dpi=110)
            plt.close(fig)
            written.append(out)
    if not ops or "step_breakdown" in ops:
        for csv_path in sorted((data / "bench").glob("*/step_breakdown.csv")):
            df = core.read_csv(csv_path)
            sizes = _as_text(df.reindex(columns=["size"]))["size"]  # no size column (older rows): ""
            for size in dict.fromkeys(sizes):  # one figure a model size: a 27B step never replaces the 9B's
                out = data / "figures" / figure_name("step_breakdown", size, csv_path.parent.name)
                written.append(_newest_step_breakdown(df[sizes == size], out))
    return written


def _newest_step_breakdown(df: pandas.DataFrame, out: Path) -> Path:
    """The figure of the step these rows recorded last (their last row's step)."""
    keys = [c for c in _step_key() if c in df]
    as_text = _as_text(df[keys])
    step = df[(as_text == as_text.iloc[-1]).all(axis=1)]
    fig = step_breakdown_figure(step)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
