"""Feature ``in_proj``: a GatedDeltaNet's four input projections, which read one input, computed
as one autograd node (``q35lab.fused_lora_projections``)."""

from __future__ import annotations

import torch

from ..hf.forwards import Forward, marked
from ..hf.modules import IN_PROJ_NAMES, base_is_trainable, base_layer, is_gated_delta_net, is_peft_lora_linear
from ..ops._compile import opaque_to_compile
from ..ops.fused_projections import (
    ConcatCache,
    Projection,
    fused_lora_projections,
    pack_rows,
    rows_of_one_buffer,
    unpack_rows,
)
from .feature import Feature
from .fp8_base import weight_scale
from .lora import lora_static_problem, unroute_lora
from .markers import IN_PROJ, LORA_PATCHED
from .report import PatchReport


def projection_problem(module: torch.nn.Module) -> str | None:
    if base_is_trainable(module):
        return "trainable base projection (full fine-tuning; the fusion is for frozen bases)"
    if type(module) is torch.nn.Linear:
        return None
    if is_peft_lora_linear(module):
        return lora_static_problem(module)
    return f"{type(module).__name__} projection"


def projection_now(module: torch.nn.Module) -> Projection | None:
    """This call's Projection for ``module``, or None when only its own forward is exact."""
    if base_is_trainable(module):  # unfrozen after patching
        return None
    if type(module) is torch.nn.Linear:
        return Projection(module.weight, module.bias, weight_scale=weight_scale(module))
    base = module.base_layer
    scale = weight_scale(base)
    if module.disable_adapters and module.merged:  # PEFT's forward unmerges first: only it is exact
        return None
    if module.disable_adapters or module.merged:  # PEFT's forward is then base_layer(x) alone
        return Projection(base.weight, base.bias, weight_scale=scale)
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) > 1 or (active and active[0] in getattr(module, "lora_variant", {})):
        return None
    if not active:
        return Projection(base.weight, base.bias, weight_scale=scale)
    name = active[0]
    dropout = module.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) and dropout.training else 0.0
    return Projection(base.weight, base.bias, module.lora_A[name].weight, module.lora_B[name].weight,
                      module.scaling[name], p, scale)


class ProjectionGroup:
    """Projections of one shared input (a GatedDeltaNet's four in_proj, an MLP's gate and up),
    computed together by ``fused_lora_projections``; ``own_buffer``: the indices of those whose
    output gets a contiguous buffer of its own (see there)."""

    def __init__(self, modules: list[torch.nn.Module], own_buffer: tuple[int, ...] = ()):
        self.modules = modules
        self.own_buffer = own_buffer
        # frozen base weights packed into one buffer: the fused GEMM's weight is a view, not a copy
        self.packed = pack_rows([base_layer(m).weight for m in modules])
        self._reset()

    def _reset(self) -> None:
        # a concatenated copy (weights not in one buffer, e.g. FSDP2's) lives only within a step
        self.cache = ConcatCache(keep_copies=False)
        self.input_key = None
        self.pending: dict[int, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) keeps the modules, not the outputs or weights of this step.
        return {"modules": self.modules, "packed": self.packed, "own_buffer": self.own_buffer}

    def __setstate__(self, state: dict) -> None:
        self.modules = state["modules"]
        self.own_buffer = state.get("own_buffer", ())
        # deepcopy and pickle give each weight a buffer of its own: packed again at the first call
        self.packed = None if state["packed"] else False
        self._reset()

    @opaque_to_compile  # keyed on the input's identity and version: eager Python state
    def output(self, index: int, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        module = self.modules[index]
        if args or kwargs:
            return type(module).forward(module, x, *args, **kwargs)
        key = (id(x), x._version, x.data_ptr(), torch.is_grad_enabled(),
               torch.is_autocast_enabled(x.device.type))
        if key != self.input_key or index not in self.pending:
            outputs = self.fused(x)
            if outputs is None:  # e.g. two active adapters: PEFT's own path
                return type(module).forward(module, x)
            self.pending = dict(enumerate(outputs))
            self.input_key = key
        return self.pending.pop(index)

    def fused(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Every projection's output of ``x`` from one fused node, or None when one of them
        must run its own forward this call."""
        if self.packed is None:
            self.packed = _pack_again([base_layer(m).weight for m in self.modules])
        projections = [projection_now(m) for m in self.modules]
        if any(p is None for p in projections):
            return None
        return fused_lora_projections(x, projections, cache=self.cache, own_buffer=self.own_buffer)


def _pack_again(weights: list[torch.Tensor]) -> bool:
    """Pack a copied group's weights, unless they still lie back to back (torch.load keeps the
    buffer they shared when saved; deepcopy gives each weight its own)."""
    if rows_of_one_buffer(weights, weights[0].dtype) is not None:
        return True
    with torch.no_grad():
        return pack_rows(weights)


class _InProjForward(Forward):
    """One in_proj projection's forward: its output from the group's fused computation."""

    def __init__(self, module: torch.nn.Module, group: ProjectionGroup, index: int):
        super().__init__(module)
        self.group, self.index = group, index

    def __call__(self, x, *args, **kwargs):
        return self.group.output(self.index, x, args, kwargs)


# z last, in a buffer of its own: its norm's reshape would copy a column block of a shared buffer
# (and keep the copy for backward); qkv, b and a are read through strides and share one GEMM.
IN_PROJ_GROUP = (*(name for name in IN_PROJ_NAMES if name != "in_proj_z"), "in_proj_z")

IN_PROJ_OWN_BUFFER = (IN_PROJ_GROUP.index("in_proj_z"),)


def fuse_in_proj(gdn: torch.nn.Module, report: PatchReport) -> None:
    modules = [getattr(gdn, name) for name in IN_PROJ_GROUP]
    if any(marked(m, IN_PROJ) is not None for m in modules):
        report.already_patched += 1
        return
    problems = [p for p in map(projection_problem, modules) if p]
    if problems:
        report.left_alone[f"{type(gdn).__name__} in_proj: {problems[0]}"] += 1
        return
    group = ProjectionGroup(modules, own_buffer=IN_PROJ_OWN_BUFFER)
    for index, module in enumerate(modules):
        if marked(module, LORA_PATCHED) is not None:  # routed by lora=True: the group takes over
            unroute_lora(module, PatchReport())
        module.forward = _InProjForward(module, group, index)
        object.__setattr__(module, IN_PROJ, group)
    report.replaced[f"{type(gdn).__name__} in_proj (4 projections, 1 node)"] += 1


def unfuse_in_proj(module: torch.nn.Module, report: PatchReport) -> None:
    group = marked(module, IN_PROJ)
    if group is not None:
        del module.forward
        object.__delattr__(module, IN_PROJ)
        if module is group.modules[0]:
            if group.packed:  # each weight in a buffer of its own again, as transformers made them
                unpack_rows([base_layer(m).weight for m in group.modules])
            report.reverted["GatedDeltaNet in_proj"] += 1


FEATURE = Feature.per_module("in_proj", "in_proj", is_gated_delta_net, fuse_in_proj, unfuse_in_proj)
