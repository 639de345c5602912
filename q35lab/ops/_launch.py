"""Launch helpers shared by the row-wise kernels: their ``[rows, width]`` view of an input, and
how many programs a persistent grid gets."""

from __future__ import annotations

import functools
import math

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


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``[rows, width]`` matrix (one copy only if ``x`` is strided).

    The row count is computed, not inferred: ``reshape(-1, 0)`` cannot infer it for a zero-width
    input, where any count fits.
    """
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()
