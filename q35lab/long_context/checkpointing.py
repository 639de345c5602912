"""Selective gradient checkpointing: some decoder layers run their forward once a step, keeping their activations,
while the others stay checkpointed (``plan_checkpointing`` says which fit)."""

from __future__ import annotations

import warnings

import torch

from ..hf import versions
from ..hf.modules import layer_stacks, remove_stack_pre_hooks, stack_layers, stack_pre_hooks
from ..ops._checks import check_module
from .memory import layer_indices
from .tiles import check_tile_tokens


class _PlainCall:
    """A decoder layer's ``_gradient_checkpointing_func`` bypassed: the layer's forward runs as it is, once, its
    activations kept for the backward. A step with more tokens than the plan's (its hidden states ``[..., H]`` are
    the first argument; unknown without one) goes through the checkpoint function it replaces, as the plan's
    memory was not made for it. An object, not a closure: it deep-copies and pickles with its model."""

    def __init__(self, guard: _PlanGuard, index: int, inner):
        self.guard, self.index, self.inner = guard, index, inner

    def __repr__(self) -> str:
        return f"<q35lab decoder layer {self.index} without checkpointing up to {self.guard.up_to_tokens} tokens>"

    def __call__(self, function, *args, **kwargs):
        hidden = args[0] if args else None
        tokens = hidden.numel() // hidden.shape[-1] if torch.is_tensor(hidden) and hidden.dim() else None
        if tokens is not None and tokens <= self.guard.up_to_tokens:
            return function(*args, **kwargs)
        self.guard.warn_once(tokens)
        return self.inner(function, *args, **kwargs)


class _PlanGuard:
    """Forward pre-hook of the module running the decoder layers: at each forward, the planned layers' checkpoint
    functions are bypassed (``_PlainCall``), also those set since (checkpointing enabled again after the plan)."""

    def __init__(self, layers: tuple[int, ...], up_to_tokens: int, previous_flags: tuple | None = None):
        self.layers, self.up_to_tokens = frozenset(layers), up_to_tokens
        self.previous_flags = previous_flags  # each layer's checkpointing flag, where the plan had to turn it on
        self.warned = False

    def warn_once(self, tokens: int | None) -> None:
        if not self.warned:
            self.warned = True
            seen = "of unknown length" if tokens is None else f"of {tokens:,} tokens"
            warnings.warn(f"q35lab: a step {seen} is longer than the {self.up_to_tokens:,} tokens the checkpointing "
                          "plan was made for: every decoder layer is checkpointed in such steps (patch with a "
                          "larger tokens_per_step to plan for them)", stacklevel=3)

    def __call__(self, stack: torch.nn.Module, args):
        for index, layer in enumerate(stack_layers(stack)):
            current = vars(layer).get("_gradient_checkpointing_func")
            if isinstance(current, _PlainCall):
                if index in self.layers:
                    current.guard, current.index = self, index
                else:
                    layer._gradient_checkpointing_func = current.inner
            elif current is not None and index in self.layers:
                layer._gradient_checkpointing_func = _PlainCall(self, index, current)


def _checkpointing_on(layer: torch.nn.Module) -> bool:
    return bool(getattr(layer, "gradient_checkpointing", False)) and (
        getattr(layer, "_gradient_checkpointing_func", None) is not None)


def run_without_checkpointing(model: torch.nn.Module, layers, *, up_to_tokens: int) -> int:
    """Run the decoder layers ``layers`` (indices) without gradient checkpointing in steps of up to ``up_to_tokens``
    tokens; every other layer, and every layer in a longer step (with a warning), stays checkpointed.

    Checkpointing is turned on (``enable_checkpointing``) where a decoder layer has it off: the layers left out of
    ``layers`` are the ones a plan needs checkpointed. Calling again replaces the layers; ``restore_checkpointing``
    undoes it, turning checkpointing off again where this call turned it on.

    Args:
        model (nn.Module): a transformers model (or a PEFT wrapper) with decoder layers in a ``layers`` list.
        layers (iterable of int): the decoder layers' indices, in the order the model runs them.
        up_to_tokens (int): the longest step, in tokens a micro-batch (rows times length), the plan is for.

    Returns:
        int: how many decoder layers run without checkpointing.

    Raises:
        TypeError: ``model`` not a module, ``layers`` not indices, ``up_to_tokens`` not an int.
        ValueError: an index out of range, ``up_to_tokens`` below 1, a model without decoder layers.
    """
    check_module("model", model)
    stacks = layer_stacks(model)
    if not stacks:
        raise ValueError(f"model: expected a transformers model with decoder layers in a `layers` list, "
                         f"got {type(model).__name__}")
    found = [layer for stack in stacks for layer in stack_layers(stack)]
    chosen = layer_indices("layers", layers, len(found))
    up_to_tokens = check_tile_tokens(up_to_tokens, "up_to_tokens", "the step's tokens")
    previous = None
    for stack in stacks:
        for guard in stack_pre_hooks(stack, _PlanGuard).values():
            previous = guard.previous_flags if previous is None else previous
    if not all(_checkpointing_on(layer) for layer in found):
        if previous is None:
            previous = tuple(_checkpointing_on(layer) for layer in found)
        versions.enable_checkpointing(model, use_reentrant=False)
    for stack in stacks:
        remove_stack_pre_hooks(stack, _PlanGuard)
        guard = _PlanGuard(chosen, up_to_tokens, previous)
        stack.register_forward_pre_hook(guard)
        guard(stack, ())  # bypass the checkpoint functions now (the guard does again at each forward)
    return len(chosen)


def planned_layers(model: torch.nn.Module) -> tuple[int, ...] | None:
    """The decoder layers ``run_without_checkpointing`` took out of checkpointing, None where it has not."""
    guards = [guard for stack in layer_stacks(model) for guard in stack_pre_hooks(stack, _PlanGuard).values()]
    return tuple(sorted(guards[0].layers)) if guards else None


def restore_checkpointing(model: torch.nn.Module) -> int:
    """Undo ``run_without_checkpointing``: every decoder layer checkpointed as before it, or not checkpointed where
    it turned checkpointing on.

    Args:
        model (nn.Module): the model it was given.

    Returns:
        int: how many decoder layers it had taken out of checkpointing.

    Raises:
        TypeError: ``model`` not a module.
    """
    check_module("model", model)
    restored, previous = 0, None
    for stack in layer_stacks(model):
        for guard in stack_pre_hooks(stack, _PlanGuard).values():
            previous = guard.previous_flags if previous is None else previous
        remove_stack_pre_hooks(stack, _PlanGuard)
        for layer in stack_layers(stack):
            current = vars(layer).get("_gradient_checkpointing_func")
            if isinstance(current, _PlainCall):
                layer._gradient_checkpointing_func = current.inner
                restored += 1
    if previous is not None:
        layers = [layer for stack in layer_stacks(model) for layer in stack_layers(stack)]
        if not any(previous):
            versions.disable_checkpointing(model)
        else:
            for layer, flag in zip(layers, previous):
                layer.gradient_checkpointing = flag
    return restored
