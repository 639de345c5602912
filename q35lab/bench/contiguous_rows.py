"""Benchmark of the copy that hands fla's delta-rule core contiguous q, k and v: T tokens, bf16.

transformers' GatedDeltaNet splits q, k and v out of the convolution's ``[1, T, C]`` output
(Qwen3.5-9B: C = 2·16·128 + 32·128 = 8192) as column blocks; each is a view whose rows lie C
elements apart. The forward pass here copies all three into contiguous memory:

* ``torch``: ``.contiguous()`` of each view, what fla does with them;
* ``q35lab``: ``contiguous_rows``, a Triton copy of a tile of rows a program.

The forward only: a copy's backward is the identity, and autograd's sum of the three gradients
into the split's input is the same whichever copy ran.
"""

from __future__ import annotations

import torch

from .. import shapes
from ..numerics import rule_rows
from ..ops.contiguous_rows import contiguous_rows
from .spec import OpBench

#: The convolution's output split into q, k (the key heads) and v (the value heads).
WIDTHS = (shapes.GDN_KEY_HEADS * shapes.GDN_HEAD_DIM,) * 2 + (shapes.GDN_VALUE_HEADS * shapes.GDN_HEAD_DIM,)


def make_inputs(T: int, device, dtype=torch.bfloat16) -> dict:
    """Batch 1, ``T`` tokens: the convolution's output [1, T, ΣWIDTHS] and q, k, v split from it."""
    mixed = torch.randn(1, T, sum(WIDTHS), device=device, dtype=dtype)
    return {"mixed": mixed, "views": torch.split(mixed, WIDTHS, dim=-1)}


def bytes_model(T: int, pass_: str, elem: int = 2) -> int:
    """Minimal traffic of the forward: every element of the three views read once and written once."""
    return {"fwd": 2 * T * sum(WIDTHS) * elem}[pass_]


def _copies(copy):
    def make(data: dict, **_variant):
        views = data["views"]
        return (lambda: tuple(copy(v) for v in views)), [data["mixed"]], None

    return make


def check(T: int, device, dtype=torch.bfloat16) -> list[dict]:
    """The rule for the three copies (exact: a copy rounds nothing) against torch's."""
    views = make_inputs(T, device, dtype)["views"]
    outs = [contiguous_rows(v) for v in views]
    return rule_rows("q35lab", ("q", "k", "v"), outs, [v.contiguous() for v in views],
                     [v.double() for v in views])


BENCH = OpBench(
    name="contiguous_rows",
    title=f"q, k, v copied contiguous for fla's core (split widths {'+'.join(map(str, WIDTHS))}), bf16",
    make_inputs=make_inputs,
    bytes_model=bytes_model,
    impls={
        "torch": (_copies(torch.Tensor.contiguous), ()),
        "q35lab": (_copies(contiguous_rows), ()),
    },
    check=check,
    ours="q35lab",
    passes=("fwd",),
)
