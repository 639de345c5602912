"""Feature ``experts``: a MoE layer's frozen routed experts through ``q35lab.routed_experts``, and
the LoRA that PEFT's ``target_parameters`` puts on them through the same op's grouped LoRA terms.

PEFT reaches the fused expert weights (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) with
``ParamWrapper``: one wrapper a targeted parameter, nested when a module has two (``mlp.experts``
is then the down projection's wrapper around the gate/up one's, around the experts). Each forward
registers a parametrization that builds ``W + s·B·A`` for every expert and runs the experts on it.
For a 3-D parameter PEFT keeps ``lora_A.weight`` as ``[E·r, in]`` (expert-major rows: a view
``[E, r, in]``) and ``lora_B.weight`` as ``[out, r·E]`` (rank-major columns: a view
``[E, out, r]`` after ``reshape(out, r, E).permute(2, 0, 1)``), ``in``/``out`` swapped to the
weight's ``[E, out, in]`` (``_did_swap_in_out_features``). The patch gives the outermost wrapper a
forward that hands those views to ``routed_experts`` instead, whenever that computes PEFT's call
exactly; otherwise PEFT's own forward runs.
"""

from __future__ import annotations

import torch

from ..hf.forwards import Forward
from ..hf.modules import hooks_would_see, is_routed_experts
from ..ops.routed_experts import ExpertLoRA, routed_experts
from .feature import Feature, Options
from .markers import EXPERT_LORA, EXPERTS
from .report import PatchReport, override_forward, restore_forward

#: The expert parameters whose LoRA the op computes.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
LABEL = "PEFT ParamWrapper (routed experts' LoRA)"


def _experts_problem(experts: torch.nn.Module) -> str | None:
    if type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(getattr(experts, 'act_fn', None)).__name__} (only SiLU is fused here)"
    layout = {"has_bias": False, "is_transposed": False, "has_gate": True, "has_post_expert_norm": False}
    if any(getattr(experts, name, default) != default for name, default in layout.items()):
        return "a weight layout other than Qwen3.5's (bias, transposed, ungated or post-norm experts)"
    if getattr(experts, "_is_expert_parallel", False):
        return "expert parallelism (its sentinel expert ids)"
    if experts.gate_up_proj.requires_grad or experts.down_proj.requires_grad:
        return "trainable expert weights (the fused path is for frozen experts, as in a LoRA fine-tune)"
    return None


class _ExpertsForward(Forward):
    """``routed_experts`` while the expert weights are frozen; transformers' forward otherwise."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        experts = self.module
        if experts.gate_up_proj.requires_grad or experts.down_proj.requires_grad:
            return type(experts).forward(experts, hidden_states, top_k_index, top_k_weights)
        return routed_experts(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj)


def patch_experts(experts: torch.nn.Module, report: PatchReport) -> None:
    override_forward(experts, EXPERTS, _ExpertsForward, _experts_problem(experts),
                      f"{type(experts).__name__} (routed experts)", report)


def unpatch_experts(experts: torch.nn.Module, report: PatchReport) -> None:
    restore_forward(experts, EXPERTS, f"{type(experts).__name__} (routed experts)", report)


# ----------------------------------------------------------------------------------------------
# PEFT's LoRA on the expert parameters.
# ----------------------------------------------------------------------------------------------
def is_param_wrapper(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "ParamWrapper" and cls.__module__.startswith("peft.tuners.lora")


def wrapper_chain(wrapper: torch.nn.Module) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """The nested ParamWrappers from ``wrapper`` inwards, and the module they wrap."""
    chain, inner = [], wrapper
    while is_param_wrapper(inner):
        chain.append(inner)
        inner = inner.base_layer
    return chain, inner


def expert_lora_static_problem(wrapper: torch.nn.Module) -> str | None:
    """Why ``routed_experts`` can never compute this (outermost) wrapper's experts exactly, or None."""
    chain, experts = wrapper_chain(wrapper)
    names = [w.parameter_name for w in chain]
    if any(name not in EXPERT_PARAMETERS for name in names) or len(set(names)) != len(names):
        return f"LoRA on the parameters {names} (the op computes it on {' and '.join(EXPERT_PARAMETERS)}, once each)"
    problem = _experts_problem(experts)
    if problem:
        return problem
    for w in chain:
        param = getattr(experts, w.parameter_name)
        if param.dim() != 3 or w.num_experts != param.shape[0] or not w._did_swap_in_out_features:
            return f"{w.parameter_name}: a layout other than [experts, out, in] with experts-first LoRA factors"
        if getattr(w, "lora_variant", None):
            return f"{w.parameter_name}: a LoRA variant (DoRA or similar)"
        for name in w.lora_A:
            a, b = w.lora_A[name], w.lora_B[name]
            if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or (a.bias, b.bias) != (None, None):
                return f"{w.parameter_name}: adapter matrices with a bias or of another type"
            dropout = w.lora_dropout[name]
            if not isinstance(dropout, torch.nn.Identity) and not (isinstance(dropout, torch.nn.Dropout)
                                                                   and dropout.p == 0):
                return f"{w.parameter_name}: adapter dropout ({type(dropout).__name__}), which the op does not apply"
    return None


def _factors(wrapper: torch.nn.Module, adapter: str) -> ExpertLoRA:
    """PEFT's factors of one wrapper as ``[E, r, in]`` and ``[E, out, r]`` views of its weights
    (``ParamWrapper.get_delta_factors``' layout, without its cast: the op casts)."""
    a, b, experts = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight, wrapper.num_experts
    return ExpertLoRA(a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts).permute(2, 0, 1),
                      wrapper.scaling[adapter])


def _expert_lora_call(wrapper: torch.nn.Module, args: tuple, kwargs: dict):
    """``routed_experts`` with LoRA for this call, or None when PEFT's own forward must run: adapters
    disabled or merged, other than one active adapter on every wrapper, a mixed-adapter batch,
    a parametrization already on the experts, a hook that would miss the inner modules' call, or
    weights of a dtype PEFT adds in another (fp8)."""
    if len(args) != 3 or kwargs:
        return None
    chain, experts = wrapper_chain(wrapper)
    loras = {}
    for w in chain:
        if w.disable_adapters or w.merged:
            return None
        active = [name for name in w.active_adapters if name in w.lora_A]
        if len(active) != 1:
            return None
        loras[w.parameter_name] = _factors(w, active[0])
    if hooks_would_see(*chain[1:], experts) or torch.nn.utils.parametrize.is_parametrized(experts):
        return None
    x, top_k_index, top_k_weights = args
    if experts.gate_up_proj.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return routed_experts(x, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj,
                          gate_up_lora=loras.get("gate_up_proj"), down_lora=loras.get("down_proj"))


class _ExpertLoRAForward(Forward):
    """The outermost ParamWrapper's forward: the op with the experts' LoRA where it computes the
    call exactly, else PEFT's (which builds the dense weights)."""

    def __call__(self, *args, **kwargs):
        out = _expert_lora_call(self.module, args, kwargs)
        return type(self.module).forward(self.module, *args, **kwargs) if out is None else out


def _outermost_wrappers(model: torch.nn.Module):
    inner = {id(m.base_layer) for m in model.modules() if is_param_wrapper(m)}
    for module in model.modules():
        if is_param_wrapper(module) and id(module) not in inner and is_routed_experts(wrapper_chain(module)[1]):
            yield module


def patch_expert_lora(wrapper: torch.nn.Module, report: PatchReport) -> None:
    override_forward(wrapper, EXPERT_LORA, _ExpertLoRAForward, expert_lora_static_problem(wrapper), LABEL, report)


def unpatch_expert_lora(wrapper: torch.nn.Module, report: PatchReport) -> None:
    restore_forward(wrapper, EXPERT_LORA, LABEL, report)


def _apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    for module in list(model.modules()):
        if is_routed_experts(module):
            patch_experts(module, report)
    for wrapper in list(_outermost_wrappers(model)):
        patch_expert_lora(wrapper, report)


def _revert(model: torch.nn.Module, report: PatchReport) -> None:
    for module in list(model.modules()):
        unpatch_expert_lora(module, report)
        unpatch_experts(module, report)


FEATURE = Feature("experts", "experts", _apply, _revert)
