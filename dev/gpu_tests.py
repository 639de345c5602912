"""Every test file on the GPU, several at once, each in its own pytest process with a time limit.

Compiling the kernels for a file's shapes is CPU work (one core a process), so files run side by
side: 16 cores compile 8 files at once while the GPU is mostly idle. A file that runs past its
limit is reported as such with the tests it finished (pytest's -v lines), not as a hang of the
whole call. Writes one row per file to the CSV (file, passed, failed, errors, skipped, seconds,
status, the slowest tests) and prints the table.

    python3 dev/gpu_tests.py --out data/bench/<gpu>/gpu_tests.csv [--jobs 8] [--limit 300]
"""

import argparse
import concurrent.futures
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

OUTCOME = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|deselected)")


def run_file(path: Path, limit: float, logs: Path, per_test: float) -> dict:
    start = time.perf_counter()
    # -rfEs: the failures and errors by name (the CSV's failures column) and why each skipped test
    # skipped (a module the GPU machine lacks). --timeout (pytest-timeout):
    # one test that hangs fails alone, and the file still ends with its tracebacks; a file killed at
    # its limit prints none
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts=", "--durations=3",
           "--tb=short", f"--timeout={per_test:.0f}", str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        text, status = proc.stdout + proc.stderr, "ok" if proc.returncode == 0 else f"rc {proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        status = f"timeout after {limit:.0f} s"
    (logs / f"{path.stem}.log").write_text(text)
    return {"file": path.name, **summarize(text), "seconds": round(time.perf_counter() - start, 1), "status": status}


def summarize(text: str) -> dict:
    """Counts of a pytest -v log (its summary line, or the -v lines of a run cut short), its
    slowest tests and its failures."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    summary = [line for line in text.splitlines() if line.startswith("=") and (" in " in line)]
    if summary:
        for n, what in OUTCOME.findall(summary[-1]):
            key = "errors" if what.startswith("error") else what
            if key in counts:
                counts[key] = int(n)
    else:  # cut short: count the -v lines it printed
        counts["passed"] = sum(" PASSED" in line for line in text.splitlines())
        counts["failed"] = sum(" FAILED" in line for line in text.splitlines())
    slowest = [line.strip() for line in text.splitlines() if re.match(r"^\d+\.\d+s (call|setup)", line.strip())]
    failures = [line for line in text.splitlines() if line.startswith("FAILED") or line.startswith("ERROR")]
    return {**counts, "slowest": " | ".join(slowest[:3]), "failures": " | ".join(failures)[:2000]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--limit", type=float, default=300.0, help="seconds a file may take")
    parser.add_argument("--per-test", type=float, default=120.0, help="seconds one test may take")
    parser.add_argument("--logs", default="/tmp/q35lab-logs/tests")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    files = [Path(f) for f in args.files] or sorted(Path("tests").glob("test_*.py"))
    from q35lab.bench.core import run_info  # the harness's columns; its commit honours Q35LAB_COMMIT

    meta = run_info()
    # The other files' rows stay, each with the commit it ran at; a file's old row goes only when its
    # new one arrives (a call cut short keeps the old rows of the files it did not reach)
    earlier = (pd.read_csv(args.out, dtype={"commit": str}) if Path(args.out).exists()
               else pd.DataFrame(columns=["file"]))
    rows = []

    def record(row: dict) -> None:
        rows.append({**row, **meta})
        new = pd.DataFrame(rows)
        kept = earlier[~earlier.file.isin(new.file)]
        (pd.concat([kept, new]) if len(kept) else new).sort_values("file").to_csv(args.out, index=False)

    # the record's test compares RESULTS.md with the CSVs under data/bench: it runs before this run
    # rewrites one of them
    first = [f for f in files if f.name == "test_results_record.py"]
    for f in first:
        record(run_file(f, args.limit, logs, args.per_test))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # the CSV rewritten as each file ends
        jobs = [pool.submit(run_file, f, args.limit, logs, args.per_test) for f in files if f not in first]
        for done in concurrent.futures.as_completed(jobs):
            record(done.result())
    table = pd.DataFrame(rows).sort_values("file")
    print(table[["file", "passed", "failed", "errors", "skipped", "seconds", "status"]].to_string(index=False))
    print("total: passed", table.passed.sum(), "failed", table.failed.sum(), "errors", table.errors.sum())
    return 0 if (table.status == "ok").all() else 1


if __name__ == "__main__":
    sys.exit(main())
