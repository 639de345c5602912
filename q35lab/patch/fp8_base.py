"""Feature ``base_precision="fp8"``: the frozen base weights of the decoder's projections kept in FP8
(e4m3, one fp32 scale an output channel) in place of their bf16 copy, and their GEMMs run on FP8
(``q35lab.ops.fp8``).

Each quantized ``nn.Linear`` keeps its ``weight`` Parameter (the same object, now holding the FP8
values: half the bytes), gains a non-persistent buffer ``FP8_SCALE`` and an instance forward that
runs ``fp8_linear``, so every path that calls the module (PEFT's own forward, an unfused projection)
computes with it; the fused paths (``lora_linear``, the in_proj and gate/up groups, ``swiglu_down``)
read the scale through ``weight_scale``. Quantizing is lossy, so the original weight is copied to
host memory first and ``revert`` puts it back bit for bit (on a model in host memory the copy saves
nothing there: the saving is the device's).
"""

from __future__ import annotations

import torch

from ..hf.forwards import Forward, marked
from ..hf.modules import (
    ATTENTION_CLASSES,
    IN_PROJ_NAMES,
    base_is_trainable,
    base_layer,
    is_gated_delta_net,
    is_swiglu_mlp,
)
from ..ops._checks import FLOAT_DTYPES
from ..ops.fp8 import check_fp8_device, fp8_linear, is_fp8, quantize_weight
from .feature import Feature, Options
from .report import PatchReport

#: The base precisions ``apply_to_qwen3_5(base_precision=...)`` takes (None: "bf16").
BASE_PRECISIONS = ("bf16", "fp8")
#: The non-persistent buffer holding a quantized Linear's per-output-channel scales.
FP8_SCALE = "q35lab_fp8_weight_scale"
#: Attribute of a quantized Linear: its original weight in host memory, for revert.
FP8_BASE = "_q35lab_fp8_base"

#: The projections quantized, by the module that holds them: full attention, GatedDeltaNet, MLP
#: (the MoE's shared expert too). The lm head, the embeddings, the MoE router and routed experts,
#: the norms and the adapters keep their dtype.
PROJECTIONS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "gated_delta_net": (*IN_PROJ_NAMES, "out_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
LABEL = "frozen base weight in FP8 e4m3 (nn.Linear)"


def base_precision_option(value: object) -> str:
    """``base_precision`` checked: None or "bf16" (the model's own weights) or "fp8"."""
    if value is None:
        return "bf16"
    if not isinstance(value, str):
        raise TypeError(f"base_precision: expected None, 'bf16' or 'fp8', got {type(value).__name__}")
    if value not in BASE_PRECISIONS:
        raise ValueError(f"base_precision: expected None, 'bf16' or 'fp8', got {value!r}")
    return value


def weight_scale(linear: torch.nn.Module) -> torch.Tensor | None:
    """The FP8 scales of a Linear this feature quantized (None for any other)."""
    scale = vars(linear).get("_buffers", {}).get(FP8_SCALE)
    return scale if scale is not None and is_fp8(linear.weight) else None


def _holder_kind(module: torch.nn.Module) -> str | None:
    cls = type(module)
    if cls.__name__ in ATTENTION_CLASSES and cls.__module__.startswith("transformers."):
        return "attention"
    if is_gated_delta_net(module):
        return "gated_delta_net"
    if is_swiglu_mlp(module):
        return "mlp"
    return None


def quantizable(model: torch.nn.Module):
    """``(name, Linear)``: each frozen base ``nn.Linear`` of a projection in ``PROJECTIONS``, in a
    float dtype, not on the meta device (or already quantized)."""
    for holder in model.modules():
        kind = _holder_kind(holder)
        for name in PROJECTIONS.get(kind, ()):
            child = getattr(holder, name, None)
            base = None if child is None else base_layer(child)
            if type(base) is not torch.nn.Linear or base_is_trainable(base) or base.weight.is_meta:
                continue
            if marked(base, FP8_BASE) is not None or base.weight.dtype in FLOAT_DTYPES:
                yield name, base


def check_devices(model: torch.nn.Module) -> None:
    """``ValueError`` naming ``base_precision`` unless every weight to quantize is on a device that
    runs FP8 GEMMs (a CUDA GPU of compute capability 8.9 or more, or the CPU): checked before
    anything is patched."""
    for device in {base.weight.device for _, base in quantizable(model)}:
        check_fp8_device("base_precision", device)


class _FP8LinearForward(Forward):
    """A quantized Linear's own forward: ``fp8_linear`` with its scales."""

    def __call__(self, x):
        linear = self.module
        return fp8_linear(x, linear.weight, weight_scale(linear), linear.bias)


class _Original:
    """A quantized Linear's weight as it was (host memory), for revert."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().to("cpu", copy=True)


def quantize_linear(linear: torch.nn.Module, report: PatchReport) -> None:
    if marked(linear, FP8_BASE) is not None:
        report.already_patched += 1
        return
    original = _Original(linear.weight)
    with torch.no_grad():
        weight, scale = quantize_weight(linear.weight)
        linear.weight.data = weight  # the Parameter object stays; its bf16 storage is released
    linear.register_buffer(FP8_SCALE, scale, persistent=False)
    linear.forward = _FP8LinearForward(linear)
    object.__setattr__(linear, FP8_BASE, original)
    report.replaced[LABEL] += 1


def restore_linear(linear: torch.nn.Module, report: PatchReport) -> None:
    original = marked(linear, FP8_BASE)
    if original is None:
        return
    with torch.no_grad():
        linear.weight.data = original.weight.to(linear.weight.device, copy=True)
    del linear._buffers[FP8_SCALE]
    del linear.forward
    object.__delattr__(linear, FP8_BASE)
    report.reverted[LABEL] += 1


def _apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    if options.base_precision != "fp8":
        return
    quantized: dict[str, int] = {}
    host_bytes = 0
    for name, linear in list(quantizable(model)):
        quantize_linear(linear, report)
        quantized[name] = quantized.get(name, 0) + 1
        host_bytes += marked(linear, FP8_BASE).weight.nbytes
    if not quantized:
        report.not_applied["base_precision"] = "no frozen base projection (nn.Linear) to quantize"
        return
    listed = ", ".join(f"{name} ×{count}" for name, count in quantized.items())
    report.runs["base precision"] = (
        f"fp8 (e4m3, per-output-channel scales; activations scaled per row): {listed}. In the compute dtype: the lm "
        f"head, embeddings, norms, adapters, attention, the delta rule, the MoE router and routed experts. Original "
        f"weights kept in host memory for revert: {host_bytes / 2**30:.2f} GiB")


def _revert(model: torch.nn.Module, report: PatchReport) -> None:
    for module in list(model.modules()):
        restore_linear(module, report)


FEATURE = Feature("base_precision", None, _apply, _revert)
