"""The model a step trains: Qwen3.5 configs at their real sizes, built with LoRA on every linear layer."""

from __future__ import annotations

import torch

#: Qwen3.5 sizes, as torchtitan's ``models/qwen3_5/flavors.py`` and the checkpoints' configs give
#: them (every fourth layer full attention, attention head dim 256, GatedDeltaNet head dim 128,
#: vocabulary 248,320). "9b" is transformers' default ``Qwen3_5TextConfig``.
SIZES = {
    "9b": dict(layers=32),
    "27b": dict(layers=64, hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                linear_num_key_heads=16, linear_num_value_heads=48),
    "35b-a3b": dict(layers=40, moe=True, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
                    linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512),
}

#: The fused expert parameters a MoE model's LoRA also targets with ``build(expert_lora=True)``.
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

#: A CPU-sized model with the same structure (``config("tiny")``; ``"tiny-moe"``: with 4 routed experts, top-2).
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)


def config(size: str = "h200", layers: int | None = None):
    """A Qwen3.5 text config. ``"9b"``, ``"27b"``, ``"35b-a3b"``: the real dimensions (``SIZES``),
    all their layers unless ``layers`` says fewer; ``"h200"``: transformers' default dimensions
    (the 9B's) with ``layers`` decoder layers (4 by default); ``"tiny"``: a CPU-sized model with
    the same structure."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    if size in SIZES:
        dims = dict(SIZES[size])
        layers = layers or dims.pop("layers")
        dims.pop("layers", None)
        moe = dims.pop("moe", False)
    elif size in ("h200", "tiny"):
        layers, dims, moe = layers or 4, dict(TINY) if size == "tiny" else {}, False
    elif size == "tiny-moe":
        layers, moe = layers or 4, True
        dims = {**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32}
        dims.pop("intermediate_size")
    else:
        raise ValueError(f"size: expected one of {sorted(SIZES) + ['h200', 'tiny', 'tiny-moe']}, got {size!r}")
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config_class = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    return config_class(num_hidden_layers=layers, layer_types=layer_types, **dims)


def base_model(size: str = "h200", layers: int | None = None, device=None, dtype=torch.bfloat16, seed: int = 0,
               attention: str | None = None):
    """``AutoModelForCausalLM.from_config(config(size, layers))``: random weights, seeded, the same
    for every variant of a size."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device or "cpu"):  # initialised where it will run: 3 B parameters init slowly on a CPU
        return AutoModelForCausalLM.from_config(config(size, layers), dtype=dtype,
                                                **({"attn_implementation": attention} if attention else {}))


def build(size: str = "h200", layers: int | None = None, rank: int = 16, device=None, dtype=torch.bfloat16,
          seed: int = 0, checkpointing: bool = True, modules_to_save: list[str] | None = None,
          attention: str | None = None, expert_lora: bool = False):
    """``AutoModelForCausalLM.from_config`` (random weights, seeded), LoRA r=``rank`` on every
    linear layer (PEFT's defaults otherwise: fp32 adapters), gradient checkpointing.
    ``modules_to_save`` (e.g. ``["embed_tokens", "lm_head"]``) trains those whole, as for new tokens.
    ``attention``: transformers' ``attn_implementation`` ("sdpa", its default; "flex_attention",
    whose block mask skips the blocks between packed sequences; "eager"). ``expert_lora``: LoRA
    r=``rank`` on a MoE's routed experts too (PEFT's ``target_parameters``: ``EXPERT_PARAMETERS``)."""
    import peft

    from ...hf import versions

    model = base_model(size, layers, device, dtype, seed, attention)
    if expert_lora and not getattr(model.config.get_text_config(), "num_experts", None):
        raise ValueError(f"expert_lora: expected a MoE size (35b-a3b, tiny-moe), got {size!r}, which has no experts")
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                       modules_to_save=modules_to_save,
                                                       target_parameters=EXPERT_PARAMETERS if expert_lora else None))
    init_lora_b(model, seed)
    if checkpointing:
        versions.enable_checkpointing(model, use_reentrant=False)
    return model


def init_lora_b(model, seed: int = 0) -> None:
    """LoRA starts with B = 0; a non-zero B (seeded, the same for every variant) makes the
    adapters' path count in the loss and its gradients."""
    generator = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.01)
