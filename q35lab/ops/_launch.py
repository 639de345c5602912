"""Launch helpers shared by the row-wise kernels: their ``[rows, width]`` view of an input (a
contiguous copy, or any row stride), how many programs a persistent grid gets, and the tiles of
the streaming row kernels."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton

#: Under the interpreter a persistent grid gets this many programs: enough to exercise the
#: reduction of per-program partials, few enough to stay quick.
INTERPRETER_PROGRAMS = 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: Dense 16-bit tensor-core FLOPs per multiprocessor per clock, fp32 accumulation, by compute
#: capability (the architectures' published peaks); another architecture is taken as an A100's.
_MMA_FLOPS_PER_SM_CLOCK = {(8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096,
                           (10, 0): 8192, (12, 0): 1024}


@functools.cache
def _machine_balance(device_index: int) -> float:
    props = torch.cuda.get_device_properties(device_index)
    flops = props.multi_processor_count * props.clock_rate * 1e3 * _MMA_FLOPS_PER_SM_CLOCK.get(
        (props.major, props.minor), 2048)
    bytes_per_s = 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8  # double data rate
    return flops / bytes_per_s


def machine_balance(device: torch.device) -> float | None:
    """FLOPs of 16-bit matmul per byte of memory traffic at ``device``'s peaks: the work per byte
    moved that keeps its tensor cores busy. None off a GPU."""
    if device.type != "cuda":
        return None
    return _machine_balance(device.index if device.index is not None else torch.cuda.current_device())


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


def row_view(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``x`` as ``[rows, width]`` with unit column stride (any row stride), and whether that took a copy.

    A view whenever the leading dimensions collapse into one row stride (a column slice of a
    ``[.., 2I]`` buffer does); a copy only for layouts that no row stride describes.
    """
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    copied = x2d.numel() > 0 and x2d.data_ptr() != x.data_ptr()
    if x2d.shape[1] > 1 and x2d.stride(1) != 1:
        x2d, copied = x2d.contiguous(), True
    return x2d, copied


@dataclass(frozen=True)
class RowTiles:
    """The launch of a streaming row kernel (a gather, a copy): each program takes ``block_rows``
    rows and walks them in column blocks of ``block_cols``."""
    block_rows: int  # rows per program (power of two)
    block_cols: int  # columns per column block (power of two); wider rows loop over blocks
    warps: int


def row_tiles(width: int) -> RowTiles:
    """Tiles of 4096 elements (8 KB a tensor in bf16), 8 warps, as for q35lab's other streaming
    kernels; a row wider than 1024 is walked in blocks of 1024 by one program."""
    block_cols = min(1024, max(16, triton.next_power_of_2(max(width, 1))))
    return RowTiles(block_rows=max(1, 4096 // block_cols), block_cols=block_cols, warps=8)
