"""Launch helpers shared by the row-wise kernels: how many programs a persistent grid gets."""

from __future__ import annotations

import functools

import torch

#: Under the interpreter a persistent grid gets this many programs: enough to exercise the
#: reduction of per-program partials, few enough to stay quick.
INTERPRETER_PROGRAMS = 4


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device: torch.device, per_sm: int) -> int:
    """Programs of a persistent grid: ``per_sm`` per multiprocessor of ``device``."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * per_sm
