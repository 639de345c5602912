"""How q35lab's ops meet ``torch.compile``.

Each public op launches hand-written Triton kernels from host code that reads pointers, picks
launch configurations and keeps Python state (dropout seeds, cached weight concatenations).
Dynamo cannot trace that code with fake tensors, so every public op is opaque to the compiler:
a graph break. Dynamo compiles the code around it (the layers' glue, rotary embeddings, the
parts no q35lab kernel covers), the op runs eagerly with its own autograd node, and the
compiled graphs' backward and the op's backward interleave as usual.
"""

from __future__ import annotations

import torch

__all__ = ["opaque_to_compile"]


def opaque_to_compile(fn):
    """``fn`` as a graph break under ``torch.compile`` (and nothing else, in eager mode)."""
    return torch.compiler.disable(fn, recursive=True)
