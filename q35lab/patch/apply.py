"""``apply_to_qwen3_5`` and ``revert``."""

from __future__ import annotations

import warnings

import torch

from ..hf.modules import (
    QWEN3_5_CLASSES,
    attention_layers,
    holds_qwen3_5,
    is_gated_delta_net,
    refuse_sharded,
)
from ..long_context.tiles import check_tile_tokens, tile_only_above
from ..ops._checks import check_bool, check_module
from . import attention, checkpointing, conv, experts, fp8_base, in_proj, long_context_options, lora, loss, mlp, norms
from .attention import (
    NAME,
    describe,
)
from .checkpointing import checkpointing_options, refuse_with_long_context
from .checkpointing import plan_for_model as checkpoint_plan_for_model
from .conv import (
    causal_conv,
    delta_rule_core,
    packing,
)
from .feature import Options
from .long_context_options import (
    offload_option,
    plan_for_model,
    report_tiled_gdn,
    tile_option,
)
from .report import PatchReport

#: The features in the order they compose: each may wrap what an earlier one installed (the tiled
#: GatedDeltaNet wraps the conv's forward and calls the fused in_proj; the tiled MLP wraps the fused
#: SwiGLU; LoRA layers that a fused group computes are not routed). FP8 base weights come first, so
#: that the fused groups pack the FP8 weights into one buffer. ``revert`` runs them reversed.
FEATURES = (fp8_base.FEATURE, in_proj.FEATURE, conv.FEATURE, long_context_options.TILED_GDN, mlp.FEATURE,
            experts.FEATURE, long_context_options.TILED_MLP, loss.FEATURE, norms.FEATURE, lora.FEATURE,
            attention.FEATURE, long_context_options.OFFLOAD, checkpointing.CHECKPOINTING, attention.BOUNDARIES)


def _record_what_runs(model: torch.nn.Module, report: PatchReport) -> None:
    layers = [m for m in model.modules() if is_gated_delta_net(m)]
    if layers:
        report.runs["delta-rule core"] = delta_rule_core(layers[0])
        report.runs["causal conv1d"] = causal_conv(layers[0])
        report.runs["packed batches"] = packing(layers[0])
    if attention_layers(model, NAME):
        report.runs["packed full attention"] = describe()


def _not_qwen3_5(model: torch.nn.Module) -> str:
    return (f"model: no Qwen3.5 module found in {type(model).__name__} (looked for transformers' "
            f"{', '.join(QWEN3_5_CLASSES)} and GatedDeltaNet); nothing was patched. For the PEFT LoRA layers of "
            "another model, q35lab.patch.route_lora(model)")


def apply_to_qwen3_5(
    model: torch.nn.Module,
    *,
    rms_norm: bool = True,
    gated_norm: bool = True,
    lora: bool = True,
    in_proj: bool = True,
    flce: bool | None = None,
    conv: bool = True,
    swiglu: bool = True,
    experts: bool = True,
    varlen_attention: bool = True,
    tiled_mlp: int | None = None,
    tiled_gdn: int | None = None,
    offload_checkpoints: float | int | None = 0,
    long_context: int | None = None,
    checkpointing: str | None = None,
    tokens_per_step: int | None = None,
    memory_budget: float | None = None,
    strict: bool = False,
    fused_linear_cross_entropy: bool | None = None,
    base_precision: str | None = None,
) -> PatchReport:
    """Replace a Qwen3.5 model's modules by q35lab's kernels, in place, and report what was done.

    Works on ``Qwen3_5ForCausalLM``, ``Qwen3_5ForConditionalGeneration``, the MoE variants and any
    PEFT wrapper around them: patch after ``peft.get_peft_model`` and after moving the model to its
    device and dtype, and with FSDP2 before ``fully_shard``. The modules keep their parameters (the
    same objects); patching twice is harmless, ``revert`` undoes it. A patched model deep-copies,
    pickles and compiles (the norms are custom ops the compiler traces, the other ops graph
    breaks). Where a call is one a kernel cannot compute exactly (a hook on ``lm_head``, two active
    adapters, DoRA, ...) the module's own forward runs, and the report says which modules can never
    be patched.

    Packed rows (``DataCollatorWithFlattening``, with or without ``return_flash_attn_kwargs``) give
    each sequence what it gets alone under the forward's default arguments: such a row runs with
    ``use_cache=False``. Where the GatedDeltaNet cannot keep them apart (``conv=False`` without the
    causal-conv1d package) a packed row is refused; the report's ``packed batches`` line says which.

    Args:
        model (nn.Module): a transformers Qwen3.5 model, bare or wrapped by PEFT.
        rms_norm (bool): the decoder norms as ``OffsetRMSNorm``. Default: True.
        gated_norm (bool): the GatedDeltaNet's gated norm as ``GatedRMSNorm``. Default: True.
        lora (bool): each PEFT LoRA ``Linear`` through ``lora_linear`` (LoRA layers added later need
            another call). Default: True.
        in_proj (bool): a GatedDeltaNet's four input projections as one ``fused_lora_projections``
            node (frozen bases). Default: True.
        flce (bool, optional): the causal LM's loss by ``linear_cross_entropy``, which makes no
            logits. Default: True.
        conv (bool): the GatedDeltaNet's causal conv1d as ``causal_conv1d`` (unless the causal-conv1d
            package runs it), and fla's delta rule given the key heads unrepeated. Default: True.
        swiglu (bool): the MLP as a fused gate/up projection and ``swiglu_down``. Default: True.
        experts (bool): a MoE layer's frozen routed experts as ``routed_experts``. Default: True.
        varlen_attention (bool): full attention over a packed row (``cu_seq_lens_q``, or ``position_ids``
            that do not step by one) as variable-length flash attention, each sequence alone; this
            model's layers only, not others built from the same config. Default: True.
        tiled_mlp (int, optional): every MLP computed in tiles of this many tokens, each recomputed
            in backward. Default: None (untiled).
        tiled_gdn (int, optional): every GatedDeltaNet decoder layer that trains on more tokens
            computed in such tiles, its state carried from tile to tile (calls with a cache or
            packed sequences run untiled, with a warning). Default: None.
        offload_checkpoints (float or int, optional): the decoder layers, a fraction in [0, 1] or a
            count, whose gradient-checkpoint inputs wait in pinned host memory. Default: 0.
        long_context (int, optional): the longest step's tokens: plans the three options above for
            it (``plan_long_context`` against the model's GPU; dense models only), in
            place of them. Default: None.
        checkpointing (str, optional): "auto": gradient-checkpoint only the decoder layers a step of
            ``tokens_per_step`` needs to fit the memory (``long_context.plan_checkpointing``, the fewest
            the memory model allows; the others run their forward once a step, keeping their
            activations), turning checkpointing on if it is off; a longer step checkpoints every
            layer, with a warning. Not with the long-context options, which need every layer
            checkpointed; dense models only. None: the model's checkpointing as it is. Default: None.
        tokens_per_step (int, optional): with ``checkpointing="auto"``, the longest step's tokens a
            micro-batch (rows times padded length; a packed row's length). Required there.
        memory_budget (float, optional): with ``checkpointing="auto"``, the bytes the step's predicted
            peak may reach. Default: on a GPU, its free memory plus what this process holds, less
            ``long_context.CHECKPOINT_MARGIN`` of its total; required for a model on a CPU.
        strict (bool): raise, rather than warn, when ``model`` holds no Qwen3.5 module. Default: False.
        fused_linear_cross_entropy (bool, optional): Liger's name for ``flce``; give one of the two.
        base_precision (str, optional): "fp8": the frozen base weights of the decoder's projections
            (q/k/v/o, the GatedDeltaNet's in_proj and out_proj, gate/up/down) quantized once to FP8
            e4m3 with one scale an output channel, kept instead of their bf16 copy (half the
            bytes), and their GEMMs in forward, recompute and input gradient run on FP8
            (``torch._scaled_mm``, activations scaled per row; the error bound: ``q35lab.ops.fp8``).
            The adapters, norms, attention, the delta rule, the lm head and the loss stay as they
            are. The original weights are copied to host memory and ``revert`` restores them bit
            for bit. Needs a CUDA GPU of compute capability 8.9 or more (Ada, Hopper and later);
            allowed on the CPU, where PyTorch's FP8 GEMM is a slow reference (for tests). Merging
            adapters into an FP8 base is not supported: revert first. None or "bf16": the weights
            as they are. Default: None.

    Returns:
        PatchReport: the modules replaced, those left alone and why, the flags that did nothing,
        and what runs where q35lab does not replace the code.

    Raises:
        TypeError: ``model`` not a module, a flag not a bool, a tile or ``long_context`` not an int,
            ``offload_checkpoints`` not a number, ``flce`` and ``fused_linear_cross_entropy`` both
            given, ``long_context`` or ``checkpointing`` for a model without a transformers config,
            ``checkpointing`` not a string, ``tokens_per_step`` not an int, ``memory_budget`` not a number,
            ``base_precision`` not a string.
        ValueError: a tile, ``long_context`` or ``offload_checkpoints`` out of range, ``long_context``
            with the options it plans or on a model that has them, no Qwen3.5 module with ``strict``;
            ``checkpointing`` not None or "auto", ``tokens_per_step`` missing with it or given
            without it, ``memory_budget`` negative, missing for a model on a CPU or given without
            it, ``checkpointing="auto"`` with the long-context options (given or on the model);
            ``base_precision`` not None, "bf16" or "fp8", or "fp8" for weights on a GPU without FP8
            GEMMs (compute capability below 8.9).
        NotImplementedError: ``long_context`` or ``checkpointing`` for a MoE model.
        RuntimeError: the model is sharded already (FSDP2).

    Warns:
        UserWarning: no Qwen3.5 module found (nothing is patched), or a ``long_context`` or
            ``checkpointing`` plan that does not fit.
    """
    check_module("model", model)
    flags = {"rms_norm": rms_norm, "gated_norm": gated_norm, "lora": lora, "in_proj": in_proj, "conv": conv,
             "swiglu": swiglu, "experts": experts, "varlen_attention": varlen_attention, "strict": strict}
    for name, value in flags.items():
        check_bool(name, value)
    flce = _flce_option(flce, fused_linear_cross_entropy)
    base_precision = fp8_base.base_precision_option(base_precision)
    tiled_mlp, tiled_gdn = tile_option("tiled_mlp", tiled_mlp), tile_option("tiled_gdn", tiled_gdn)
    offload_checkpoints = offload_option(model, offload_checkpoints)
    if long_context is not None:
        long_context = check_tile_tokens(long_context, "long_context", "the longest step's tokens")
        if tiled_mlp or tiled_gdn or offload_checkpoints:
            raise ValueError("long_context: it plans tiled_mlp, tiled_gdn and offload_checkpoints itself; pass either "
                             "long_context or those options, not both")
    step_tokens, memory_budget = checkpointing_options(checkpointing, tokens_per_step, memory_budget)
    refuse_with_long_context(model, checkpointing is not None,
                             {"tiled_mlp": tiled_mlp, "tiled_gdn": tiled_gdn,
                              "offload_checkpoints": offload_checkpoints, "long_context": long_context})
    refuse_sharded(model, "apply_to_qwen3_5")
    if base_precision == "fp8":  # before anything is patched
        fp8_base.check_devices(model)
    if not holds_qwen3_5(model):
        if strict:
            raise ValueError(_not_qwen3_5(model))
        warnings.warn(f"q35lab.apply_to_qwen3_5: {_not_qwen3_5(model)} (strict=True makes this an error)",
                      stacklevel=2)
        return PatchReport(qwen3_5=False)
    plan = None
    if long_context is not None:
        plan = plan_for_model(model, long_context)
        if not plan.fits:
            warnings.warn(f"q35lab: long_context={long_context}: {plan}", stacklevel=2)
        tiled_mlp, tiled_gdn, offload_checkpoints = plan.tiled_mlp, plan.tiled_gdn, plan.offload_layers
    checkpoint_plan = None
    if step_tokens is not None:
        checkpoint_plan = checkpoint_plan_for_model(model, step_tokens, memory_budget)
        if not checkpoint_plan.fits:
            warnings.warn(f"q35lab: checkpointing='auto': {checkpoint_plan}", stacklevel=2)
    options = Options(rms_norm=rms_norm, gated_norm=gated_norm, lora=lora, in_proj=in_proj, flce=flce, conv=conv,
                      swiglu=swiglu, experts=experts, varlen_attention=varlen_attention, tiled_mlp=tiled_mlp,
                      tiled_gdn=tiled_gdn, offload_checkpoints=offload_checkpoints, checkpointing=checkpoint_plan,
                      base_precision=base_precision)
    report = PatchReport()
    for flag in ("rms_norm", "gated_norm", "lora", "in_proj", "flce", "conv", "swiglu", "experts", "varlen_attention"):
        if not getattr(options, flag):
            report.not_applied[flag] = "disabled by the caller"
    for feature in FEATURES:
        if feature.wanted(options):
            feature.apply(model, report, options)
    _record_what_runs(model, report)
    if tiled_gdn:
        report_tiled_gdn(model, tiled_gdn, report)
    if plan is not None and plan.untiled_up_to:  # short steps need no tiles: they would pay launches for nothing
        tile_only_above(model, plan.untiled_up_to)
    if plan is not None:
        report.runs["long context"] = str(plan)
    return report


def _flce_option(flce, fused_linear_cross_entropy) -> bool:
    """The loss switch under either of its names (Liger's is the long one); True unless given."""
    if flce is not None and fused_linear_cross_entropy is not None:
        raise TypeError("flce, fused_linear_cross_entropy: expected one of the two (they are one switch), got both")
    if fused_linear_cross_entropy is not None:
        return check_bool("fused_linear_cross_entropy", fused_linear_cross_entropy)
    return True if flce is None else check_bool("flce", flce)


def revert(model: torch.nn.Module) -> PatchReport:
    """Undo ``apply_to_qwen3_5`` (or ``route_lora``): every patched module gets its original back,
    with the same parameters.

    Args:
        model (nn.Module): a patched model (an unpatched one is left as it is).

    Returns:
        PatchReport: what was restored (``reverted``), by class.

    Raises:
        TypeError: ``model`` not a module.
        RuntimeError: the model is sharded already (FSDP2): rebuild it instead.
    """
    check_module("model", model)
    refuse_sharded(model, "revert")
    report = PatchReport()
    for feature in reversed(FEATURES):
        feature.revert(model, report)
    return report
