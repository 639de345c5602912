"""Features ``tiled_mlp``, ``tiled_gdn``, ``offload_checkpoints`` and ``long_context``: the patch's
side of ``q35lab.long_context``."""

from __future__ import annotations

import numbers

import torch

from ..hf.gated_delta_net import gated_delta_net_problem
from ..hf.modules import is_gated_delta_net, is_gated_delta_net_layer, is_peft_lora_linear, is_swiglu_mlp
from ..long_context import restore_decoder_layers, untile_gated_delta_net, untile_gated_delta_net_layer, untile_mlp
from ..long_context.gated_delta_net import TiledGDNForward, tile_gated_delta_net, tile_gated_delta_net_layer
from ..long_context.memory import layer_count
from ..long_context.offload import decoder_layers, has_long_context_options, offload_decoder_layers
from ..long_context.planner import LongContextPlan, plan_long_context, usable_gpu_bytes
from ..long_context.tiles import check_tile_tokens, tile_mlp
from .feature import Feature, Options
from .report import PatchReport


def plan_for_model(model: torch.nn.Module, tokens) -> LongContextPlan:
    """``plan_long_context`` for this model: its text config, its LoRA rank, its other
    trainable parameters, the bytes of its weights' dtype (the activations'), and the memory of
    the GPU it is on. Refused where the memory model does not describe the step: a MoE model, a
    model that carries long-context options already (a plan only adds)."""
    tokens = check_tile_tokens(tokens, "long_context", "the longest step's tokens")
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"long_context: {type(model).__name__} has no transformers config to plan from")
    if getattr(config.get_text_config(), "num_experts", None):
        raise NotImplementedError("long_context: the memory model covers the dense Qwen3.5 models, not the MoE; "
                                  "pass tiled_gdn and offload_checkpoints yourself")
    weight = first_parameter(model, "long_context")
    if has_long_context_options(model):
        raise ValueError("long_context: the model carries long-context options already (tiles or an offload); "
                         "q35lab.revert(model) first, then patch it with the plan")
    return plan_long_context(config, tokens, gpu_bytes=usable_gpu_bytes(weight.device), **model_settings(model))


def first_parameter(model: torch.nn.Module, option: str) -> torch.nn.Parameter:
    """The model's first parameter (its device and dtype are the step's); ``TypeError`` naming ``option`` without."""
    weight = next(model.parameters(), None)
    if weight is None:
        raise TypeError(f"{option}: {type(model).__name__} has no parameters to plan for")
    return weight


def model_settings(model: torch.nn.Module) -> dict:
    """``bytes_per_token``'s settings read off a model: its LoRA rank, its other trainable parameters, the bytes of
    its weights' dtype (the activations')."""
    lora = [m for m in model.modules() if is_peft_lora_linear(m) and m.r]
    adapters = {id(p) for m in lora for name, p in m.named_parameters() if "lora_" in name}
    others = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in adapters)
    return dict(lora_rank=max((max(m.r.values()) for m in lora), default=0),
                dtype_bytes=next(model.parameters()).element_size(), other_trainable_parameters=others)


def apply_tiled_mlp(mlp: torch.nn.Module, tile_tokens: int, report: PatchReport) -> None:
    if tile_mlp(mlp, tile_tokens):
        report.replaced[f"{type(mlp).__name__} (tiled, {tile_tokens} tokens a tile)"] += 1


def apply_offload(model: torch.nn.Module, layers, report: PatchReport) -> None:
    offloader = offload_decoder_layers(model, layers)
    report.replaced[f"decoder-layer checkpoints offloaded to host memory ({offloader.layers} layers)"] += 1


def report_tiled_gdn(model: torch.nn.Module, tile_tokens: int, report: PatchReport) -> None:
    if any(isinstance(vars(m).get("forward"), TiledGDNForward) for m in model.modules()):
        report.runs["tiled GatedDeltaNet"] = (
            f"tiles of {tile_tokens} tokens when a GatedDeltaNet trains on more, its whole decoder layer (norms, MLP, "
            "residuals) in each tile where the MLP is per token; untiled without grad (eval, "
            "generation) and, with a warning, given a cache (use_cache=False without gradient checkpointing) or "
            "packed sequences (cu_seq_lens_q: their boundaries do not line up with tiles)")


def tile_option(name: str, value) -> int | None:
    """A long-context tile size: None (or 0) for off, else a positive int; errors name ``name``."""
    if value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == 0):
        return None
    return check_tile_tokens(value, name)


def offload_option(model: torch.nn.Module, value) -> float | int:
    """``offload_checkpoints`` checked against ``model``'s decoder layers: None (or 0) for off."""
    if value is None:
        return 0
    layers = decoder_layers(model)
    layer_count("offload_checkpoints", value, len(layers))
    if value and not layers:
        raise ValueError("offload_checkpoints: the model has no decoder layers to offload (transformers' "
                         "*DecoderLayer in a `layers` list)")
    return value


def apply_tiled_gdn(gdn: torch.nn.Module, tile_tokens: int, report: PatchReport) -> None:
    problem = gated_delta_net_problem(gdn)
    if problem:
        report.left_alone[f"{type(gdn).__name__} (tiled): {problem}"] += 1
    elif tile_gated_delta_net(gdn, tile_tokens):
        report.replaced[f"{type(gdn).__name__} (tiled, {tile_tokens} tokens a tile)"] += 1
    else:
        report.already_patched += 1


def apply_tiled_gdn_layer(layer: torch.nn.Module, tile_tokens: int, report: PatchReport) -> None:
    if not is_gated_delta_net_layer(layer) or gated_delta_net_problem(layer.linear_attn):
        return  # a problem is said once, by apply_tiled_gdn
    if tile_gated_delta_net_layer(layer, tile_tokens):
        what = f"{type(layer).__name__} (GatedDeltaNet and MLP tiled together, {tile_tokens} tokens a tile)"
        report.replaced[what] += 1
    else:
        report.already_patched += 1


def _apply_tiled_gdn(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    for module in list(model.modules()):
        if is_gated_delta_net(module):  # wraps the conv's forward, and calls the fused in_proj
            apply_tiled_gdn(module, options.tiled_gdn, report)
        apply_tiled_gdn_layer(module, options.tiled_gdn, report)  # a GatedDeltaNet's decoder layer, tile by tile


def _revert_tiled_gdn(model: torch.nn.Module, report: PatchReport) -> None:
    for module in list(model.modules()):
        if untile_gated_delta_net(module) or untile_gated_delta_net_layer(module):
            report.reverted[f"{type(module).__name__} (tiled)"] += 1


def _apply_tiled_mlp(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    for module in list(model.modules()):
        if is_swiglu_mlp(module):  # wraps the fused SwiGLU forward where there is one
            apply_tiled_mlp(module, options.tiled_mlp, report)


def _revert_tiled_mlp(model: torch.nn.Module, report: PatchReport) -> None:
    for module in list(model.modules()):
        if untile_mlp(module):
            report.reverted[f"{type(module).__name__} (tiled)"] += 1


def _apply_offload(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    apply_offload(model, options.offload_checkpoints, report)


def _revert_offload(model: torch.nn.Module, report: PatchReport) -> None:
    if restore_decoder_layers(model):
        report.reverted["decoder-layer checkpoint offload"] += 1


TILED_GDN = Feature("tiled_gdn", "tiled_gdn", _apply_tiled_gdn, _revert_tiled_gdn)
TILED_MLP = Feature("tiled_mlp", "tiled_mlp", _apply_tiled_mlp, _revert_tiled_mlp)
OFFLOAD = Feature("offload_checkpoints", "offload_checkpoints", _apply_offload, _revert_offload)
