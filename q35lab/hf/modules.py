"""What transformers and PEFT build for Qwen3.5, as q35lab recognises it: class names, predicates,
decoder-layer stacks, hooks, and the cache and packing keyword arguments.

Classes are matched by name and module (``transformers.*``), so whichever class the installed
transformers puts in a layer is the one seen."""

from __future__ import annotations

import torch

from ..hf import versions
from .forwards import ORIGINAL

#: transformers classes computing x̂·(1+w) with Gemma-style casting.
OFFSET_RMS_NORM_CLASSES = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")

#: transformers' gated norms after each GatedDeltaNet: w · bf16(x̂), rounded three times ("hf").
HF_GATED_NORM_CLASSES = ("Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated")


def named_children_everywhere(model: torch.nn.Module):
    """Yield (parent, attribute name, child) for every submodule, parents first."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            yield parent, name, child


def is_peft_lora_linear(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Linear" and cls.__module__.startswith("peft.tuners.lora")


IN_PROJ_NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def is_gated_delta_net(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__.endswith("GatedDeltaNet") and cls.__module__.startswith("transformers.") and all(
        hasattr(module, name) for name in IN_PROJ_NAMES)


def base_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The frozen Linear itself, or the one a PEFT LoRA layer wraps."""
    return getattr(module, "base_layer", module)


def base_is_trainable(module: torch.nn.Module) -> bool:
    base = base_layer(module)
    return base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)


MLP_CLASSES = ("Qwen3_5MLP", "Qwen3_5MoeMLP")


def is_swiglu_mlp(module: torch.nn.Module) -> bool:
    cls = type(module)
    return (cls.__name__ in MLP_CLASSES and cls.__module__.startswith("transformers.")
            and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")))


EXPERTS_CLASSES = ("Qwen3_5MoeExperts",)


def is_routed_experts(module: torch.nn.Module) -> bool:
    cls = type(module)
    return (cls.__name__ in EXPERTS_CLASSES and cls.__module__.startswith("transformers.")
            and all(isinstance(getattr(module, n, None), torch.Tensor) for n in ("gate_up_proj", "down_proj")))


FLCE_CLASSES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def head_linear(head) -> torch.nn.Linear | None:
    """The plain ``nn.Linear`` that computes the head now: the head, the one active adapter's copy of
    a PEFT ``modules_to_save`` head, or its original when adapters are disabled; else None."""
    if type(head).__name__ == "ModulesToSaveWrapper":
        active = getattr(head, "active_adapters", None) or [getattr(head, "active_adapter", None)]
        if getattr(head, "disable_adapters", False) or active[0] not in head.modules_to_save:
            head = head.original_module
        elif len(active) == 1:
            head = head.modules_to_save[active[0]]
        else:
            return None
    return head if type(head) is torch.nn.Linear else None


#: A module's hook dictionaries (backward hooks act through the module call too), also global ones.
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooks_would_see(*modules: torch.nn.Module | None) -> bool:
    """Whether a hook of one of ``modules`` or a global module hook would see the call, forward or
    backward: a fused path that does not call those modules must then let them run."""
    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, f"_global{name}", None) for name in _HOOKS):
        return True
    return any(getattr(m, name, None) for m in modules if m is not None for name in _HOOKS)


def head_has_hooks(head: torch.nn.Module) -> bool:
    """Whether a hook would see lm_head's output: it expects logits, which the fused loss never makes."""
    return hooks_would_see(head, head_linear(head))


ATTENTION_CLASSES = ("Qwen3_5Attention", "Qwen3_5MoeAttention")


def attention_layers(model: torch.nn.Module, implementation: str | None = None) -> list:
    """The model's full-attention modules (text decoder) that read their implementation from a
    config; with ``implementation``, those set to it."""
    return [m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES
            and type(m).__module__.startswith("transformers.") and getattr(m, "config", None) is not None
            and (implementation is None or getattr(m.config, "_attn_implementation", None) == implementation)]


#: What ``apply_to_qwen3_5`` looks for (transformers' classes; a GatedDeltaNet of any provider too).
QWEN3_5_CLASSES = (OFFSET_RMS_NORM_CLASSES + HF_GATED_NORM_CLASSES + MLP_CLASSES + EXPERTS_CLASSES + ATTENTION_CLASSES
                   + FLCE_CLASSES)


def _is_qwen3_5_module(module: torch.nn.Module) -> bool:
    cls = type(module)
    known = cls.__name__ in QWEN3_5_CLASSES and cls.__module__.startswith("transformers.")
    return known or is_gated_delta_net(module)


def holds_qwen3_5(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a Qwen3.5 module, or one that q35lab put in the place of one."""
    return any(_is_qwen3_5_module(m) or _is_qwen3_5_module(vars(m).get(ORIGINAL)) for m in model.modules())


def refuse_sharded(model: torch.nn.Module, what: str) -> None:
    """Raise when ``model`` is sharded already (FSDP2's ``fully_shard``, or DTensor parameters).

    ``fully_shard`` gathers each weight into the module it recorded; a module swapped in later would
    keep the sharded DTensor and fail deep inside a kernel."""
    if not torch.distributed.is_available():
        return
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without FSDP2: nothing can be sharded by it
        return
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) or any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            where = f"module {name!r}" if name else "the model itself"
            raise RuntimeError(
                f"{what}: the model is sharded already ({where} is managed by FSDP2's fully_shard or holds DTensor "
                "parameters). Patch before sharding: call apply_to_qwen3_5(model) first, then fully_shard each "
                "decoder layer and the root (the patched modules hold the original Parameters, which fully_shard "
                "then shards like any other); to revert, rebuild the model, or revert before sharding.")


#: The keyword arguments under which transformers hands a GatedDeltaNet a cache (by version).
CACHE_ARGUMENTS = versions.CACHE_ARGUMENTS

#: ... and packed sequences' boundaries (flash-attention's kwargs; fla's and causal-conv1d's names).
_PACKING_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")


def has_cache(kwargs: dict) -> bool:
    """Whether a forward's keyword arguments hand it a cache."""
    return any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS)


def packed_arguments(kwargs: dict) -> str | None:
    return next((name for name in _PACKING_ARGUMENTS if kwargs.get(name) is not None), None)


def is_gated_delta_net_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers decoder layer of a GatedDeltaNet and a dense MLP."""
    return (_is_decoder_layer(module) and getattr(module, "block_type", None) == "linear_attention"
            and is_gated_delta_net(getattr(module, "linear_attn", None)) and is_mlp(getattr(module, "mlp", None))
            and all(isinstance(getattr(module, n, None), torch.nn.Module)
                    for n in ("input_layernorm", "post_attention_layernorm")))


def checkpoints_the_call() -> bool:
    """Whether ``GradientCheckpointingLayer`` checkpoints ``__call__`` (see ``versions``)."""
    return versions.checkpoints_the_call()


def is_mlp(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ in MLP_CLASSES and cls.__module__.startswith("transformers.")


def _is_decoder_layer(module: torch.nn.Module) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer) and type(module).__name__.endswith("DecoderLayer")


def stack_layers(stack: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in stack.layers if _is_decoder_layer(m)]


def layer_stacks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold decoder layers in a ``layers`` list (a vision-language model's text one)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "layers", None), torch.nn.ModuleList) and stack_layers(m)]


def stack_pre_hooks(stack: torch.nn.Module, kind: type) -> dict:
    """The forward pre-hooks of ``stack`` that are ``kind`` objects, by their handle's key."""
    return {key: hook for key, hook in stack._forward_pre_hooks.items() if isinstance(hook, kind)}


def remove_stack_pre_hooks(stack: torch.nn.Module, kind: type) -> bool:
    """Remove ``stack``'s ``kind`` pre-hooks (with or without kwargs); whether there were any."""
    keys = list(stack_pre_hooks(stack, kind))
    for key in keys:
        del stack._forward_pre_hooks[key]
        stack._forward_pre_hooks_with_kwargs.pop(key, None)
    return bool(keys)
