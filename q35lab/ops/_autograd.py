"""What q35lab's autograd Functions promise about higher-order gradients.

Their backward passes launch Triton kernels, which autograd cannot differentiate. Under
``create_graph=True`` (a gradient penalty, Hessian-vector products) the gradients they return
would then be constants to autograd, and a second derivative through them silently wrong. So a
backward made first-order only returns its gradients as usual, and any attempt to differentiate
*them* raises an error that names the op — as ``torch.autograd.function.once_differentiable``
does, with a message that says what to do.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["first_order_only", "graph_is_kept"]


def first_order_only(backward, op: str | None = None):
    """Decorate an autograd Function's ``backward``: first derivatives only, loudly. ``op``: the
    name the error gives (a custom op's backward has no class), else the class that holds ``backward``."""
    op = op or backward.__qualname__.split(".")[0]
    message = (f"q35lab: {op} has no second derivative (its backward runs Triton kernels); "
               "for double backward or create_graph=True, run this part of the model unpatched "
               "(q35lab.revert, or apply_to_qwen3_5 with this optimization's flag off)")

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not torch.is_grad_enabled():  # grad mode is on in a backward only under create_graph=True
            return grads
        single = not isinstance(grads, tuple)
        grads = (grads,) if single else grads
        # the gradients depend on the inputs through the saved tensors, which autograd cannot see:
        # each is made a tensor whose own gradient is the error
        tensors = [g.requires_grad_() for g in grads if isinstance(g, torch.Tensor)]
        delayed = torch._C._functions.DelayedError(message, len(tensors))(*tensors)
        delayed = iter(delayed if isinstance(delayed, tuple) else (delayed,))
        out = tuple(next(delayed) if isinstance(g, torch.Tensor) else g for g in grads)
        return out[0] if single else out

    return wrapper


def graph_is_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph`` or ``create_graph``): then a
    node may run again and must leave what it saved untouched. Where torch cannot say, assume it is."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):
        return True
