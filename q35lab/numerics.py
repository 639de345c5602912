"""The numerics rule (flash-attention's): the kernel may be at most twice as wrong as PyTorch.

For an output or a gradient, compare three tensors: the kernel's ``out``, the reference computed
in the same dtype ``ref``, and the reference computed in fp64 ``ref64``. Pass when::

    max|out − ref64| ≤ 2 · max|ref − ref64| + atol(dtype)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops._checks import check_real

#: Absolute slack per dtype, for outputs whose reference happens to be (nearly) exact.
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


@dataclass(frozen=True)
class Comparison:
    """One application of the rule to one tensor."""

    name: str
    kernel_err: float  # max|out − ref64|
    ref_err: float  # max|ref − ref64|
    atol: float

    @property
    def bound(self) -> float:
        return 2.0 * self.ref_err + self.atol

    @property
    def ok(self) -> bool:
        return self.kernel_err <= self.bound

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"{self.name}: max|out-ref64|={self.kernel_err:.3e} <= "
            f"2*{self.ref_err:.3e}+{self.atol:.0e} = {self.bound:.3e}  {verdict}"
        )


def scaled_atol(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """``ATOL[dtype]`` for outputs of order one, scaled down with smaller ones (never up): an
    absolute 1e-2 would exceed a gradient whose entries are all ~1e-5 (a mean over many tokens)
    and pass anything."""
    largest = exact.abs().max().item() if exact.numel() else 0.0
    return ATOL[dtype] * min(1.0, largest)


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor,
            atol: float | None = None) -> Comparison:
    """Apply the rule to ``out`` (the kernel), ``ref`` (same dtype) and ``ref64`` (fp64).

    Args:
        name (str): what is compared, for the report.
        out, ref, ref64 (Tensor): of one shape.
        atol (float, optional): the absolute slack. Default: ``ATOL[out.dtype]``.

    Returns:
        Comparison: the errors and the verdict (``ok``).

    Raises:
        TypeError: ``out``, ``ref`` or ``ref64`` not a tensor, ``atol`` not a number, no default
            ``atol`` for ``out``'s dtype.
        ValueError: shapes that differ, ``atol`` negative or not finite.
    """
    for label, t in (("out", out), ("ref", ref), ("ref64", ref64)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label}: expected a torch.Tensor, got {type(t).__name__}")
    if atol is None and out.dtype not in ATOL:
        raise TypeError(f"out: expected one of the dtypes {list(ATOL)} (or an atol), got {out.dtype}")
    if atol is not None:
        atol = check_real("atol", atol, minimum=0)
    if out.shape != ref64.shape or ref.shape != ref64.shape:
        raise ValueError(f"{name}: shapes differ: out {tuple(out.shape)}, ref {tuple(ref.shape)}, "
                         f"ref64 {tuple(ref64.shape)}")
    exact = ref64.double()
    kernel_err = (out.double() - exact).abs().max().item() if out.numel() else 0.0
    ref_err = (ref.double() - exact).abs().max().item() if ref.numel() else 0.0
    if atol is None:
        atol = ATOL[out.dtype]
    return Comparison(name, kernel_err, ref_err, atol)


def assert_close_by_rule(name: str, out: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor,
                         atol: float | None = None) -> None:
    """``compare`` and raise ``AssertionError`` with the numbers when the rule fails."""
    result = compare(name, out, ref, ref64, atol)
    assert result.ok, str(result)


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two tensors of one 16- or 32-bit float dtype.

    Reinterprets the bits as integers ordered like the floats (sign-magnitude → two's
    complement), so adjacent representable values are 1 apart.
    """
    if a.dtype != b.dtype:
        raise ValueError(f"ulp_diff: dtypes differ ({a.dtype} vs {b.dtype})")
    if not a.is_floating_point() or a.element_size() not in (2, 4):
        raise TypeError(f"a: expected a 16- or 32-bit float tensor, got {a.dtype}")
    int_type = {2: torch.int16, 4: torch.int32}[a.element_size()]
    sign_bit = -(1 << (8 * a.element_size() - 1))

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(int_type).to(torch.int64)
        return torch.where(bits < 0, sign_bit - bits, bits)

    return (ordered(a) - ordered(b)).abs()


def agreement(out: torch.Tensor, hf: torch.Tensor) -> dict[str, float]:
    """How a low-precision output differs from the transformers module's output.

    Returns the share of elements that differ, the largest difference in ulps, and the
    norm-wise relative error ‖out − hf‖ / ‖hf‖ (computed in fp64).
    """
    ulps = ulp_diff(out, hf)
    diff = (out.double() - hf.double()).norm().item()
    norm = hf.double().norm().item()
    return {
        "frac_differ": (ulps > 0).double().mean().item() if ulps.numel() else 0.0,
        "max_ulp": ulps.max().item() if ulps.numel() else 0,
        "rel_err": diff / norm if norm > 0 else diff,
    }


def with_grads(outputs, wanted, grad_outputs) -> tuple:
    """``outputs`` (a tensor or a sequence) followed by their gradients with respect to ``wanted``."""
    outs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    return (*outs, *torch.autograd.grad(outs, wanted, grad_outputs))


def rule_rows(impl: str, names, outs, refs, refs64) -> list[dict]:
    """``compare`` for each named tensor, as rows for a numerics CSV (``out`` cast to ``ref``'s dtype)."""
    rows = []
    for name, out, ref, ref64 in zip(names, outs, refs, refs64):
        result = compare(name, out.to(ref.dtype), ref, ref64)
        rows.append({"impl": impl, "tensor": name, "kernel_err": result.kernel_err,
                     "ref_err": result.ref_err, "bound": result.bound, "ok": result.ok})
    return rows
