"""Feature ``swiglu``: the MLP's SwiGLU (and, where it can, its down projection) as q35lab's fused
nodes."""

from __future__ import annotations

import torch

from ..hf.forwards import Forward, marked
from ..hf.modules import base_layer, hooks_would_see, is_peft_lora_linear, is_swiglu_mlp
from ..ops._linear import compute_dtype
from ..ops.fused_projections import Projection, unpack_rows
from ..ops.swiglu import swiglu
from ..ops.swiglu_down import swiglu_down
from .feature import Feature
from .in_proj import ProjectionGroup, projection_now, projection_problem
from .lora import unroute_lora
from .markers import LORA_PATCHED, MLP
from .report import PatchReport, override_forward, restore_forward


def _mlp_problem(mlp: torch.nn.Module) -> str | None:
    if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(mlp.act_fn).__name__} (only SiLU is fused here)"
    return None


class _MLPForward(Forward):
    """``down(swiglu(gate(x), up(x)))`` with gate and up fused when their bases are frozen, and
    the SwiGLU and the down projection two nodes (``swiglu_down``: ``h`` is not kept for the
    backward) when this call's down projection is a frozen base with at most one adapter,
    without dropout or hooks, in the input's own compute dtype."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        pair = [module.gate_proj, module.up_proj]
        fusable = not any(map(projection_problem, pair))
        self.group = ProjectionGroup(pair) if fusable else None
        self.down_fusable = projection_problem(module.down_proj) is None  # what a call cannot change

    def __call__(self, x):
        mlp = self.module
        # the fused group leaves gate_proj's and up_proj's module calls out: a hook on either (PEFT's
        # adapter_names pre-hooks of a mixed-adapter batch among them) needs those calls
        hooked = self.group is not None and hooks_would_see(*mlp.gate_proj.modules(), *mlp.up_proj.modules())
        gate_up = self.group.fused(x) if self.group is not None and not hooked else None
        gate, up = gate_up if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
        down = self._down_now(gate)
        if down is None:
            return mlp.down_proj(swiglu(gate, up, rounding="hf"))
        return swiglu_down(gate, up, down.weight, down.lora_A, down.lora_B, down.scaling, down.bias,
                           rounding="hf", weight_scale=down.weight_scale)

    def _down_now(self, gate: torch.Tensor) -> Projection | None:
        """This call's down projection as a ``Projection`` for ``swiglu_down``, or None when its
        own forward must run (see the class docstring)."""
        down_proj = self.module.down_proj
        if not self.down_fusable or hooks_would_see(*down_proj.modules()):
            return None
        down = projection_now(down_proj)
        if down is None or down.dropout or compute_dtype(gate) != gate.dtype:
            return None
        if down.lora_A is not None and is_peft_lora_linear(down_proj) and marked(down_proj, LORA_PATCHED) is None:
            return None  # lora=False: the adapter's math stays PEFT's, as on every other projection
        return down


def patch_mlp(mlp: torch.nn.Module, report: PatchReport) -> None:
    override_forward(mlp, MLP, _MLPForward, _mlp_problem(mlp), f"{type(mlp).__name__} (SwiGLU)", report)
    forward = vars(mlp).get("forward")
    if marked(mlp, MLP) is True and forward.group is not None:  # newly patched, gate and up fused
        for proj in forward.group.modules:  # the group computes them: no routing of their own
            unroute_lora(proj, PatchReport())
        object.__setattr__(mlp, MLP, forward.group)  # the mark is the group, as for the in_proj
        report.replaced[f"{type(mlp).__name__} gate/up (2 projections, 1 node)"] += 1


def unpatch_mlp(mlp: torch.nn.Module, report: PatchReport) -> None:
    group = marked(mlp, MLP)
    if isinstance(group, ProjectionGroup) and group.packed:
        unpack_rows([base_layer(m).weight for m in group.modules])
    restore_forward(mlp, MLP, f"{type(mlp).__name__} (SwiGLU)", report)


FEATURE = Feature.per_module("swiglu", "swiglu", is_swiglu_mlp, patch_mlp, unpatch_mlp)
