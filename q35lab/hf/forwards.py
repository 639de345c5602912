"""Instance-level forwards: the one mechanism by which q35lab changes what a module computes.

A patched module gets an object as its ``forward`` (``nn.Module.__call__`` prefers an instance
attribute) and a marker in its ``__dict__``; taking both away restores the class's forward."""

from __future__ import annotations

import torch

ORIGINAL = "_q35lab_original"  # attribute of a patched module: the module it replaced


def marked(module: torch.nn.Module, marker: str):
    """The value q35lab stored on this very module under ``marker`` (None if absent).

    Read from the module's own ``__dict__``: wrappers such as PeftModel forward attribute
    look-ups to the model inside, so ``hasattr`` would see the inner model's mark.
    """
    return vars(module).get(marker)


class Forward:
    """The instance-level ``forward`` q35lab gives a module (``nn.Module.__call__`` prefers it).

    An object that holds its module rather than a closure over it: ``copy.deepcopy`` then gives
    the copy a forward bound to the copied module (deepcopy's memo maps one to the other), and
    ``pickle``/``torch.save`` store it by its class's name. ``inspect.signature`` follows
    ``__wrapped__`` to the class's own forward, so Trainer still sees the forward's arguments.
    Subclasses implement ``__call__``.
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
