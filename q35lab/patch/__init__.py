"""Patch a transformers Qwen3.5 model (bare, or wrapped by PEFT) with q35lab's kernels, in place and
revertibly: ``apply_to_qwen3_5`` and ``revert``."""

from .apply import apply_to_qwen3_5, revert
from .lora import route_lora
from .report import PatchReport

__all__ = ["PatchReport", "apply_to_qwen3_5", "revert", "route_lora"]
