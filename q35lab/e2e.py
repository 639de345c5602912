"""One training step of a Qwen3.5 + PEFT model, patched or not: the end-to-end measurement.

A model is built from a config (no download), wrapped by PEFT with LoRA on every linear layer,
optionally patched (by q35lab, by Liger, or as axolotl patches it), and trained with
gradient checkpointing under bf16 autocast, as a fine-tuning run would. For each step we record

* the step's wall time (forward, backward and optimizer step, between CUDA events);
* the share of it spent in the delta-rule core and the causal convolution — code that is not
  ours and that no variant changes — timed by ``RegionTimer`` around those functions, forward
  (including checkpointing's recompute) and backward; the rest is the step "outside the core";
* the peak memory allocated, and the loss (equal across variants at the same seed);
* with ``--memory-at-peak``, one more step with the allocator's history recorded: what is alive at
  that step's highest point, by the code that allocated it (``peak_breakdown``).

Patching libraries replace classes module-wide (Liger does), so the CLI runs every variant in a
fresh process::

    python -m q35lab.e2e --variants peft peft+liger q35lab --T 8192 32768 --out data/bench/<gpu>/end_to_end.csv
    python -m q35lab.e2e --what layer --layers 1 --variants peft q35lab --T 8192 32768 \
        --out data/bench/<gpu>/gdn_layer.csv        # one GatedDeltaNet, its in_proj share
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

#: What each variant does to the PEFT model: q35lab flags, or a peer's patch.
ALL_FLAGS = ("rms_norm", "gated_norm", "lora", "in_proj", "flce")
VARIANTS = {
    "peft": "PEFT with its defaults (fp32 adapters, input cast)",
    "peft+liger": "PEFT + apply_liger_kernel_to_qwen3_5 (RMSNorm, SwiGLU, fused linear cross entropy)",
    "peft+axolotl": "PEFT + axolotl 0.21's Qwen3.5 LoRA patches: LoRA kernels, gated norm (see _axolotl_patches)",
    "q35lab": "PEFT + q35lab.apply_to_qwen3_5, every optimization",
    **{f"q35lab:{flag}": f"PEFT + q35lab, only {flag}" for flag in ALL_FLAGS},
}

#: Names under which transformers' Qwen3.5 holds the delta-rule core and the causal convolution:
#: module functions (transformers ≥ 5.20) or GatedDeltaNet attributes (earlier versions).
CORE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule", "causal_conv1d_fn")


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
#: Qwen3.5 sizes, as torchtitan's ``models/qwen3_5/flavors.py`` and the checkpoints' configs give
#: them (every fourth layer full attention, attention head dim 256, GatedDeltaNet head dim 128,
#: vocabulary 248,320). "9b" is transformers' default ``Qwen3_5TextConfig``.
SIZES = {
    "9b": dict(layers=32),
    "27b": dict(layers=64, hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                linear_num_key_heads=16, linear_num_value_heads=48),
    "35b-a3b": dict(layers=40, moe=True, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
                    linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512),
}


def config(size: str = "h200", layers: int | None = None):
    """A Qwen3.5 text config. ``"9b"``, ``"27b"``, ``"35b-a3b"``: the real dimensions (``SIZES``),
    all their layers unless ``layers`` says fewer; ``"h200"``: transformers' default dimensions
    (the 9B's) with ``layers`` decoder layers (4 by default); ``"tiny"``: a CPU-sized model with
    the same structure."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    if size in SIZES:
        dims = dict(SIZES[size])
        layers = layers or dims.pop("layers")
        dims.pop("layers", None)
        moe = dims.pop("moe", False)
    elif size in ("h200", "tiny"):
        layers, dims, moe = layers or 4, {}, False
    else:
        raise ValueError(f"size: expected one of {sorted(SIZES) + ['h200', 'tiny']}, got {size!r}")
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if size == "tiny":
        dims = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16)
    config_class = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    return config_class(num_hidden_layers=layers, layer_types=layer_types, **dims)


def build(size: str = "h200", layers: int | None = None, rank: int = 16, device=None, dtype=torch.bfloat16, seed: int = 0,
          checkpointing: bool = True, modules_to_save: list[str] | None = None):
    """``AutoModelForCausalLM.from_config`` (random weights, seeded), LoRA r=``rank`` on every
    linear layer (PEFT's defaults otherwise: fp32 adapters), gradient checkpointing.
    ``modules_to_save`` (e.g. ``["embed_tokens", "lm_head"]``) trains those whole, as for new tokens."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device or "cpu"):  # initialised where it will run: 3 B parameters init slowly on a CPU
        model = AutoModelForCausalLM.from_config(config(size, layers), dtype=dtype)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                       modules_to_save=modules_to_save))
    with torch.no_grad():  # LoRA starts with B = 0; a non-zero B makes the adapters' path count
        generator = torch.Generator(device="cpu").manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.01)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


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
    import q35lab

    flags = dict.fromkeys(ALL_FLAGS, True) if variant == "q35lab" else {f: f == variant.split(":")[1] for f in ALL_FLAGS}
    return q35lab.apply_to_qwen3_5(model, **flags)


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


# ----------------------------------------------------------------------------------------------
# Timing the delta-rule core
# ----------------------------------------------------------------------------------------------
class _Stamp:
    """A point in the GPU's stream (a CUDA event), or in host time on a CPU."""

    def __init__(self, device_type: str):
        self.event = torch.cuda.Event(enable_timing=True) if device_type == "cuda" else None
        if self.event is not None:
            self.event.record()
        else:
            self.time = time.perf_counter()

    def ms_until(self, end: "_Stamp") -> float:
        if self.event is None:
            return 1e3 * (end.time - self.time)
        end.event.synchronize()  # an event still queued behind the step's kernels has no time yet
        return self.event.elapsed_time(end.event)


class RegionTimer:
    """Device time spent in some regions of a step — calls of given functions or modules —
    forward and backward, as the union of their intervals.

    Forward: a stamp before and after each call (a checkpointed layer's recompute is a call too).
    Backward: from the moment the gradient of a call's output arrives (a hook on the output) to
    the moment the gradients of all its differentiable inputs are done (hooks on the inputs) —
    autograd runs that region's nodes in between. Intervals may overlap (four projections of one
    input finish their backward together), so ``total_ms()`` measures their union on the
    stream's clock, from the ``start()`` of the step.
    """

    def __init__(self):
        self.intervals: list[tuple[_Stamp, _Stamp]] = []
        self.origin: _Stamp | None = None

    def start(self, device_type: str) -> None:
        self.intervals.clear()
        self.origin = _Stamp(device_type)

    def total_ms(self) -> float:
        if not self.intervals:
            return 0.0
        spans = sorted((self.origin.ms_until(a), self.origin.ms_until(b)) for a, b in self.intervals)
        total, (lo, hi) = 0.0, spans[0]
        for a, b in spans[1:]:
            if a > hi:
                total, lo = total + (hi - lo), a
            hi = max(hi, b)
        return total + (hi - lo)

    # -- what a region is -------------------------------------------------------------------
    def _forward_done(self, start, inputs, out, device_type) -> None:
        self.intervals.append((start, _Stamp(device_type)))
        if not torch.is_grad_enabled():
            return
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(o, torch.Tensor) and o.requires_grad]
        inputs = [t for t in inputs if t.requires_grad]
        if not inputs or not outputs:
            return
        state = {"start": None, "pending": len(inputs)}

        def output_grad_arrives(grad):
            if state["start"] is None:
                state["start"] = _Stamp(device_type)

        def input_grad_done(grad):
            state["pending"] -= 1
            if state["pending"] == 0 and state["start"] is not None:
                self.intervals.append((state["start"], _Stamp(device_type)))

        for o in outputs:
            o.register_hook(output_grad_arrives)
        for t in inputs:
            t.register_hook(input_grad_done)

    def wrap(self, fn):
        """``fn`` timed as a region (for functions the model looks up by name)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            device_type = tensors[0].device.type if tensors else "cpu"
            start = _Stamp(device_type)
            out = fn(*args, **kwargs)
            self._forward_done(start, tensors, out, device_type)
            return out

        return timed

    @contextlib.contextmanager
    def functions(self, model, names=CORE_FUNCTIONS):
        """Wrap ``names`` where this transformers version keeps them (the Qwen3.5 modeling module,
        or attributes of each GatedDeltaNet); yields how many were wrapped; undone on exit."""
        from transformers.models.qwen3_5 import modeling_qwen3_5

        targets = [(modeling_qwen3_5, name) for name in names]
        targets += [(m, name) for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")
                    for name in names if name in vars(m)]
        undo = []
        for owner, name in targets:
            fn = getattr(owner, name, None)
            if callable(fn):
                setattr(owner, name, self.wrap(fn))
                undo.append((owner, name, fn))
        # versions that keep causal_conv1d_fn = None on the layer run its nn.Conv1d instead
        convs = [m.conv1d for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")
                 and "causal_conv1d_fn" in vars(m) and vars(m)["causal_conv1d_fn"] is None and hasattr(m, "conv1d")]
        try:
            with self.modules(convs):
                yield len(undo) + len(convs)
        finally:
            for owner, name, fn in undo:
                setattr(owner, name, fn)

    @contextlib.contextmanager
    def modules(self, modules):
        """Time every call of each module in ``modules`` (forward hooks); removed on exit."""
        handles, pending = [], {}

        def before(module, args, kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            pending[id(module)] = (_Stamp(tensors[0].device.type if tensors else "cpu"), tensors)

        def after(module, args, kwargs, out):
            start, tensors = pending.pop(id(module))
            self._forward_done(start, tensors, out, tensors[0].device.type if tensors else "cpu")

        for m in modules:
            handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(m.register_forward_hook(after, with_kwargs=True))
        try:
            yield len(modules)
        finally:
            for h in handles:
                h.remove()


# ----------------------------------------------------------------------------------------------
# A training step and its measurement
# ----------------------------------------------------------------------------------------------
def toy_corpus(n_sequences: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[n_sequences, length]`` token ids a tiny model learns in a few hundred CPU steps.

    Each sequence is an arithmetic progression modulo the vocabulary, ``x_{t+1} = (x_t + k) mod V``,
    with a random start and a step ``k`` from {1, 2, 3, 5, 7}: the first token is a guess (ln V),
    the second one of five, the rest follow. A model that learns the rule brings the mean loss
    from ln V to about (ln V + ln 5) / length.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    start = torch.randint(0, vocab, (n_sequences, 1), generator=generator)
    steps = torch.tensor([1, 2, 3, 5, 7])[torch.randint(0, 5, (n_sequences, 1), generator=generator)]
    return (start + steps * torch.arange(length)) % vocab


def tokens(T: int, vocab: int, device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (1, T), generator=generator).to(device)


def train_step(model, optimizer, input_ids: torch.Tensor) -> float:
    """Forward with labels under bf16 autocast, backward, optimizer step; returns the loss."""
    with torch.autocast(device_type=input_ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().float().item()


def _training_setup(model, lr: float):
    """The model's device, its vocabulary size (for random tokens) and a fresh AdamW over its
    trainable parameters: what every measured step starts from."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    return next(model.parameters()).device, model.get_input_embeddings().weight.shape[0], optimizer


def measure(model, T: int, steps: int = 3, warmup: int = 1, lr: float = 1e-4, compile: bool = False) -> dict:
    """Median step time and core time over ``steps`` steps after ``warmup``; peak memory; losses.
    ``compile``: the steps run ``torch.compile(model)`` (its compilation falls in the warm-up)."""
    device, vocab, optimizer = _training_setup(model, lr)
    step_model = torch.compile(model) if compile else model
    timer = RegionTimer()
    losses, step_ms, core_ms = [], [], []
    on_gpu = device.type == "cuda"
    with timer.functions(model) as n_wrapped:
        for i in range(warmup + steps):
            ids = tokens(T, vocab, device, seed=i)
            if on_gpu:
                torch.cuda.synchronize()
                if i == warmup:
                    torch.cuda.reset_peak_memory_stats()
            timer.start(device.type)
            start = _Stamp(device.type)
            losses.append(train_step(step_model, optimizer, ids))
            end = _Stamp(device.type)
            if i >= warmup:
                step_ms.append(start.ms_until(end))
                core_ms.append(timer.total_ms())
    step, core = statistics.median(step_ms), statistics.median(core_ms)
    return {
        "step_ms": step, "core_ms": core, "outside_core_ms": step - core,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else math.nan,
        "loss_first": losses[0], "losses": json.dumps([round(v, 5) for v in losses]), "core_functions": n_wrapped,
    }


#: Where an allocation comes from: the innermost Python frame in one of these places (not this
#: file, whose wrappers sit around everything).
PEAK_SOURCES = (("/q35lab/ops/", "q35lab"), ("/q35lab/patch.py", "q35lab"), ("liger_kernel", "liger"),
                ("/axolotl/", "axolotl"), ("/peft/", "peft"), ("/transformers/", "transformers"),
                ("torch/utils/checkpoint", "checkpoint"), ("torch/optim", "optimizer"))


def allocation_source(frames: list[dict]) -> str:
    """``package:function`` of the innermost frame from ``PEAK_SOURCES`` (frames innermost first)."""
    for frame in frames:
        path = frame["filename"].replace("\\", "/")
        for marker, package in PEAK_SOURCES:
            if marker in path:
                return f"{package}:{frame['name']}"
    return "other Python" if frames else "no Python frame (autograd's own backward ops)"


def peak_breakdown(events: list[dict], top: int = 12) -> tuple[int, list[tuple[str, int]]]:
    """Bytes alive at the highest point of a CUDA allocator trace, by ``allocation_source``.

    ``events``: one device's ``torch.cuda.memory._snapshot()["device_traces"]``; ``alloc`` adds a
    block, ``free_completed`` removes it. Blocks allocated before the recording began (weights,
    optimizer state) are not in it: the peak is the step's own, above what it started with.
    Returns (peak bytes, [(source, bytes)] largest first)."""
    total = peak = 0
    peak_index = -1
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            total += event["size"]
        elif event["action"] == "free_completed":
            total -= event["size"]
        if total > peak:
            peak, peak_index = total, i
    live = {}
    for event in events[:peak_index + 1]:  # replay up to the peak: the blocks alive there
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    by_source = collections.Counter()
    for event in live.values():
        by_source[allocation_source(event.get("frames", []))] += event["size"]
    return peak, by_source.most_common(top)


def memory_at_peak(model, T: int, lr: float = 1e-4) -> dict:
    """One more training step at ``T`` with the CUDA allocator's history recorded (Python stacks):
    the step's peak above its starting point and its largest sources (MiB), as CSV columns."""
    device, vocab, optimizer = _training_setup(model, lr)
    ids = tokens(T, vocab, device, seed=0)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    try:
        start = torch.cuda.memory_allocated()
        train_step(model, optimizer, ids)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, sources = peak_breakdown(snapshot["device_traces"][device.index or 0])
    return {"step_start_gib": start / 2**30, "step_peak_above_start_gib": peak / 2**30,
            "peak_sources_mib": json.dumps({name: round(size / 2**20) for name, size in sources})}


IN_PROJ_NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def measure_layer(model, T: int, steps: int = 3, warmup: int = 1) -> dict:
    """The model's first GatedDeltaNet alone, forward + backward under bf16 autocast at ``T``
    tokens: its time, and how much of it its four in_proj projections and its delta-rule core
    (with the causal convolution) take, each timed as regions (see ``RegionTimer``)."""
    device = next(model.parameters()).device
    gdn = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    hidden = gdn.in_proj_qkv.in_features
    in_proj, core = RegionTimer(), RegionTimer()
    layer_ms, in_proj_ms, core_ms = [], [], []
    with in_proj.modules([getattr(gdn, name) for name in IN_PROJ_NAMES]), core.functions(model):
        for i in range(warmup + steps):
            generator = torch.Generator(device="cpu").manual_seed(i)
            x = torch.randn(1, T, hidden, generator=generator).to(device, torch.bfloat16).requires_grad_()
            dy = torch.randn(1, T, hidden, generator=generator).to(device, torch.bfloat16)
            if device.type == "cuda":
                torch.cuda.synchronize()
            in_proj.start(device.type)
            core.start(device.type)
            start = _Stamp(device.type)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                out = gdn(x)
            (out[0] if isinstance(out, tuple) else out).backward(dy)
            end = _Stamp(device.type)
            model.zero_grad(set_to_none=True)
            if i >= warmup:
                layer_ms.append(start.ms_until(end))
                in_proj_ms.append(in_proj.total_ms())
                core_ms.append(core.total_ms())
    layer, proj, delta = (statistics.median(v) for v in (layer_ms, in_proj_ms, core_ms))
    return {"layer_ms": layer, "in_proj_ms": proj, "in_proj_share": proj / layer, "core_ms": delta,
            "core_share": delta / layer}


# ----------------------------------------------------------------------------------------------
# CLI: one process per variant
# ----------------------------------------------------------------------------------------------
def _sizes(args):
    """The requested T, then with --fit longer ones until one fails: from --fit-from (default: the
    largest T), each --fit-step times the last (multiples of 4096), up to --fit-max. Steps near
    the limit cost the most, so starting near a predicted limit saves most of the search."""
    yield from args.T
    if not args.fit:
        return
    T = max(args.T)
    if args.fit_from and args.fit_from > T:
        T = min(args.fit_max, args.fit_from // 4096 * 4096)
        yield T
    while T < args.fit_max:
        T = min(args.fit_max, max(T + 4096, int(T * args.fit_step) // 4096 * 4096))
        yield T


def out_of_memory_note(exc: BaseException) -> str:
    """Where the allocation that failed was made (the innermost three frames) and the allocator's
    own account: the size asked for, what was in use, and what was reserved but unallocated (a
    large remainder there means fragmentation, not a lack of memory). PyTorch's advice is dropped."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " < ".join(f"{frame.name} ({Path(frame.filename).name}:{frame.lineno})" for frame in reversed(frames))
    message = " ".join(str(exc).split())
    account = message.split(" If reserved but unallocated")[0].split(" See documentation")[0]
    return f"out of memory in {where}: {account}"[:600]


def _measured(model, T: int, args) -> dict:
    """The row's measurements, or its status when the variant runs out of memory or fails."""
    steps, warmup = (args.steps, args.warmup) if T in args.T else (1, 0)  # --fit asks only: does it fit?
    try:
        if args.what == "layer":
            return dict(what="layer", **measure_layer(model, T, steps=steps, warmup=warmup))
        row = dict(what="step", **measure(model, T, steps=steps, warmup=warmup, compile=args.compile))
        if args.memory_at_peak and T in args.T and torch.cuda.is_available():
            try:  # an extra, optional look: its failure must not cost the measured row
                row.update(memory_at_peak(model, T))
            except Exception as exc:  # (memory_at_peak has stopped the recording itself)
                row["note"] = f"memory-at-peak failed: {type(exc).__name__}: {exc}"[:300]
        return row
    except torch.cuda.OutOfMemoryError as exc:
        return dict(status="oom", note=out_of_memory_note(exc))
    except Exception as exc:  # a variant failing is a result
        return dict(status="error", note=f"{type(exc).__name__}: {exc}"[:300])


def _one_variant(args) -> None:
    """Runs in its own process: build, patch, measure every T, append JSON lines to --out."""
    from .bench import core

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = core.run_info()
    model = build(args.size, args.layers, args.rank, device=device)
    try:
        report, missing = prepare(model, args.variant), ""
    except ImportError as exc:  # a peer that is not installed is a row that says so
        report, missing = None, f"not installed: {exc.name or exc}"
    for T in _sizes(args):
        row = {"variant": args.variant + ("+compile" if args.compile else ""), "T": T, "size": args.size,
               "layers": model.config.get_text_config().num_hidden_layers, "rank": args.rank,
               "status": "skipped" if missing else "ok", "note": missing,
               "report": " ".join(str(report).split())[:300] if report else ""}
        if not missing:
            row.update(_measured(model, T, args))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row.update(info)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        if args.what == "layer":
            print(f"{args.variant:22s} T={T:6d} {row['status']:5s} GatedDeltaNet fwd+bwd {row.get('layer_ms', math.nan):8.2f} ms, "
                  f"in_proj {row.get('in_proj_ms', math.nan):8.2f} ms, core {row.get('core_ms', math.nan):8.2f} ms", flush=True)
        else:
            print(f"{args.variant:22s} T={T:6d} {row['status']:5s} step {row.get('step_ms', math.nan):9.1f} ms, "
                  f"outside core {row.get('outside_core_ms', math.nan):9.1f} ms, peak {row.get('peak_gib', math.nan):6.1f} GiB",
                  flush=True)
        if row["status"] == "oom":
            break  # longer sequences will not fit either (and --fit has found its limit)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m q35lab.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["peft", "peft+liger", "q35lab"], choices=sorted(VARIANTS),
                        metavar="VARIANT", help="what to train, each in a fresh process (default: peft peft+liger q35lab): "
                        + ", ".join(sorted(VARIANTS)))
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768],
                        help="sequence lengths in tokens, batch 1 (default: 8192 32768)")
    parser.add_argument("--what", default="step", choices=["step", "layer"],
                        help="a whole training step, or one GatedDeltaNet layer forward + backward")
    parser.add_argument("--size", default="h200", choices=[*SIZES, "h200", "tiny"],
                        help="model dimensions: a real Qwen3.5 size, 'h200' (the 9B's dims, --layers layers) or 'tiny'")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: all of a real size's, 4 for 'h200' and 'tiny')")
    parser.add_argument("--compile", action="store_true", help="train torch.compile(model) (variant label +compile)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank on every linear layer (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="measured training steps per size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them (default: %(default)s)")
    parser.add_argument("--fit", action="store_true",
                        help="after --T, longer sequences until one runs out of memory: the longest that fits")
    parser.add_argument("--fit-max", type=int, default=512 * 1024,
                        help="with --fit: the longest size tried (default: %(default)s)")
    parser.add_argument("--fit-from", type=int, default=0, help="with --fit: the first longer size tried")
    parser.add_argument("--fit-step", type=float, default=1.25, help="with --fit: the factor between sizes tried")
    parser.add_argument("--memory-at-peak", action="store_true",
                        help="at each --T, one more step recorded by the allocator: what is alive at its peak, by source")
    parser.add_argument("--out", required=True, help="CSV to write; rows of a variant and T measured again replace theirs, others are kept "
                        "(a .jsonl of the same name collects the rows)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # the child process's one variant
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.variant:
        _one_variant(args)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = out.with_suffix(".jsonl")
    lines.unlink(missing_ok=True)
    for variant in args.variants:
        child = [sys.executable, "-m", "q35lab.e2e", "--variant", variant, "--out", str(lines), "--what", args.what,
                 "--size", args.size,
                 *(["--layers", str(args.layers)] if args.layers else []), *(["--compile"] if args.compile else []),
                 "--rank", str(args.rank), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--fit-max", str(args.fit_max), "--fit-from", str(args.fit_from),
                 "--fit-step", str(args.fit_step), *(["--fit"] if args.fit else []),
                 *(["--memory-at-peak"] if args.memory_at_peak else []),
                 "--T", *map(str, args.T)]
        if subprocess.run(child).returncode != 0:  # one row per size asked for, so that it replaces theirs
            with open(lines, "a") as f:
                for T in args.T:
                    f.write(json.dumps({"variant": variant, "T": T, "status": "error", "note": "the process failed"}) + "\n")
    rows = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
    merge_rows(out, rows).to_csv(out, index=False, float_format="%.5g")
    lines.unlink(missing_ok=True)
    return 0


def merge_rows(path: Path, rows: list[dict]):
    """This run's rows, after the rows already in ``path`` that it did not measure again (another
    variant, or another T of the same variant): results gathered over several device calls."""
    import pandas as pd

    def integer_sizes(frame):  # a row without T would make the column float, written as 1.3107e+05
        if "T" in frame.columns:
            frame["T"] = frame["T"].astype("Int64")
        return frame

    new = integer_sizes(pd.DataFrame(rows))
    if not path.exists() or path.stat().st_size == 0:
        return new
    old = integer_sizes(pd.read_csv(path))
    # a row is (variant, T) of one model: its size and layers where both frames record them
    key = [c for c in ("variant", "T", "size", "layers") if c in old.columns and c in new.columns]
    if {"variant", "T"} <= set(key):
        measured = set(new[key].astype(str).itertuples(index=False, name=None))
        old = old[[k not in measured for k in old[key].astype(str).itertuples(index=False, name=None)]]
    return integer_sizes(pd.concat([old, new], ignore_index=True))


if __name__ == "__main__":
    sys.exit(main())
