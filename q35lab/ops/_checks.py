"""Input checks shared by every op: a wrong input fails loudly, naming the argument."""

from __future__ import annotations

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
    """Return ``eps`` as a float if it is a finite number > 0, else raise ``ValueError``."""
    try:
        value = float(eps)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"eps: expected a positive float, got {eps!r}") from None
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"eps: expected a positive finite float, got {eps!r}")
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
