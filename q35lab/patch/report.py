"""``PatchReport``: what ``apply_to_qwen3_5`` or ``revert`` did, and what will run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..hf.forwards import marked


@dataclass
class PatchReport:
    """What ``apply_to_qwen3_5``, ``route_lora`` or ``revert`` did; ``print`` it for a summary.

    Attributes:
        replaced (Counter): what was patched (mostly the original class name) → count.
        left_alone (Counter): ``"class: why"`` → count, for modules q35lab cannot compute exactly.
        already_patched (int): modules already patched, left as they are.
        not_applied (dict): flag → why it did nothing.
        reverted (Counter): class name → count (``revert``).
        qwen3_5 (bool): whether a Qwen3.5 module was found (``apply_to_qwen3_5`` patches nothing else).
        runs (dict): what computes the parts q35lab does not replace, or replaces only sometimes
            (the delta-rule core, the causal conv1d, packed batches, the long-context plan), and
            what to do where it is slow.
        checkpoint_plan (CheckpointPlan, optional): with ``checkpointing="auto"``, the decoder layers checkpointed
            and not, the predicted peak and the budget (also in ``runs["checkpointing"]``).
    """

    replaced: Counter = field(default_factory=Counter)
    left_alone: Counter = field(default_factory=Counter)
    already_patched: int = 0
    not_applied: dict = field(default_factory=dict)
    reverted: Counter = field(default_factory=Counter)
    qwen3_5: bool = True
    runs: dict = field(default_factory=dict)
    checkpoint_plan: object = None

    @property
    def total(self) -> int:
        return sum(self.replaced.values())

    @property
    def nothing_to_patch(self) -> bool:
        return self.total == 0 and self.already_patched == 0 and not self.reverted

    def __str__(self) -> str:
        lines = []
        for name, count in sorted(self.replaced.items()):
            lines.append(f"replaced {count} × {name}")
        for why, count in sorted(self.left_alone.items()):
            lines.append(f"left {count} × {why}")
        for name, count in sorted(self.reverted.items()):
            lines.append(f"restored {count} × {name}")
        if self.already_patched:
            lines.append(f"{self.already_patched} module(s) already patched, left as they are")
        if self.nothing_to_patch:
            why = "" if self.qwen3_5 else ": not a Qwen3.5 model (no Qwen3.5 module found)"
            lines.append(f"nothing to patch{why}")
        for flag, why in self.not_applied.items():
            lines.append(f"{flag}: {why}")
        for part, what in self.runs.items():
            lines.append(f"{part}: {what}")
        return "PatchReport(\n  " + "\n  ".join(lines) + "\n)"


def override_forward(module: torch.nn.Module, marker: str, forward_class: type, problem: str | None,
                      label: str, report: PatchReport) -> None:
    """Give ``module`` an instance-level forward of ``forward_class``, unless it already has one
    of ours or ``problem`` says it cannot be handled exactly; the report says which."""
    if marked(module, marker) is not None:
        report.already_patched += 1
    elif problem:
        report.left_alone[f"{label}: {problem}"] += 1
    else:
        module.forward = forward_class(module)
        object.__setattr__(module, marker, True)
        report.replaced[label] += 1


def restore_forward(module: torch.nn.Module, marker: str, label: str, report: PatchReport) -> None:
    if marked(module, marker) is not None:
        del module.forward
        object.__delattr__(module, marker)
        report.reverted[label] += 1
