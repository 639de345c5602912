"""Feature ``lora``: PEFT LoRA layers routed through ``q35lab.lora_linear`` (no cast of the
activation to the adapter's dtype)."""

from __future__ import annotations

import torch

from ..hf.forwards import Forward, marked
from ..hf.modules import holds_qwen3_5, is_peft_lora_linear, named_children_everywhere, refuse_sharded
from ..ops._checks import check_module
from ..ops.lora import lora_linear
from .feature import Feature, Options
from .fp8_base import weight_scale
from .markers import IN_PROJ, LORA_PATCHED, MLP
from .report import PatchReport, override_forward, restore_forward


def lora_static_problem(layer: torch.nn.Module) -> str | None:
    """Why lora_linear can never compute this layer exactly, or None if it can."""
    base = layer.base_layer
    if type(base) is not torch.nn.Linear:
        return f"base layer {type(base).__name__} (quantized or custom)"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    if getattr(layer, "lora_variant", None):
        return "a LoRA variant (DoRA or similar)"
    for name in layer.lora_A:
        a, b = layer.lora_A[name], layer.lora_B[name]
        if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or a.bias is not None or b.bias is not None:
            return "adapter matrices with a bias or of another type"
        dropout = layer.lora_dropout[name]
        if not isinstance(dropout, (torch.nn.Identity, torch.nn.Dropout)):
            return f"dropout module {type(dropout).__name__}"
    return None


def _lora_call(layer: torch.nn.Module, x: torch.Tensor, args: tuple, kwargs: dict):
    """lora_linear for this call, or None when PEFT's own forward must run."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    base, dropout = layer.base_layer, layer.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) and dropout.training else 0.0
    return lora_linear(x, base.weight, layer.lora_A[name].weight, layer.lora_B[name].weight,
                       layer.scaling[name], base.bias, p, weight_scale=weight_scale(base))


class _RoutedLoRAForward(Forward):
    """A PEFT LoRA layer's forward: lora_linear when it computes the call exactly, else PEFT's."""

    def __call__(self, x, *args, **kwargs):
        out = _lora_call(self.module, x, args, kwargs)
        return type(self.module).forward(self.module, x, *args, **kwargs) if out is None else out


def route_lora_layer(layer: torch.nn.Module, report: PatchReport) -> None:
    override_forward(layer, LORA_PATCHED, _RoutedLoRAForward, lora_static_problem(layer),
                      "PEFT lora.Linear (forward)", report)


def unroute_lora(layer: torch.nn.Module, report: PatchReport) -> None:
    restore_forward(layer, LORA_PATCHED, "PEFT lora.Linear (forward)", report)


def route_lora(model: torch.nn.Module) -> PatchReport:
    """Route the PEFT LoRA ``Linear`` layers of any model through ``lora_linear``, where it computes
    the call exactly (else PEFT's own forward runs): what ``apply_to_qwen3_5(lora=True)`` does in a
    Qwen3.5 model. ``revert`` undoes it.

    Args:
        model (nn.Module): a model with PEFT LoRA layers (``peft.get_peft_model``).

    Returns:
        PatchReport: the layers routed, and those left to PEFT (and why).

    Raises:
        TypeError: ``model`` not a module.
        RuntimeError: the model is sharded already (FSDP2).
    """
    check_module("model", model)
    refuse_sharded(model, "route_lora")
    report = PatchReport(qwen3_5=holds_qwen3_5(model))
    _route_all(model, report)
    if not any(map(is_peft_lora_linear, model.modules())):
        report.not_applied["lora"] = "no PEFT LoRA layers in the model"
    return report


def _route_all(model: torch.nn.Module, report: PatchReport) -> None:
    for parent, _, child in named_children_everywhere(model):
        # a layer that a fused node computes (the in_proj group, the MLP's gate/up) keeps no routing of its own
        fused = (*getattr(marked(child, IN_PROJ), "modules", ()), *getattr(marked(parent, MLP), "modules", ()))
        if is_peft_lora_linear(child) and not any(child is m for m in fused):
            route_lora_layer(child, report)


def _apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    if not any(map(is_peft_lora_linear, model.modules())):
        report.not_applied["lora"] = ("no PEFT LoRA layers in the model; if you add adapters later "
                                      "(peft.get_peft_model), call apply_to_qwen3_5 again afterwards")
    _route_all(model, report)


def _revert(model: torch.nn.Module, report: PatchReport) -> None:
    for module in list(model.modules()):
        unroute_lora(module, report)


FEATURE = Feature("lora", "lora", _apply, _revert)
