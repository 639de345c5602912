"""The patch as an ordered registry of features: each undoes what it did, and ``revert`` runs them reversed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .report import PatchReport


@dataclass(frozen=True)
class Options:
    """``apply_to_qwen3_5``'s switches, checked: a flag each, the tile sizes (None: off), the offload and the
    checkpointing plan (a ``long_context.CheckpointPlan``; None: the model's checkpointing as it is), the frozen
    base weights' precision ("bf16": as the model holds them; "fp8")."""

    rms_norm: bool = True
    gated_norm: bool = True
    lora: bool = True
    in_proj: bool = True
    flce: bool = True
    conv: bool = True
    swiglu: bool = True
    experts: bool = True
    varlen_attention: bool = True
    tiled_mlp: int | None = None
    tiled_gdn: int | None = None
    offload_checkpoints: float | int = 0
    checkpointing: object = None
    base_precision: str = "bf16"


@dataclass(frozen=True)
class Feature:
    """One thing the patch does to a model. ``flag`` names the option that turns it on (None: always,
    or the feature reads its options itself); ``apply`` walks the model and records what it did in the
    report; ``revert`` undoes it, whatever the options were."""

    name: str
    flag: str | None
    apply: Callable[[torch.nn.Module, PatchReport, Options], None]
    revert: Callable[[torch.nn.Module, PatchReport], None]

    def wanted(self, options: Options) -> bool:
        return self.flag is None or bool(getattr(options, self.flag))

    @classmethod
    def per_module(cls, name: str, flag: str, matches: Callable[[torch.nn.Module], bool],
                   patch: Callable[[torch.nn.Module, PatchReport], None],
                   unpatch: Callable[[torch.nn.Module, PatchReport], None]) -> Feature:
        """A feature that patches each module ``matches`` picks and, in revert, unpatches every module
        (an unpatch leaves a module it did not patch as it is)."""

        def apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
            for module in list(model.modules()):
                if matches(module):
                    patch(module, report)

        def revert(model: torch.nn.Module, report: PatchReport) -> None:
            for module in list(model.modules()):
                unpatch(module, report)

        return cls(name, flag, apply, revert)
