"""Memory at a step's peak: what is alive there, by the code that allocated it; what an
out-of-memory error says."""

from __future__ import annotations

import collections
import gc
import json
import traceback
from pathlib import Path

import torch
import torch.utils.checkpoint

from .step import _training_setup, tokens, train_step

#: Where memory or a kernel comes from: the innermost Python frame in one of these places (not
#: the harness's own wrappers, which sit around everything).
SOURCES = (("/q35lab/ops/", "q35lab"), ("/q35lab/patch.py", "q35lab"), ("liger_kernel", "liger"),
           ("/axolotl/", "axolotl"), ("/fla/", "fla"), ("/peft/", "peft"), ("/transformers/", "transformers"),
           ("torch/utils/checkpoint", "checkpoint"), ("torch/optim", "optimizer"))


def package_of(path: str) -> str | None:
    """The ``SOURCES`` package a file belongs to (paths absolute, or relative to site-packages as
    the profiler writes them), or None."""
    path = "/" + path.replace("\\", "/").lstrip("/")
    return next((package for marker, package in SOURCES if marker in path), None)


def allocation_source(frames: list[dict]) -> str:
    """``package:function`` of the innermost frame from ``SOURCES`` (frames innermost first)."""
    for frame in frames:
        package = package_of(frame["filename"])
        if package:
            return f"{package}:{frame['name']}"
    return "other Python" if frames else "no Python frame (autograd's own backward ops)"


def peak_breakdown(events: list[dict], top: int = 12) -> tuple[int, list[tuple[str, int]]]:
    """Bytes alive at the highest point of a CUDA allocator trace, by ``allocation_source``.

    ``events``: one device's ``torch.cuda.memory._snapshot()["device_traces"]``; ``alloc`` adds a
    block, ``free_completed`` removes it. Blocks allocated before the recording began (weights,
    optimizer state) are not in it: the peak is the step's own, above what it started with.
    Returns (peak bytes, [(source, bytes)] largest first)."""
    total = peak = 0
    peak_index = -1
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            total += event["size"]
        elif event["action"] == "free_completed":
            total -= event["size"]
        if total > peak:
            peak, peak_index = total, i
    live = {}
    for event in events[:peak_index + 1]:  # replay up to the peak: the blocks alive there
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    by_source = collections.Counter()
    for event in live.values():
        by_source[allocation_source(event.get("frames", []))] += event["size"]
    return peak, by_source.most_common(top)


def memory_at_peak(model, T: int, lr: float = 1e-4) -> dict:
    """One more training step at ``T`` with the CUDA allocator's history recorded (Python stacks):
    the step's peak above its starting point and its largest sources (MiB), as CSV columns."""
    device, vocab, optimizer = _training_setup(model, lr)
    ids = tokens(T, vocab, device, seed=0)

    def recorded_step():
        torch.cuda.synchronize()
        # Stacks of allocations only (context="alloc"): the peak's sources need no more
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
        try:
            start = torch.cuda.memory_allocated()
            train_step(model, optimizer, ids)
            torch.cuda.synchronize()
            return start, torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            optimizer.zero_grad(set_to_none=True)  # a failed step leaves no gradients behind

    (start, snapshot), early_stop = with_full_recompute_on_system_error(recorded_step)
    peak, sources = peak_breakdown(snapshot["device_traces"][device.index or 0])
    return {"step_start_gib": start / 2**30, "step_peak_above_start_gib": peak / 2**30,
            "peak_sources_mib": json.dumps({name: round(size / 2**20) for name, size in sources}),
            "peak_recompute": "stopped early (as in the timed steps)" if early_stop else "run to the layer's end"}


def with_full_recompute_on_system_error(step):
    """``(step(), True)``; if ``step`` raises ``SystemError``, ``(step(), False)`` run again with
    checkpointing's recompute going to the end of each layer (``set_checkpoint_early_stop(False)``).

    Why: on the H200 under torch 2.11 every step recorded with the allocator's history failed
    inside an autograd Function's apply ("returned NULL without setting an exception"), the
    regression of pytorch/pytorch#179536 (history on, non-reentrant checkpointing). The recompute
    stops early by raising an exception through the layer's ops; without the early stop none is
    raised. The recompute then also makes the layer's last tensors, freed at once: the peak it
    records may be that much higher than the timed steps'."""
    try:
        return step(), True
    except SystemError:
        pass  # retried outside the handler: its traceback holds the failed step's graph and tensors
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        return step(), False


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the GPU ran out of memory: PyTorch's allocator raises
    ``torch.cuda.OutOfMemoryError``; a Triton kernel whose launch finds no memory left (fla's, near
    the limit, as seen on an H100) raises a plain ``RuntimeError("Triton Error [CUDA]: out of
    memory")``, which is the same limit, not a failure of the variant."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and "CUDA" in message and "out of memory" in message


def out_of_memory_note(exc: BaseException) -> str:
    """Where the allocation that failed was made (the innermost three frames) and the allocator's
    own account: the size asked for, what was in use, and what was reserved but unallocated (a
    large remainder there means fragmentation, not a lack of memory). PyTorch's advice is dropped."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " < ".join(f"{frame.name} ({Path(frame.filename).name}:{frame.lineno})" for frame in reversed(frames))
    message = " ".join(str(exc).split())
    account = message.split(" If reserved but unallocated")[0].split(" See documentation")[0]
    return f"out of memory in {where}: {account}"[:600]
