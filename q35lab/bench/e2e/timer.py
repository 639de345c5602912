"""Where a step's time goes: device time of regions of it (the delta-rule core, the in_proj
projections), forward, checkpointing's recompute and backward."""

from __future__ import annotations

import contextlib
import functools
import time

import torch

#: The functions of transformers' Qwen3.5 modeling module that compute the delta-rule core and the
#: causal convolution.
CORE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")


class _Stamp:
    """A point in the GPU's stream (a CUDA event), or in host time on a CPU."""

    def __init__(self, device_type: str):
        self.event = torch.cuda.Event(enable_timing=True) if device_type == "cuda" else None
        if self.event is not None:
            self.event.record()
        else:
            self.time = time.perf_counter()

    def ms_until(self, end: _Stamp) -> float:
        if self.event is None:
            return 1e3 * (end.time - self.time)
        end.event.synchronize()  # an event still queued behind the step's kernels has no time yet
        return self.event.elapsed_time(end.event)


class RegionTimer:
    """Device time spent in some regions of a step — calls of given functions or modules —
    forward and backward, as the union of their intervals.

    Forward: a stamp before and after each call (a checkpointed layer's recompute is a call too).
    Backward: from the moment the gradient of a call's output arrives (a hook on the output) to
    the moment the gradients of all its differentiable inputs are done (hooks on the inputs) —
    autograd runs that region's nodes in between. Intervals may overlap (four projections of one
    input finish their backward together), so ``total_ms()`` measures their union on the
    stream's clock, from the ``start()`` of the step.
    """

    def __init__(self):
        self.intervals: list[tuple[_Stamp, _Stamp]] = []
        self.origin: _Stamp | None = None

    def start(self, device_type: str) -> None:
        self.intervals.clear()
        self.origin = _Stamp(device_type)

    def total_ms(self) -> float:
        if not self.intervals:
            return 0.0
        spans = sorted((self.origin.ms_until(a), self.origin.ms_until(b)) for a, b in self.intervals)
        total, (lo, hi) = 0.0, spans[0]
        for a, b in spans[1:]:
            if a > hi:
                total, lo = total + (hi - lo), a
            hi = max(hi, b)
        return total + (hi - lo)

    # -- what a region is -------------------------------------------------------------------
    def _forward_done(self, start, inputs, out, device_type) -> None:
        self.intervals.append((start, _Stamp(device_type)))
        if not torch.is_grad_enabled():
            return
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(o, torch.Tensor) and o.requires_grad]
        inputs = [t for t in inputs if t.requires_grad]
        if not inputs or not outputs:
            return
        state = {"start": None, "pending": len(inputs)}

        def output_grad_arrives(grad):
            if state["start"] is None:
                state["start"] = _Stamp(device_type)

        def input_grad_done(grad):
            state["pending"] -= 1
            if state["pending"] == 0 and state["start"] is not None:
                self.intervals.append((state["start"], _Stamp(device_type)))

        for o in outputs:
            o.register_hook(output_grad_arrives)
        for t in inputs:
            t.register_hook(input_grad_done)

    def wrap(self, fn):
        """``fn`` timed as a region (for functions the model looks up by name)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            device_type = tensors[0].device.type if tensors else "cpu"
            start = _Stamp(device_type)
            out = fn(*args, **kwargs)
            self._forward_done(start, tensors, out, device_type)
            return out

        return timed

    @contextlib.contextmanager
    def functions(self, model, names=CORE_FUNCTIONS):
        """Wrap the Qwen3.5 modeling module's functions ``names``; yields how many were wrapped;
        undone on exit."""
        from transformers.models.qwen3_5 import modeling_qwen3_5

        undo = []
        for name in names:
            fn = getattr(modeling_qwen3_5, name, None)
            if callable(fn):
                setattr(modeling_qwen3_5, name, self.wrap(fn))
                undo.append((modeling_qwen3_5, name, fn))
        try:
            yield len(undo)
        finally:
            for owner, name, fn in undo:
                setattr(owner, name, fn)

    @contextlib.contextmanager
    def modules(self, modules):
        """Time every call of each module in ``modules`` (forward hooks); removed on exit."""
        handles, pending = [], {}

        def before(module, args, kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            pending[id(module)] = (_Stamp(tensors[0].device.type if tensors else "cpu"), tensors)

        def after(module, args, kwargs, out):
            start, tensors = pending.pop(id(module))
            self._forward_done(start, tensors, out, tensors[0].device.type if tensors else "cpu")

        for m in modules:
            handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(m.register_forward_hook(after, with_kwargs=True))
        try:
            yield len(modules)
        finally:
            for h in handles:
                h.remove()
