"""Full attention of packed rows without a [T, T] mask: transformers' SDPA, except where a row's
sequence boundaries are known, which go to PyTorch's variable-length flash attention.

A packed row (many short sequences in one row, ``position_ids`` starting anew at each) is block-
causal: token t attends to the tokens of its own sequence up to itself. transformers' SDPA path
writes that as a dense boolean mask, [1, 1, T, T] (1 GiB at T = 32k), and SDPA with an arbitrary
mask cannot skip the blocks the mask rules out: it computes every query against every key, about
T² where the row's real work is Σ nᵢ² over its sequences (a small part of T² for chat-length
sequences, ``bench.e2e.sft_lengths``).

``torch.nn.attention.varlen.varlen_attn`` takes the sequences as cumulative boundaries
``cu_seq_lens = [0, n₁, n₁ + n₂, ..., T]`` and runs flash attention over each sequence alone:
the row costs what its sequences cost. q35lab registers one attention implementation with
transformers (``NAME``): given ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (the packing collator's
``return_flash_attn_kwargs``, or derived by q35lab from ``position_ids``), on a CUDA
device, in bf16 or fp16, one row whose queries are its keys, it calls ``varlen_attn``; every other
call (padding masks, a cache, fp32, a CPU, no boundaries) is transformers' own SDPA function with
transformers' own SDPA mask, unchanged, except that a call with boundaries gets that mask narrowed
to each sequence (transformers finds packing only in position_ids, and not beside an attention
mask). On the varlen path the mask is not read: the boundaries say it, as on transformers' flash path.
"""

from __future__ import annotations

import functools
import inspect

import torch

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
    """The keyword that makes ``varlen_attn`` causal: ``window_size=(-1, 0)`` (newer torch) or
    ``is_causal=True`` (the first releases). Read once per function, not per call."""
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
    """Register ``NAME`` with transformers' attention and mask registries (idempotent): the
    attention function below, and SDPA's mask function (so a padded batch gets SDPA's mask)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(NAME, sdpa_or_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def boundaries_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The sequences of one packed row by transformers' rule (``masking_utils.find_packed_sequence_indices``,
    which its SDPA, eager and flex masks follow): a sequence starts wherever ``position_ids`` do not step
    by one, so rows restarting at 0 or at 1 both split. ``position_ids``: [T] or [1, T]. Returns
    ``(cu_seq_lens, longest)`` (int32 ``[0, s_1, ..., T]`` on the positions' device, the longest
    sequence's tokens), or None for a row of one sequence. One host sync."""
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
    """Whether ``cu_seq_lens`` ([0, s_1, ..., T]) split one row where its ``position_ids`` ([T] or
    [1, T]) do by ``boundaries_from_positions``' rule (empty sequences aside). One host sync."""
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
    """The mask transformers built (None: causal; boolean: True attends; float: added to the
    scores), narrowed to each query's own sequence: SDPA reads a mask, not boundaries."""
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
    """Whether this call's boundaries go to ``varlen_attn``: boundaries given (the same for keys
    as for queries: self-attention), one row whose queries are its keys (no cache in front of
    them), no dropout, and tensors flash attention takes (``flash_can_run``)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    return (isinstance(cu_q, torch.Tensor) and (cu_k is None or tuple(cu_k.shape) == tuple(cu_q.shape))
            and query.shape[0] == 1 and query.shape[2] == key.shape[2] and not dropout
            and varlen_attention_function() is not None and flash_can_run(query))


def varlen_attention(module, query, key, value, cu_seq_lens, max_length, scaling):
    """Causal attention within each sequence of a packed row: ``query`` [1, heads, T, d], ``key``
    and ``value`` [1, kv heads, T, d] (grouped-query: heads a multiple of kv heads), sequence i
    the tokens ``cu_seq_lens[i] : cu_seq_lens[i + 1]``; returns [1, T, heads, d], as
    transformers' attention functions do."""
    function = varlen_attention_function()
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query: {heads} heads is not a multiple of the {kv_heads} key/value heads")
    options = {"scale": scaling, **_causal_keyword(function)}
    if kv_heads != heads:  # one key/value head per group of query heads
        if _takes_grouped_heads(function):
            options["enable_gqa"] = True
        else:  # (a torch whose varlen_attn does not say it takes fewer key/value heads)
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d]
    cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    out = function(q, k, v, cu, cu, int(max_length), int(max_length), **options)
    return out[None]


def sdpa_or_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             **kwargs):
    """transformers' attention-function interface (``AttentionInterface``): ``varlen_attention``
    where ``takes_the_varlen_path``, else transformers' ``sdpa_attention_forward``, its mask narrowed
    to each sequence where the call carries boundaries (``cu_seq_lens_q``): transformers' mask
    knows them only from position_ids, and only without an attention mask."""
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
