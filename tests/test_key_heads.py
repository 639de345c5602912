"""The GatedDeltaNet's q/k head repeat: transformers before 5.2x repeats q and k to the value heads
before the core; with flash-linear-attention's core, which reads key head i // (Hv/Hk) for value
head i itself, ``apply_to_qwen3_5`` (``conv=True``) skips the repeat. On the CPU the conditions are
simulated (this machine's transformers hands the core the key heads as they are, and has no fla);
on a GPU with fla the grouped core is checked against the repeated one."""

import copy
import importlib.util
import io

import pytest
import torch

import q35lab
from q35lab import long_context, patch
from q35lab.numerics import assert_close_by_rule
from q35lab.runtime import device

from tiny_models import causal_lm

SKIPPED = "Qwen3_5GatedDeltaNet q/k head repeat (skipped: fla's core groups the key heads)"


def _gdns(model):
    return [m for m in model.modules() if patch._is_gated_delta_net(m)]


@pytest.fixture
def repeating_forward_with_fla(monkeypatch):
    """transformers 5.17's situation on a GPU with fla: the forward repeats, fla is the core."""
    monkeypatch.setattr(long_context, "_forward_repeats_key_heads", lambda cls: True)
    monkeypatch.setattr(patch, "_delta_rule_core", lambda gdn: patch._FLA_CORE)


def test_this_transformers_and_core_decide_whether_the_repeat_is_skipped():
    model = causal_lm()
    gdn = _gdns(model)[0]
    before = (gdn.num_k_heads, gdn.num_v_heads)
    assert before[0] < before[1]  # the tiny model groups its key heads: a repeat to skip or not
    report = q35lab.apply_to_qwen3_5(model)
    skip = long_context._forward_repeats_key_heads(type(gdn)) and patch._delta_rule_core(gdn) == patch._FLA_CORE
    assert (SKIPPED in report.replaced) == skip
    assert (gdn.num_k_heads, gdn.num_v_heads) == ((before[1], before[1]) if skip else before)


def test_the_repeat_is_skipped_once_kept_by_copies_and_reverted(repeating_forward_with_fla):
    model = causal_lm()
    gdns = _gdns(model)
    own = [g.num_k_heads for g in gdns]
    report = q35lab.apply_to_qwen3_5(model)
    assert report.replaced[SKIPPED] == len(gdns)
    # the forward repeats by num_v_heads // num_k_heads: 1 now
    assert all(g.num_k_heads == g.num_v_heads and g.num_v_heads // g.num_k_heads == 1 for g in gdns)
    assert not any("q/k head repeat" in k for k in q35lab.apply_to_qwen3_5(model).replaced)  # twice: once
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        for g, heads in zip(_gdns(other), own):
            assert g.num_k_heads == g.num_v_heads and vars(g)[patch._KEY_HEADS] == heads
        reverted = q35lab.revert(other)
        assert reverted.reverted["Qwen3_5GatedDeltaNet q/k head repeat"] == len(gdns)
        assert [g.num_k_heads for g in _gdns(other)] == own
    reverted = q35lab.revert(model)
    assert [g.num_k_heads for g in gdns] == own and not any(patch._KEY_HEADS in vars(g) for g in gdns)
    assert reverted.reverted["Qwen3_5GatedDeltaNet q/k head repeat"] == len(gdns)


def test_with_conv_off_the_repeat_stays(repeating_forward_with_fla):
    model = causal_lm()
    own = [g.num_k_heads for g in _gdns(model)]
    report = q35lab.apply_to_qwen3_5(model, conv=False)
    assert SKIPPED not in report.replaced and [g.num_k_heads for g in _gdns(model)] == own


def test_without_fla_the_repeat_stays_and_the_report_says_why(monkeypatch):
    monkeypatch.setattr(long_context, "_forward_repeats_key_heads", lambda cls: True)
    monkeypatch.setattr(patch, "_delta_rule_core", lambda gdn: "transformers' PyTorch fallback")
    model = causal_lm()
    own = [g.num_k_heads for g in _gdns(model)]
    report = q35lab.apply_to_qwen3_5(model)
    why = ("Qwen3_5GatedDeltaNet q/k head repeat: the core is not flash-linear-attention's, which alone reads "
           "grouped key heads")
    assert report.left_alone[why] == len(own) and [g.num_k_heads for g in _gdns(model)] == own


@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("fla") is not None),
                    reason="fla's kernels need a GPU and flash-linear-attention")
@pytest.mark.parametrize("tokens", [1, 63, 300])
def test_fla_core_with_grouped_key_heads_follows_the_core_with_repeated_ones(tokens):
    """fla's chunk_gated_delta_rule given Hk key heads and Hv = 2·Hk value heads: the output and
    every gradient (q and k summed over each group, as repeat_interleave's backward sums them)
    against the same core given the repeated heads, by the numerics rule with the repeated core
    in fp32 as the reference."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    torch.manual_seed(tokens)
    Hk, Hv, K, V = 2, 4, 64, 64
    dev = device()
    leaves = {"q": torch.randn(1, tokens, Hk, K, device=dev), "k": torch.randn(1, tokens, Hk, K, device=dev),
              "v": torch.randn(1, tokens, Hv, V, device=dev),
              "g": torch.nn.functional.logsigmoid(torch.randn(1, tokens, Hv, device=dev)),
              "beta": torch.rand(1, tokens, Hv, device=dev)}
    dout = torch.randn(1, tokens, Hv, V, device=dev)

    def run(dtype, grouped):
        xs = {n: t.to(dtype if n != "g" else torch.float32).requires_grad_() for n, t in leaves.items()}
        q, k = (xs["q"], xs["k"]) if grouped else (xs["q"].repeat_interleave(Hv // Hk, 2),
                                                    xs["k"].repeat_interleave(Hv // Hk, 2))
        out, _ = chunk_gated_delta_rule(q, k, xs["v"], g=xs["g"], beta=xs["beta"], use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad(out, list(xs.values()), dout.to(out.dtype))
        return [out.float(), *(g.float() for g in grads)]

    grouped, repeated, reference = run(torch.bfloat16, True), run(torch.bfloat16, False), run(torch.float32, False)
    for name, a, b, hi in zip(["out", "dq", "dk", "dv", "dg", "dbeta"], grouped, repeated, reference):
        assert_close_by_rule(name, a, b, hi)
