"""How q35lab's ops meet ``torch.compile``.

Custom ops (``torch.library``, namespace ``q35lab``): ``offset_rms_norm`` and ``gated_rms_norm``.
Each is a forward and a backward op with fake implementations (shapes and dtypes only) and
``register_autograd`` joining them, so Dynamo traces through the op, forward and backward, with
no graph break, and Inductor fuses the code around it; the real implementations launch the
kernels and choose their launch configuration at run time. Under ``torch.compile`` a second
derivative raises torch's "double backward" error rather than q35lab's (eager raises q35lab's).

Graph breaks (``opaque_to_compile``): every other public op, not converted yet. Their host code
holds what a custom op must first make explicit: Python state kept across calls (dropout seeds,
cached weight concatenations), backwards that overwrite saved buffers in place, Python callables
(the long-context tiles). Dynamo compiles the code around them, the op runs eagerly with its own
autograd node, and the compiled graphs' backward and the op's backward interleave as usual.
"""

from __future__ import annotations

import torch

__all__ = ["opaque_to_compile"]


def opaque_to_compile(fn):
    """``fn`` as a graph break under ``torch.compile`` (and nothing else, in eager mode)."""
    return torch.compiler.disable(fn, recursive=True)
