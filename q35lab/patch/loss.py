"""Feature ``flce``: the causal LM's loss through ``q35lab.linear_cross_entropy``, without logits."""

from __future__ import annotations

import torch

from ..hf.forwards import Forward
from ..hf.modules import FLCE_CLASSES, head_has_hooks, head_linear
from ..ops.linear_cross_entropy import linear_cross_entropy
from .feature import Feature, Options
from .markers import FLCE
from .report import PatchReport, override_forward, restore_forward


class _HiddenStates(torch.nn.Module):
    def forward(self, hidden_states):
        return hidden_states


def causal_lm_loss(hidden_states, head_weight, labels, *, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None):
    """transformers' ForCausalLMLoss over ``hidden_states @ head_weightᵀ``, without the logits."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    shift_labels = shift_labels.to(hidden_states.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(hidden_states, head_weight, shift_labels, ignore_index=ignore_index,
                                reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _flce_problem(model: torch.nn.Module) -> str | None:
    head = getattr(model, "lm_head", None)
    linear = head_linear(head)
    if linear is None:
        return f"lm_head is {type(head).__name__} (a LoRA or quantized head keeps the model's loss)"
    if linear.bias is not None:
        return "lm_head has a bias"
    return None


class _FusedLossForward(Forward):
    """A causal LM's forward that, given labels, computes the loss from the hidden states.

    The model's own forward runs with lm_head swapped for an identity, so its "logits" are the
    hidden states and everything else it does (the backbone, a VL model's vision tower, an MoE's
    router loss) is its own. The swap is a plain attribute write, which torch.compile traces.
    Logits are not returned then. Without labels, or when a hook is registered on lm_head (it
    expects logits), the model's own forward runs, and its loss is transformers'.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.identity = _HiddenStates()

    def __call__(self, *args, **kwargs):
        model = self.module
        own_forward = type(model).forward
        labels = kwargs.pop("labels", None)
        if (labels is None or kwargs.get("return_dict") is False or len(args) > 1 or _flce_problem(model)
                or head_has_hooks(model.lm_head)):
            return own_forward(model, *args, labels=labels, **kwargs)  # the model's own path
        head = model.lm_head
        model.lm_head = self.identity
        try:
            out = own_forward(model, *args, **kwargs)  # "logits" = hidden states
        finally:
            model.lm_head = head
        out.loss = causal_lm_loss(out.logits, head_linear(head).weight, labels,
                                  num_items_in_batch=kwargs.get("num_items_in_batch"),
                                  ignore_index=kwargs.get("ignore_index", -100),
                                  shift_labels=kwargs.get("shift_labels"))
        out.logits = None
        return out


def patch_loss(model: torch.nn.Module, report: PatchReport) -> None:
    name = type(model).__name__
    problem = _flce_problem(model)
    label = f"{name} loss" if problem else f"{name} loss (fused linear cross entropy)"
    override_forward(model, FLCE, _FusedLossForward, problem, label, report)


def unpatch_loss(model: torch.nn.Module, report: PatchReport) -> None:
    restore_forward(model, FLCE, f"{type(model).__name__} loss", report)


def _apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    for module in list(model.modules()):
        cls = type(module)
        if cls.__name__ in FLCE_CLASSES and cls.__module__.startswith("transformers."):
            patch_loss(module, report)


def _revert(model: torch.nn.Module, report: PatchReport) -> None:
    for module in list(model.modules()):
        unpatch_loss(module, report)


FEATURE = Feature("flce", "flce", _apply, _revert)
