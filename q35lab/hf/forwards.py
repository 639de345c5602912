"""Instance-level forwards: the one mechanism by which q35lab changes what a module computes.

A patched module gets an object as its ``forward`` (``nn.Module.__call__`` prefers an instance
attribute) and a marker in its ``__dict__``; taking both away restores the class's forward."""

from __future__ import annotations

import torch

ORIGINAL = "_q35lab_original"  # attribute of a patched module: the module it replaced


def marked(module: torch.nn.Module, marker: str):
    """The value q35lab stored on this very module under ``marker`` (None if absent), read from its
    own ``__dict__``: PeftModel forwards attribute look-ups to the model inside."""
    return vars(module).get(marker)


class Forward:
    """The instance-level ``forward`` q35lab gives a module; subclasses implement ``__call__``.

    An object holding its module, not a closure, so deepcopy rebinds it to the copy and pickle stores
    it by class name; ``__wrapped__`` lets ``inspect.signature`` (Trainer) see the class's arguments.
    """

    __name__ = "forward"

    def __init__(self, module: torch.nn.Module):
        self.module = module

    @property
    def __wrapped__(self):
        return type(self.module).forward.__get__(self.module)

    def __repr__(self) -> str:
        return f"<q35lab {type(self).__name__} of {type(self.module).__name__}{self._details()}>"

    def _details(self) -> str:
        return ""
