"""q35lab: fast, faithful training kernels for Qwen3.5, and the notebooks that derive them.

Importing q35lab compiles nothing. Without a CUDA device its Triton kernels run through the
Triton interpreter (see ``q35lab.runtime``), which must be decided before any kernel is
defined, hence ``runtime`` is imported first.
"""

from . import runtime  # noqa: F401  (first: chooses compiled Triton or the interpreter)
from .ops.causal_conv1d import causal_conv1d
from .ops.fused_projections import Projection, fused_lora_projections
from .ops.gated_rms_norm import GatedRMSNorm, gated_rms_norm
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.lora import lora_linear
from .ops.offset_rms_norm import OffsetRMSNorm, offset_rms_norm
from .ops.routed_experts import routed_experts
from .ops.swiglu import swiglu, swiglu_packed
from .patch import PatchReport, apply_to_qwen3_5, revert

__version__ = "0.1.0"

__all__ = [
    "OffsetRMSNorm",
    "offset_rms_norm",
    "GatedRMSNorm",
    "gated_rms_norm",
    "lora_linear",
    "fused_lora_projections",
    "Projection",
    "linear_cross_entropy",
    "causal_conv1d",
    "swiglu",
    "swiglu_packed",
    "routed_experts",
    "apply_to_qwen3_5",
    "revert",
    "PatchReport",
    "__version__",
]
