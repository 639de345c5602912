"""What a step trains: the PEFT model as is, patched by q35lab, by Liger's public entry point, or
as a peer's training recipe patches it (axolotl's loader, Unsloth's: ``peers``, loaded from the
checkout's ``benchmarks/peers/``, never from the wheel)."""

from __future__ import annotations

from . import peers

#: What each variant does to the PEFT model: q35lab flags, or a peer's patch.
ALL_FLAGS = ("rms_norm", "gated_norm", "lora", "in_proj", "flce", "conv", "swiglu", "experts", "varlen_attention")
#: Long-context options on top of every optimization (``q35lab.long_context``): the MLP (and, in
#: q35lab+long, the GatedDeltaNet) in tiles of this many tokens, and the decoder layers'
#: checkpoint inputs offloaded to host memory.
TILE_TOKENS = 8192
#: q35lab+long_context plans its options for steps of this many tokens (or the step's, if longer):
#: at 32k it measures what the switch a half-million-token user turns on costs a shorter step.
PLAN_TOKENS = 512 * 1024
LONG_CONTEXT = {
    "q35lab+tiled": "q35lab with the sequence-tiled MLP (tiles of 8192 tokens)",
    "q35lab+tiled_gdn": "q35lab with the GatedDeltaNet decoder layers tiled along the sequence (tiles of 8192 tokens)",
    "q35lab+offload": "q35lab with decoder-layer checkpoints offloaded to host memory (as many layers as it holds)",
    "q35lab+long": "q35lab with all three: the tiled MLP, the tiled GatedDeltaNet (tiles of 8192 tokens) and the "
                   "checkpoint offload of the fewest layers the memory model says the step needs",
    "q35lab+long_context": "q35lab with apply_to_qwen3_5(long_context=N): the options planned for N = 524,288 tokens "
                           "(or the step's, if longer) on this GPU and host",
}
#: How many decoder layers are gradient-checkpointed: the plan of apply_to_qwen3_5(checkpointing="auto") for the
#: longest step asked, or none (every layer's forward once a step: what no checkpointing costs, and saves).
CHECKPOINTING = {
    "q35lab+ckpt_auto": "q35lab with apply_to_qwen3_5(checkpointing='auto'): only the decoder layers the memory model "
                        "says the longest step needs stay checkpointed (its GPU's memory less 10%)",
    "q35lab+no_ckpt": "q35lab without gradient checkpointing",
    "peft+no_ckpt": "PEFT with its defaults, without gradient checkpointing",
    "peft+liger+no_ckpt": "PEFT + Liger (as peft+liger), without gradient checkpointing",
}
VARIANTS = {
    "peft": "PEFT with its defaults (fp32 adapters, input cast)",
    "peft+liger": "PEFT + apply_liger_kernel_to_qwen3_5 (_moe for the MoE): RMSNorm, SwiGLU, "
                  "fused linear cross entropy",
    "peft+axolotl": "PEFT + axolotl 0.21's Qwen3.5 LoRA patches: LoRA kernels, gated norm "
                    "(benchmarks/peers/axolotl.py)",
    "peft+liger+axolotl": "PEFT + axolotl 0.21's Qwen3.5 recipe with its Liger plugin: Liger's RMSNorm and "
                          "fused linear cross entropy, axolotl's LoRA kernels and gated norm; Liger's SwiGLU MLP is "
                          "built but axolotl's LoRA_MLP, bound later, replaces its forward "
                          "(benchmarks/peers/axolotl.py)",
    "unsloth": "Unsloth's Qwen3.5 LoRA path: the same weights saved and loaded by FastLanguageModel (bf16), "
               "get_peft_model on every linear layer, its offloaded gradient checkpointing "
               "(benchmarks/peers/unsloth.py)",
    "q35lab": "PEFT + q35lab.apply_to_qwen3_5, every optimization",
    "q35lab+fp8": "q35lab with apply_to_qwen3_5(base_precision='fp8'): the decoder's frozen base projections in FP8 "
                  "e4m3, their GEMMs on FP8",
    **{f"q35lab:{flag}": f"PEFT + q35lab, only {flag}" for flag in ALL_FLAGS},
    **{f"q35lab-{flag}": f"PEFT + q35lab, every optimization but {flag}" for flag in ALL_FLAGS},
    **LONG_CONTEXT,
    **CHECKPOINTING,
}
#: The variants that also train LoRA on a MoE's routed experts (PEFT's ``target_parameters`` on the
#: fused ``gate_up_proj``/``down_proj``, ``model.EXPERT_PARAMETERS``): "<variant>+expert_lora".
EXPERT_LORA = "+expert_lora"
VARIANTS.update({f"{name}{EXPERT_LORA}": f"{VARIANTS[name]}; LoRA on the routed experts' gate_up_proj and down_proj too"
                 for name in ("peft", "peft+liger", "q35lab")})


def expert_lora(variant: str) -> bool:
    """Whether ``variant``'s model trains LoRA on the routed experts as well."""
    return variant.endswith(EXPERT_LORA)


def prepare(model, variant: str, tokens: int | None = None, batch: str | None = None):
    """Apply ``variant`` to a PEFT model in place; returns what the patch reported (or None).
    ``tokens``, the longest sequence the model will train on, sizes the checkpoint offload.
    ``tokens`` also plans q35lab+ckpt_auto's checkpointing (a model on a CPU is planned against an H200's
    memory, ``H200_USABLE_BYTES``, less the same margin).
    ``batch`` (None, "packed" or "padded"), the kind of batch it will train on: axolotl installs its
    packing forward only for packed runs, and that forward turns the position_ids of a padded batch
    of several rows into one set of cu_seqlens, which FLA refuses.

    A peer's recipe (``peers.RECIPES``) is loaded from the checkout's ``benchmarks/peers/``; without
    a checkout it raises ``peers.RecipeNotFound``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {sorted(VARIANTS)}, got {variant!r}")
    variant = variant.removesuffix(EXPERT_LORA)  # the model carries the experts' LoRA (build(expert_lora=True))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if variant.endswith("+no_ckpt"):  # the model comes with checkpointing on (model.build)
        from ...hf import versions

        versions.disable_checkpointing(model)
        variant = variant.removesuffix("+no_ckpt")
    if variant in ("peft", "unsloth"):  # Unsloth's model comes patched from its own loader (cli._built)
        return None
    if variant == "peft+liger":  # Liger has one entry point for the dense models, one for the MoE
        from liger_kernel import transformers as liger

        moe = "Moe" in type(base).__name__
        getattr(liger, "apply_liger_kernel_to_qwen3_5_moe" if moe else "apply_liger_kernel_to_qwen3_5")(model=base)
        return None
    if variant in ("peft+axolotl", "peft+liger+axolotl"):
        return peers.recipe("axolotl").patch(model, packing=False if batch == "padded" else None,
                                             liger=variant == "peft+liger+axolotl")
    from ...patch import apply_to_qwen3_5

    if variant == "q35lab+ckpt_auto":
        return apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=tokens,
                                memory_budget=_cpu_checkpoint_budget(model))
    if variant == "q35lab+fp8":
        return apply_to_qwen3_5(model, base_precision="fp8")
    if variant == "q35lab+long_context":
        return apply_to_qwen3_5(model, long_context=max(tokens or 0, PLAN_TOKENS))
    if variant in LONG_CONTEXT:
        options = {}
        if variant in ("q35lab+tiled", "q35lab+long"):
            options["tiled_mlp"] = TILE_TOKENS
        if variant in ("q35lab+tiled_gdn", "q35lab+long"):
            options["tiled_gdn"] = TILE_TOKENS
        if variant == "q35lab+offload":  # the mechanism's cost: every layer the host holds
            options["offload_checkpoints"] = offloadable_layers(model, tokens)
        elif variant == "q35lab+long":  # as a long-context user runs it: what the step needs
            options["offload_checkpoints"] = planned_offload_layers(model, tokens, tiled_mlp_tokens=TILE_TOKENS,
                                                                    tiled_gdn_tokens=TILE_TOKENS)
        return apply_to_qwen3_5(model, **options)
    return apply_to_qwen3_5(model, **_flags(variant))


def _cpu_checkpoint_budget(model) -> float | None:
    """None on a GPU (the plan reads its memory); off one, an H200's usable memory less the plan's margin, so that
    the variant runs its plan at the harness's tiny size on a CPU."""
    from ...long_context import CHECKPOINT_MARGIN, H200_USABLE_BYTES

    if next(model.parameters()).device.type == "cuda":
        return None
    return (1 - CHECKPOINT_MARGIN) * H200_USABLE_BYTES


def report_text(report) -> str:
    """A patch report as a CSV row keeps it: one line, at most 4000 characters ("" for none); the
    long-context plan comes last, and 2000 characters cut it off."""
    return " ".join(str(report).split())[:4000] if report else ""


def _flags(variant: str) -> dict:
    """apply_to_qwen3_5's flags for "q35lab" (all), "q35lab:<flag>" (that one only) and
    "q35lab-<flag>" (all but that one)."""
    if variant.startswith("q35lab:"):
        return {f: f == variant.split(":", 1)[1] for f in ALL_FLAGS}
    if variant.startswith("q35lab-"):
        return {f: f != variant.split("-", 1)[1] for f in ALL_FLAGS}
    return dict.fromkeys(ALL_FLAGS, True)


def planned_offload_layers(model, tokens: int | None, **tiles) -> int:
    """The fewest decoder layers to offload that the memory model says a step of ``tokens`` needs
    on the model's GPU (``long_context.plan_offload_layers`` with the tiles' settings, the memory
    ``usable_gpu_bytes`` counts — an H200's for a model on the CPU — and this host's memory): none
    at lengths that fit without. Where it predicts no fit, every layer the host holds
    (``offloadable_layers``), so that the attempt still runs and says how far it got."""
    from ...long_context import plan_offload_layers, usable_gpu_bytes

    if tokens is None:
        return offloadable_layers(model, tokens)
    device = next(model.parameters()).device
    layers, fits = plan_offload_layers(model.config.get_text_config(), tokens, gpu_bytes=usable_gpu_bytes(device),
                                       **tiles)
    return layers if fits else offloadable_layers(model, tokens)


def offloadable_layers(model, tokens: int | None, reserve_bytes: float | None = None) -> int:
    """How many decoder layers' checkpoint inputs (``tokens`` · hidden · 2 bytes each) the host
    memory holds, less ``reserve_bytes`` (default ``default_host_reserve()``, what the offload
    itself keeps free) for the process and the data: every layer where it can."""
    from ...long_context import default_host_reserve, host_memory_available

    reserve_bytes = default_host_reserve() if reserve_bytes is None else reserve_bytes
    config = model.config.get_text_config()
    layers = config.num_hidden_layers
    host = host_memory_available()
    if tokens is None or host is None:
        return layers
    per_layer = tokens * config.hidden_size * 2
    return max(1, min(layers, int((host - reserve_bytes) // per_layer)))
