"""The GatedDeltaNet's q/k head repeat: transformers before 5.2x repeats q and k to the value heads
before the core; with flash-linear-attention's core, which reads key head i // (Hv/Hk) for value
head i itself, ``apply_to_qwen3_5`` (``conv=True``) skips the repeat. On the CPU the conditions are
simulated (this machine's transformers hands the core the key heads as they are, and has no fla);
on a GPU with fla the grouped core is checked against the repeated one."""

import copy
import functools
import importlib.util
import io
import sys

import pytest
import torch
from conftest import patch_everywhere

import q35lab
from q35lab.hf import gated_delta_net as hf_gdn
from q35lab.hf import modules as hf_modules
from q35lab.numerics import assert_close_by_rule
from q35lab.patch import markers as patch_markers
from q35lab.runtime import device
from tiny_models import causal_lm

SKIPPED = "Qwen3_5GatedDeltaNet q/k head repeat (skipped: fla's core groups the key heads)"


def _gdns(model):
    return [m for m in model.modules() if hf_modules.is_gated_delta_net(m)]


@pytest.fixture
def repeating_forward_with_fla(monkeypatch):
    """transformers 5.17's situation on a GPU with fla: the forward repeats, fla is the core."""
    patch_everywhere(monkeypatch, "forward_repeats_key_heads", lambda cls: True)
    patch_everywhere(monkeypatch, "core_groups_key_heads", lambda gdn: True)


def test_this_transformers_and_core_decide_whether_the_repeat_is_skipped():
    model = causal_lm()
    gdn = _gdns(model)[0]
    before = (gdn.num_k_heads, gdn.num_v_heads)
    assert before[0] < before[1]  # the tiny model groups its key heads: a repeat to skip or not
    skip = hf_gdn.forward_repeats_key_heads(type(gdn)) and hf_gdn.core_groups_key_heads(gdn)
    assert skip == (skip and importlib.util.find_spec("fla") is not None)  # never without fla
    report = q35lab.apply_to_qwen3_5(model)
    assert (SKIPPED in report.replaced) == skip
    assert (gdn.num_k_heads, gdn.num_v_heads) == ((before[1], before[1]) if skip else before)


def _kernel_hub_wrapper(implementation, torch_function):
    """What transformers' use_kernel_func_from_hub_with_fallback makes: the resolved function in
    its closure, named after the PyTorch one."""
    @functools.wraps(torch_function)
    def wrapped(*args, **kwargs):
        return implementation(*args, **kwargs)
    return wrapped


def test_the_core_is_read_from_what_transformers_resolved_through_the_switch():
    def torch_core(*args):
        return "torch"

    def fla_core(*args):
        return "fla"

    fla_core.__module__ = "fla.ops.gated_delta_rule.chunk"
    for implementation in (torch_core, fla_core):
        wrapped = _kernel_hub_wrapper(implementation, torch_core)
        assert hf_gdn._resolved_core(wrapped) is implementation
        assert hf_gdn._resolved_core(hf_gdn.DeltaRuleSwitch(wrapped)) is implementation  # q35lab's switch, through
    assert hf_gdn._resolved_core(fla_core) is fla_core and hf_gdn._resolved_core(None) is None
    # this machine's modeling module: what its names resolve to decides, whatever is installed
    gdn = _gdns(causal_lm())[0]
    module = sys.modules[type(gdn).__module__]
    resolved = [hf_gdn._resolved_core(getattr(module, n, None))
                for n in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")]
    assert hf_gdn.core_groups_key_heads(gdn) == all(getattr(f, "__module__", "").startswith("fla.") for f in resolved)


def test_the_repeat_is_skipped_once_kept_by_copies_and_reverted(repeating_forward_with_fla):
    model = causal_lm()
    gdns = _gdns(model)
    own = [g.num_k_heads for g in gdns]
    report = q35lab.apply_to_qwen3_5(model)
    assert report.replaced[SKIPPED] == len(gdns)
    # the forward repeats by num_v_heads // num_k_heads: 1 now
    assert all(g.num_k_heads == g.num_v_heads and g.num_v_heads // g.num_k_heads == 1 for g in gdns)
    again = q35lab.apply_to_qwen3_5(model)  # twice: once, and counted as already patched
    assert not any("q/k head repeat" in k for k in again.replaced) and again.already_patched >= len(gdns)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        for g, heads in zip(_gdns(other), own):
            assert g.num_k_heads == g.num_v_heads and vars(g)[patch_markers.KEY_HEADS] == heads
        reverted = q35lab.revert(other)
        assert reverted.reverted["Qwen3_5GatedDeltaNet q/k head repeat"] == len(gdns)
        assert [g.num_k_heads for g in _gdns(other)] == own
    reverted = q35lab.revert(model)
    assert [g.num_k_heads for g in gdns] == own and not any(patch_markers.KEY_HEADS in vars(g) for g in gdns)
    assert reverted.reverted["Qwen3_5GatedDeltaNet q/k head repeat"] == len(gdns)


def test_with_conv_off_the_repeat_stays(repeating_forward_with_fla):
    model = causal_lm()
    own = [g.num_k_heads for g in _gdns(model)]
    report = q35lab.apply_to_qwen3_5(model, conv=False)
    assert SKIPPED not in report.replaced and [g.num_k_heads for g in _gdns(model)] == own


def test_without_fla_as_the_core_the_repeat_stays_and_the_report_says_why(monkeypatch):
    patch_everywhere(monkeypatch, "forward_repeats_key_heads", lambda cls: True)
    patch_everywhere(monkeypatch, "core_groups_key_heads", lambda gdn: False)
    model = causal_lm()
    own = [g.num_k_heads for g in _gdns(model)]
    report = q35lab.apply_to_qwen3_5(model)
    why = ("Qwen3_5GatedDeltaNet q/k head repeat: transformers calls its PyTorch core, not flash-linear-attention's, "
           "which alone reads grouped key heads")
    assert report.left_alone[why] == len(own) and [g.num_k_heads for g in _gdns(model)] == own


_ON_GPU_WITH_FLA = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None


def _pytorch_core(name):
    """transformers' own PyTorch delta rule ``name`` (under the hub wrapper, and a ``kernels``
    module where 5.25 makes one), run once per sequence of a packed row, as it ignores boundaries."""
    import inspect

    function = getattr(sys.modules[type(_gdns(causal_lm())[0]).__module__], name)
    function = getattr(function, "original", function)  # q35lab's switch
    if not inspect.isfunction(function):
        function = inspect.getclosurevars(type(function).forward).nonlocals.get("func", function)
    function = inspect.unwrap(function)

    def per_sequence(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
        bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            out, final = function(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                  initial_state=None if initial_state is None else initial_state[i:i + 1],
                                  output_final_state=output_final_state, **kwargs)
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)

    return per_sequence


def _grouped_and_repeated(core, tokens, cu_seqlens=None, with_state=False, backward=True, K=128, reference=None):
    """(grouped, repeated in bf16, repeated in fp32): the output, the final state and every
    gradient of ``core`` given Hk = 2 key heads and Hv = 4 value heads (Qwen3.5's 128-wide heads
    by default), once with the key heads as they are and once repeated as transformers 5.17 does;
    the fp32 reference by ``reference`` (transformers' PyTorch core: no kernel autotuning), else ``core``."""
    torch.manual_seed(tokens)
    Hk, Hv, dev = 2, 4, device()
    sequences = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    leaves = {"q": torch.randn(1, tokens, Hk, K, device=dev), "k": torch.randn(1, tokens, Hk, K, device=dev),
              "v": torch.randn(1, tokens, Hv, K, device=dev),
              "g": torch.nn.functional.logsigmoid(torch.randn(1, tokens, Hv, device=dev)),
              "beta": torch.rand(1, tokens, Hv, device=dev)}
    if with_state:
        leaves["h0"] = torch.randn(sequences, Hv, K, K, device=dev) * 0.1
    dout = torch.randn(1, tokens, Hv, K, device=dev)
    dht = torch.randn(sequences, Hv, K, K, device=dev) * 0.1
    bounds = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=dev, dtype=torch.int32)

    def run(dtype, grouped, run_core=core):
        xs = {n: t.to(torch.float32 if n in ("g", "h0") else dtype).requires_grad_(backward) for n, t in leaves.items()}
        q, k = (xs["q"], xs["k"]) if grouped else (xs["q"].repeat_interleave(Hv // Hk, 2),
                                                    xs["k"].repeat_interleave(Hv // Hk, 2))
        out, final = run_core(q, k, xs["v"], g=xs["g"], beta=xs["beta"], initial_state=xs.get("h0"),
                              output_final_state=with_state, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
        results = [out.float()] + ([final.float()] if with_state else [])
        if backward:
            roots, grads_out = [out], [dout.to(out.dtype)]
            if with_state:
                roots, grads_out = roots + [final], grads_out + [dht.to(final.dtype)]
            results += [g.float() for g in torch.autograd.grad(roots, list(xs.values()), grads_out)]
        return results

    return run(torch.bfloat16, True), run(torch.bfloat16, False), run(torch.float32, False, reference or core)


@pytest.mark.skipif(not _ON_GPU_WITH_FLA, reason="fla's kernels need a GPU and flash-linear-attention")
@pytest.mark.timeout(400)  # a fresh machine: fla autotunes each shape and dtype, forward and backward, minutes
@pytest.mark.parametrize("tokens, cu_seqlens, with_state", [(1, None, False), (63, None, True), (300, None, False),
                                                            (300, [0, 7, 70, 300], True)])
def test_fla_chunked_core_with_grouped_key_heads_follows_the_core_with_repeated_ones(tokens, cu_seqlens, with_state):
    """fla's chunk_gated_delta_rule given the key heads as they are, against the same core given
    them repeated, by the numerics rule with transformers' PyTorch core in fp32 as the reference: the output,
    the final state and every gradient (q's and k's summed over each group by fla, by
    repeat_interleave's backward on the other side), single rows and packed ones, with and without
    states."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    grouped, repeated, reference = _grouped_and_repeated(chunk_gated_delta_rule, tokens, cu_seqlens, with_state,
                                                         reference=_pytorch_core("torch_chunk_gated_delta_rule"))
    names = ["out"] + (["final state"] if with_state else []) + ["dq", "dk", "dv", "dg", "dbeta"] + \
        (["dh0"] if with_state else [])
    assert len(names) == len(grouped)
    for name, a, b, hi in zip(names, grouped, repeated, reference):
        assert_close_by_rule(name, a, b, hi)


@pytest.mark.skipif(not _ON_GPU_WITH_FLA, reason="fla's kernels need a GPU and flash-linear-attention")
def test_fla_recurrent_core_with_grouped_key_heads_follows_the_core_with_repeated_ones():
    """The recurrent core a cached decode calls (forward only, as fla has it), one token and a few."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    for tokens in (1, 5):
        grouped, repeated, reference = _grouped_and_repeated(
            fused_recurrent_gated_delta_rule, tokens, with_state=True, backward=False,
            reference=_pytorch_core("torch_recurrent_gated_delta_rule"))
        for name, a, b, hi in zip(["out", "final state"], grouped, repeated, reference):
            assert_close_by_rule(name, a, b, hi)


@pytest.mark.parametrize("switch_class", [hf_gdn.CoreSwitch, hf_gdn.DeltaRuleSwitch])
def test_where_transformers_runs_its_pytorch_core_the_switch_repeats_the_skipped_heads(monkeypatch, switch_class):
    """Under torch.export (and torch.compile with torch < 2.13, whose tracer answers is_exporting()
    with True) transformers' wrapper calls its PyTorch core, which needs q and k repeated: the switch
    repeats them there, in repeat_interleave's order, and hands them on untouched otherwise."""
    seen = []

    def core(query, key, value, g=None, beta=None, **kwargs):
        seen.append((query, key))
        return value, None

    switch = switch_class.install(core)
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 6, 8)
    for pytorch_core in (False, True):
        monkeypatch.setattr(hf_gdn.versions, "hub_calls_pytorch_core", lambda _answer=pytorch_core: _answer)
        out, _ = switch(q, k, v, g=None, beta=None)
        assert out is v
    (q1, k1), (q3, k3) = seen
    assert q1 is q and k1 is k
    assert torch.equal(q3, q.repeat_interleave(3, dim=2)) and torch.equal(k3, k.repeat_interleave(3, dim=2))
    # a layer that repeated for itself reaches the core with equal heads: nothing to do
    seen.clear()
    switch(q3, k3, v, g=None, beta=None)
    assert seen[0][0] is q3


def test_skipping_the_repeat_installs_the_switches_around_both_cores(repeating_forward_with_fla):
    model = causal_lm()
    module = sys.modules[type(_gdns(model)[0]).__module__]
    q35lab.apply_to_qwen3_5(model, conv=True)
    assert isinstance(module.torch_chunk_gated_delta_rule, hf_gdn.DeltaRuleSwitch)
    assert isinstance(module.torch_recurrent_gated_delta_rule, hf_gdn.CoreSwitch)


def test_transformers_wrapper_decides_by_what_hub_calls_pytorch_core_reads(monkeypatch):
    from transformers.utils import import_utils

    for exporting in (False, True):
        monkeypatch.setattr(import_utils, "is_torchdynamo_exporting", lambda _answer=exporting: _answer)
        assert hf_gdn.versions.hub_calls_pytorch_core() is exporting
