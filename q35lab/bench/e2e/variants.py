"""What a step trains: the PEFT model as is, patched by q35lab, or patched as a peer patches it
(Liger, axolotl) — the peers' patches kept here, apart from the library's own code."""

from __future__ import annotations

import sys

#: What each variant does to the PEFT model: q35lab flags, or a peer's patch.
ALL_FLAGS = ("rms_norm", "gated_norm", "lora", "in_proj", "flce")
VARIANTS = {
    "peft": "PEFT with its defaults (fp32 adapters, input cast)",
    "peft+liger": "PEFT + apply_liger_kernel_to_qwen3_5 (RMSNorm, SwiGLU, fused linear cross entropy)",
    "peft+axolotl": "PEFT + axolotl 0.21's Qwen3.5 LoRA patches: LoRA kernels, gated norm (see _axolotl_patches)",
    "q35lab": "PEFT + q35lab.apply_to_qwen3_5, every optimization",
    **{f"q35lab:{flag}": f"PEFT + q35lab, only {flag}" for flag in ALL_FLAGS},
}


def prepare(model, variant: str):
    """Apply ``variant`` to a PEFT model in place; returns what the patch reported (or None)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {sorted(VARIANTS)}, got {variant!r}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if variant == "peft":
        return None
    if variant == "peft+liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5

        apply_liger_kernel_to_qwen3_5(model=base)
        return None
    if variant == "peft+axolotl":
        return _axolotl_patches(model)
    from ...patch import apply_to_qwen3_5

    flags = dict.fromkeys(ALL_FLAGS, True) if variant == "q35lab" else {f: f == variant.split(":")[1] for f in ALL_FLAGS}
    return apply_to_qwen3_5(model, **flags)


def _axolotl_patches(model, packing: bool | None = None) -> str:
    """What axolotl 0.21 applies to a Qwen3.5 LoRA run, through its own functions, as its loader does.

    ``adapter: lora`` auto-enables ``lora_mlp_kernel``, ``lora_qkv_kernel``, ``lora_o_kernel`` and
    ``lora_embedding_kernel`` (schemas' ``check_auto_enable_lora_kernels``); with that config:

    * ``patch_self_attn_lora`` (PatchManager, before the model is built) rewrites the source of
      ``Qwen3_5Attention.forward`` to call ``self.apply_qkv`` / ``self.apply_o``: **class-level**,
      so every Qwen3.5 model in the process needs the next step. It resolves the attention class
      from the checkpoint's config, so it is handed one of model_type ``qwen3_5``, as the hub's
      Qwen3.5 checkpoints are (a text-only ``qwen3_5_text`` config makes axolotl raise there).
    * ``apply_lora_kernel_patches`` (after PEFT), per instance: each MLP's forward becomes LoRA_MLP
      (one autograd node, its SwiGLU Triton kernel), the attention's ``apply_qkv`` LoRA_QKV and
      ``apply_o`` LoRA_O; each GatedDeltaNet gets ``apply_in_proj_fused`` (its four in_proj in
      one LoRA_FusedProj node) and ``apply_out_proj`` (LoRA_O). The embedding kernel finds no
      embedding adapter ("all-linear" targets none).
    * ``patch_qwen3_5_modeling_packing``: **class-level** forwards of the decoder layer and the
      GatedDeltaNet, the only GatedDeltaNet forward that calls ``apply_in_proj_fused`` and
      ``apply_out_proj``. axolotl installs it only for ``sample_packing`` (or batch flattening),
      and it then needs flash-linear-attention: the model always passes position_ids, which it
      turns into cu_seqlens for FLA's varlen kernels, raising without them. ``packing=None``
      means "a packed run when FLA is importable"; otherwise the GatedDeltaNet keeps
      transformers' forward, which calls its PEFT in_proj / out_proj as the unpatched model does.
    * the gated norm: axolotl's FusedRMSNormGated, which its Liger integration
      (``liger_rms_norm_gated: true``) sets as ``Qwen3_5RMSNormGated`` before the model is built
      (``apply_liger_kernel_to_qwen3_5``, class-level); the model is built here, so each
      GatedDeltaNet's norm is replaced by the module that build would make, weight shared.

    The variant runs on a GPU only: the gated norm refuses non-CUDA tensors and the SwiGLU kernel's
    launcher allocates its output on ``"cuda"`` (the CPU test stands in for both). Not applied:
    ``fused_attn_kernel`` (q/k norm + RoPE in one kernel for the full attention), an opt-in.

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
    lora_kernels.apply_lora_kernel_patches(model, cfg)
    if packing is None:
        packing = modeling.fla_chunk_gated_delta_rule is not None and modeling.fla_causal_conv1d is not None
    if packing:
        modeling.patch_qwen3_5_modeling_packing(torch_compile=False)

    modules = list(model.modules())

    def bound(name, function):  # modules whose method ``name`` is axolotl's ``function``
        return sum(getattr(getattr(m, name, None), "__func__", None) is function for m in modules)

    mlp = bound("forward", lora_kernels.apply_lora_mlp_swiglu)
    qkv, o = bound("apply_qkv", lora_kernels.apply_lora_qkv), bound("apply_o", lora_kernels.apply_lora_o)
    gdn = [m for m in modules if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    fused, out = (sum(name in vars(m) for m in gdn) for name in ("apply_in_proj_fused", "apply_out_proj"))
    norms = _axolotl_gated_norm(model)
    gdn_note = (f"in_proj fused on {fused} GatedDeltaNets, out_proj on {out} (packing forward)" if packing else
                f"GatedDeltaNet in_proj/out_proj left as PEFT on {len(gdn)} (axolotl calls its kernels only in its "
                "packing forward, which needs flash-linear-attention)")
    return (f"axolotl: lora_mlp_kernel on {mlp} MLPs, qkv on {qkv} and o on {o} attentions, {gdn_note}, "
            f"gated norm {norms}")


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


def _axolotl_gated_norm(model) -> int:
    """axolotl's FusedRMSNormGated in place of every GatedDeltaNet's norm (weights shared); how many."""
    from axolotl.kernels.rms_norm_gated import FusedRMSNormGated

    count = 0
    for module in model.modules():
        norm = getattr(module, "norm", None)
        if type(norm).__name__ == "Qwen3_5RMSNormGated":
            fused = FusedRMSNormGated(norm.weight.shape[0], eps=norm.variance_epsilon).to(norm.weight.device)
            fused.weight = norm.weight
            module.norm = fused
            count += 1
    return count
