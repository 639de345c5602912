"""Feature ``checkpointing="auto"``: only the decoder layers the step's memory needs stay gradient-checkpointed,
planned for ``tokens_per_step`` against the GPU's memory (``long_context.plan_checkpointing``); the others run
their forward once a step."""

from __future__ import annotations

import torch

from ..long_context import planned_layers, restore_checkpointing, run_without_checkpointing
from ..long_context.memory import memory_bytes
from ..long_context.offload import decoder_layers, has_long_context_options
from ..long_context.planner import CHECKPOINT_MARGIN, CheckpointPlan, checkpoint_budget, plan_checkpointing
from ..long_context.tiles import check_tile_tokens
from .feature import Feature, Options
from .long_context_options import first_parameter, model_settings
from .report import PatchReport

#: ``apply_to_qwen3_5``'s ``checkpointing`` values: None leaves the model's checkpointing as it is.
MODES = (None, "auto")


def checkpointing_options(checkpointing, tokens_per_step, memory_budget) -> tuple[int | None, float | None]:
    """``checkpointing``, ``tokens_per_step`` and ``memory_budget`` checked together: the tokens and the budget
    (None: the GPU's) where ``checkpointing`` is "auto", (None, None) where it is None."""
    if checkpointing is not None and not isinstance(checkpointing, str):
        raise TypeError(f"checkpointing: expected None or 'auto', got {checkpointing!r}")
    if checkpointing not in MODES:
        raise ValueError(f"checkpointing: expected None (as the model is) or 'auto' (the fewest checkpointed decoder "
                         f"layers that fit), got {checkpointing!r}")
    if checkpointing is None:
        for name, value in (("tokens_per_step", tokens_per_step), ("memory_budget", memory_budget)):
            if value is not None:
                raise ValueError(f"{name}: plans the checkpointing, so it goes with checkpointing='auto'")
        return None, None
    if tokens_per_step is None:
        raise ValueError("tokens_per_step: checkpointing='auto' plans for a step's tokens (a micro-batch's rows times "
                         "their padded length, the longest the run trains on); pass it")
    tokens = check_tile_tokens(tokens_per_step, "tokens_per_step", "the step's tokens")
    return tokens, None if memory_budget is None else memory_bytes(memory_budget, "memory_budget")


def refuse_with_long_context(model: torch.nn.Module, planned: bool, long_context_options: dict) -> None:
    """The checkpointing plan runs layers without checkpointing, which the tiles and the offload need: refuse the
    two together, given now or one on the model already, naming what clashes."""
    given = [name for name, value in long_context_options.items() if value]
    if planned and given:
        raise ValueError(f"checkpointing: 'auto' runs some decoder layers without checkpointing, and "
                         f"{', '.join(given)} need every layer checkpointed; pass one or the other")
    if planned and has_long_context_options(model):
        raise ValueError("checkpointing: the model carries long-context options (tiles or an offload), which need "
                         "every layer checkpointed; q35lab.revert(model) first")
    if given and planned_layers(model) is not None:
        raise ValueError(f"{', '.join(given)}: the model runs decoder layers without checkpointing "
                         "(checkpointing='auto'), and these options need every layer checkpointed; "
                         "q35lab.revert(model) first")


def plan_for_model(model: torch.nn.Module, tokens: int, memory_budget: float | None) -> CheckpointPlan:
    """``plan_checkpointing`` for this model: its text config, LoRA rank, other trainable parameters and dtype,
    against ``memory_budget`` or, for a model on a GPU, ``checkpoint_budget`` (its free and reserved memory less
    ``CHECKPOINT_MARGIN`` of its total). A model on a CPU has no GPU memory to plan against: ``memory_budget`` is
    required there."""
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"checkpointing: {type(model).__name__} has no transformers config to plan from")
    if getattr(config.get_text_config(), "num_experts", None):
        raise NotImplementedError("checkpointing: the memory model covers the dense Qwen3.5 models, not the MoE; "
                                  "leave checkpointing=None")
    if not decoder_layers(model):
        raise ValueError("checkpointing: the model has no decoder layers to plan (transformers' *DecoderLayer in a "
                         "`layers` list)")
    weight = first_parameter(model, "checkpointing")
    if memory_budget is None:
        memory_budget = checkpoint_budget(weight.device)
        source = f"{weight.device}'s free and reserved memory less {CHECKPOINT_MARGIN:.0%} of its total"
    else:
        source = "memory_budget"
    return plan_checkpointing(config, tokens, memory_budget=memory_budget, budget_source=source,
                              **model_settings(model))


def _apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    plan = options.checkpointing
    was_on = all(getattr(layer, "gradient_checkpointing", False) for layer in decoder_layers(model))
    run_without_checkpointing(model, plan.not_checkpointed, up_to_tokens=plan.tokens)
    report.checkpoint_plan = plan
    report.runs["checkpointing"] = str(plan) + ("" if was_on else "; gradient checkpointing turned on for it")


def _revert(model: torch.nn.Module, report: PatchReport) -> None:
    if planned_layers(model) is not None:
        restore_checkpointing(model)
        report.reverted["decoder-layer checkpointing plan"] += 1


CHECKPOINTING = Feature("checkpointing", "checkpointing", _apply, _revert)
