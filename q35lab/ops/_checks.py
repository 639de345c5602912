"""Input checks shared by every op: a wrong input fails loudly, naming the argument."""

from __future__ import annotations

import math
import numbers

import torch

from .. import runtime  # chose compiled Triton or the interpreter when q35lab was imported

#: The activation dtypes every kernel supports.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_float_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a bf16/fp16/fp32 tensor, else raise ``TypeError`` naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected dtype bfloat16, float16 or float32, got {value.dtype}"
        )
    return value


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless all ``tensors`` live on one device."""
    values = iter(tensors.values())
    first = next(values).device
    if any(t.device != first for t in values):  # the message is built only on failure
        listed = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"expected all tensors on one device, got {listed}")


def check_kernel_device(**tensors: torch.Tensor) -> None:
    """``check_same_device``, then raise ``ValueError`` unless that device is where this process
    runs Triton kernels: a CUDA device when they run compiled. Triton's own failure for a CPU tensor
    is a launch error that names no argument."""
    check_same_device(**tensors)
    name, first = next(iter(tensors.items()))
    if not runtime.INTERPRET and first.device.type != "cuda":
        raise ValueError(
            f"{name}: expected a CUDA tensor, got one on {first.device}: q35lab's Triton kernels run "
            "compiled on the GPU in this process (move the inputs with .cuda(); on a machine without a GPU "
            "they run through the Triton interpreter on the CPU, Q35LAB_INTERPRET=1)"
        )


def check_weight(name: str, weight: torch.Tensor, width: int) -> None:
    """Raise ``ValueError`` unless ``weight`` is a 1-D vector of length ``width``."""
    if weight.dim() != 1 or weight.shape[0] != width:
        raise ValueError(
            f"{name}: expected a 1-D tensor of size {width} (the last dimension of x), "
            f"got shape {tuple(weight.shape)}"
        )


def check_eps(eps: object) -> float:
    """Return ``eps`` as a float if it is a finite real number > 0, else raise naming it."""
    return check_real("eps", eps, positive=True, what="added to the mean square")


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise ``TypeError`` naming it: ``"yes"``, ``1``,
    ``1.0`` and ``None`` are slips, not switches."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


def _expected(kind: str, minimum, maximum, positive: bool, what: str) -> str:
    if positive:
        text = f"a positive {kind}"
    elif minimum is not None and maximum is not None:
        text = f"{'an' if kind == 'int' else 'a'} {kind} in [{minimum}, {maximum}]"
    elif minimum is not None:
        text = f"{'an' if kind == 'int' else 'a'} {kind} of at least {minimum}"
    else:
        text = f"{'an' if kind == 'int' else 'a'} {kind}"
    return f"{text} ({what})" if what else text


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None,
              what: str = "") -> int:
    """Return ``value`` as an int if it is an integer (not a bool) in ``[minimum, maximum]``; else
    ``TypeError`` (another type) or ``ValueError`` (out of range), naming it and what was expected."""
    expected = _expected("int", minimum, maximum, minimum == 1 and maximum is None, what)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return int(value)


def check_real(name: str, value: object, *, minimum: float | None = None, maximum: float | None = None,
               positive: bool = False, what: str = "") -> float:
    """Return ``value`` as a float if it is a finite real number (not a bool, not a tensor) in
    ``[minimum, maximum]`` (``> 0`` if ``positive``); else ``TypeError`` (another type) or
    ``ValueError`` (NaN, infinite or out of range), naming it and what was expected."""
    expected = _expected("finite number", minimum, maximum, positive, what)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    number = float(value)
    # not math.isfinite, which torch.compile cannot trace for a float it keeps symbolic (an argument)
    if (not abs(number) < math.inf or (positive and not number > 0) or (minimum is not None and number < minimum)
            or (maximum is not None and number > maximum)):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return number


def check_module(name: str, value: object) -> torch.nn.Module:
    """Return ``value`` if it is a ``torch.nn.Module``, else raise ``TypeError`` naming it."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name}: expected a torch.nn.Module, got {type(value).__name__}")
    return value


def check_like(name: str, value: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """Raise unless ``value`` has the shape (``ValueError``) and dtype (``TypeError``) of ``like``,
    itself at least 1-D (the width is its last dimension)."""
    if like.dim() == 0:
        raise ValueError(f"{like_name}: expected at least one dimension (the width), got a scalar")
    if value.shape != like.shape:
        raise ValueError(f"{name}: expected the shape of {like_name} {tuple(like.shape)}, got {tuple(value.shape)}")
    if value.dtype != like.dtype:
        raise TypeError(f"{name}: expected the dtype of {like_name} ({like.dtype}), got {value.dtype}")
