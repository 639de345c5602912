"""The memory model: a LoRA training step's peak as ``fixed + T · per_token`` bytes, term by term
(``bytes_per_token``)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from ..ops._checks import check_int, check_real
from .tiles import check_tile_tokens

GiB = 2**30

KiB = 2**10


def layer_count(name: str, value: object, available: int) -> int:
    """How many of ``available`` decoder layers ``value`` asks for: a fraction (a float in [0, 1]) or
    a count (an int in [0, available]); ``TypeError`` / ``ValueError`` naming ``name`` else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a fraction of the decoder layers (a float in [0, 1]) or a count (an int), "
                        f"got {value!r}")
    if isinstance(value, numbers.Integral):
        if not 0 <= value <= available:
            raise ValueError(f"{name}: expected a count in [0, {available}] (the model's decoder layers), got {value}")
        return int(value)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(f"{name}: expected a fraction in [0, 1] of the decoder layers, got {value}")
    return round(value * available)


#: What an H200 leaves to a training process (of its 140 GiB; the CUDA context and NCCL take the rest).
H200_USABLE_BYTES = 139 * GiB


@dataclass(frozen=True)
class _Dims:
    H: int
    I: int
    L: int
    V: int
    layer_types: tuple
    Hk: int
    Hv: int
    dk: int
    dv: int
    conv_kernel: int
    nq: int
    nkv: int
    hd: int
    rotary: int
    tied: bool

    @property
    def key_dim(self):
        return self.Hk * self.dk

    @property
    def value_dim(self):
        return self.Hv * self.dv

    @property
    def conv_dim(self):
        return 2 * self.key_dim + self.value_dim


#: What the memory model reads of a config (a dense Qwen3.5 text config has them all).
_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                  "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim")


def dims(config) -> _Dims:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_experts", None):
        raise NotImplementedError(
            f"config: expected a dense Qwen3.5 config, got a MoE one ({type(text).__name__}): the memory model does "
            "not cover routed experts; pass tiled_mlp, tiled_gdn and offload_checkpoints to apply_to_qwen3_5 yourself")
    missing = [name for name in _CONFIG_FIELDS if getattr(text, name, None) is None]
    if missing:
        raise TypeError(f"config: expected a dense Qwen3.5 config (transformers' Qwen3_5TextConfig, or a config "
                        f"holding one), got {type(config).__name__} without {', '.join(missing)}")
    L = text.num_hidden_layers
    layer_types = tuple(getattr(text, "layer_types", None) or ["full_attention"] * L)[:L]
    rope = getattr(text, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
    hd = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return _Dims(H=text.hidden_size, I=text.intermediate_size, L=L, V=text.vocab_size, layer_types=layer_types,
                 Hk=text.linear_num_key_heads, Hv=text.linear_num_value_heads, dk=text.linear_key_head_dim,
                 dv=text.linear_value_head_dim, conv_kernel=text.linear_conv_kernel_dim,
                 nq=text.num_attention_heads, nkv=text.num_key_value_heads, hd=hd, rotary=int(hd * factor),
                 tied=bool(getattr(text, "tie_word_embeddings", False)))


def _linears(d: _Dims) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every nn.Linear of one layer of each kind (what LoRA "all-linear" adapts)."""
    mlp = [(d.H, d.I), (d.H, d.I), (d.I, d.H)]
    gdn = [(d.H, d.conv_dim), (d.H, d.value_dim), (d.H, d.Hv), (d.H, d.Hv), (d.value_dim, d.H)]
    attn = [(d.H, 2 * d.nq * d.hd), (d.H, d.nkv * d.hd), (d.H, d.nkv * d.hd), (d.nq * d.hd, d.H)]
    return {"mlp": mlp, "linear_attention": gdn, "full_attention": attn}


def parameter_count(config) -> int:
    """Parameters of a dense Qwen3.5 text model (embeddings, head unless tied, every layer) of
    ``config``, a ``Qwen3_5TextConfig`` or a config holding one."""
    d = dims(config)
    lin = _linears(d)
    count = d.V * d.H * (1 if d.tied else 2) + d.H  # embeddings, lm_head, final norm
    for kind in d.layer_types:
        count += 2 * d.H + sum(i * o for i, o in lin["mlp"] + lin[kind])  # two norms, MLP, mixer
        if kind == "linear_attention":
            count += d.conv_dim * d.conv_kernel + 2 * d.Hv + d.dv  # conv1d, dt_bias + A_log, gated norm
        else:
            count += 2 * d.hd  # q_norm, k_norm
    return count


def lora_parameter_count(config, rank: int = 16, targets: str | tuple = "all-linear") -> int:
    """LoRA parameters, r·(in + out) per adapted linear of every layer ("all-linear": each of them, lm_head
    excluded, as PEFT; or a tuple of projection kinds: "mlp", "mixer")."""
    rank = check_int("rank", rank, minimum=0, what="the LoRA rank")
    if targets != "all-linear" and (isinstance(targets, str) or not set(targets) <= {"mlp", "mixer"}):
        raise ValueError(f"targets: expected 'all-linear' or a tuple of 'mlp' and 'mixer', got {targets!r}")
    d = dims(config)
    lin = _linears(d)
    kinds = ("mlp", "mixer") if targets == "all-linear" else tuple(targets)
    total = 0
    for kind in d.layer_types:
        pairs = (lin["mlp"] if "mlp" in kinds else []) + (lin[kind] if "mixer" in kinds else [])
        total += sum(rank * (i + o) for i, o in pairs)
    return total


def _gdn_terms(d: _Dims, e: int, r: int) -> tuple[dict, dict]:
    """The untiled GatedDeltaNet's per-token bytes: what its forward saves, what its backward adds."""
    H, Hv, dk, dv, vd = d.H, d.Hv, d.dk, d.dv, d.value_dim
    saved = {
        "GDN: input (saved by in_proj)": H * e,
        # z has a buffer of its own (the patch's own_buffer): the norm's reshape of it is a view
        "GDN: in_proj output [qkv|b|a], one buffer (saved by the conv)": (d.conv_dim + 2 * Hv) * e,
        "GDN: in_proj z, its own buffer (saved by the gated norm)": vd * e,
        "GDN: beta, softplus in/out, g (fp32)": Hv * (e + 12),
        "GDN core: q, k l2-normed + fp32 rstd": 2 * (d.key_dim * e + 4 * d.Hk),
        "GDN core: v (contiguous copy)": vd * e,
        "GDN core: A (WY, 64 per value head)": Hv * 64 * e,
        "GDN core: output (saved by gated norm)": vd * e,
        "GDN: gated-norm output (saved by out_proj)": vd * e,
        "GDN: LoRA x·Aᵀ (5 adapters)": 5 * r * e,
    }
    backward = {
        "GDN backward: d(out), dz from the gated norm": 2 * vd * e,
        "GDN core backward: w, u, v_new (recomputed)": (Hv * dk + 2 * Hv * dv) * e,
        "GDN core backward: h, dh (chunk states, per 64 tokens)": 2 * Hv * dk * dv * e / 64,
        "GDN core backward: dv, dw": (Hv * dv + Hv * dk) * e,
        "GDN core backward: dq, dk (per value head)": 2 * Hv * dk * e,
    }
    return saved, backward


def _gdn_carry_bytes(d: _Dims, e: int) -> int:
    """One tile's carry in the tiled GatedDeltaNet: the recurrent state S [Hv, dk, dv] in fp32 and
    the conv's last K−1 input rows [K−1, conv_dim] (a batch row's)."""
    return 4 * d.Hv * d.dk * d.dv + (d.conv_kernel - 1) * d.conv_dim * e


def _held_bytes(d: _Dims, e: int, r: int) -> dict[str, float]:
    """Per-token bytes a decoder layer of each kind holds from its forward to its backward when it runs without
    checkpointing: its input (saved by the input norm) and what its modules save, the terms of ``_phase_terms``'s
    untiled phases less what only the backward makes (the MLP's dh)."""
    phases = _phase_terms(d, e, r, tiled=False)
    held = {}
    for kind, phase in (("linear_attention", "MLP backward (GatedDeltaNet layer)"),
                        ("full_attention", "MLP backward (attention layer)")):
        if phase in phases:
            terms = {name: value for name, value in phases[phase].items() if not name.startswith("MLP backward")}
            held[kind] = d.H * e + sum(terms.values())
    return held


def _phase_terms(d: _Dims, e: int, r: int, tiled: bool, gdn_tile: int | None = None) -> dict[str, dict[str, float]]:
    """Per-token bytes of each phase of one layer's backward (checkpoints and residual excluded), counted from the
    code that runs: q35lab's patched modules (fused in_proj and gate/up, SwiGLU with the down projection in its node,
    norms, conv, LoRA saving ``x·Aᵀ`` of r values), fla's ``chunk_gated_delta_rule`` (saves l2-normed q, k with their
    rstd, v, g, beta and the WY matrix A, 64 values per token and value head; its backward recomputes w, u, the chunk
    states h and makes dh, dv, dw, dq, dk) and SDPA's flash backend (saves q, k, v, out, lse; an fp32 dq accumulator).

    ``tiled``: the MLP is tiled (its input and dx stay per token). ``gdn_tile``: GatedDeltaNet layers are tiled whole
    at this many tokens, their backward one phase of input and dx per token; ``bytes_per_token`` counts the rest as
    one tile's (fixed) and the carries as common to every phase."""
    H, I = d.H, d.I
    q = d.nq * d.hd
    kv = d.nkv * d.hd
    norm = {"post-attention norm: input + fp32 rstd": H * e + 4, "input norm: fp32 rstd": 4}
    if tiled:
        mlp = {"MLP: input (saved once by the tiling)": H * e, "MLP: dx of the whole sequence": H * e}
    else:
        # swiglu_down keeps no SwiGLU output: dh's buffer takes h again for the down adapter's dA,
        # and dgate, dup are written over the gate/up output
        mlp = {"MLP: input (saved by gate/up)": H * e, "MLP: gate/up output [2I]": 2 * I * e,
               "MLP: LoRA x·Aᵀ (3 adapters)": 3 * r * e, "MLP backward: dh [I], then h rebuilt in it": I * e}
    gdn_saved, gdn_bwd = _gdn_terms(d, e, r)
    attn_saved = {
        "attention: input (saved by q/k/v)": H * e,
        "attention: q-norm input (contiguous copy)": q * e,
        "attention: k-norm input": kv * e,
        "attention: q, k after RoPE, v (saved by SDPA)": (q + 2 * kv) * e,
        "attention: SDPA output + its contiguous copy": 2 * q * e,
        "attention: sigmoid(gate), gated output (saved by o_proj)": 2 * q * e,
        "attention: lse (fp32)": 4 * d.nq,
        "attention: LoRA x·Aᵀ (4 adapters)": 4 * r * e,
    }
    attn_bwd = {
        "attention backward: d(gated), d(out), d(gate)": 3 * q * e,
        "attention backward: dq fp32 accumulator, dq, dk, dv": 4 * q + (q + 2 * kv) * e,
    }
    phases = {}
    kinds = set(d.layer_types)
    if "linear_attention" in kinds and gdn_tile is not None:
        phases["GatedDeltaNet layer backward (tiled)"] = {"GDN layer: input (saved once by the tiling)": H * e,
                                                          "GDN layer: dx of the whole sequence": H * e}
    elif "linear_attention" in kinds:
        phases["MLP backward (GatedDeltaNet layer)"] = {**gdn_saved, **norm, **mlp}
        phases["GatedDeltaNet backward"] = {**gdn_saved, **gdn_bwd, "input norm: fp32 rstd": 4}
    if "full_attention" in kinds:
        phases["MLP backward (attention layer)"] = {**attn_saved, **norm, **mlp}
        phases["attention backward"] = {**attn_saved, **attn_bwd, "input norm: fp32 rstd": 4}
    return phases


@dataclass
class MemoryModel:
    """The predicted peak of a LoRA training step, made by ``bytes_per_token``: ``fixed + T · per_token``
    bytes on the GPU and ``T · host_per_token`` in host memory.

    Attributes:
        terms (dict): per-token bytes at the peak phase, by name.
        phase (str): the phase of one layer's backward (or the loss) where the peak falls.
        phases (dict): each phase's per-token bytes.
        fixed (dict): the constant bytes, by name (weights, adapters and optimizer, slack, tiles).
        host_per_token (float): host bytes a token for the offloaded checkpoints.
        offloaded_layers (int): the decoder layers whose checkpoints are offloaded, of ``layers``.
        not_checkpointed (tuple): the decoder layers that run without gradient checkpointing.
    """

    terms: dict
    phase: str
    phases: dict
    fixed: dict
    host_per_token: float
    offloaded_layers: int
    layers: int
    notes: list = field(default_factory=list)
    not_checkpointed: tuple = ()

    @property
    def per_token(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def fixed_bytes(self) -> float:
        return float(sum(self.fixed.values()))

    def peak(self, tokens: int) -> float:
        """The predicted peak bytes of a step of ``tokens`` tokens."""
        return self.fixed_bytes + check_real("tokens", tokens, minimum=0) * self.per_token

    def longest_fit(self, gpu_bytes: float = H200_USABLE_BYTES, host_bytes: float | None = None,
                    multiple: int = 1024) -> int:
        """The most tokens, a multiple of ``multiple``, whose peak fits ``gpu_bytes`` and whose host copies fit
        ``host_bytes`` (if given); 0 where none do.

        Raises:
            TypeError: an argument not a number (``multiple`` not an int).
            ValueError: a negative or infinite number of bytes, ``multiple`` below 1.
        """
        gpu_bytes = memory_bytes(gpu_bytes, "gpu_bytes")
        host_bytes = None if host_bytes is None else memory_bytes(host_bytes, "host_bytes")
        multiple = check_int("multiple", multiple, minimum=1, what="tokens")
        tokens = (gpu_bytes - self.fixed_bytes) / self.per_token
        if host_bytes is not None and self.host_per_token:
            tokens = min(tokens, host_bytes / self.host_per_token)
        return max(0, int(tokens) // multiple * multiple)

    def table(self) -> str:
        width = max(map(len, list(self.terms) + list(self.fixed)))
        rows = [f"peak phase: {self.phase}"]
        rows += [f"  {name:<{width}}  {value / KiB:9.2f} KiB/token" for name, value in self.terms.items()]
        rows.append(f"  {'total':<{width}}  {self.per_token / KiB:9.2f} KiB/token")
        rows += [f"  {name:<{width}}  {value / GiB:9.2f} GiB" for name, value in self.fixed.items()]
        if self.host_per_token:
            rows.append(f"  host: {self.host_per_token / KiB:.2f} KiB/token "
                        f"({self.offloaded_layers} of {self.layers} layers)")
        return "\n".join(rows)


def bytes_per_token(config, *, tiled_mlp_tokens: int | None = None, tiled_gdn_tokens: int | None = None,
                    offload: float | int | bool = False,
                    lora_rank: int = 16, dtype_bytes: int = 2, weight_bytes: int | None = None,
                    adapter_bytes: int = 4, batch: int = 1, loss_chunk_bytes: int | None = None,
                    slack_bytes: float = 2 * GiB, other_trainable_parameters: int = 0,
                    not_checkpointed=()) -> MemoryModel:
    """Predict the peak of a Qwen3.5 LoRA step under gradient checkpointing, ``fixed + T · per_token``, term by term.

    Per token (e = ``dtype_bytes``, H the hidden size): the checkpoint inputs on the GPU at the peak (L·H·e; with k
    layers offloaded max(L − k, 2)·H·e), the residual stream's gradients (3·H·e), token ids, labels, positions and
    RoPE, and the largest phase: one layer's backward working set (MLP, GatedDeltaNet or attention, ``_phase_terms``;
    a tiled one keeps its input and dx, 2·H·e, and its carries) or the loss at the end of the forward (its logits
    chunked). A layer that runs without checkpointing (``not_checkpointed``) holds, in place of its H·e checkpoint
    input, its input and everything its modules save (``_held_bytes``) in every phase: the count is the backward's
    first layer, where every layer's activations are alive. Fixed: the weights, the adapters with their gradients and
    AdamW's two fp32 moments, one chunk of the fused loss's logits, one tile's working set where tiled, and
    ``slack_bytes``.

    Args:
        config: a dense Qwen3.5 text config (``Qwen3_5TextConfig``, or a config holding one).
        tiled_mlp_tokens (int, optional): the MLP's tile. Default: None (untiled).
        tiled_gdn_tokens (int, optional): the GatedDeltaNet decoder layer's tile. Default: None.
        offload (bool, float or int): the decoder layers whose checkpoints are in host memory: all
            (True), none (False), a fraction in [0, 1] or a count. Default: False.
        lora_rank (int): the adapters' rank, on every linear layer. Default: 16.
        dtype_bytes (int): bytes of an activation. Default: 2 (bf16).
        weight_bytes (int, optional): bytes of a frozen weight. Default: ``dtype_bytes``.
        adapter_bytes (int): bytes of an adapter's parameter. Default: 4 (fp32).
        batch (int): the step's rows, each of the tokens a step is planned for. Default: 1.
        loss_chunk_bytes (int, optional): a chunk of logits. Default: ``ops.linear_cross_entropy.CHUNK_BYTES``.
        slack_bytes (float): cuBLAS workspaces, allocator rounding. Default: 2 GiB.
        other_trainable_parameters (int): parameters that train besides the adapters (``modules_to_save``, a full
            fine-tune), each with a gradient and two AdamW moments. Default: 0.
        not_checkpointed (iterable of int): the indices of decoder layers that run without gradient checkpointing
            (untiled, nothing offloaded). Default: () (every layer checkpointed).

    Returns:
        MemoryModel: the terms; its ``peak(T)`` and ``longest_fit(gpu_bytes)`` read them.

    Raises:
        TypeError: ``config`` not a dense Qwen3.5 config, an argument not of the type above.
        ValueError: an argument out of range.
        NotImplementedError: a MoE config.
    """
    d = dims(config)
    e = check_int("dtype_bytes", dtype_bytes, minimum=1, what="bytes of an activation")
    r = check_int("lora_rank", lora_rank, minimum=0, what="the adapters' rank")
    weight_bytes = e if weight_bytes is None else check_int("weight_bytes", weight_bytes, minimum=1,
                                                            what="bytes of a weight")
    adapter_bytes = check_int("adapter_bytes", adapter_bytes, minimum=1, what="bytes of an adapter's parameter")
    batch = check_int("batch", batch, minimum=1, what="rows")
    if loss_chunk_bytes is not None:
        loss_chunk_bytes = check_int("loss_chunk_bytes", loss_chunk_bytes, minimum=0, what="bytes")
    slack_bytes = memory_bytes(slack_bytes, "slack_bytes")
    other_trainable_parameters = check_int("other_trainable_parameters", other_trainable_parameters, minimum=0,
                                           what="parameters")
    if tiled_mlp_tokens is not None:
        tiled_mlp_tokens = check_tile_tokens(tiled_mlp_tokens, "tiled_mlp_tokens")
    if offload is True:
        k = d.L
    elif offload is False or offload is None:
        k = 0
    else:
        k = layer_count("offload", offload, d.L)
    on_gpu = d.L if k == 0 else max(d.L - k, min(2, d.L))
    plain = layer_indices("not_checkpointed", not_checkpointed, d.L)
    if plain and (k or tiled_mlp_tokens is not None or tiled_gdn_tokens is not None):
        raise ValueError("not_checkpointed: the tiles and the offload run in checkpointed layers; give layers that "
                         "run without checkpointing, or the tiles and offload, not both")
    held = {}
    if plain:
        per_kind = _held_bytes(d, e, r)
        on_gpu = d.L - len(plain)
        held[f"activations of {len(plain)} decoder layers run without checkpointing"] = sum(
            per_kind[d.layer_types[i]] for i in plain)
    common = {
        f"checkpoint inputs ({on_gpu} of {d.L} layers on the GPU)": on_gpu * d.H * e,
        **held,
        "residual-stream gradients": 3 * d.H * e,
        "token ids, labels, positions, RoPE": 8 + 8 + 32 + 2 * d.rotary * e,
    }
    gdn_tile = None if tiled_gdn_tokens is None else check_tile_tokens(tiled_gdn_tokens, "tiled_gdn_tokens")
    gdn_layers = d.layer_types.count("linear_attention")
    carries = {}  # held from each tiled layer's forward to its backward: alive in every phase
    if gdn_tile is not None and gdn_layers:
        carries[f"GDN layers: carries held into each tile ({gdn_layers} layers)"] = (
            gdn_layers * _gdn_carry_bytes(d, e) / gdn_tile)
    common.update(carries)
    phases = {name: {**common, **terms} for name, terms in
              _phase_terms(d, e, r, tiled=tiled_mlp_tokens is not None, gdn_tile=gdn_tile).items()}
    phases["loss (end of forward)"] = {
        f"checkpoint inputs ({d.L - k - len(plain)} of {d.L} layers on the GPU)": (d.L - k - len(plain)) * d.H * e,
        **held,
        "final norm: input, output": 2 * d.H * e,
        "fused loss: dx (computed in forward)": d.H * e,
        "token ids, labels, positions, RoPE": common["token ids, labels, positions, RoPE"],
        **carries,
    }
    totals = {name: sum(terms.values()) for name, terms in phases.items()}
    phase = max(totals, key=totals.get)
    if loss_chunk_bytes is None:
        from ..ops.linear_cross_entropy import CHUNK_BYTES
        loss_chunk_bytes = CHUNK_BYTES
    fixed = {
        "weights": parameter_count(config) * weight_bytes,
        "LoRA adapters + gradients + AdamW moments": lora_parameter_count(config, r) * (2 * adapter_bytes + 8),
        "fused loss: one chunk of logits": loss_chunk_bytes,
        "slack: workspaces, allocator rounding": slack_bytes,
    }
    if other_trainable_parameters:
        fixed["other trainable parameters: gradients + AdamW moments"] = other_trainable_parameters * (weight_bytes + 8)
    # a tile's input, gate/up output and dh (h rebuilt in it): the untiled MLP's terms, per token
    mlp_tile_terms = (d.H + 3 * d.I) * e
    if tiled_mlp_tokens is not None:
        fixed["MLP: one tile's working set"] = (check_tile_tokens(tiled_mlp_tokens, "tiled_mlp_tokens") * batch
                                                * mlp_tile_terms)
    if gdn_tile is not None and "linear_attention" in d.layer_types:
        saved, backward = _gdn_terms(d, e, r)
        # the GatedDeltaNet's saved and backward terms, the norms' inputs, the MLP's untiled terms, two carries (the
        # one handed on and its gradient), and a later tile's conv input: the carried K−1 rows and the tile's
        layer_terms = 2 * (d.H * e + 4) + mlp_tile_terms + 3 * r * e  # + the MLP's LoRA
        fixed["GatedDeltaNet layer: one tile's working set"] = batch * (
            gdn_tile * (sum(saved.values()) + sum(backward.values()) + layer_terms)
            + 2 * _gdn_carry_bytes(d, e) + (gdn_tile + d.conv_kernel - 1) * d.conv_dim * e)
    terms = {name: value * batch for name, value in phases[phase].items()}
    return MemoryModel(terms=terms, phase=phase, phases={n: t * batch for n, t in totals.items()}, fixed=fixed,
                       host_per_token=k * d.H * e * batch, offloaded_layers=k, layers=d.L, not_checkpointed=plain)


def layer_indices(name: str, value, layers: int) -> tuple[int, ...]:
    """Distinct decoder-layer indices in [0, ``layers``), sorted; errors name ``name``."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name}: expected an iterable of decoder-layer indices (ints), got {value!r}")
    indices = set()
    for index in value:
        indices.add(check_int(name, index, minimum=0, maximum=layers - 1, what="a decoder-layer index"))
    return tuple(sorted(indices))


def memory_bytes(value: object, name: str) -> float:
    """A memory size in bytes: a finite real number, not below zero."""
    return check_real(name, value, minimum=0, what="bytes")
