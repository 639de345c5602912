"""The course's exercises: a check for each, and a solution to read after trying.

Each notebook ends with an exercise: a skeleton cell (a kernel to complete and the host function
that launches it), then ``check_<exercise>(your_host_function)``. The check runs the host function
on small, awkward inputs (through the interpreter on a CPU, in seconds) and holds every output to
the course's numerics rule (``q35lab.numerics``) against PyTorch.

A skeleton's host fills its output with NaN before the launch, so a kernel that writes nothing
leaves only NaN. The check then says the exercise is not written yet and runs the same cases on
the solution below instead: that is how the notebooks run in CI, and the solutions stay tested.

* notebook 01: ``row_softmax`` — softmax along each row, one block a row;
* notebook 02: ``scale_grad`` — ``dw = Σ_rows dy·x`` of ``y = x·w``: each program reduces its
  tile down the rows into one partial row;
* notebook 05: ``log_softmax_wide`` — ``z − logsumexp(z)`` of rows wider than one block: the
  online log-sum-exp, then a second pass over the row;
* notebook 07: ``second_difference`` — ``y_t = x_{t−1} − 2x_t + x_{t+1}`` along tokens, with
  zeros past both ends: a stencil of K = 3 taps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .numerics import Comparison, compare
from .runtime import device

__all__ = [
    "row_softmax",
    "scale_grad",
    "log_softmax_wide",
    "second_difference",
    "check_row_softmax",
    "check_scale_grad",
    "check_log_softmax_wide",
    "check_second_difference",
]


# --------------------------------------------------------------------------------------------
# Notebook 01: a row softmax.
# --------------------------------------------------------------------------------------------
@triton.jit
def _softmax_rows(X, Y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # -inf past the row's end: never the max, and exp(-inf) = 0 adds nothing to the sum.
    x = tl.load(X + row * n_cols + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))  # every exponent <= 0: nothing overflows
    tl.store(Y + row * n_cols + cols, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=mask)


def row_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax along the rows of a contiguous ``[rows, cols]`` matrix, one program a row."""
    y = torch.empty_like(x)
    _softmax_rows[(x.shape[0],)](x, y, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


def _softmax_cases():
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for (rows, cols), spread in (((1, 5), 1.0), ((7, 1000), 30.0), ((3, 37), 100.0)):
            x = (spread * torch.randn(rows, cols, device=device())).to(dtype)
            cases.append((f"{dtype}, [{rows}, {cols}], logits ~ {spread:g}", (x,), lambda x: torch.softmax(x, -1)))
    return cases


# --------------------------------------------------------------------------------------------
# Notebook 02: a reduction down the rows.
# --------------------------------------------------------------------------------------------
@triton.jit
def _scale_grad_partials(DY, X, PARTIAL, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    # Down the rows (axis 0): one fp32 sum per column; masked rows add 0.
    tl.store(PARTIAL + pid * n_cols + cols, tl.sum(dy * x, axis=0), mask=cols < n_cols)


def scale_grad(dy: torch.Tensor, x: torch.Tensor, rows_per_program: int = 8) -> torch.Tensor:
    """``dw = Σ_rows dy·x`` (fp32) for contiguous ``[rows, cols]`` ``dy`` and ``x``: one partial row
    a program, the partials summed by PyTorch in a fixed order."""
    n_rows, n_cols = x.shape
    n_programs = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=x.device)
    _scale_grad_partials[(n_programs,)](dy, x, partial, n_rows, n_cols, ROWS=rows_per_program,
                                        BLOCK=triton.next_power_of_2(n_cols))
    return partial.sum(0)


def _scale_grad_reference(dy, x):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (dy.to(compute) * x.to(compute)).sum(0)


def _scale_grad_cases():
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in ((1, 5), (37, 100), (64, 128)):
            dy, x = (torch.randn(rows, cols, device=device()).to(dtype) for _ in range(2))
            cases.append((f"{dtype}, [{rows}, {cols}]", (dy, x), _scale_grad_reference))
    return cases


# --------------------------------------------------------------------------------------------
# Notebook 05: log-softmax of rows wider than one block.
# --------------------------------------------------------------------------------------------
@triton.jit
def _log_softmax_rows(Z, OUT, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    running_max = tl.full([], -float("inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    for start in range(0, n_cols, BLOCK):  # pass 1: the online log-sum-exp
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(Z + row * n_cols + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
    log_sum = tl.log(running_sum)
    for start in range(0, n_cols, BLOCK):  # pass 2: (z − m) − log s, as torch.log_softmax forms it
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(Z + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * n_cols + cols, (z - running_max) - log_sum, mask=mask)


def log_softmax_wide(z: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``log_softmax`` (fp32) along the rows of a contiguous ``[rows, cols]`` matrix, ``block``
    columns at a time."""
    out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
    _log_softmax_rows[(z.shape[0],)](z, out, z.shape[1], BLOCK=block)
    return out


def _log_softmax_reference(z):
    return torch.log_softmax(z.to(torch.float64 if z.dtype == torch.float64 else torch.float32), -1)


def _log_softmax_cases():
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for (rows, cols), spread in (((1, 200), 1.0), ((3, 700), 30.0), ((2, 1000), 300.0)):
            z = (spread * torch.randn(rows, cols, device=device())).to(dtype)
            cases.append((f"{dtype}, [{rows}, {cols}], logits ~ {spread:g}", (z,), _log_softmax_reference))
    return cases


# --------------------------------------------------------------------------------------------
# Notebook 07: a stencil of three taps along the tokens.
# --------------------------------------------------------------------------------------------
@triton.jit
def _tokens(X, src, cols, col_ok, T, C):
    """The tile's channels at tokens ``src``, in fp32: 0 where ``src`` is outside 0..T-1."""
    ok = ((src >= 0) & (src < T))[:, None] & col_ok
    return tl.load(X + src[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _second_difference(X, Y, T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = (cols < C)[None, :]
    # Three loads of one tile at shifted offsets; the masks give the zeros past both ends.
    y = _tokens(X, rows - 1, cols, col_ok, T, C) - 2.0 * _tokens(X, rows, cols, col_ok, T, C) \
        + _tokens(X, rows + 1, cols, col_ok, T, C)
    tl.store(Y + rows[:, None] * C + cols[None, :], y.to(Y.dtype.element_ty), mask=(rows < T)[:, None] & col_ok)


def second_difference(x: torch.Tensor, block_t: int = 16, block_c: int = 32) -> torch.Tensor:
    """``y_t = x_{t−1} − 2·x_t + x_{t+1}`` along the tokens of a contiguous ``[T, C]`` matrix
    (zeros outside it), in fp32, stored in ``x.dtype``."""
    T, C = x.shape
    y = torch.empty_like(x)
    _second_difference[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](x, y, T, C, BLOCK_T=block_t,
                                                                            BLOCK_C=block_c)
    return y


def _second_difference_reference(x):
    padded = torch.nn.functional.pad(x, (0, 0, 1, 1))  # a zero token before the first and after the last
    return padded[:-2] - 2 * padded[1:-1] + padded[2:]


def _second_difference_cases():
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for T, C in ((1, 5), (45, 40), (17, 3)):
            x = torch.randn(T, C, device=device()).to(dtype)
            cases.append((f"{dtype}, [{T}, {C}]", (x,), _second_difference_reference))
    return cases


# --------------------------------------------------------------------------------------------
# The checks.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Exercise:
    name: str
    solution: Callable[..., torch.Tensor]
    cases: Callable[[], list]  # (label, inputs, reference): reference(*inputs) in the inputs' dtype


def _check(exercise: _Exercise, attempt: Callable[..., torch.Tensor]) -> list[Comparison]:
    """Run ``attempt`` on every case and apply the numerics rule to each output; fall back to the
    solution when every output is still the skeleton's NaN. Raises AssertionError with the failing
    cases' numbers."""
    if not callable(attempt):
        raise TypeError(f"{exercise.name}: expected your host function, got {type(attempt).__name__}")
    cases = exercise.cases()
    outs = [attempt(*inputs) for _, inputs, _ in cases]
    if all(isinstance(out, torch.Tensor) and out.numel() and torch.isnan(out).all() for out in outs):
        print(f"{exercise.name}: every output is still NaN, so the kernel is not written yet. "
              f"The same cases on the solution (q35lab/exercises.py, {exercise.solution.__name__}):")
        outs = [exercise.solution(*inputs) for _, inputs, _ in cases]
    results = []
    for (label, inputs, reference), out in zip(cases, outs):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{exercise.name}, {label}: expected a tensor, got {type(out).__name__}")
        ref = reference(*inputs)
        ref64 = reference(*(t.double() for t in inputs))
        result = compare(label, out.cpu(), ref.cpu(), ref64.cpu())
        print(" ", result)
        results.append(result)
    failed = [r for r in results if not r.ok]
    assert not failed, (f"{exercise.name}: {len(failed)} of {len(results)} cases fail the numerics rule: "
                        + "; ".join(map(str, failed)))
    return results


_ROW_SOFTMAX = _Exercise("row softmax", row_softmax, _softmax_cases)
_SCALE_GRAD = _Exercise("scale gradient", scale_grad, _scale_grad_cases)
_LOG_SOFTMAX = _Exercise("log-softmax of wide rows", log_softmax_wide, _log_softmax_cases)
_SECOND_DIFFERENCE = _Exercise("second difference", second_difference, _second_difference_cases)


def check_row_softmax(attempt: Callable[[torch.Tensor], torch.Tensor]) -> list[Comparison]:
    """``attempt(x)`` against ``torch.softmax(x, -1)``: rows of 5, 1000 and 37 (no power of two),
    logits up to a few hundred, fp32 and bf16."""
    return _check(_ROW_SOFTMAX, attempt)


def check_scale_grad(attempt: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[Comparison]:
    """``attempt(dy, x)`` against ``(dy·x).sum(0)`` in fp32: 1, 37 and 64 rows (a last program
    partly filled), widths 5, 100 and 128, fp32 and bf16 inputs."""
    return _check(_SCALE_GRAD, attempt)


def check_log_softmax_wide(attempt: Callable[[torch.Tensor], torch.Tensor]) -> list[Comparison]:
    """``attempt(z)`` against ``torch.log_softmax(z.float(), -1)``: rows of 200, 700 and 1000
    columns, logits up to a few hundred (where exp overflows fp32), fp32 and bf16."""
    return _check(_LOG_SOFTMAX, attempt)


def check_second_difference(attempt: Callable[[torch.Tensor], torch.Tensor]) -> list[Comparison]:
    """``attempt(x)`` against the difference in PyTorch: 1, 45 and 17 tokens, 5, 40 and 3 channels,
    fp32 and bf16."""
    return _check(_SECOND_DIFFERENCE, attempt)
