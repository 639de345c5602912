"""What a per-op benchmark file declares: inputs, bytes model, implementations, numerics check."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import shapes

#: An implementation: ``make(inputs, **variant_options) -> (forward, grad_tensors, dy)``.
#: ``forward()`` returns the output; the backward is ``torch.autograd.grad(output, grad_tensors, dy)``.
Impl = Callable[[dict], tuple[Callable[[], torch.Tensor], list, torch.Tensor]]


class NotApplicable(Exception):
    """Raised by an Impl's ``make`` for a variant it does not run under (the row says ``n/a``
    and why), e.g. PEFT with its input cast disabled but no autocast: the dtypes do not meet."""


@dataclass
class OpBench:
    name: str
    title: str
    make_inputs: Callable[..., dict]  # (T, device, dtype) -> inputs
    bytes_model: Callable[[int, str], int]  # (T, pass) -> minimal bytes moved
    impls: dict[str, tuple[Impl, tuple[str, ...]]]  # name -> (impl, modules it needs)
    check: Callable[..., list[dict]]  # (T, device, dtype) -> numerics rows
    ours: str  # the impl drawn last and highlighted
    passes: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
    sweep: list[int] = field(default_factory=lambda: list(shapes.SWEEP_T))
    quick: list[int] = field(default_factory=lambda: list(shapes.QUICK_T))
    smoke: list[int] = field(default_factory=lambda: list(shapes.SMOKE_T))
    check_sizes: list[int] | None = None  # numerics on a GPU (default: the quick sizes)
    #: Conditions every implementation is measured under (the CSV's ``variant`` column), as
    #: keyword options passed to each Impl's ``make``; one figure is drawn per variant.
    variants: dict[str, dict] = field(default_factory=lambda: {"": {}})
    #: "bandwidth" (GB/s of the bytes model, memory-bound ops) or "time" (ms, GEMM-bound ops).
    metric: str = "bandwidth"


def no_bytes_model(T: int, pass_: str) -> int:
    """For GEMM-bound ops (metric "time"): no minimal-traffic model, so the GB/s columns stay empty."""
    return 0


def autocast_if(on: bool, device_type: str):
    """bf16 autocast when ``on`` (a variant of the LoRA benches), else a context that does nothing."""
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


def module_impl(build: Callable[[], Callable[[int], torch.nn.Module]], inputs: tuple[str, ...] = ("x",),
                frozen: bool = False, compile: bool = False) -> Impl:
    """An Impl that runs a module over ``inputs`` (names in the inputs dict, all differentiated).

    ``build()`` returns the module's class (or any ``width -> module``); it is called lazily, so
    a peer that is not installed is only imported when measured. The module's weight is copied
    from ``inputs["w"]`` and frozen when ``frozen``.
    """

    def make(data: dict, **_variant):
        first = data[inputs[0]]
        module = build()(first.shape[-1]).to(device=first.device, dtype=first.dtype)
        with torch.no_grad():
            module.weight.copy_(data["w"])
        module.weight.requires_grad_(not frozen)
        if compile:
            module = torch.compile(module, dynamic=False)
        args = [data[name].detach().requires_grad_() for name in inputs]
        params = [] if frozen else [module.weight]
        return (lambda: module(*args)), [*args, *params], data["dy"]

    return make
