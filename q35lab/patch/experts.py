"""Feature ``experts``: a MoE layer's frozen routed experts through ``q35lab.routed_experts``."""

from __future__ import annotations

import torch

from ..hf.forwards import Forward
from ..hf.modules import is_routed_experts
from ..ops.routed_experts import routed_experts
from .feature import Feature
from .markers import EXPERTS
from .report import PatchReport, override_forward, restore_forward


def _experts_problem(experts: torch.nn.Module) -> str | None:
    if type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(getattr(experts, 'act_fn', None)).__name__} (only SiLU is fused here)"
    layout = {"has_bias": False, "is_transposed": False, "has_gate": True, "has_post_expert_norm": False}
    if any(getattr(experts, name, default) != default for name, default in layout.items()):
        return "a weight layout other than Qwen3.5's (bias, transposed, ungated or post-norm experts)"
    if getattr(experts, "_is_expert_parallel", False):
        return "expert parallelism (its sentinel expert ids)"
    if experts.gate_up_proj.requires_grad or experts.down_proj.requires_grad:
        return "trainable expert weights (the fused path is for frozen experts, as in a LoRA fine-tune)"
    return None


class _ExpertsForward(Forward):
    """``routed_experts`` while the expert weights are frozen; transformers' forward otherwise."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        experts = self.module
        if experts.gate_up_proj.requires_grad or experts.down_proj.requires_grad:
            return type(experts).forward(experts, hidden_states, top_k_index, top_k_weights)
        return routed_experts(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj)


def patch_experts(experts: torch.nn.Module, report: PatchReport) -> None:
    override_forward(experts, EXPERTS, _ExpertsForward, _experts_problem(experts),
                      f"{type(experts).__name__} (routed experts)", report)


def unpatch_experts(experts: torch.nn.Module, report: PatchReport) -> None:
    restore_forward(experts, EXPERTS, f"{type(experts).__name__} (routed experts)", report)


FEATURE = Feature.per_module("experts", "experts", is_routed_experts, patch_experts, unpatch_experts)
