"""The benchmark harness: ``run`` sweeps ops on a GPU, ``check`` applies the numerics rule anywhere.

Each op lives in its own file here and exposes ``BENCH`` (a ``spec.OpBench``); ops are found by
listing this package, so adding an op touches neither this file nor ``core``.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import math
import os
import pkgutil
from pathlib import Path

import torch

from .. import runtime
from . import core
from .spec import NotApplicable, OpBench

__all__ = ["discover", "run", "check", "data_dir", "DATA"]


def data_dir(folder: str | os.PathLike | None = None) -> Path:
    """The results folder (``bench/<gpu>/<op>.csv``, ``figures/``): ``folder`` when given, else
    ``$Q35LAB_DATA``, else the checkout's ``data/`` when q35lab runs from a source checkout
    (pyproject.toml beside the package), else ``./data``: an installed package must not write
    into site-packages."""
    if folder is not None:
        return Path(folder)
    if os.environ.get("Q35LAB_DATA"):
        return Path(os.environ["Q35LAB_DATA"])
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return root / "data"
    return Path.cwd() / "data"


#: The default results folder, as ``data_dir()`` found it when this module was imported.
DATA = data_dir()


def discover() -> dict[str, OpBench]:
    """Every op benchmark in this package, by name."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in ("core", "spec"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        bench = getattr(module, "BENCH", None)
        if isinstance(bench, OpBench):
            found[bench.name] = bench
    return found


def _select(ops) -> list[OpBench]:
    available = discover()
    if not ops:
        return list(available.values())
    unknown = [op for op in ops if op not in available]
    if unknown:
        raise ValueError(f"ops: unknown {unknown}; expected some of {sorted(available)}")
    return [available[op] for op in ops]


def _missing(modules: tuple[str, ...]) -> str:
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"not installed: {', '.join(absent)}" if absent else ""


def _pass_calls(make, inputs_sets: list[dict], pass_: str, options: dict | None = None):
    """One zero-argument callable per input set, running ``pass_`` of an implementation."""
    calls = []
    for inputs in inputs_sets:
        forward, grad_tensors, dy = make(inputs, **(options or {}))
        if pass_ == "fwd":
            calls.append(forward)
        elif pass_ == "bwd":
            out = forward()
            calls.append(lambda out=out, g=grad_tensors, dy=dy: torch.autograd.grad(out, g, dy, retain_graph=True))
        else:
            calls.append(lambda f=forward, g=grad_tensors, dy=dy: torch.autograd.grad(f(), g, dy))
    return calls


def _configure_compile() -> None:
    """One compiled graph per swept shape: raise Dynamo's recompile limit above the sweep."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)


def _tensor_bytes(value) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or dicts/tuples/lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _n_input_sets(footprint: int) -> int:
    """How many input sets to rotate so that consecutive calls touch ROTATE_BYTES (twice the L2
    and more) and none finds its data in the cache: 1 to 16. ``footprint``: a call's traffic
    (the op's bytes model) or, for GEMM-bound ops without one, its inputs' bytes — each set costs
    a model build for the PEFT benches, so no more sets than that."""
    return max(1, min(16, math.ceil(core.ROTATE_BYTES / max(footprint, 1))))


def _footprint(bench: OpBench, T: int, inputs) -> int:
    """A call's traffic for the rotation: the bytes model of the bench's largest pass (an op
    measured forward only has no "fwd+bwd"), or, without a model, the inputs' bytes."""
    return max(bench.bytes_model(T, pass_) or 0 for pass_ in bench.passes) or _tensor_bytes(inputs)


def _measure_impl(bench: OpBench, impl_name: str, T: int, ceilings: core.Ceilings, info: dict) -> list[dict]:
    """Every pass of one implementation at one size, as CSV rows."""
    make, needs = bench.impls[impl_name]
    skip = _missing(needs)
    inputs_sets = [] if skip else [bench.make_inputs(T, runtime.device())]
    if inputs_sets:
        footprint = _footprint(bench, T, inputs_sets[0])
        inputs_sets += [bench.make_inputs(T, runtime.device()) for _ in range(_n_input_sets(footprint) - 1)]
    rows = []
    for (variant, options), pass_ in ((v, p) for v in bench.variants.items() for p in bench.passes):
        case = core.Case(bench.name, impl_name, pass_, T, variant=variant, bytes=bench.bytes_model(T, pass_))
        if skip:
            timing = core.Timing(status="skipped", note=skip)
        else:
            try:
                timing = core.measure(_pass_calls(make, inputs_sets, pass_, options))
            except NotApplicable as reason:
                timing = core.Timing(status="n/a", note=str(reason))
            except torch.cuda.OutOfMemoryError:
                timing = core.Timing(status="oom", note="out of memory")
            except Exception as exc:  # a peer failing is a result, not a crash
                timing = core.Timing(status="error", note=f"{type(exc).__name__}: {exc}"[:200])
            torch.cuda.empty_cache()
        rows.append(core.make_row(case, timing, ceilings, info))
    del inputs_sets
    torch.cuda.empty_cache()
    return rows


def run(ops=None, *, quick: bool = False, sizes: list[int] | None = None, out: Path | None = None,
        progress: bool = True) -> dict[str, Path]:
    """Sweep ``ops`` on this GPU and write ``<out>/bench/<gpu>/<op>.csv``; returns the paths.

    With ``sizes``, only those T are measured and the file keeps its rows at every other T (each
    row still compares the peers measured in the same run at its T; ``commit``/``date`` tell runs
    apart)."""
    if runtime.smoke():
        raise RuntimeError("bench.run measures speed and needs a CUDA GPU; on a CPU, bench.check() checks correctness")
    from tqdm.auto import tqdm

    _configure_compile()
    out = data_dir(out)
    info = core.run_info()
    ceilings = core.measure_ceilings()
    print(f"{info['gpu']}: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    written = {}
    for bench in _select(ops):
        path = out / "bench" / core.gpu_slug(info["gpu"]) / f"{bench.name}.csv"
        rows = _rows_kept(path, sizes) if sizes else []
        todo = [(T, impl) for T in (sizes or (bench.quick if quick else bench.sweep)) for impl in bench.impls]
        for T, impl_name in tqdm(todo, desc=bench.name, disable=not progress):
            rows += _measure_impl(bench, impl_name, T, ceilings, info)
            core.write_csv(rows, path)  # after every case: a run cut short keeps what it measured
        written[bench.name] = path
    return written


def _rows_kept(path: Path, sizes: list[int]) -> list[dict]:
    """The rows of an existing results file at sizes other than ``sizes``."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [row for row in csv.DictReader(f) if int(row["T"]) not in sizes]


def check(ops=None, *, sizes: list[int] | None = None, dtypes=(torch.bfloat16, torch.float32)) -> list[dict]:
    """The numerics rule at each size and dtype; one row per (op, T, dtype, tensor)."""
    rows = []
    for bench in _select(ops):
        for T in sizes or (bench.smoke if runtime.smoke() else (bench.check_sizes or bench.quick)):
            for dtype in dtypes:
                for row in bench.check(T, runtime.device(), dtype):
                    rows.append({"op": bench.name, "T": T, "dtype": str(dtype).removeprefix("torch."), **row})
    return rows
