"""axolotl 0.21's Qwen3.5 LoRA recipe, rebuilt through axolotl's own functions: the
``peft+axolotl`` and ``peft+liger+axolotl`` variants of ``python -m q35lab.e2e``.

A peer's training recipe, not part of q35lab: the e2e harness loads this file from a checkout
(``q35lab.bench.e2e.peers``). Nothing of axolotl is imported until ``patch`` runs.
"""

from __future__ import annotations

import functools
import sys

import torch


def patch(model, packing: bool | None = None, liger: bool = False) -> str:
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
    * the Liger plugin (``_liger_plugin``): ``liger_rms_norm_gated: true`` — the gated norm,
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
    rebuilt = _liger_plugin(model, everything=liger)
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


def _liger_plugin(model, everything: bool) -> dict[str, int]:
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
        raise RuntimeError(f"{type(module).__name__} holds a tensor that the {type(built).__name__} it replaces "
                           "has not")
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
