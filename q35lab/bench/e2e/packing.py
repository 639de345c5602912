"""Fine-tuning batches of many short sequences: a length mix like chat SFT data, packed into one
row or padded per micro-batch — the same tokens either way, so the two steps compute the same loss.

The mix: conversation lengths drawn from a log-normal distribution whose mean is that of
LMSYS-Chat-1M (Zheng et al., 2023, arXiv 2309.11998, Table 1: 2.0 turns a conversation, 69.5
prompt and 214.5 response tokens a turn on average, so 2.0 · (69.5 + 214.5) = 568 tokens); the
spread ``SFT_SIGMA`` is our choice (the paper gives no spread), clipped at ``SFT_LONGEST``.
Generated from a seed, never downloaded.

* packed: one row of exactly T tokens, the sequences one after another (the last one cut to fill
  the row), as transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes
  it: ``position_ids`` restarting at each sequence, ``cu_seq_lens_q/k`` and ``max_length_q/k``
  for the kernels that take boundaries, and each sequence's first label masked (it is not
  predicted from the sequence before it);
* padded: the same sequences in the same order, in micro-batches of rows padded to the micro-
  batch's longest (right padding, ``attention_mask``, padded labels masked), each micro-batch at
  most T tokens with its padding, trained by gradient accumulation.

A micro-batch's loss is the model's mean over its predicted tokens; weighted by its share of all
predicted tokens (``weight``), the micro-batches' losses sum to the mean over every predicted
token — what the packed row's loss is.
"""

from __future__ import annotations

import math

import torch

SFT_MEAN_TOKENS = 2.0 * (69.5 + 214.5)  # LMSYS-Chat-1M's mean conversation (Table 1 of arXiv 2309.11998)
SFT_SIGMA = 1.0  # log-normal spread of ln(length): our assumption
SFT_LONGEST = 8192  # longer conversations are cut here (a common SFT max_length)
SFT_SHORTEST = 8


def sft_lengths(T: int, seed: int = 0, mean: float = SFT_MEAN_TOKENS, sigma: float = SFT_SIGMA,
                longest: int = SFT_LONGEST, shortest: int = SFT_SHORTEST) -> list[int]:
    """Sequence lengths, log-normal with the given mean (median mean·e^(−σ²/2)), clipped to
    [shortest, longest], drawn until they fill ``T`` tokens exactly (the last one cut)."""
    if T < 1:
        raise ValueError(f"T: expected at least 1 token, got {T}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    mu = math.log(mean) - sigma ** 2 / 2
    lengths, total = [], 0
    while total < T:
        draw = math.exp(mu + sigma * float(torch.randn((), generator=generator)))
        n = min(T - total, max(shortest, min(longest, round(draw))))
        lengths.append(n)
        total += n
    return lengths


def _sequences(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def _predicted(lengths) -> int:
    return sum(n - 1 for n in lengths)


def pack_sequences(sequences: list[torch.Tensor]) -> dict:
    """The model's keyword arguments for 1-D token sequences in one row (see the module's text),
    on the sequences' device."""
    lengths = [len(s) for s in sequences]
    ids = torch.cat(sequences)[None]
    device = ids.device
    labels = ids.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    labels[0, cu[:-1].long()] = -100
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    return dict(input_ids=ids, labels=labels, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=max(lengths), max_length_k=max(lengths))


def packed_batch(lengths: list[int], vocab: int, device, seed: int = 0) -> list[dict]:
    """One micro-batch: the sequences in one row, with their boundaries (``pack_sequences``)."""
    sequences = [s.to(device) for s in _sequences(lengths, vocab, seed)]
    return [{"kwargs": pack_sequences(sequences), "weight": 1.0, "real_tokens": sum(lengths), "tokens": sum(lengths)}]


def padded_batches(lengths: list[int], vocab: int, device, seed: int = 0,
                   tokens_per_batch: int | None = None) -> list[dict]:
    """The same sequences (same ids as ``packed_batch``), in order, in micro-batches padded to
    their longest, each at most ``tokens_per_batch`` tokens with padding (default: all of them)."""
    sequences = _sequences(lengths, vocab, seed)
    budget = tokens_per_batch or sum(lengths)
    groups, group = [], []
    for s in sequences:
        if group and (len(group) + 1) * max(len(s), *map(len, group)) > budget:
            groups.append(group)
            group = []
        group.append(s)
    groups.append(group)
    groups = [g for g in groups if _predicted(map(len, g))]  # a lone 1-token sequence predicts nothing (its loss: NaN)
    total = _predicted(lengths)
    batches = []
    for group in groups:
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, s in enumerate(group):
            ids[row, :len(s)], mask[row, :len(s)] = s, 1
        labels = ids.masked_fill(mask == 0, -100)
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
        batches.append({"kwargs": {k: v.to(device) for k, v in batch.items()},
                        "weight": _predicted(map(len, group)) / total if total else 0.0,
                        "real_tokens": sum(map(len, group)), "tokens": ids.numel()})
    return batches


def sft_batch(kind: str, T: int, vocab: int, device, seed: int = 0) -> list[dict]:
    """``kind`` "packed" or "padded": the micro-batches of one step over ``T`` tokens of the mix."""
    lengths = sft_lengths(T, seed)
    if kind == "packed":
        return packed_batch(lengths, vocab, device, seed)
    if kind == "padded":
        return padded_batches(lengths, vocab, device, seed, tokens_per_batch=T)
    raise ValueError(f"batch: expected 'packed' or 'padded', got {kind!r}")
