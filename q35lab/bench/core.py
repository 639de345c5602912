"""The measurement core shared by every op: ceilings, timing, memory, CSV rows.

What is measured (DESIGN.md, "Measurement"):

* **ceilings**, in the same run: a device-to-device copy (GB/s, bytes read + written) and a bf16
  matmul (TFLOP/s);
* **wall** time: per-call time of calls issued back to back (as a training loop issues them)
  between CUDA events, median over batches; the host's overhead is included — when the host is
  slower than the GPU, it is what is measured — so this is what a training step feels;
* **kernel** time: the summed device time of every kernel the call launches (PyTorch's
  profiler), per call — what the kernels themselves are worth;
* **extra peak memory**: peak allocated during the call minus what was allocated before it.

A per-op file (``q35lab/bench/<op>.py``) supplies the inputs, the implementations and a bytes
model; this module never needs to change when an op is added.
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import importlib.metadata
import math
import os
import re
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..ops._tuned import gpu_slug as _slug

#: One schema for every op's CSV; one row per (op, impl, pass, T, variant).
SCHEMA = [
    "op", "impl", "pass", "T", "variant", "dtype", "status", "note",
    "wall_ms", "kernel_ms", "bytes", "gbps_kernel", "gbps_wall", "pct_copy_kernel", "pct_copy_wall",
    "extra_peak_mb", "copy_gbps", "matmul_tflops",
    "gpu", "torch", "triton", "q35lab", "commit", "date",
]

PASSES = ("fwd", "bwd", "fwd+bwd")

#: Data kept resident across repetitions so that no case is timed out of L2 by accident
#: (H100/H200 have 50–60 MB of L2): inputs are rotated until they cover this many bytes.
ROTATE_BYTES = 256 * 2**20


# ----------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------
def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_slug(name: str | None = None) -> str:
    """'NVIDIA H200' → 'nvidia-h200': the folder under data/bench/."""
    return _slug(gpu_name() if name is None else name)


def _git_commit() -> str:
    """Q35LAB_COMMIT when set (a copy of the tree on another machine may carry stale git
    metadata), else the checkout's short hash, marked +dirty with uncommitted changes outside
    ``data/`` and ``notebooks/`` (what the measurements themselves write: a run's second
    measurement is of the same code as its first)."""
    if os.environ.get("Q35LAB_COMMIT"):
        return os.environ["Q35LAB_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        commit = out.stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                                 ":(top,exclude)data", ":(top,exclude)notebooks"], cwd=here,
                                capture_output=True, text=True, timeout=5)
        if status.returncode != 0:  # a git without pathspec magic: any change counts
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=5)
        dirty = status.stdout.strip() if status.returncode == 0 else "unknown"
        return (commit + ("+dirty" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def q35lab_version() -> str:
    """The installed distribution's version; a source checkout used without installing has no
    metadata, so its pyproject.toml is read. (Not ``q35lab.__version__``: the harness must not
    import the package's front door, which imports the patch and every op.)"""
    try:
        return importlib.metadata.version("q35lab")
    except importlib.metadata.PackageNotFoundError:
        return _checkout_version(Path(__file__).resolve().parents[2] / "pyproject.toml")


def _checkout_version(pyproject: Path) -> str:
    """``version = "..."`` of a pyproject.toml (the first one: [project]'s), else "unknown"."""
    try:
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
    except OSError:
        return "unknown"
    return found.group(1) if found else "unknown"


def run_info() -> dict[str, str]:
    """The columns every row carries: what ran, where, when."""
    import triton

    return {
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "q35lab": q35lab_version(),
        "commit": _git_commit(),
        "date": _dt.date.today().isoformat(),
    }


# ----------------------------------------------------------------------------------------------
# Ceilings
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second
    matmul_tflops: float  # bf16 GEMM


def _median_event_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def measure_ceilings(copy_bytes: int = 2 * 2**30, matmul_n: int = 8192) -> Ceilings:
    """Copy bandwidth (2 GiB buffer, bytes read + written) and bf16 matmul rate (n³, random data)."""
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = _median_event_ms(functools.partial(dst.copy_, src), reps=20)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    mm_ms = _median_event_ms(lambda: a @ b, reps=20)
    return Ceilings(copy_gbps=2 * copy_bytes / copy_ms / 1e6, matmul_tflops=2 * matmul_n**3 / mm_ms / 1e9)


# ----------------------------------------------------------------------------------------------
# One case: time and memory of one callable
# ----------------------------------------------------------------------------------------------
@dataclass
class Timing:
    wall_ms: float = math.nan
    kernel_ms: float = math.nan
    extra_peak_mb: float = math.nan
    status: str = "ok"  # ok | oom | error | skipped | n/a
    note: str = ""


def kernel_ms(calls: list[Callable[[], object]]) -> float:
    """Summed device time of all kernels launched by ``calls`` (run once each), per call.

    Only the GPU's activity is traced: tracing every host-side op as well (thousands per call
    for a PEFT model's backward) is slow to post-process. Should a PyTorch build report no
    kernels that way, host and device are traced together."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        torch.cuda.synchronize()
        # acc_events: one cycle either way; without it PyTorch warns that events clear between cycles
        with profile(activities=activities, acc_events=True) as prof:
            for call in calls:
                call()
            torch.cuda.synchronize()
        total_us = sum(float(e.device_time) for e in prof.events() if e.device_type == DeviceType.CUDA)
        if total_us > 0:
            break
    return total_us / 1e3 / len(calls)


def wall_ms(calls: list[Callable[[], object]], reps: int, batch: int = 10) -> float:
    """Per-call time of back-to-back calls, host overhead included: what a training step feels.

    ``batch`` calls are issued without synchronising (as a training loop issues them) between
    two CUDA events; the per-call mean of a batch is one sample, the median of ``reps // batch``
    samples is returned. When the host is slower than the GPU the GPU waits, and the host's
    time is what is measured; when it is faster, the kernels' time is.
    """
    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for b in range(max(1, reps // batch)):
        torch.cuda.synchronize()
        start.record()
        for i in range(batch):
            calls[(b * batch + i) % len(calls)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / batch)
    return statistics.median(samples)


def extra_peak_mb(call: Callable[[], object]) -> float:
    """Peak memory allocated during ``call`` minus what was allocated just before, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - before) / 1e6


def measure(calls: list[Callable[[], object]], *, warmup: int = 3, reps: int = 100, profile_calls: int = 10,
            budget_s: float = 0.3) -> Timing:
    """Time and memory of ``calls`` (equivalent callables over rotated inputs).

    Slow calls get fewer repetitions (at least 20 timed, 3 profiled) so that one case costs about
    ``budget_s`` seconds. Out-of-memory is a result, not a crash: the row says ``oom``.
    """
    try:
        for i in range(warmup):
            calls[i % len(calls)]()
        torch.cuda.synchronize()
        one_ms = _median_event_ms(calls[0], reps=1, warmup=0)
        least = 5 if one_ms > 50 else 20  # calls of a tenth of a second are steady: fewer suffice
        reps = max(least, min(reps, int(1e3 * budget_s / max(one_ms, 1e-3))))
        profile_calls = max(3, min(profile_calls, int(0.3e3 * budget_s / max(one_ms, 1e-3))))
        timing = Timing()
        timing.extra_peak_mb = extra_peak_mb(calls[0])
        timing.wall_ms = wall_ms(calls, reps, batch=min(10, reps))
        timing.kernel_ms = kernel_ms([calls[i % len(calls)] for i in range(profile_calls)])
        return timing
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return Timing(status="oom", note="out of memory")


# ----------------------------------------------------------------------------------------------
# Rows and CSV files
# ----------------------------------------------------------------------------------------------
@dataclass
class Case:
    """What a row describes, before it is measured."""

    op: str
    impl: str
    pass_: str
    T: int
    variant: str = ""
    dtype: str = "bfloat16"
    bytes: int = 0


def make_row(case: Case, timing: Timing, ceilings: Ceilings | None, info: dict[str, str]) -> dict:
    """One CSV row: the case, its timing, throughput against the copy ceiling, provenance."""
    def gbps(ms: float) -> float:
        return case.bytes / ms / 1e6 if case.bytes and ms and not math.isnan(ms) else math.nan

    copy = ceilings.copy_gbps if ceilings else math.nan
    row = {
        "op": case.op, "impl": case.impl, "pass": case.pass_, "T": case.T, "variant": case.variant,
        "dtype": case.dtype, "status": timing.status, "note": timing.note,
        "wall_ms": timing.wall_ms, "kernel_ms": timing.kernel_ms, "bytes": case.bytes,
        "gbps_kernel": gbps(timing.kernel_ms), "gbps_wall": gbps(timing.wall_ms),
        "pct_copy_kernel": 100 * gbps(timing.kernel_ms) / copy, "pct_copy_wall": 100 * gbps(timing.wall_ms) / copy,
        "extra_peak_mb": timing.extra_peak_mb, "copy_gbps": copy,
        "matmul_tflops": ceilings.matmul_tflops if ceilings else math.nan,
        **info,
    }
    assert list(row) == SCHEMA, "row columns drifted from SCHEMA"
    return row


def write_csv(rows: list[dict], path: Path) -> Path:
    """Write ``rows`` (SCHEMA columns, floats with 6 significant digits) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SCHEMA)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return path


def read_csv(path: Path):
    """A committed results file as a pandas DataFrame (numbers parsed)."""
    import pandas as pd

    return pd.read_csv(path, keep_default_na=True, na_values=["nan"], dtype={"note": str, "variant": str}).fillna(
        {"note": "", "variant": ""}
    )


def write_numerics_csv(rows: list[dict], path: Path) -> Path:
    """The numerics rows of ``bench.check`` with provenance, as ``<op>_numerics.csv``."""
    import pandas as pd

    info = run_info()
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{**r, **info} for r in rows]).to_csv(path, index=False, float_format="%.6g")
    return path
