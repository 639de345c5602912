"""Feature ``conv``: a GatedDeltaNet's causal conv through ``q35lab.causal_conv1d``, the delta rule
kept per packed sequence, and the q/k head repeat left to the core where it can take grouped heads."""

from __future__ import annotations

import sys

import torch

from ..hf import versions
from ..hf.forwards import Forward, marked
from ..hf.gated_delta_net import (
    CONV,
    CONV_SWITCHES,
    DELTA_RULE_SWITCHES,
    RECURRENT_SWITCHES,
    ConvSwitch,
    CoreSwitch,
    DeltaRuleSwitch,
    conv_problem,
    core_groups_key_heads,
    core_is_fla,
    flash_qla_problem,
    package_installed,
    packing_problem,
    repeats_key_heads,
    switch_in,
    switched_to_q35lab,
    triton_at_least,
)
from ..hf.modules import is_gated_delta_net
from .feature import Feature, Options
from .markers import KEY_HEADS
from .report import PatchReport, override_forward, restore_forward


class _SwitchedConvForward(Forward):
    """A GatedDeltaNet's own forward, with its module's convolution switched to q35lab's (and its
    PyTorch delta rule to one that honours packed sequences' boundaries)."""

    def __call__(self, *args, **kwargs):
        with switched_to_q35lab(self.module):
            return type(self.module).forward(self.module, *args, **kwargs)


def patch_conv(gdn: torch.nn.Module, report: PatchReport) -> None:
    label = f"{type(gdn).__name__} causal conv1d"
    problem = conv_problem(gdn)
    if marked(gdn, CONV) is not None:
        report.already_patched += 1
    elif problem:
        report.left_alone[f"{label}: {problem}"] += 1
    else:
        module = sys.modules[type(gdn).__module__]
        switch_in(module, "causal_conv1d_fn", CONV_SWITCHES, ConvSwitch)
        if versions.module_function(module, versions.CHUNK_CORE) is not None:
            switch_in(module, versions.CHUNK_CORE, DELTA_RULE_SWITCHES, DeltaRuleSwitch)
        override_forward(gdn, CONV, _SwitchedConvForward, None, label, report)


def unpatch_conv(gdn: torch.nn.Module, report: PatchReport) -> None:
    restore_forward(gdn, CONV, f"{type(gdn).__name__} causal conv1d", report)


def skip_key_head_repeat(gdn: torch.nn.Module, report: PatchReport) -> None:
    """The forward repeats by ``num_v_heads // num_k_heads``: with ``num_k_heads`` set to the value
    heads on this module, the factor is 1 and q, k reach fla's core as the projections made them.
    The forward reads ``num_k_heads`` for nothing else (its dimensions are set at construction).
    Where transformers' wrapper runs its PyTorch core instead (under export, and compile with
    torch < 2.13), the switches around both cores repeat q and k there."""
    if marked(gdn, KEY_HEADS) is not None:
        report.already_patched += 1
    elif not repeats_key_heads(gdn):
        return
    elif not core_groups_key_heads(gdn):
        report.left_alone[f"{type(gdn).__name__} q/k head repeat: transformers calls its PyTorch core, not "
                          "flash-linear-attention's, which alone reads grouped key heads"] += 1
    else:
        module = sys.modules[type(gdn).__module__]
        switch_in(module, versions.CHUNK_CORE, DELTA_RULE_SWITCHES, DeltaRuleSwitch)
        switch_in(module, versions.RECURRENT_CORE, RECURRENT_SWITCHES, CoreSwitch)
        object.__setattr__(gdn, KEY_HEADS, gdn.num_k_heads)
        gdn.num_k_heads = gdn.num_v_heads
        report.replaced[f"{type(gdn).__name__} q/k head repeat (skipped: fla's core groups the key heads)"] += 1


def unskip_key_head_repeat(gdn: torch.nn.Module, report: PatchReport) -> None:
    heads = marked(gdn, KEY_HEADS)
    if heads is not None:
        gdn.num_k_heads = heads
        object.__delattr__(gdn, KEY_HEADS)
        report.reverted[f"{type(gdn).__name__} q/k head repeat"] += 1


def delta_rule_core(gdn: torch.nn.Module) -> str:
    """Which delta-rule core this GatedDeltaNet will run, and what to install when it is slow."""
    if not core_is_fla(gdn):
        fix = ("transformers did not take the installed flash-linear-attention (its import failed when the "
               "modeling module was imported: import fla to see why)" if package_installed("fla")
               else "pip install flash-linear-attention (on Hopper with Triton >= 3.7.1)")
        return (f"transformers' PyTorch fallback, far slower than fla's (`python -m q35lab bench delta_rule` "
                f"measures both): {fix}")
    qla = flash_qla_problem(gdn)
    if qla is None:  # FlashQLA's path runs none of fla's Triton kernels: fla#640's guard is not on it
        return "flash-linear-attention's chunk_gated_delta_rule, which runs FlashQLA's fused kernels (bf16/fp16 calls)"
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if hopper and not triton_at_least((3, 7, 1)):
        return ("flash-linear-attention's, whose backward refuses Hopper with this Triton (< 3.7.1, fla#640): "
                "install Triton 3.7.1 (or torch >= 2.12.1)")
    return f"flash-linear-attention's chunk_gated_delta_rule, its Triton kernels: {qla}"


def causal_conv(gdn: torch.nn.Module) -> str:
    if marked(gdn, CONV) is not None:
        return "q35lab's causal_conv1d (channels last, no transposes)"
    if conv_problem(gdn) == "the causal-conv1d CUDA package runs it":
        return "the causal-conv1d CUDA package"
    return "transformers' PyTorch fallback (a depthwise nn.Conv1d between two transposes): patch with conv=True"


def packing(gdn: torch.nn.Module) -> str:
    """What a row of packed sequences gets: kept apart, or refused (``_PackedBoundaries`` raises)."""
    problem = packing_problem(gdn)
    if problem:
        return f"a row of packed sequences is refused (ValueError): {problem}"
    core = ("fla's delta rule" if core_is_fla(gdn)
            else "transformers' PyTorch delta rule, run by q35lab once per sequence")
    return ("sequences kept apart when their boundaries come as cu_seq_lens_q (DataCollatorWithFlattening("
            "return_flash_attn_kwargs=True)) or as the position_ids of one row without an attention mask, a "
            "sequence starting wherever they do not step by one (transformers' rule; q35lab derives cu_seq_lens_q "
            f"from them): the conv honours them, and {core}; such a row runs with use_cache=False, as transformers' "
            "full-attention mask ignores the packing when it has a cache")


def _apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    for module in list(model.modules()):
        if is_gated_delta_net(module):
            patch_conv(module, report)
            skip_key_head_repeat(module, report)


def _revert(model: torch.nn.Module, report: PatchReport) -> None:
    for module in list(model.modules()):
        unpatch_conv(module, report)
        unskip_key_head_repeat(module, report)


FEATURE = Feature("conv", "conv", _apply, _revert)
