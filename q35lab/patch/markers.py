"""The attributes by which the patch marks a module it changed (read with ``hf.forwards.marked``)."""

from __future__ import annotations

LORA_PATCHED = "_q35lab_lora"  # attribute of a PEFT LoRA layer whose forward q35lab routes

IN_PROJ = "_q35lab_in_proj"  # attribute of a GatedDeltaNet projection computed by its group

FLCE = "_q35lab_flce"  # attribute of a causal LM whose loss goes through linear_cross_entropy

KEY_HEADS = "_q35lab_key_heads"  # attribute of a GatedDeltaNet whose q/k head repeat q35lab skips: its num_k_heads

MLP = "_q35lab_mlp"  # attribute of an MLP whose forward q35lab computes

EXPERTS = "_q35lab_experts"

EXPERT_LORA = "_q35lab_expert_lora"  # attribute of PEFT's outermost ParamWrapper of the experts that q35lab routes
