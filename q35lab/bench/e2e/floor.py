"""A step's floor: the time its work would take at the rates this GPU reaches on each kind of work.

``step_floor`` counts the work from the config; ``floor_inputs`` measures the rates in the same
run (bench.core's ceilings, and the attention and delta-rule kernels the model calls, alone).
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass

import torch

from ..core import Ceilings, kernel_ms, measure_ceilings
from .timer import _Stamp

#: Bytes of an activation element: the step trains a bf16 model under bf16 autocast.
ACTIVATION_BYTES = 2


@dataclass(frozen=True)
class Linear:
    """A linear layer of a decoder layer: ``k`` inputs, ``n`` outputs, ``rows`` rows per token (1;
    top-k for routed experts); ``lora``: PEFT's "all-linear" wraps it (it is an ``nn.Linear``);
    ``recomputed``: checkpointing's recompute runs its base GEMM again (not the dense MLP's down
    projection: see ``_mlp_linears``)."""

    name: str
    k: int
    n: int
    lora: bool = True
    rows: int = 1
    recomputed: bool = True


def decoder_linears(config, layer_type: str) -> list[Linear]:
    """Every linear layer of one decoder layer (``"full_attention"`` or ``"linear_attention"``),
    as transformers' Qwen3.5 builds it: the attention's q_proj holds the query and its output gate
    (2·heads·head_dim); the GatedDeltaNet's in_proj_qkv holds q, k (key heads × key dim each) and
    v (value heads × value dim)."""
    H = config.hidden_size
    if layer_type == "full_attention":
        nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        mixer = [Linear("q_proj", H, 2 * nh * hd), Linear("k_proj", H, nkv * hd), Linear("v_proj", H, nkv * hd),
                 Linear("o_proj", nh * hd, H)]
    else:
        qk, v, heads = _delta_rule_widths(config)
        mixer = [Linear("in_proj_qkv", H, 2 * qk + v), Linear("in_proj_z", H, v), Linear("in_proj_b", H, heads),
                 Linear("in_proj_a", H, heads), Linear("out_proj", v, H)]
    return mixer + _mlp_linears(config)


def _delta_rule_widths(config) -> tuple[int, int, int]:
    """Per token: the width of q (= of k), of v, and the number of value heads of a GatedDeltaNet."""
    nv = config.linear_num_value_heads
    return config.linear_num_key_heads * config.linear_key_head_dim, nv * config.linear_value_head_dim, nv


def _mlp_linears(config) -> list[Linear]:
    """The MLP's projections; a MoE layer's router and routed experts are parameters, not
    ``nn.Linear`` (no adapter), its shared expert and that expert's gate are linear layers.

    A dense MLP's down projection is the layer's last GEMM and its output feeds only the residual
    add, which saves nothing: the recompute has nothing to rebuild there, and stops before it where
    the down projection's node saves no activation (q35lab's ``swiglu_down``). In a MoE layer every
    output is read again (the router's weights and the shared expert's gate multiply them)."""
    H = config.hidden_size
    if not getattr(config, "num_experts", 0):
        I = config.intermediate_size  # noqa: E741 (the paper's name)
        return [Linear("gate_proj", H, I), Linear("up_proj", H, I), Linear("down_proj", I, H, recomputed=False)]
    top, I, shared = config.num_experts_per_tok, config.moe_intermediate_size, config.shared_expert_intermediate_size
    return [Linear("router", H, config.num_experts, lora=False),
            Linear("experts.gate_up_proj", H, 2 * I, lora=False, rows=top),
            Linear("experts.down_proj", I, H, lora=False, rows=top),
            Linear("shared_expert.gate_proj", H, shared), Linear("shared_expert.up_proj", H, shared),
            Linear("shared_expert.down_proj", shared, H), Linear("shared_expert_gate", H, 1)]


def linear_flop(layer: Linear, rank: int) -> int:
    """GEMM FLOPs of one linear layer per token over a whole step under gradient checkpointing.

    The frozen base ``W [n, k]``: forward ``2kn``, checkpointing's recompute ``2kn`` (unless it
    need not be ``recomputed``), backward dx only ``2kn`` (no dW: frozen) — ``6kn`` (``4kn``).
    Its LoRA adapter ``A [r, k]``, ``B [n, r]``: forward ``xA`` ``2kr`` and ``(xA)B`` ``2rn``, the
    same again in the recompute, backward dB ``2rn``, d(xA) ``2nr``, dA ``2kr`` and dx through A
    ``2rk`` — ``8r(k + n)``. Routed experts count ``rows`` (top-k) times."""
    adapter = 8 * rank * (layer.k + layer.n) if layer.lora else 0
    return layer.rows * ((6 if layer.recomputed else 4) * layer.k * layer.n + adapter)


def step_gemm_flop(config, T: int, rank: int) -> int:
    """GEMM FLOPs of a step: ``T · (Σ_layers Σ_linear linear_flop + 4·H·V)``. The LM head
    ``[V, H]`` is frozen, has no adapter ("all-linear" leaves the output layer out) and lies outside
    the checkpointed layers: its forward ``2HV`` and its dx ``2HV``; the loss over its logits adds
    no GEMM."""
    per_token = sum(linear_flop(layer, rank) for kind in config.layer_types for layer in decoder_linears(config, kind))
    return T * (per_token + 4 * config.hidden_size * config.vocab_size)


def step_gemms(config, T: int, rank: int) -> dict[tuple[int, int, int], int]:
    """The GEMMs of a step as ``{(m, k, n): count}`` (an ``[m, k] @ [k, n]`` product each), the
    same work ``linear_flop`` and ``step_gemm_flop`` count: per linear layer its base forward
    ``(T, k, n)`` twice (forward, recompute; once where it is not ``recomputed``) and dx ``(T, n, k)``;
    its adapter's ``xA (T, k, r)`` and ``(xA)B (T, r, n)`` twice, ``dB (n, T, r)``, ``d(xA) (T, n, r)``,
    ``dA (r, T, k)``, dx through A ``(T, r, k)``; the LM head's forward ``(T, H, V)`` and dx
    ``(T, V, H)``. Routed experts as one dense GEMM of ``rows·T`` rows."""
    gemms: dict[tuple[int, int, int], int] = {}

    def add(shape, count):
        gemms[shape] = gemms.get(shape, 0) + count

    for kind in config.layer_types:
        for layer in decoder_linears(config, kind):
            m, k, n, r = layer.rows * T, layer.k, layer.n, rank
            add((m, k, n), 2 if layer.recomputed else 1)
            add((m, n, k), 1)
            if layer.lora:
                for shape, count in (((m, k, r), 2), ((m, r, n), 2), ((n, m, r), 1), ((m, n, r), 1), ((r, m, k), 1),
                                     ((m, r, k), 1)):
                    add(shape, count)
    H, V = config.hidden_size, config.vocab_size
    add((T, H, V), 1)
    add((T, V, H), 1)
    return gemms


def gemms_alone_ms(config, T: int, rank: int, device, max_rows: int = 8192) -> float:
    """The step's GEMMs (``step_gemms``) each run alone in bf16 on ``device`` at its own shape:
    what cuBLAS reaches on exactly this work, against which ``gemm_ms`` (every FLOP at the 8192³
    rate) is the stricter floor. A GEMM of more than ``max_rows`` rows (or columns, or inner
    length: the LM head's 248k-wide product would need 16 GB at 32k) is timed on that many and
    scaled: its time is linear in each dimension once it is that long. NaN on a CPU."""
    if torch.device(device).type != "cuda":
        return math.nan
    total = 0.0
    for (m, k, n), count in step_gemms(config, T, rank).items():
        dims = [min(d, max_rows) for d in (m, k, n)]
        scale = (m * k * n) / (dims[0] * dims[1] * dims[2])
        a = torch.randn(dims[0], dims[1], device=device, dtype=torch.bfloat16)
        b = torch.randn(dims[1], dims[2], device=device, dtype=torch.bfloat16)
        torch.mm(a, b)  # cuBLAS picks and warms its kernel
        total += count * scale * kernel_ms([lambda a=a, b=b: torch.mm(a, b)] * 3)  # bound: deleted below
        del a, b
    return total


def streaming_elements(config, layer_type: str) -> tuple[int, int]:
    """Activation elements per token a decoder layer's streaming ops must read and write, (forward,
    backward), at their minimum: each op reads its inputs and writes its outputs once.

    Every layer: two RMSNorms over H (forward reads x, writes y: ``2H``; backward reads x and dy,
    writes dx: ``3H``; frozen weights, no dW); two residual adds (forward ``3H``; backward the sum of
    the two gradients meeting there, ``3H``); the SwiGLU over width I (forward reads g, u, writes h:
    ``3I``; backward reads g, u, dh, writes dg, du: ``5I``) — a MoE layer's width is
    ``top_k·I_expert + I_shared``, and its combine reads the top-k outputs and the shared one and
    writes their sum (``(top_k + 2)·H`` each way; the dispatch is left to the grouped GEMM's loads).
    Full attention: q_norm and k_norm over the heads (``2``/``3`` per element, as above); rotary on
    the rotated part of q and k (``2`` per element each way); the output gate ``o·sigmoid(g)``
    (forward ``3·heads·head_dim``, backward ``5·heads·head_dim``). GatedDeltaNet: the depthwise
    causal conv over q, k, v (forward ``2C``, backward ``3C``, frozen filter) and the gated norm
    (forward reads x, z, writes y: ``3v``; backward ``5v``). Left out: the per-head gates β and g
    (``heads`` elements, < 0.1% of a layer) and the delta-rule core, counted apart."""
    H = config.hidden_size
    if getattr(config, "num_experts", 0):
        top = config.num_experts_per_tok
        width = top * config.moe_intermediate_size + config.shared_expert_intermediate_size
        forward = 2 * 2 * H + 2 * 3 * H + 3 * width + (top + 2) * H
        backward = 2 * 3 * H + 2 * 3 * H + 5 * width + (top + 2) * H
    else:
        I = config.intermediate_size  # noqa: E741
        forward, backward = 2 * 2 * H + 2 * 3 * H + 3 * I, 2 * 3 * H + 2 * 3 * H + 5 * I
    if layer_type == "full_attention":
        nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        rotated = (nh + nkv) * int(hd * _partial_rotary_factor(config))
        return (forward + 2 * (nh + nkv) * hd + 2 * rotated + 3 * nh * hd,
                backward + 3 * (nh + nkv) * hd + 2 * rotated + 5 * nh * hd)
    qk, v, _ = _delta_rule_widths(config)
    conv = 2 * qk + v
    return forward + 2 * conv + 3 * v, backward + 3 * conv + 5 * v


def _partial_rotary_factor(config) -> float:
    """The share of a head's dims that rotary rotates (Qwen3.5: 0.25), where this transformers keeps it."""
    factor = getattr(config, "partial_rotary_factor", None)
    return factor or (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)


def step_streaming_bytes(config, T: int) -> int:
    """Streaming bytes of a step: ``b·T·(Σ_layers (2·forward − tail + backward) + 2H + 3H)`` with the
    elements of ``streaming_elements`` (the forward twice: gradient checkpointing recomputes it,
    but for a layer's last residual add, ``tail`` = ``3H``, which saves nothing and follows the
    layer's last saved tensor, where the recompute stops; a MoE layer's combine ends with an add
    that follows it too, left in: at most ``3H`` a layer over) and the final norm once each way;
    ``b`` = 2 (bf16 activations)."""
    tail = 3 * config.hidden_size
    per_token = 0
    for kind in config.layer_types:
        forward, backward = streaming_elements(config, kind)
        per_token += 2 * forward - tail + backward
    return ACTIVATION_BYTES * T * (per_token + 5 * config.hidden_size)


def step_floor(config, T: int, rank: int, matmul_tflops: float, copy_gbps: float, sdpa_ms: float | None,
               core_ms: float | None, gemms_alone_ms: float | None = None) -> dict:
    """The step's floor, term by term (ms):

    * ``gemm_ms`` = ``step_gemm_flop / (matmul_tflops · 1e9)``: every GEMM at the run's bf16 matmul rate;
    * ``attention_ms`` = full-attention layers × ``sdpa_ms``, one layer's SDPA as the step runs it
      (forward, recompute, backward), measured alone at the same shapes;
    * ``core_ms`` = GatedDeltaNet layers × ``core_ms``, one layer's delta-rule core the same way;
    * ``streaming_ms`` = ``step_streaming_bytes / (copy_gbps · 1e6)``: norms, SwiGLU, conv,
      rotary, gates and residual adds at the run's copy speed;
    * ``total_ms``, their sum; beside them the counts, ``gemm_tflop`` and ``streaming_gb``, and
      ``gemm_at_shapes_ms``: the same GEMMs each alone at its own shape (``gemms_alone_ms``), the
      share of the GEMM gap that is cuBLAS on these shapes rather than the step's code.

    An unknown rate (None or NaN) makes its term and the total NaN."""
    kinds = list(config.layer_types)
    flop, nbytes = step_gemm_flop(config, T, rank), step_streaming_bytes(config, T)
    terms = {"gemm_ms": flop / (matmul_tflops * 1e9), "attention_ms": kinds.count("full_attention") * _known(sdpa_ms),
             "core_ms": kinds.count("linear_attention") * _known(core_ms), "streaming_ms": nbytes / (copy_gbps * 1e6)}
    return {**terms, "total_ms": sum(terms.values()), "gemm_tflop": flop / 1e12, "streaming_gb": nbytes / 1e9,
            "gemm_at_shapes_ms": _known(gemms_alone_ms)}


def _known(value: float | None) -> float:
    return math.nan if value is None else value


# ----------------------------------------------------------------------------------------------
# The rates, measured in the same run
# ----------------------------------------------------------------------------------------------
def floor_inputs(model, T: int) -> dict:
    """``step_floor``'s rates for ``model`` at ``T``: bench.core's copy and matmul ceilings (NaN on
    a CPU), one layer's SDPA and delta-rule core alone, as the step runs them, and the step's GEMMs
    alone at their shapes (LoRA rank read from the model's adapters)."""
    device = next(model.parameters()).device
    ceilings = measure_ceilings() if device.type == "cuda" else Ceilings(math.nan, math.nan)
    return {"matmul_tflops": ceilings.matmul_tflops, "copy_gbps": ceilings.copy_gbps,
            "sdpa_ms": attention_alone_ms(model, T), "core_ms": delta_rule_alone_ms(model, T),
            "gemms_alone_ms": gemms_alone_ms(model.config.get_text_config(), T, _lora_rank(model), device)}


def _lora_rank(model) -> int:
    """The rank of the model's first LoRA adapter (its A's rows), 0 without one."""
    return next((p.shape[0] for name, p in model.named_parameters() if "lora_A" in name), 0)


def attention_alone_ms(model, T: int) -> float:
    """One full-attention layer's attention at ``T`` tokens, alone: the attention function this
    model is configured with (SDPA by default), on its own attention module, bf16 q [1, heads, T,
    head_dim] and k, v with the key/value heads, forward, recompute and backward. NaN without such
    a layer."""
    attention = next((m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "o_proj")),
                     None)
    if attention is None:
        return math.nan
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = attention.config._attn_implementation
    if implementation in ALL_ATTENTION_FUNCTIONS:
        function = ALL_ATTENTION_FUNCTIONS[implementation]
    else:  # "eager": the modeling module's own
        function = sys.modules[type(attention).__module__].eager_attention_forward
    config = attention.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    q, k, v = (_random((1, h, T, attention.head_dim), attention, seed)
               for seed, h in enumerate((heads, kv_heads, kv_heads)))
    return _alone_ms(lambda: function(attention, q, k, v, None, dropout=0.0, scaling=attention.scaling)[0],
                     (q, k, v))


def delta_rule_alone_ms(model, T: int) -> float:
    """One GatedDeltaNet's delta-rule core at ``T`` tokens, alone: the function the layer calls,
    with inputs of the heads, head dims and dtypes it hands it (``core_call``) — q, k, v in bf16,
    fp32 log-decays g and bf16 β — forward, recompute and backward under bf16 autocast. NaN without
    such a layer. Inputs shaped as the step's keep fla on the launch configurations its autotuning
    chose in the step (a head count of its own would tune afresh: minutes on a new machine)."""
    call = core_call(model)
    if call is None:
        return math.nan
    core, gdn, heads, kwargs = call["function"], call["layer"], call["heads"], call["kwargs"]
    q, k, v = (_random((1, T, h, d), gdn, seed) for seed, (h, d) in enumerate(heads))
    nv = heads[2][0]
    beta = _random((1, T, nv), gdn, 3).sigmoid().detach().requires_grad_()
    g = torch.nn.functional.logsigmoid(_random((1, T, nv), gdn, 4).float()).detach().requires_grad_()

    def run():
        with torch.autocast(device_type=q.device.type, dtype=torch.bfloat16):
            return core(q, k, v, g=g, beta=beta, **kwargs)[0]

    return _alone_ms(run, (q, k, v, g, beta))


def core_call(model, tokens: int = 64) -> dict | None:
    """How this model's first GatedDeltaNet calls its delta-rule core, read from one short forward
    (``tokens`` tokens, no grad): the function (its modeling module's ``torch_chunk_gated_delta_rule``),
    the (heads, dim) of q, k and v as passed (some versions repeat q and k to the value heads first),
    and the keyword arguments other than the tensors and the recurrent state. None without such a layer."""
    from ...hf.gated_delta_net import modeling_module
    from ...hf.modules import is_gated_delta_net

    gdn = next((m for m in model.modules() if is_gated_delta_net(m)), None)
    if gdn is None:
        return None
    owners = [(modeling_module(gdn), "torch_chunk_gated_delta_rule")]
    seen = []

    def recorder(function):
        def record(query, key, value, *args, **kwargs):
            if not seen:
                extra = {k: v for k, v in kwargs.items() if k not in ("g", "beta", "initial_state", "cu_seqlens")}
                seen.append({"function": function, "layer": gdn, "kwargs": {**extra, "output_final_state": False},
                             "heads": [tuple(t.shape[2:4]) for t in (query, key, value)]})
            return function(query, key, value, *args, **kwargs)
        return record

    originals = [(owner, name, getattr(owner, name)) for owner, name in owners]
    ids = torch.zeros(1, tokens, dtype=torch.long, device=next(gdn.parameters()).device)
    try:
        for owner, name, function in originals:
            setattr(owner, name, recorder(function))
        with torch.no_grad(), torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16):
            model(input_ids=ids)
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    return seen[0] if seen else None


def _random(shape, module, seed: int) -> torch.Tensor:
    """A bf16 leaf that requires grad, on ``module``'s device."""
    device = next(module.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device, torch.bfloat16).requires_grad_()


def _alone_ms(function, inputs, reps: int = 3) -> float:
    """``function`` as the step runs it — forward without grad (checkpointing's first pass), forward
    again with grad (its recompute), backward — after one unmeasured run (fla tunes each shape on
    its first call): on a GPU the device time of its kernels, as bench.core measures kernels; on a
    CPU host time (never a speed)."""
    def run():
        with torch.no_grad():
            function()
        out = function()
        out.backward(torch.ones_like(out))
        for t in inputs:
            t.grad = None

    run()
    if inputs[0].device.type == "cuda":
        return kernel_ms([run] * reps)
    times = []
    for _ in range(reps):
        start = _Stamp("cpu")
        run()
        times.append(start.ms_until(_Stamp("cpu")))
    return statistics.median(times)
