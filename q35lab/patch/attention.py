"""Feature ``varlen_attention``: full attention of packed rows without a [T, T] mask, and packed
sequences' boundaries derived from ``position_ids``.

A packed row is block-causal. Instead of SDPA's dense mask, the implementation ``NAME`` hands the
boundaries ``cu_seq_lens = [0, n1, n1 + n2, ..., T]`` to PyTorch's ``varlen_attn`` where flash
attention can run, and is transformers' SDPA for every other call."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings

import torch

from ..hf.gated_delta_net import packing_problem
from ..hf.modules import (
    ATTENTION_CLASSES,
    attention_layers,
    has_cache,
    is_gated_delta_net,
    layer_stacks,
    remove_stack_pre_hooks,
    stack_pre_hooks,
)
from .feature import Feature, Options
from .report import PatchReport

#: The attention implementation's name in transformers' registries (``config._attn_implementation``).
NAME = "q35lab_sdpa_varlen"


@functools.cache
def varlen_attention_function():
    """PyTorch's ``varlen_attn`` (torch ≥ 2.9), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _causal_keyword(function) -> dict:
    """The keyword that makes ``varlen_attn`` causal: ``window_size=(-1, 0)`` or ``is_causal=True``."""
    parameters = inspect.signature(function).parameters
    if "window_size" in parameters:
        return {"window_size": (-1, 0)}
    if "is_causal" in parameters:
        return {"is_causal": True}
    raise RuntimeError("q35lab: this torch's varlen_attn takes neither window_size nor is_causal; "
                       f"its signature: {inspect.signature(function)}")


@functools.cache
def _takes_grouped_heads(function) -> bool:
    """Whether ``varlen_attn`` says it takes fewer key/value heads than query heads (``enable_gqa``)."""
    return "enable_gqa" in inspect.signature(function).parameters


def register() -> None:
    """Register ``NAME`` with transformers' attention and mask registries (SDPA's mask), idempotently."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(NAME, sdpa_or_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def boundaries_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The sequences of one packed row by transformers' rule: one starts wherever ``position_ids``
    ([T] or [1, T]) do not step by one. Returns ``(cu_seq_lens, longest)`` (int32 ``[0, s_1, ..., T]``,
    the longest sequence's tokens), or None for a single sequence. One host sync."""
    if position_ids.dim() == 2 and position_ids.shape[0] == 1:
        position_ids = position_ids[0]
    if position_ids.dim() != 1:
        raise ValueError(f"position_ids: expected one row, [T] or [1, T], got shape {tuple(position_ids.shape)}")
    starts = ((position_ids.diff() != 1).nonzero().flatten() + 1).tolist()  # the sync
    if not starts:
        return None
    edges = [0, *starts, position_ids.shape[0]]
    longest = max(b - a for a, b in zip(edges, edges[1:]))
    return torch.tensor(edges, dtype=torch.int32, device=position_ids.device), longest


def boundaries_agree(cu_seq_lens: torch.Tensor, position_ids: torch.Tensor) -> bool:
    """Whether ``cu_seq_lens`` split one row where its ``position_ids`` do (empty sequences aside)."""
    positions = position_ids.reshape(-1)
    length = positions.shape[0]
    cu = cu_seq_lens.to(device=positions.device, dtype=torch.long).reshape(-1)
    starts = torch.ones(length + 1, dtype=torch.bool, device=positions.device)
    starts[1:length] = positions.diff() != 1
    given = torch.zeros_like(starts)
    given[cu.clamp(0, length)] = True
    valid = (cu[0] == 0) & (cu[-1] == length) & (cu.diff() >= 0).all()
    return bool(valid & torch.equal(given, starts))  # the sync


def block_causal_mask(cu_seq_lens: torch.Tensor, length: int, device) -> torch.Tensor:
    """[1, 1, T, T] boolean, True where a query may see a key: earlier or itself, in its own
    sequence (``cu_seq_lens[i] : cu_seq_lens[i + 1]``)."""
    cu = cu_seq_lens.to(device=device, dtype=torch.long).reshape(-1)
    tokens = torch.arange(length, device=device)
    sequence = torch.searchsorted(cu[1:], tokens, right=True)  # the sequence each token is in
    return ((sequence[:, None] == sequence[None, :]) & (tokens[:, None] >= tokens[None, :]))[None, None]


def _within_sequences(attention_mask, query, key, cu_seq_lens):
    """transformers' mask (None, boolean or additive) narrowed to each query's own sequence."""
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(f"cu_seq_lens_q: packed sequences come as one row (batch 1) whose queries are its keys "
                         f"(no cache), got queries {tuple(query.shape)} and keys {tuple(key.shape)}; pass one row, "
                         "without a cache and with use_cache=False")
    block = block_causal_mask(cu_seq_lens, query.shape[2], query.device)
    if attention_mask is None:
        return block
    if attention_mask.dtype == torch.bool:
        return attention_mask & block
    return attention_mask.masked_fill(~block, torch.finfo(attention_mask.dtype).min)


def flash_can_run(query: torch.Tensor) -> bool:
    """Flash attention's requirements of the tensors: a CUDA device, bf16 or fp16."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


def takes_the_varlen_path(query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """Whether this call goes to ``varlen_attn``: self-attention boundaries given, one row without a
    cache, no dropout, and tensors flash attention takes."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    return (isinstance(cu_q, torch.Tensor) and (cu_k is None or tuple(cu_k.shape) == tuple(cu_q.shape))
            and query.shape[0] == 1 and query.shape[2] == key.shape[2] and not dropout
            and varlen_attention_function() is not None and flash_can_run(query))


def varlen_attention(module, query, key, value, cu_seq_lens, max_length, scaling):
    """Causal attention within each sequence ``cu_seq_lens[i] : cu_seq_lens[i + 1]`` of a packed row:
    ``query`` [1, heads, T, d], ``key``/``value`` [1, kv heads, T, d]; returns [1, T, heads, d]."""
    function = varlen_attention_function()
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query: {heads} heads is not a multiple of the {kv_heads} key/value heads")
    options = {"scale": scaling, **_causal_keyword(function)}
    if kv_heads != heads:  # one key/value head per group of query heads
        if _takes_grouped_heads(function):
            options["enable_gqa"] = True
        else:  # this torch's varlen_attn takes no grouped heads
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d]
    cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    out = function(q, k, v, cu, cu, int(max_length), int(max_length), **options)
    return out[None]


def sdpa_or_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             **kwargs):
    """transformers' ``AttentionInterface``: ``varlen_attention`` where ``takes_the_varlen_path``, else
    SDPA with its mask narrowed to the given boundaries (transformers' mask may not know them)."""
    if takes_the_varlen_path(query, key, dropout, kwargs):
        longest = kwargs.get("max_length_q")
        if longest is None:
            longest = int(kwargs["cu_seq_lens_q"].diff().max())  # a device sync: collators pass it
        return varlen_attention(module, query, key, value, kwargs["cu_seq_lens_q"], longest, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(kwargs.get("cu_seq_lens_q"), torch.Tensor):  # boundaries that transformers' mask may not know
        attention_mask = _within_sequences(attention_mask, query, key, kwargs["cu_seq_lens_q"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def describe() -> str:
    """What the report says runs a packed row's full attention."""
    if varlen_attention_function() is None:
        return (f"SDPA with a dense [T, T] block mask: torch {torch.__version__} has no "
                "torch.nn.attention.varlen (torch >= 2.9 has)")
    return ("torch's variable-length flash attention (varlen_attn) when the row's boundaries are known "
            "(cu_seq_lens, given or derived from position_ids) on a CUDA device in bf16/fp16; SDPA, as "
            "before, for every other call (a packed row's with transformers' block mask)")


class _PackedBoundaries:
    """Forward pre-hook of the decoder-layer stack for a row of packed sequences.

    A row whose text positions restart gets ``cu_seq_lens_q/k`` and ``max_length_q/k`` (the
    GatedDeltaNet never sees ``position_ids``), where transformers' masks would find packing too.
    A packed row runs with ``use_cache=False``: a cache makes transformers' mask ignore the packing.
    Raises ValueError where the GatedDeltaNet and the full attention would not split it alike."""

    def __reduce__(self):  # unpickled in a fresh process: the attention it feeds is registered there too
        return (_packed_boundaries, ())

    def __call__(self, module, args, kwargs):
        derived = {}
        positions = kwargs.get("position_ids")
        text = _text_positions(positions)  # what transformers' masks find packing in
        given = kwargs.get("cu_seq_lens_q")
        if given is None:
            if kwargs.get("attention_mask") is not None or has_cache(kwargs):
                return None  # transformers' masks look for no packing either
            if text is None:
                _refuse_restarting_mrope(positions)
                return None
            if text.shape[0] != 1:
                if bool((text.diff(dim=-1) != 1).any()):  # a sync, for rows of explicit positions only
                    raise ValueError(f"position_ids: {text.shape[0]} rows, and a row holds packed sequences (its "
                                     "positions do not step by one); q35lab keeps packed sequences apart in one row "
                                     "(batch 1): pack them into one row, or pad them with an attention_mask")
                return None
            found = boundaries_from_positions(text)  # the one sync
            if found is None:
                return None  # one sequence: nothing to keep apart
            cu, longest = found
            derived = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        elif has_cache(kwargs):
            raise ValueError("cache: a cache continues one sequence a row, and the row holds packed sequences "
                             "(cu_seq_lens_q); call the model without a cache and with use_cache=False")
        else:
            if text is not None and text.shape[0] == 1 and not boundaries_agree(given, text):
                edges = boundaries_from_positions(text)
                edges = [0, text.shape[-1]] if edges is None else edges[0].tolist()
                raise ValueError(f"cu_seq_lens_q {given.tolist()} and position_ids (sequences at {edges}: a sequence "
                                 "starts wherever they do not step by one) split the row differently; pass "
                                 "boundaries that agree, or only one of them")
            unseen = _attention_misses_boundaries(module, text is None or kwargs.get("attention_mask") is not None)
            if unseen:
                raise ValueError(f"cu_seq_lens_q: {unseen}")
        gdn = next((m for m in module.modules() if is_gated_delta_net(m)), None)
        problem = None if gdn is None else packing_problem(gdn)
        if problem:
            raise ValueError(f"q35lab: a row of packed sequences: {problem}")
        if kwargs.get("use_cache"):
            warnings.warn("q35lab: use_cache=True for a row of packed sequences: it runs with use_cache=False and "
                          "returns no cache (a cache continues one sequence a row, and transformers' mask would "
                          "let the sequences see each other); pass use_cache=False", stacklevel=2)
        return args, {**kwargs, **derived, "use_cache": False}


def _text_positions(positions: torch.Tensor | None) -> torch.Tensor | None:
    """The [B, T] positions transformers' masks read: 2-D ``position_ids`` or the [4, B, T] form's
    first row; None otherwise."""
    if positions is None:
        return None
    if positions.dim() == 2:
        return positions
    if positions.dim() == 3 and positions.shape[0] == 4:
        return positions[0]
    return None


def _refuse_restarting_mrope(positions: torch.Tensor | None) -> None:
    """Refuse restarting [3, B, T] positions: transformers' masks find no packing there, so it would leak."""
    if positions is not None and positions.dim() == 3 and positions.shape[0] == 3 and positions.shape[-1] > 1:
        if bool((positions[0].diff(dim=-1) < 0).any()):  # a sync, for explicit [3, B, T] positions only
            raise ValueError("position_ids: the [3, B, T] rotary positions restart within a row (packed "
                             "sequences), and in this form transformers' attention mask does not find packed "
                             "sequences; pass the [4, B, T] form (the text positions first, as generate builds "
                             "them) or the boundaries as cu_seq_lens_q, one row")


def _attention_misses_boundaries(stack: torch.nn.Module, mask_misses: bool) -> str | None:
    """Why the full attention under ``stack`` would not see ``cu_seq_lens_q``, or None: only q35lab's
    and the flash implementations read them; the others read a mask (``mask_misses``: it misses them)."""
    layer = next((m for m in stack.modules() if type(m).__name__ in ATTENTION_CLASSES), None)
    implementation = str(getattr(getattr(layer, "config", None), "_attn_implementation", None))
    if layer is None or not mask_misses or implementation == NAME or "flash" in implementation:
        return None
    return (f"the full attention ({implementation}) keeps packed sequences apart by transformers' mask, which "
            "finds them only in position_ids and without an attention_mask; pass position_ids that restart at each "
            "sequence and no attention_mask, or patch with varlen_attention=True")


def _packed_boundaries() -> _PackedBoundaries:
    if importlib.util.find_spec("transformers") is not None:
        register()
    return _PackedBoundaries()


class _AttentionConfig:
    """A full-attention layer's view of its model's config in which SDPA reads as ``NAME``: the switch
    stays this model's, not the (possibly shared) config object's."""

    def __init__(self, config):
        object.__setattr__(self, "_q35lab_config", config)

    def __getattr__(self, name):  # every config attribute
        if name == "_q35lab_config":  # not set yet while copy or pickle builds the view
            raise AttributeError(name)
        value = getattr(self._q35lab_config, name)
        return NAME if name == "_attn_implementation" and value == "sdpa" else value

    def __setattr__(self, name, value):
        setattr(self._q35lab_config, name, value)

    def __delattr__(self, name):
        delattr(self._q35lab_config, name)

    def __reduce__(self):  # unpickled in a fresh process: the implementation is registered there too
        return (_attention_config, (self._q35lab_config,))

    def __repr__(self) -> str:
        return f"<q35lab attention view of {type(self._q35lab_config).__name__}>"


def _attention_config(config) -> _AttentionConfig:
    register()
    return _AttentionConfig(config)


def patch_attention(model: torch.nn.Module, report: PatchReport) -> None:
    layers = attention_layers(model)
    switched = [m for m in layers if isinstance(m.config, _AttentionConfig)]
    on_sdpa = [m for m in layers if m not in switched and m.config._attn_implementation == "sdpa"]
    others = {str(m.config._attn_implementation) for m in layers if m not in switched} - {"sdpa"}
    if not on_sdpa:
        if others:
            report.not_applied["varlen_attention"] = (f"the attention runs {', '.join(sorted(others))}, not "
                                                      "transformers' SDPA: left as it is")
        report.already_patched += len(switched)
        return
    if varlen_attention_function() is None:
        report.not_applied["varlen_attention"] = describe()
        return
    views = {}
    for m in on_sdpa:  # one view per config object, shared by the layers of this model that share it
        if id(m.config) not in views:
            views[id(m.config)] = _attention_config(m.config)
        m.config = views[id(m.config)]
    report.replaced[f"{type(on_sdpa[0]).__name__} (SDPA; packed rows: varlen flash attention)"] += len(on_sdpa)


def unpatch_attention(model: torch.nn.Module, report: PatchReport) -> None:
    switched = [m for m in attention_layers(model) if isinstance(m.config, _AttentionConfig)]
    for m in switched:
        m.config = m.config._q35lab_config
    if switched:
        report.reverted[f"{type(switched[0]).__name__} (SDPA)"] += len(switched)


def derive_packed_boundaries(model: torch.nn.Module) -> None:
    """Register ``_PackedBoundaries`` on every module that holds decoder layers (once)."""
    for stack in layer_stacks(model):
        if not stack_pre_hooks(stack, _PackedBoundaries):
            stack.register_forward_pre_hook(_PackedBoundaries(), with_kwargs=True)


def forget_packed_boundaries(model: torch.nn.Module) -> None:
    for stack in layer_stacks(model):
        remove_stack_pre_hooks(stack, _PackedBoundaries)


def _apply(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    patch_attention(model, report)


def _revert(model: torch.nn.Module, report: PatchReport) -> None:
    unpatch_attention(model, report)


def _apply_boundaries(model: torch.nn.Module, report: PatchReport, options: Options) -> None:
    if any(is_gated_delta_net(m) for m in model.modules()):
        derive_packed_boundaries(model)  # said in report.runs["packed batches"]


def _revert_boundaries(model: torch.nn.Module, report: PatchReport) -> None:
    forget_packed_boundaries(model)


FEATURE = Feature("varlen_attention", "varlen_attention", _apply, _revert)
BOUNDARIES = Feature("packed boundaries", None, _apply_boundaries, _revert_boundaries)
