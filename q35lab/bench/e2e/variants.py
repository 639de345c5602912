"""What a step trains: the PEFT model as is, patched by q35lab, or patched as a peer patches it
(Liger, axolotl) — the peers' patches kept here, apart from the library's own code."""

from __future__ import annotations

import functools
import sys

import torch

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
VARIANTS = {
    "peft": "PEFT with its defaults (fp32 adapters, input cast)",
    "peft+liger": "PEFT + apply_liger_kernel_to_qwen3_5 (_moe for the MoE): RMSNorm, SwiGLU, fused linear cross entropy",
    "peft+axolotl": "PEFT + axolotl 0.21's Qwen3.5 LoRA patches: LoRA kernels, gated norm (see _axolotl_patches)",
    "peft+liger+axolotl": "PEFT + axolotl 0.21's Qwen3.5 recipe with its Liger plugin: Liger's RMSNorm and fused linear "
                          "cross entropy, axolotl's LoRA kernels and gated norm; Liger's SwiGLU MLP is built but "
                          "axolotl's LoRA_MLP, bound later, replaces its forward (see _axolotl_patches)",
    "unsloth": "Unsloth's Qwen3.5 LoRA path: the same weights saved and loaded by FastLanguageModel (bf16), "
               "get_peft_model on every linear layer, its offloaded gradient checkpointing (see e2e/unsloth.py)",
    "q35lab": "PEFT + q35lab.apply_to_qwen3_5, every optimization",
    **{f"q35lab:{flag}": f"PEFT + q35lab, only {flag}" for flag in ALL_FLAGS},
    **{f"q35lab-{flag}": f"PEFT + q35lab, every optimization but {flag}" for flag in ALL_FLAGS},
    **LONG_CONTEXT,
}


def prepare(model, variant: str, tokens: int | None = None, batch: str | None = None):
    """Apply ``variant`` to a PEFT model in place; returns what the patch reported (or None).
    ``tokens``, the longest sequence the model will train on, sizes the checkpoint offload.
    ``batch`` (None, "packed" or "padded"), the kind of batch it will train on: axolotl installs its
    packing forward only for packed runs, and that forward turns the position_ids of a padded batch
    of several rows into one set of cu_seqlens, which FLA refuses (a row of 2026-12-06)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {sorted(VARIANTS)}, got {variant!r}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if variant in ("peft", "unsloth"):  # Unsloth's model comes patched from its own loader (cli._one_variant)
        return None
    if variant == "peft+liger":  # Liger has one entry point for the dense models, one for the MoE
        from liger_kernel import transformers as liger

        moe = "Moe" in type(base).__name__
        getattr(liger, "apply_liger_kernel_to_qwen3_5_moe" if moe else "apply_liger_kernel_to_qwen3_5")(model=base)
        return None
    if variant in ("peft+axolotl", "peft+liger+axolotl"):
        return _axolotl_patches(model, packing=False if batch == "padded" else None,
                                liger=variant == "peft+liger+axolotl")
    from ...patch import apply_to_qwen3_5

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


def report_text(report) -> str:
    """A patch report as a CSV row keeps it: one line, at most 4000 characters ("" for none); the
    long-context plan comes last, and 2000 characters cut it (2cd76b4's row)."""
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


def _axolotl_patches(model, packing: bool | None = None, liger: bool = False) -> str:
    """What axolotl 0.21 applies to a Qwen3.5 LoRA run, through its own functions, in its loader's
    order (``ModelLoader.load``: pre-model-load patches, plugins' ``pre_model_load``, the build,
    PEFT, post-load patches).

    ``adapter: lora`` auto-enables ``lora_mlp_kernel``, ``lora_qkv_kernel``, ``lora_o_kernel`` and
    ``lora_embedding_kernel`` (schemas' ``check_auto_enable_lora_kernels``); with that config:

    * ``patch_self_attn_lora`` (PatchManager, before the model is built) rewrites the source of
      ``Qwen3_5Attention.forward`` to call ``self.apply_qkv`` / ``self.apply_o``: **class-level**,
      so every Qwen3.5 model in the process needs the last step. It resolves the attention class
      from the checkpoint's config, so it is handed one of model_type ``qwen3_5``, as the hub's
      Qwen3.5 checkpoints are (a text-only ``qwen3_5_text`` config makes axolotl raise there).
    * ``patch_qwen3_5_modeling_packing`` (before the build too): **class-level** forwards of the
      decoder layer and the GatedDeltaNet, the only GatedDeltaNet forward that calls
      ``apply_in_proj_fused`` and ``apply_out_proj``. axolotl installs it only for
      ``sample_packing`` (or batch flattening), and it then needs flash-linear-attention: the model
      always passes position_ids, which it turns into cu_seqlens for FLA's varlen kernels, raising
      without them. ``packing=None`` means "a packed run when FLA is importable"; otherwise the
      GatedDeltaNet keeps transformers' forward, which calls its PEFT in_proj / out_proj as the
      unpatched model does.
    * the Liger plugin (``_axolotl_liger``): ``liger_rms_norm_gated: true`` — the gated norm,
      axolotl's FusedRMSNormGated — and, with ``liger``, the recipe's ``liger_rms_norm``,
      ``liger_glu_activation`` and ``liger_fused_linear_cross_entropy``.
    * ``apply_lora_kernel_patches`` (after PEFT), per instance: each MLP's forward becomes LoRA_MLP
      (one autograd node, axolotl's SwiGLU Triton kernel), the attention's ``apply_qkv`` LoRA_QKV
      and ``apply_o`` LoRA_O; each GatedDeltaNet gets ``apply_in_proj_fused`` (its four in_proj in
      one LoRA_FusedProj node) and ``apply_out_proj`` (LoRA_O). The embedding kernel finds no
      embedding adapter ("all-linear" targets none).

    Where Liger and axolotl meet (``liger``): the MLP. Liger's SwiGLU MLP class is what the build
    makes, but ``apply_lora_kernel_patches`` comes later and binds LoRA_MLP as each MLP's forward,
    so axolotl's wins: its SwiGLU kernel runs inside LoRA_MLP, Liger's never does (its class only
    holds the projections). Nothing else overlaps: the norms and the loss are Liger's alone (the
    LoRA kernels touch neither; lm_head has no adapter), the gated norm is axolotl's in both
    integrations (Liger has none for Qwen3.5), and ``fused_attn_kernel`` — q/k norm + RoPE in one
    kernel, which would take q_norm/k_norm from Liger — is an opt-in, not applied.

    The variants run on a GPU only: the gated norm refuses non-CUDA tensors and the SwiGLU kernel's
    launcher allocates its output on ``"cuda"`` (the CPU tests stand in for both).

    Nothing is undone: one process per variant.
    """
    import tempfile

    from transformers import Qwen3_5Config

    _bare_axolotl_callbacks()
    from axolotl.monkeypatch import lora_kernels
    from axolotl.monkeypatch.models.qwen3_5 import modeling
    from axolotl.utils.dict import DictDefault

    kernels = dict.fromkeys(("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel"), True)
    with tempfile.TemporaryDirectory() as checkpoint:
        Qwen3_5Config(text_config=model.config.get_text_config().to_dict()).save_pretrained(checkpoint)
        cfg = DictDefault(base_model=checkpoint, model_config_type="qwen3_5", adapter="lora", **kernels)
        lora_kernels.patch_self_attn_lora(cfg)
    if packing is None:
        packing = modeling.fla_chunk_gated_delta_rule is not None and modeling.fla_causal_conv1d is not None
    if packing:
        modeling.patch_qwen3_5_modeling_packing(torch_compile=False)
    rebuilt = _axolotl_liger(model, everything=liger)
    lora_kernels.apply_lora_kernel_patches(model, cfg)

    modules = list(model.modules())

    def bound(name, function):  # modules whose method ``name`` is axolotl's ``function``
        return sum(getattr(getattr(m, name, None), "__func__", None) is function for m in modules)

    mlp = bound("forward", lora_kernels.apply_lora_mlp_swiglu)
    qkv, o = bound("apply_qkv", lora_kernels.apply_lora_qkv), bound("apply_o", lora_kernels.apply_lora_o)
    gdn = [m for m in modules if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    fused, out = (sum(name in vars(m) for m in gdn) for name in ("apply_in_proj_fused", "apply_out_proj"))
    gdn_note = (f"in_proj fused on {fused} GatedDeltaNets, out_proj on {out} (packing forward)" if packing else
                f"GatedDeltaNet in_proj/out_proj left as PEFT on {len(gdn)} (axolotl calls its kernels only in its "
                "packing forward, which needs flash-linear-attention)")
    report = (f"axolotl: lora_mlp_kernel on {mlp} MLPs, qkv on {qkv} and o on {o} attentions, {gdn_note}, "
              f"gated norm {rebuilt['Qwen3_5RMSNormGated']}")
    if not liger:
        return report
    from axolotl.integrations.liger.models.qwen3_5 import lce_forward

    loss = ("Liger's fused linear cross entropy" if type(model.get_base_model()).forward is lce_forward else
            "transformers' loss (the FLCE forward is Qwen3_5ForCausalLM's only)")
    return (f"Liger: RMSNorm on {rebuilt['Qwen3_5RMSNorm']}, SwiGLU MLP class on {rebuilt['Qwen3_5MLP']} "
            f"(its forward replaced by LoRA_MLP on {mlp}), {loss}; {report}")


#: transformers' Qwen3.5 classes that axolotl's Liger integration replaces before the model is
#: built, and how the build makes one: its arguments, read off the module it holds.
_BUILT_AS = {
    "Qwen3_5RMSNorm": lambda cls, built: cls(built.weight.shape[0], eps=built.eps),
    "Qwen3_5RMSNormGated": lambda cls, built: cls(built.weight.shape[0], eps=built.variance_epsilon),
    "Qwen3_5MLP": lambda cls, built: cls(built.config, built.intermediate_size),
}


def _axolotl_liger(model, everything: bool) -> dict[str, int]:
    """axolotl's Liger plugin for Qwen3.5 (``LigerPlugin.pre_model_load``): not Liger's
    ``apply_liger_kernel_to_qwen3_5`` but axolotl's own (``integrations.liger.models.qwen3_5``),
    which adds the gated norm. It replaces classes of transformers' modeling module before the
    build — Qwen3_5RMSNorm by a LigerRMSNorm (offset 1, Gemma casting, not in place),
    Qwen3_5RMSNormGated by axolotl's FusedRMSNormGated, Qwen3_5MLP by Liger's SwiGLU MLP — and
    Qwen3_5ForCausalLM.forward by its FLCE forward (a class attribute: built models get it too).
    ``everything``: the recipe's four flags; else ``liger_rms_norm_gated`` alone.

    The model here is built already, so each module of a replaced class is rebuilt as the build
    would have made it, holding the built module's weights and submodules (PEFT's linear layers).
    Returns how many modules of each class were rebuilt."""
    from axolotl.integrations.liger.models.qwen3_5 import apply_liger_kernel_to_qwen3_5
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    built = {name: getattr(hf, name) for name in _BUILT_AS}
    apply_liger_kernel_to_qwen3_5(rms_norm=everything, glu_activation=everything,
                                  fused_linear_cross_entropy=everything, rms_norm_gated=True)
    counts = dict.fromkeys(_BUILT_AS, 0)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            name = type(child).__name__
            if name in built and type(child) is built[name] and getattr(hf, name) is not built[name]:
                make = functools.partial(_BUILT_AS[name], getattr(hf, name), child)
                setattr(parent, child_name, _as_built_by(child, make))
                counts[name] += 1
    return counts


def _as_built_by(built, make):
    """The module ``make()`` returns, in place of ``built``, holding built's parameters and
    submodules: it is made on the meta device, so that it allocates nothing of its own."""
    with torch.device("meta"):
        module = make()
    for name, _ in list(module.named_children()):
        setattr(module, name, getattr(built, name))
    for name, _ in list(module.named_parameters(recurse=False)):
        setattr(module, name, getattr(built, name))
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        raise RuntimeError(f"{type(module).__name__} holds a tensor that the {type(built).__name__} it replaces has not")
    return module.train(built.training)


def _bare_axolotl_callbacks() -> None:
    """axolotl's LoRA patches import one helper from ``axolotl.utils.callbacks.models``, whose
    package imports the training stack (evaluate, wandb, trl, datasets); without it the package
    is registered bare, so that only ``models.py`` loads."""
    import importlib.util
    import os
    import types

    try:
        import axolotl.utils.callbacks  # noqa: F401
    except ImportError:
        bare = types.ModuleType("axolotl.utils.callbacks")
        utils = importlib.util.find_spec("axolotl.utils").submodule_search_locations[0]
        bare.__path__ = [os.path.join(utils, "callbacks")]
        sys.modules["axolotl.utils.callbacks"] = bare
