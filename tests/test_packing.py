"""Packed batches (issue 18): sequences of different lengths in one row, as transformers' packing
collator makes them (position_ids restarting per sequence, cu_seq_lens_* for the GatedDeltaNet,
the first label of each sequence masked), give per sequence what each sequence gives alone."""

import copy
import importlib.util

import peft
import pytest
import torch
from conftest import patch_everywhere

import q35lab
from q35lab.hf import gated_delta_net as hf_gdn
from q35lab.runtime import device
from tiny_models import TEXT, assert_same_loss_and_grads, lora_causal_lm


def _peft_model(seed):
    return lora_causal_lm(seed)


def _packed(sequences):
    """One row, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) builds it."""
    from q35lab import e2e

    kwargs = e2e.pack_sequences(sequences)
    return kwargs.pop("input_ids"), kwargs.pop("labels"), kwargs


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_step(model, sequences, **options):
    """The packed row's loss and gradients, under the forward's default arguments (Trainer's call)
    unless ``options`` say otherwise."""
    model.zero_grad(set_to_none=True)
    ids, labels, kwargs = _packed(sequences)
    loss = model(input_ids=ids, labels=labels, **kwargs, **options).loss
    loss.backward()
    return loss.detach(), _grads(model)


def _collated(sequences, **collator_options):
    """``DataCollatorWithFlattening(**collator_options)``'s row of ``sequences``, on the device."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(**collator_options)([{"input_ids": s.tolist()} for s in sequences])
    return {k: torch.as_tensor(v).to(device()) for k, v in batch.items()}


def _collated_step(model, sequences, **collator_options):
    """The loss and gradients of the collator's row, the model called as Trainer calls it: the
    collator's dict and nothing else (use_cache at its default)."""
    model.zero_grad(set_to_none=True)
    loss = model(**_collated(sequences, **collator_options)).loss
    loss.backward()
    return loss.detach(), _grads(model)


def _one_at_a_time(model, sequences):
    """The packed loss from the sequences run alone: their token-mean losses weighted by the
    tokens each predicts (L - 1), over all predicted tokens."""
    model.zero_grad(set_to_none=True)
    predicted = sum(len(s) - 1 for s in sequences)
    total = 0.0
    for s in sequences:
        if len(s) == 1:  # predicts nothing (alone its mean loss is over no tokens: NaN)
            continue
        loss = model(input_ids=s[None], labels=s[None], use_cache=False).loss * (len(s) - 1) / predicted
        loss.backward()
        total = total + loss.detach()
    return total, _grads(model)


def _assert_same(a, b, rtol=1e-4, atol=1e-5):
    if device().type == "cuda":  # fla's kernels and cuDNN's conv multiply fp32 in TF32 (a 10-bit mantissa)
        rtol, atol = max(rtol, 2e-3), max(atol, 1e-4)
    assert_same_loss_and_grads(a, b, rtol=rtol, atol=atol)


# Lengths around the conv window (4 taps): a sequence shorter than it, one of one token, and
# boundaries that fall inside a window of the one before.
LENGTHS = [[5, 9, 3], [1, 6, 2, 7]]


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda ls: "-".join(map(str, ls)))
def test_a_packed_row_gives_the_loss_and_gradients_of_its_sequences_run_alone(lengths):
    model = _peft_model(seed=0)
    report = q35lab.apply_to_qwen3_5(model)
    line = report.runs["packed batches"]
    assert line.startswith("sequences kept apart") and "wherever they do not step by one" in line
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in lengths]
    _assert_same(_packed_step(model, sequences), _one_at_a_time(model, sequences))


def test_the_patched_packed_row_matches_the_unpatched_model_run_one_sequence_at_a_time():
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in (6, 4, 8)]
    unpatched = _peft_model(seed=1)
    patched = copy.deepcopy(unpatched)
    q35lab.apply_to_qwen3_5(patched)
    _assert_same(_packed_step(patched, sequences), _one_at_a_time(unpatched, sequences))


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda ls: "-".join(map(str, ls)))
def test_a_row_with_restarting_position_ids_only_is_kept_apart_too(lengths):
    """DataCollatorWithFlattening's default row (no cu_seq_lens): the patch derives the boundaries
    from position_ids for the GatedDeltaNet; unpatched, the conv and the recurrence run across them."""
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in lengths]
    ids, labels, kwargs = _packed(sequences)

    def positions_only_step(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels, position_ids=kwargs["position_ids"], use_cache=False).loss
        loss.backward()
        return loss.detach(), _grads(model)

    unpatched = _peft_model(seed=3)
    patched = copy.deepcopy(unpatched)
    report = q35lab.apply_to_qwen3_5(patched)
    assert "or as the position_ids of one row" in report.runs["packed batches"]
    alone = _one_at_a_time(unpatched, sequences)
    _assert_same(positions_only_step(patched), alone)
    leaked, leaked_grads = positions_only_step(unpatched)
    # what the derivation prevents: the sequences see each other. The gradients say so for every draw;
    # the loss of this near-uniform tiny model (about ln V) can move by less than 1e-4 (seed 1392964597)
    assert any(not torch.allclose(leaked_grads[n], g, rtol=1e-3, atol=1e-6) for n, g in alone[1].items())
    q35lab.revert(patched)
    torch.testing.assert_close(positions_only_step(patched)[0], leaked, rtol=1e-5, atol=1e-6)


# The collator's options: boundaries given (cu_seq_lens_q) or in position_ids alone, positions from
# 0 or from 1 (1, 2, ..., 1, 2, ...); gradient checkpointing on for two of them.
COLLATED = [pytest.param(flash_kwargs, start, checkpointing,
                         id=f"{'cu' if flash_kwargs else 'positions'}-from{start}{'-checkpointed' * checkpointing}")
            for flash_kwargs, start, checkpointing in ((True, 0, False), (False, 0, False), (True, 1, False),
                                                       (False, 1, False), (True, 1, True), (False, 0, True))]


@pytest.mark.parametrize("flash_kwargs, start, checkpointing", COLLATED)
def test_a_collated_row_under_the_default_kwargs_gives_its_sequences_run_alone_unpatched(flash_kwargs, start,
                                                                                         checkpointing):
    """Trainer's call of a packed row: no use_cache=False. transformers' default (use_cache=True)
    builds a cache in train mode without checkpointing, and its full-attention mask then ignores the
    packing: the patch runs the row without one. Positions restarting at 1 split where they do not
    step by one (transformers' rule), as the masks split them."""
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in (5, 1, 9, 4)]
    unpatched = _peft_model(seed=8)
    patched = copy.deepcopy(unpatched)
    q35lab.apply_to_qwen3_5(patched)
    if checkpointing:
        patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patched.train()
    alone = _one_at_a_time(unpatched, sequences)
    options = {"return_flash_attn_kwargs": flash_kwargs, "position_ids_start": start}
    _assert_same(_collated_step(patched, sequences, **options), alone)
    with torch.no_grad():  # and so does the evaluation of the same row (eval mode, no grad, use_cache by default)
        patched.eval()
        torch.testing.assert_close(patched(**_collated(sequences, **options)).loss, alone[0], rtol=1e-4, atol=1e-5)


def test_use_cache_true_for_a_packed_row_is_turned_off_with_a_warning_and_a_cache_of_the_callers_is_refused():
    from transformers import DynamicCache

    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in (3, 6, 2)]
    model = _peft_model(seed=9)
    q35lab.apply_to_qwen3_5(model)
    alone = _one_at_a_time(model, sequences)
    with pytest.warns(UserWarning, match="use_cache=True for a row of packed sequences"):
        _assert_same(_packed_step(model, sequences, use_cache=True), alone)
    _assert_same(_packed_step(model, sequences, use_cache=False), alone)
    ids, labels, kwargs = _packed(sequences)
    with pytest.raises(ValueError, match="cache: a cache continues one sequence a row"):
        model(input_ids=ids, labels=labels, **kwargs, past_key_values=DynamicCache(config=model.config))


@pytest.mark.parametrize("conv", [True, False])
def test_the_packed_batches_line_says_what_a_packed_row_gets(conv):
    """Kept apart: the collated row (both collator layouts) gives its sequences run alone. Refused:
    the forward raises a ValueError with the line's reason, and a row of one sequence still runs."""

    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in (4, 7, 2)]
    unpatched = _peft_model(seed=2)
    patched = copy.deepcopy(unpatched)
    line = q35lab.apply_to_qwen3_5(patched, conv=conv).runs["packed batches"]
    if not hf_gdn.package_installed("causal_conv1d"):  # without the package, only q35lab's conv keeps them apart
        assert line.startswith("sequences kept apart") == conv
    if line.startswith("sequences kept apart"):
        alone = _one_at_a_time(unpatched, sequences)
        for flash_kwargs in (True, False):
            _assert_same(_collated_step(patched, sequences, return_flash_attn_kwargs=flash_kwargs), alone)
        return
    prefix = "a row of packed sequences is refused (ValueError): "
    assert line.startswith(prefix) and "conv=True" in line
    for flash_kwargs in (True, False):
        with pytest.raises(ValueError) as refused:
            _collated_step(patched, sequences, return_flash_attn_kwargs=flash_kwargs)
        assert line[len(prefix):] in str(refused.value)
    one = sequences[1][None]
    torch.testing.assert_close(patched(input_ids=one, labels=one).loss, unpatched(input_ids=one, labels=one).loss,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["from0", "from1", "ones", "one-sequence", "random"])
def test_the_boundaries_of_a_row_are_those_transformers_masks_find(case):
    """packed_attention.boundaries_from_positions against masking_utils.find_packed_sequence_indices
    (what transformers' SDPA, eager and flex masks keep apart): rows of random lengths restarting at
    0 or at 1, sequences of one token, one sequence, and random positions (a run that steps by one is
    one sequence, wherever it starts)."""
    from transformers.masking_utils import find_packed_sequence_indices

    from q35lab.patch.attention import boundaries_from_positions

    lengths = torch.randint(1, 6, (int(torch.randint(2, 7, ())),)).tolist()
    lengths = {"ones": [1] * len(lengths), "one-sequence": lengths[:1]}.get(case, lengths)
    first = {"from1": 1, "one-sequence": 7}.get(case, 0)
    positions = torch.cat([torch.arange(n) + first for n in lengths])
    if case == "random":
        positions = torch.randint(0, 4, (int(torch.randint(2, 20, ())),))
    positions = positions[None].to(device())
    theirs = find_packed_sequence_indices(positions)
    ours = boundaries_from_positions(positions)
    assert (ours is None) == (theirs is None)
    if ours is not None:
        cu, longest = ours
        assert cu.dtype == torch.int32 and cu.device == positions.device and longest == int(cu.diff().max())
        ids = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device()), cu.diff().long())
        assert torch.equal(ids, theirs[0])
    if case != "random":
        assert (ours is None) == (len(lengths) == 1)
        assert ours is None or ours[0].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    flat = boundaries_from_positions(positions[0])  # a [T] row reads as the [1, T] one
    assert (flat is None) == (ours is None) and (flat is None or torch.equal(flat[0], ours[0]))
    with pytest.raises(ValueError, match=r"position_ids: expected one row, \[T\] or \[1, T\]"):
        boundaries_from_positions(positions.expand(2, -1))


@pytest.mark.parametrize("fla_installed", [False, True])
def test_the_per_sequence_delta_rule_checks_its_boundaries(fla_installed, monkeypatch):
    """The PyTorch function ignores cu_seqlens whether or not fla is installed (on the GPU machine
    it is, and the rule once passed boundaries through to the PyTorch function there)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    from q35lab.hf.gated_delta_net import _PerSequenceDeltaRule

    patch_everywhere(monkeypatch, "package_installed",
                     lambda package: fla_installed or importlib.util.find_spec(package))

    rule = _PerSequenceDeltaRule(modeling.torch_chunk_gated_delta_rule)
    q = torch.randn(1, 7, 2, 8, device=device())
    g, beta = -torch.rand(1, 7, 2, device=device()), torch.rand(1, 7, 2, device=device())
    with pytest.raises(ValueError, match="cu_seqlens: expected 0 = c0"):
        rule(q, q, q, g, beta, cu_seqlens=torch.tensor([0, 3, 6], device=device()))
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences come in one row"):
        rule(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), g.expand(2, -1, -1),
             beta.expand(2, -1, -1), cu_seqlens=torch.tensor([0, 7], device=device()))
    # two sequences: each one's output is the function's on that sequence alone, and the final states stack
    out, final = rule(q, q, q, g, beta, cu_seqlens=torch.tensor([0, 3, 7], device=device()), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    for start, end, i in ((0, 3, 0), (3, 7, 1)):
        alone, state = modeling.torch_chunk_gated_delta_rule(
            q[:, start:end], q[:, start:end], q[:, start:end], g[:, start:end], beta[:, start:end],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, start:end], alone)
        torch.testing.assert_close(final[i:i + 1], state)


# ----------------------------------------------------------------------------------------------
# The e2e's packed mode: an SFT length mix, packed or padded (q35lab.bench.e2e.packing)
# ----------------------------------------------------------------------------------------------
def test_the_length_mix_fills_T_exactly_with_the_cited_mean():
    from q35lab import e2e
    from q35lab.bench.e2e import packing

    lengths = e2e.sft_lengths(2_000_000, seed=3)
    assert sum(lengths) == 2_000_000 and max(lengths) <= packing.SFT_LONGEST
    assert min(lengths[:-1]) >= packing.SFT_SHORTEST  # only the last one is cut to fill the row
    body = lengths[:-1]
    assert sum(body) / len(body) == pytest.approx(packing.SFT_MEAN_TOKENS, rel=0.1)  # 568 tokens (LMSYS-Chat-1M)
    assert sorted(body)[len(body) // 2] < packing.SFT_MEAN_TOKENS  # log-normal: the median below the mean
    assert e2e.sft_lengths(100, seed=3) == e2e.sft_lengths(100, seed=3) and sum(e2e.sft_lengths(1)) == 1
    with pytest.raises(ValueError, match="T: expected"):
        e2e.sft_lengths(0)


def test_packed_and_padded_batches_of_the_same_tokens_give_the_same_loss_and_gradients():
    from q35lab import e2e

    lengths = [7, 3, 12, 5, 1, 20]  # the 1-token sequence is alone in its micro-batch: it predicts nothing
    model = _peft_model(seed=4)
    q35lab.apply_to_qwen3_5(model)
    packed = e2e.packed_batch(lengths, TEXT["vocab_size"], device(), seed=5)
    padded = e2e.padded_batches(lengths, TEXT["vocab_size"], device(), seed=5, tokens_per_batch=24)
    assert len(packed) == 1 and packed[0]["real_tokens"] == sum(lengths) == packed[0]["tokens"]
    assert len(padded) > 2 and sum(m["weight"] for m in padded) == pytest.approx(1.0)
    assert all(m["tokens"] <= 24 for m in padded) and sum(m["real_tokens"] for m in padded) == sum(lengths) - 1
    pieces = list(packed[0]["kwargs"]["input_ids"][0].split(lengths))
    del pieces[4]  # the lone 1-token micro-batch is left out (it has no loss to add)
    assert torch.equal(torch.cat([m["kwargs"]["input_ids"][m["kwargs"]["attention_mask"].bool()] for m in padded]),
                       torch.cat(pieces))  # the same ids, in the same order

    def step(batch):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for micro in batch:
            loss = model(**micro["kwargs"], use_cache=False).loss * micro["weight"]
            loss.backward()
            total = total + loss.detach()
        return total, _grads(model)

    _assert_same(step(packed), step(padded))


def test_a_measured_packed_step_counts_its_real_tokens(tmp_path):
    from q35lab import e2e

    model = e2e.build("tiny", 2, rank=4, device=device(), dtype=torch.float32)
    q35lab.apply_to_qwen3_5(model)
    for kind in ("packed", "padded"):
        row = e2e.measure(model, 96, steps=1, warmup=0, batch=kind)
        assert row["batch"] == kind and row["real_tokens"] == 96 and row["padded_tokens"] >= 96
        assert row["real_tokens_per_s"] > 0 and row["micro_batches"] >= 1
    with pytest.raises(ValueError, match="batch: expected"):
        e2e.sft_batch("sorted", 96, 128, device())


def test_a_padded_measurement_repeats_its_warm_up_mix_and_a_packed_one_draws_a_mix_a_step(monkeypatch):
    from q35lab import e2e
    from q35lab.bench.e2e import step as step_module

    model = e2e.build("tiny", 2, rank=4, device=device(), dtype=torch.float32)
    q35lab.apply_to_qwen3_5(model)  # packed rows on a CPU: q35lab's delta rule keeps the sequences apart
    seeds = []

    def recorded(kind, T, vocab, device, seed=0):
        seeds.append((kind, seed))
        return e2e.sft_batch(kind, T, vocab, device, seed=seed)

    monkeypatch.setattr(step_module, "sft_batch", recorded)
    for kind in ("packed", "padded"):
        e2e.measure(model, 64, steps=2, warmup=1, batch=kind)
    assert seeds == [("packed", 0), ("packed", 1), ("packed", 2), ("padded", 0), ("padded", 0), ("padded", 0)]


def test_the_rows_built_here_are_those_of_transformers_packing_collator():
    from transformers import DataCollatorWithFlattening

    from q35lab import e2e

    sequences = [torch.randint(0, TEXT["vocab_size"], (n,)) for n in (4, 1, 6)]
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in sequences])
    ids, labels, kwargs = _packed([s.to(device()) for s in sequences])
    ours = {"input_ids": ids, "labels": labels, **kwargs}
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(torch.as_tensor(ours[key]).cpu().long(), torch.as_tensor(value).long()), key
    generator = torch.Generator().manual_seed(5)
    lengths = [4, 1, 6]
    same_ids = [torch.randint(0, TEXT["vocab_size"], (n,), generator=generator) for n in lengths]
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in same_ids])
    batch = e2e.packed_batch(lengths, TEXT["vocab_size"], "cpu", seed=5)[0]["kwargs"]
    assert set(batch) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(torch.as_tensor(batch[key]).long(), torch.as_tensor(value).long()), key


def test_the_attention_a_step_is_built_with_is_recorded_and_changes_no_loss(tmp_path):
    """e2e.build(attention=...) is transformers' attn_implementation; a packed row gives the same
    loss through eager attention as through SDPA (both mask across the packed sequences), and rows
    of another attention never replace the default's in the CSV."""
    from q35lab import e2e

    losses = {}
    for attention in (None, "eager"):
        # layer 4 attends
        model = e2e.build("tiny", 4, rank=4, device=device(), dtype=torch.float32, attention=attention)
        assert model.config._attn_implementation == (attention or "sdpa")
        q35lab.apply_to_qwen3_5(model)
        (row,) = e2e.packed_batch([5, 3, 8], TEXT["vocab_size"], device(), seed=1)
        with torch.no_grad():
            losses[attention] = model(**row["kwargs"], use_cache=False).loss
    torch.testing.assert_close(losses[None], losses["eager"], rtol=1e-5, atol=1e-6)
    path = tmp_path / "end_to_end.csv"
    e2e.merge_rows(path, [{"variant": "q35lab", "T": 64, "batch": "packed", "step_ms": 1.0}]).to_csv(path, index=False)
    both = e2e.merge_rows(path, [{"variant": "q35lab", "T": 64, "batch": "packed", "attention": "flex_attention",
                                  "step_ms": 2.0}], last_line_wins=True)
    assert sorted(both.step_ms) == [1.0, 2.0]


def test_the_report_asks_which_core_transformers_resolved_not_whether_fla_is_installed(monkeypatch):
    """fla installed, transformers' PyTorch core resolved all the same (fla's import failed in
    transformers): the report says the PyTorch core runs, never that fla's does."""

    patch_everywhere(monkeypatch, "package_installed",
                     lambda package: package == "fla" or importlib.util.find_spec(package))
    patch_everywhere(monkeypatch, "_is_fla_function", lambda function: False)  # whatever transformers resolved
    report = q35lab.apply_to_qwen3_5(_peft_model(seed=4))
    assert "PyTorch fallback" in report.runs["delta-rule core"] and "did not take" in report.runs["delta-rule core"]
    assert "fla's delta rule" not in report.runs["packed batches"]


def test_a_core_replaced_after_an_earlier_patch_is_switched_again(monkeypatch):
    """Another library (or a monkeypatch undone) puts a function of its own where q35lab's switch
    was: the next patch wraps that function in a switch, and packed rows stay apart."""
    import sys


    q35lab.apply_to_qwen3_5(_peft_model(seed=5))  # the module's switches exist from here on
    model = _peft_model(seed=6)
    gdn = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    modeling = sys.modules[type(gdn).__module__]
    original = modeling.torch_chunk_gated_delta_rule
    calls = []

    def replaced(*args, **kwargs):  # a function of another library's: not q35lab's switch
        calls.append(kwargs.get("cu_seqlens"))
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", replaced)
    q35lab.apply_to_qwen3_5(model)
    switch = modeling.torch_chunk_gated_delta_rule
    assert isinstance(switch, hf_gdn.DeltaRuleSwitch) and switch.original is replaced
    assert hf_gdn.DELTA_RULE_SWITCHES[modeling.__name__] is switch
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in (5, 3, 6)]
    _assert_same(_packed_step(model, sequences), _one_at_a_time(model, sequences))
    assert calls  # the replaced function is what runs, inside the switch
    monkeypatch.undo()  # the first switch is back in the module: the next patch takes it up again
    q35lab.apply_to_qwen3_5(_peft_model(seed=7))
    assert hf_gdn.DELTA_RULE_SWITCHES[modeling.__name__] is modeling.torch_chunk_gated_delta_rule is original


def _call_forms(kwargs):
    """The packed row's keywords (``pack_sequences``: position_ids, cu_seq_lens_*, max_length_*),
    rearranged into the other documented ways of stating its sequences."""
    positions = kwargs["position_ids"]
    flash = {k: v for k, v in kwargs.items() if k != "position_ids"}
    mrope = positions[None].expand(3, -1, -1)  # text-only: every rotary row is the text row
    return {
        "cu-only": flash,  # the model counts positions 0..T-1 itself: its mask sees one sequence
        "cu+attention_mask": {**kwargs, "attention_mask": torch.ones_like(positions)},  # masks skip packing then
        "cu+position_ids[3,B,T]": {**flash, "position_ids": mrope},  # no text row: the mask reads no positions
        "position_ids[4,B,T]": {"position_ids": torch.cat([positions[None], mrope])},  # text row first
    }


@pytest.mark.parametrize("form", ["cu-only", "cu+attention_mask", "cu+position_ids[3,B,T]", "position_ids[4,B,T]"])
@pytest.mark.parametrize("build", ["causal_lm", "multimodal"])
def test_every_way_of_stating_a_packed_row_gives_its_sequences_run_alone_unpatched(form, build):
    """Boundaries as cu_seq_lens alone or beside an attention mask or [3, B, T] positions (the
    attention, SDPA on this CPU, narrows transformers' mask to them), or as the text row of
    [4, B, T] positions (the GatedDeltaNet splits where transformers' mask does)."""
    import tiny_models

    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in (5, 1, 8, 3)]
    torch.manual_seed(11)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
               "in_proj_z", "out_proj"]  # the text decoder's (all-linear would take the vision tower's too)
    unpatched = peft.get_peft_model(getattr(tiny_models, build)(),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, p in unpatched.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    patched = copy.deepcopy(unpatched)
    q35lab.apply_to_qwen3_5(patched)
    ids, labels, kwargs = _packed(sequences)
    patched.zero_grad(set_to_none=True)
    loss = patched(input_ids=ids, labels=labels, **_call_forms(kwargs)[form]).loss
    loss.backward()
    _assert_same((loss.detach(), _grads(patched)), _one_at_a_time(unpatched, sequences))


def test_boundaries_the_attention_or_the_positions_cannot_honour_are_refused_with_what_to_pass():
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in (4, 6, 3)]
    ids, labels, kwargs = _packed(sequences)
    positions = kwargs["position_ids"]
    model = _peft_model(seed=12)
    q35lab.apply_to_qwen3_5(model)
    shifted = kwargs["cu_seq_lens_q"].clone()
    shifted[1] += 1
    with pytest.raises(ValueError, match=r"cu_seq_lens_q \[0, 5, 10, 13\] and position_ids \(sequences at "
                                         r"\[0, 4, 10, 13\].*split the row differently"):
        model(input_ids=ids, labels=labels, **{**kwargs, "cu_seq_lens_q": shifted, "cu_seq_lens_k": shifted})
    with pytest.raises(ValueError, match=r"split the row differently"):  # positions of one sequence: still a split
        model(input_ids=ids, labels=labels, **{**kwargs, "position_ids": torch.arange(13, device=device())[None]})
    with pytest.raises(ValueError, match=r"\[3, B, T\] rotary positions restart.*pass the \[4, B, T\] form"):
        model(input_ids=ids, labels=labels, position_ids=positions[None].expand(3, -1, -1))
    two_rows = torch.cat([positions, positions])
    with pytest.raises(ValueError, match="position_ids: 2 rows, and a row holds packed sequences"):
        model(input_ids=torch.cat([ids, ids]), labels=torch.cat([labels, labels]), position_ids=two_rows)
    plain = _peft_model(seed=12)  # transformers' own SDPA: it reads the mask only
    q35lab.apply_to_qwen3_5(plain, varlen_attention=False)
    flash = {k: v for k, v in kwargs.items() if k != "position_ids"}
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: the full attention \(sdpa\).*varlen_attention=True"):
        plain(input_ids=ids, labels=labels, **flash)
    # what it does take: the positions beside them, no attention mask
    _assert_same(_packed_step(plain, sequences), _one_at_a_time(plain, sequences))
    # and rows that are not packed run as before, several rows with positions included
    one = torch.arange(7, device=device())[None]
    model(input_ids=ids[:, :7].repeat(2, 1), position_ids=one.repeat(2, 1))
    model(input_ids=ids[:, :7], position_ids=one[None].expand(3, -1, -1))
