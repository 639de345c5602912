"""Feature ``rms_norm`` / ``gated_norm``: transformers' Qwen3.5 norms swapped for q35lab's modules,
which hold the original weight Parameter."""

from __future__ import annotations

import torch

from ..hf.forwards import ORIGINAL, marked
from ..hf.modules import HF_GATED_NORM_CLASSES, OFFSET_RMS_NORM_CLASSES, named_children_everywhere
from ..ops.gated_rms_norm import GatedRMSNorm
from ..ops.offset_rms_norm import OffsetRMSNorm
from .feature import Feature, Options
from .report import PatchReport


def _share_weight(patched: torch.nn.Module, original: torch.nn.Module) -> torch.nn.Module:
    """Give ``patched`` the original's weight Parameter (same object) and remember the original."""
    patched.weight = original.weight  # training state, optimizer and PEFT references carry over
    patched.train(original.training)
    object.__setattr__(patched, ORIGINAL, original)  # not a submodule: no duplicate state
    return patched


def _offset_norm_from(original: torch.nn.Module) -> OffsetRMSNorm:
    return _share_weight(OffsetRMSNorm(original.weight.shape[0], eps=original.eps, device="meta"), original)


def _gated_norm_from_hf(original: torch.nn.Module) -> GatedRMSNorm:
    width, eps = original.weight.shape[0], original.variance_epsilon
    return _share_weight(GatedRMSNorm(width, eps=eps, rounding="hf", device="meta"), original)


def _gated_norm_from_fla(original: torch.nn.Module) -> GatedRMSNorm | str:
    """flash-linear-attention's FusedRMSNormGated, when it computes what ours does."""
    if original.activation not in ("swish", "silu"):
        return f"activation {original.activation!r} (only silu/swish is fused here)"
    if original.weight is None or getattr(original, "bias", None) is not None:
        return "no weight or a bias (not the GatedDeltaNet norm)"
    width = original.weight.shape[0]
    return _share_weight(GatedRMSNorm(width, eps=original.eps, rounding="fused", device="meta"), original)


def replacement_rule(module: torch.nn.Module):
    """(flag, builder) for a module q35lab knows how to replace, else None.

    Matched by class name *and* defining package, so that e.g. axolotl's class of the same name
    as flash-linear-attention's is not mistaken for it.
    """
    cls = type(module)
    if cls.__name__ in OFFSET_RMS_NORM_CLASSES and cls.__module__.startswith("transformers."):
        return "rms_norm", _offset_norm_from
    if cls.__name__ in HF_GATED_NORM_CLASSES and cls.__module__.startswith("transformers."):
        return "gated_norm", _gated_norm_from_hf
    if cls.__name__ == "FusedRMSNormGated" and cls.__module__.startswith("fla."):
        return "gated_norm", _gated_norm_from_fla
    return None


def _apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    for parent, name, child in named_children_everywhere(model):
        if marked(child, ORIGINAL) is not None:
            report.already_patched += 1
            continue
        rule = replacement_rule(child)
        if rule is None or not getattr(options, rule[0]):
            continue
        replacement = rule[1](child)
        if isinstance(replacement, str):
            report.left_alone[f"{type(child).__name__}: {replacement}"] += 1
        else:
            setattr(parent, name, replacement)
            report.replaced[type(child).__name__] += 1


def _revert(model: torch.nn.Module, report: PatchReport) -> None:
    for parent, name, child in named_children_everywhere(model):
        original = marked(child, ORIGINAL)
        if original is not None:
            original.weight = child.weight  # keep any Parameter swap made while patched
            original.train(child.training)
            setattr(parent, name, original)
            report.reverted[type(original).__name__] += 1


FEATURE = Feature("norms", None, _apply, _revert)  # rms_norm and gated_norm, read per module
