"""Weight-only preparations shared by the tiles of one tiled call.

A LoRA projection derives small tensors from its weights alone before its GEMMs: the rank-r
factors cast to the activations' dtype, ``s·B``, the adapters' ``A`` concatenated, the
block-diagonal ``B``. Each is a kernel launch of a few microseconds. A tiled layer
(``q35lab.long_context``) runs its projections once a tile in the forward and twice in the
backward (recompute, then gradients), so in 8192-token tiles a 9B step at 32k would launch each
of them four times over, with the same result every time. Inside ``shared_preparations()`` the
first call builds a preparation and the later ones with the same key reuse it; outside it every
call builds its own.

A key is the preparation's name, plain values, and tensors by the memory they read (address,
dtype, shape, strides: a view made again per call, such as a weight's rows, matches) and their
version (an in-place update bumps ``_version``, so a changed weight is prepared again). The cache
holds the key's tensors, so no address is reused while it lives; it lives for one ``with`` block.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_CACHE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("q35lab_shared_preparations", default=None)


@contextlib.contextmanager
def shared_preparations():
    """Share ``prepared`` results until the block ends (a nested block shares the outer one's)."""
    if _CACHE.get() is not None:
        yield
        return
    token = _CACHE.set({})
    try:
        yield
    finally:
        _CACHE.reset(token)


def prepared(build, name: str, *key) -> torch.Tensor:
    """``build()``, or inside ``shared_preparations`` the tensor an earlier call with the same
    ``name`` and ``key`` (plain values and tensors) built."""
    cache = _CACHE.get()
    if cache is None:
        return build()
    lookup = (name, *(_memory(k) if isinstance(k, torch.Tensor) else k for k in key))
    entry = cache.get(lookup)
    if entry is None:
        entry = cache[lookup] = (key, build())  # the key's tensors held: their ids stay theirs
    return entry[1]


def _memory(t: torch.Tensor) -> tuple:
    """What a tensor reads, as a key: equal for two views of the same elements, and changed by an
    in-place update of them."""
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t._version
