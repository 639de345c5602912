"""When may a backward write its gradients over the activations it saved?

SwiGLU's node saves only its inputs ``g`` and ``u``, which are dead once its backward has run:
that backward can write ``dg`` and ``du`` over them and allocate nothing. It may do so only when it
is their last reader, decided per call by ``may_overwrite``:

* the graph is not kept (``retain_graph``/``create_graph``: a second backward reads them again);
* the tensor is not a leaf (the caller's) nor a view (its base shares the memory);
* nothing but this node references it or its memory — no Python variable, no other node's saved
  tensor, no alias — except the other input when ``g`` and ``u`` are the two halves of one fused
  gate/up output (``side_by_side``): each element's gradients go where its inputs were read, so
  the two blocks are written over together.

The references are counted (``ownership``) and compared with the counts of a saved tensor that
nothing else holds, read once on this torch build by a probe node (``_sole_owner_counts``). Any
doubt answers no: the gradients then get fresh buffers and the inputs are never touched.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch

from ._autograd import graph_is_kept
from ._launch import row_view

__all__ = ["INPLACE_MODES", "ownership", "inplace_mode", "side_by_side", "may_overwrite", "overwrite_plan",
           "bump_version"]

#: "auto": overwrite a saved activation when ``may_overwrite`` allows it; "never"; "always"
#: (benchmarks only, as Liger does: a retained graph or another reader would read gradients).
INPLACE_MODES = ("auto", "never", "always")


def ownership(t: torch.Tensor) -> tuple[int, int, int]:
    """References to ``t``: C++ handles of its TensorImpl (a Python object counts once),
    Python references to its object (the caller's local, this frame and ``getrefcount``'s
    included), handles of its storage (every other tensor on the same memory adds one).

    A backward reads it first thing after unpacking its saved tensors, as ``_OwnershipProbe``
    does: anything it binds before would count."""
    return t._use_count(), sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _OwnershipProbe(torch.autograd.Function):
    """Reads ``ownership`` of a saved tensor that nothing else holds — the output of an op that
    keeps no reference to it, saved by this node only — unpacked in the backward exactly as the
    ops unpack their own (one local, then ``ownership``)."""

    counts: tuple[int, int, int] | None = None

    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t.clone()

    @staticmethod
    def backward(ctx, dy):
        (t,) = ctx.saved_tensors
        _OwnershipProbe.counts = ownership(t)
        return dy


@functools.lru_cache(maxsize=1)
def _sole_owner_counts() -> tuple[int, int, int] | None:
    """``ownership`` of an unshared saved tensor on this torch build, read once on a few CPU
    elements; ``None`` if this build lacks the introspection (then never overwrite).

    Read in a thread of its own: grad mode, inference mode and saved-tensor hooks (those of
    gradient checkpointing, say) are thread-local, so the caller's context cannot skew it.
    """
    found = []

    def probe():
        try:
            leaf = torch.zeros(2, requires_grad=True)
            _OwnershipProbe.apply(leaf * 1.0).sum().backward()
            found.append(_OwnershipProbe.counts)
        except Exception:  # noqa: BLE001 - any failure means: cannot tell, never overwrite
            pass

    thread = threading.Thread(target=probe, name="q35lab-swiglu-probe")
    thread.start()
    thread.join()
    return found[0] if found else None


def inplace_mode(inplace_backward: object) -> str:
    """The mode for an op's ``inplace_backward`` flag (a bool, else ``TypeError``)."""
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward: expected a bool, got {type(inplace_backward).__name__}")
    if inplace_backward:
        _sole_owner_counts()  # probed here, once, rather than in the middle of a backward
    return "auto" if inplace_backward else "never"


def side_by_side(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are two column blocks of the rows of one buffer that share no
    element: the gate and up outputs of one fused ``[T, 2I]`` GEMM. Both ``[rows, width]`` with
    unit column stride and the same row stride ``s``; block ``b`` starts ``d`` elements after
    ``a`` (modulo ``s``) with ``width ≤ d ≤ s − width``. Written over together by a kernel that
    stores each element's gradients where it read its inputs, they cannot disturb each other."""
    if a.dim() != 2 or a.shape != b.shape or a.dtype != b.dtype or a.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    rows, width = a.shape
    if width > 1 and (a.stride(1) != 1 or b.stride(1) != 1):
        return False
    if rows == 1:  # one row each: two runs of `width` elements
        return abs(b.storage_offset() - a.storage_offset()) >= width
    if a.stride(0) != b.stride(0) or a.stride(0) < 2 * width:
        return False  # (a row stride below two widths cannot hold both: repeated or overlapping rows)
    gap = (b.storage_offset() - a.storage_offset()) % a.stride(0)
    return width <= gap <= a.stride(0) - width


def may_overwrite(mode: str, t: torch.Tensor, counts, owned: bool, *others: torch.Tensor | None,
                  sibling: torch.Tensor | None = None) -> bool:
    """Whether the saved activation ``t`` may receive its own gradient: this backward is its
    last reader. ``counts``: ``ownership(t)`` read by the backward right after unpacking;
    ``owned``: ``t`` is a copy this node made; ``sibling``: the node's other input when the two
    lie side by side in one buffer (``side_by_side``): its handle on the memory is expected,
    and nothing else may hold one. Any doubt answers False (a fresh buffer)."""
    if mode != "auto":
        return mode == "always"
    if t.numel() == 0 or graph_is_kept():
        return False  # a retained graph reads the activations again
    if any(o is not None and o is not sibling and o.numel()
           and o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for o in others):
        return False  # aliases the other input or the upstream gradient
    if owned:
        return True  # no one else ever saw it
    if t.is_leaf or t._base is not None:
        return False  # a leaf is the caller's tensor; a view shares its base's memory
    expected = _sole_owner_counts()
    if expected is None:
        return False
    if sibling is not None:  # the memory's one other handle: the sibling block's
        expected = (*expected[:2], expected[2] + 1)
    return all(n <= e for n, e in zip(counts, expected))


def overwrite_plan(ctx, gate, up, g_counts, u_counts, need_dg: bool, need_du: bool, dh):
    """``(g2d, u2d, into_g, into_u)`` for a backward that unpacked ``gate`` and ``up``: their
    ``[rows, width]`` views and whether each gradient may be written over its input
    (``may_overwrite``; ``ctx.inplace`` the mode, ``ctx.owned`` whether each is the node's copy).
    The two halves of one fused gate/up output (the patched MLP's case) are each the other's only
    co-owner of the buffer, and both may be written over."""
    g2d, _ = row_view(gate)  # views: the saved tensors have a row stride by construction
    u2d, _ = row_view(up)
    pair = ctx.inplace == "auto" and side_by_side(g2d, u2d)
    into_g = need_dg and may_overwrite(ctx.inplace, gate, g_counts, ctx.owned[0], up, dh,
                                       sibling=up if pair else None)
    into_u = need_du and may_overwrite(ctx.inplace, up, u_counts, ctx.owned[1], gate, dh,
                                       sibling=gate if pair else None)
    return g2d, u2d, into_g, into_u


def bump_version(t: torch.Tensor) -> None:
    """Mark ``t`` written: a reader that ``may_overwrite`` failed to see then fails loudly, not
    with gradients."""
    increment = getattr(torch.autograd.graph, "increment_version", None)
    if increment is not None:
        increment(t)
