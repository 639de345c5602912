"""q35lab's attention implementation for packed rows (q35lab.packed_attention): a row's known
sequence boundaries go to PyTorch's varlen flash attention, every other call to transformers'
SDPA. Flash attention needs a CUDA device, so on a CPU a per-sequence causal SDPA stands in for
varlen_attn (same signature) to check everything around it; the last test runs the real one."""

import copy
import functools
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import patch_everywhere
from test_packing import _one_at_a_time, _packed, _packed_step, _peft_model

import q35lab
from q35lab import packed_attention
from q35lab.numerics import assert_close_by_rule
from q35lab.patch import attention as patch_attention
from q35lab.runtime import device
from tiny_models import TEXT, assert_same_loss_and_grads, causal_lm


def per_sequence_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                           window_size=(-1, -1), enable_gqa=False):
    """What varlen_attn computes, by its signature: [T, heads, d] in and out, causal attention
    within each sequence cu_seq_q[i] : cu_seq_q[i + 1]."""
    assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    bounds = cu_seq_q.tolist()
    assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                     enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(pieces)


@pytest.fixture
def stand_in(monkeypatch):
    """varlen_attn replaced by ``per_sequence_attention`` and allowed on this device; returns the
    boundaries of each call."""
    calls = []

    @functools.wraps(per_sequence_attention)  # its signature: the keywords varlen_attn takes
    def recorded(*args, **kwargs):
        calls.append(args[3].tolist())
        return per_sequence_attention(*args, **kwargs)

    patch_everywhere(monkeypatch, "varlen_attention_function", lambda: recorded)
    patch_everywhere(monkeypatch, "flash_can_run", lambda query: True)
    return calls


def _full_attention_layers(model):
    return sum(type(m).__name__ == "Qwen3_5Attention" for m in model.modules())


def _implementations(model):
    """What the model's full-attention layers run, as transformers reads it (``layer.config``)."""
    return {m.config._attn_implementation for m in model.modules() if type(m).__name__ == "Qwen3_5Attention"}


@pytest.mark.parametrize("lengths", [[5, 9, 3], [1, 6, 2, 7]], ids=lambda ls: "-".join(map(str, ls)))
def test_a_packed_row_runs_each_sequence_alone_without_a_dense_mask(stand_in, monkeypatch, lengths):
    """Loss and every gradient of the packed row = the sequences run alone; the attention got
    the row's boundaries (once per layer and pass) and SDPA never ran (its dense mask unused)."""
    import transformers.integrations.sdpa_attention as sdpa

    model = _peft_model(seed=1)
    report = q35lab.apply_to_qwen3_5(model)
    assert "varlen" in report.runs["packed full attention"]
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in lengths]
    alone = _one_at_a_time(model, sequences)  # one sequence a call: no boundaries, SDPA
    stand_in.clear()
    sdpa_calls = []
    original = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: sdpa_calls.append(1) or original(*a, **k))
    packed = _packed_step(model, sequences)
    assert_same_loss_and_grads(packed, alone, rtol=1e-4, atol=1e-5)
    edges = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert stand_in == [edges] * _full_attention_layers(model)  # one forward (no checkpointing here)
    assert not sdpa_calls


@pytest.mark.parametrize("start", [0, 1])
def test_boundaries_derived_from_position_ids_take_the_varlen_path_too(stand_in, start):
    """DataCollatorWithFlattening's default row (position_ids only, from 0 or from 1): q35lab
    derives cu_seq_lens where the positions do not step by one."""
    model = _peft_model(seed=2)
    q35lab.apply_to_qwen3_5(model)
    lengths = [4, 7, 2]
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in lengths]
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(n, device=device()) + start for n in lengths])[None]
    labels = ids.clone()
    labels[0, [0, 4, 11]] = -100
    with torch.no_grad():
        model(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    assert stand_in == [[0, 4, 11, 13]] * _full_attention_layers(model)


def test_every_other_call_is_transformers_sdpa_unchanged(stand_in):
    """A padded batch, one sequence without boundaries and a generation with a cache take SDPA:
    the same numbers, bit for bit, as the patched model with varlen_attention=False."""
    torch.manual_seed(3)
    switched, plain = causal_lm(), causal_lm()
    plain.load_state_dict(switched.state_dict())
    q35lab.apply_to_qwen3_5(switched)
    q35lab.apply_to_qwen3_5(plain, varlen_attention=False)
    assert _implementations(plain) == {"sdpa"} != _implementations(switched)
    ids = torch.randint(0, TEXT["vocab_size"], (2, 9), device=device())
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    for kwargs in ({"input_ids": ids, "attention_mask": mask}, {"input_ids": ids[:1]}):
        with torch.no_grad():
            a, b = switched(**kwargs, use_cache=False).logits, plain(**kwargs, use_cache=False).logits
        assert torch.equal(a, b)
    with torch.no_grad():
        generated = [m.generate(ids[:1, :5], max_new_tokens=4, do_sample=False) for m in (switched, plain)]
    assert torch.equal(*generated)
    assert not stand_in


def test_the_switch_is_reported_reverted_and_left_alone_where_it_does_not_apply(monkeypatch):
    model = causal_lm()
    report = q35lab.apply_to_qwen3_5(model)
    if packed_attention.varlen_attention_function() is not None:  # torch >= 2.9
        assert report.replaced["Qwen3_5Attention (SDPA; packed rows: varlen flash attention)"] == 1
        assert _implementations(model) == {packed_attention.NAME} and model.config._attn_implementation == "sdpa"
        assert "q35lab" not in model.config.to_json_string()  # a saved config names no q35lab implementation
    again = q35lab.apply_to_qwen3_5(model)
    assert not any("Attention" in name for name in again.replaced)
    reverted = q35lab.revert(model)
    assert _implementations(model) == {"sdpa"}
    switched = packed_attention.varlen_attention_function() is not None
    assert reverted.reverted.get("Qwen3_5Attention (SDPA)", 0) == switched

    eager = causal_lm()
    eager.config._attn_implementation = "eager"
    report = q35lab.apply_to_qwen3_5(eager)
    assert _implementations(eager) == {"eager"} and "eager" in report.not_applied["varlen_attention"]

    patch_everywhere(monkeypatch, "varlen_attention_function", lambda: None)
    older = causal_lm()
    report = q35lab.apply_to_qwen3_5(older)
    assert _implementations(older) == {"sdpa"}
    assert "no torch.nn.attention.varlen" in report.not_applied["varlen_attention"]


def test_two_models_of_one_config_object_are_switched_and_reverted_each_on_its_own(stand_in):
    """Patching one model leaves the other's attention (and the shared config) on SDPA; patching the
    other is its own patch; reverting one leaves the other switched. A packed row of the other
    model (patched without the switch: its GatedDeltaNet keeps the row apart) never reaches varlen_attn."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(intermediate_size=96, **TEXT)
    a, b = Qwen3_5ForCausalLM(config).to(device()), Qwen3_5ForCausalLM(config).to(device())
    assert a.config is b.config
    q35lab.apply_to_qwen3_5(b, varlen_attention=False)
    first = q35lab.apply_to_qwen3_5(a)
    assert first.replaced["Qwen3_5Attention (SDPA; packed rows: varlen flash attention)"] == 1
    assert _implementations(a) == {packed_attention.NAME} and _implementations(b) == {"sdpa"}
    assert config._attn_implementation == "sdpa"
    sequences = [torch.randint(0, TEXT["vocab_size"], (n,), device=device()) for n in (3, 5)]
    ids, labels, kwargs = _packed(sequences)
    with torch.no_grad():
        for model in (b, a):
            model(input_ids=ids, labels=labels, **kwargs)
    assert stand_in == [[0, 3, 8]]  # a's one attention layer, not b's
    second = q35lab.apply_to_qwen3_5(b)
    assert second.replaced["Qwen3_5Attention (SDPA; packed rows: varlen flash attention)"] == 1  # not "already"
    assert "Qwen3_5Attention (SDPA)" in q35lab.revert(a).reverted
    assert _implementations(a) == {"sdpa"} and _implementations(b) == {packed_attention.NAME}
    b.set_attn_implementation("eager")  # the model's own switch reaches a switched layer, and back again
    assert _implementations(b) == {"eager"}
    b.set_attn_implementation("sdpa")
    assert _implementations(b) == {packed_attention.NAME}
    q35lab.revert(b)
    assert _implementations(b) == {"sdpa"} and config._attn_implementation == "sdpa"
    assert all(m.config is config for m in (*a.modules(), *b.modules()) if type(m).__name__ == "Qwen3_5Attention")


def test_a_copy_and_a_pickled_model_keep_the_switch_and_find_it_registered():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if packed_attention.varlen_attention_function() is None:
        pytest.skip("this torch has no varlen_attn: nothing is switched")
    model = causal_lm()
    q35lab.apply_to_qwen3_5(model)
    twin = copy.deepcopy(model)
    q35lab.revert(twin)
    assert _implementations(twin) == {"sdpa"} and _implementations(model) == {packed_attention.NAME}
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for registry in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):  # as in a fresh process
        registry._global_mapping.pop(packed_attention.NAME)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert packed_attention.NAME in ALL_ATTENTION_FUNCTIONS._global_mapping
    assert packed_attention.NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    ids = torch.randint(0, TEXT["vocab_size"], (1, 7), device=device())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    assert pickle.loads(pickle.dumps(loaded.config)).to_dict() == loaded.config.to_dict()


def test_the_causal_keyword_follows_the_signature_and_head_groups_are_checked():
    def newer(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        pass

    def first(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
        pass

    def unknown(q, k, v, cu_q, cu_k, max_q, max_k):
        pass

    assert patch_attention._causal_keyword(newer) == {"window_size": (-1, 0)}
    assert patch_attention._causal_keyword(first) == {"is_causal": True}
    with pytest.raises(RuntimeError, match="neither window_size nor is_causal"):
        patch_attention._causal_keyword(unknown)
    q, kv = torch.zeros(1, 6, 5, 8), torch.zeros(1, 4, 5, 8)
    with pytest.raises(ValueError, match="6 heads is not a multiple of the 4 key/value heads"):
        packed_attention.varlen_attention(None, q, kv, kv, torch.tensor([0, 5]), 5, 1.0)


@pytest.mark.parametrize("lengths", [[1, 37, 300, 5, 683], [1024]], ids=lambda ls: "-".join(map(str, ls)))
def test_varlen_flash_attention_on_the_gpu_matches_each_sequence_alone(lengths):
    """The real varlen_attn (flash), bf16, the 9B's head_dim 256 with grouped-query heads (8 of
    them on 2 key/value heads): output and the gradients of q, k and v against per-sequence SDPA
    in bf16, both against fp64, by the numerics rule."""
    if not torch.cuda.is_available() or packed_attention.varlen_attention_function() is None:
        pytest.skip("flash attention runs on a CUDA device, with torch >= 2.9")
    generator = torch.Generator().manual_seed(len(lengths))
    T, heads, kv_heads, d = sum(lengths), 8, 2, 256
    make = lambda h: torch.randn(1, h, T, d, generator=generator).to("cuda")  # noqa: E731
    q64, k64, v64 = make(heads).double(), make(kv_heads).double(), make(kv_heads).double()
    grad = torch.randn(1, T, heads, d, generator=generator).to("cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    scale = d ** -0.5

    def run(dtype, attention):
        q, k, v = (t.to(dtype).detach().requires_grad_() for t in (q64, k64, v64))
        out = attention(q, k, v)
        out.backward(grad.to(dtype))
        return [out.detach(), q.grad, k.grad, v.grad]

    def reference(q, k, v):
        rows = [t[0].transpose(0, 1) for t in (q, k, v)]
        return per_sequence_attention(*rows, cu, cu, max(lengths), max(lengths), scale=scale,
                                      window_size=(-1, 0), enable_gqa=True)[None]

    flash = run(torch.bfloat16,
                lambda q, k, v: packed_attention.varlen_attention(None, q, k, v, cu, max(lengths), scale))
    ref, exact = run(torch.bfloat16, reference), run(torch.float64, reference)
    for name, out, r, e in zip(("out", "dq", "dk", "dv"), flash, ref, exact):
        assert_close_by_rule(name, out, r, e)


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_the_sdpa_path_narrows_any_mask_to_the_given_boundaries(mask):
    """Off the varlen path (here: a CPU), a call with cu_seq_lens_q gets transformers' mask (causal
    when None, boolean or additive) narrowed to each sequence: per-sequence causal attention."""
    torch.manual_seed(5)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    lengths = [3, 1, 6, 4]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device())
    query = torch.randn(1, 4, 14, 16, device=device(), requires_grad=True)
    key, value = (torch.randn(1, 2, 14, 16, device=device(), requires_grad=True) for _ in range(2))
    causal = torch.ones(14, 14, dtype=torch.bool, device=device()).tril()[None, None]
    given = {"none": None, "bool": causal,
             "float": torch.zeros(1, 1, 14, 14, device=device()).masked_fill(~causal, float("-inf"))}[mask]
    out, _ = packed_attention.sdpa_or_varlen_attention(module, query, key, value, given, scaling=0.25,
                                                       cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    expected = per_sequence_attention(*(t[0].transpose(0, 1) for t in (query, key, value)), cu, cu, 6, 6,
                                      scale=0.25, window_size=(-1, 0), enable_gqa=True)[None]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (query, key, value), grad)
    for a, b in zip(got, torch.autograd.grad(expected, (query, key, value), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cu_seq_lens_q: packed sequences come as one row"):
        packed_attention.sdpa_or_varlen_attention(module, query.expand(2, -1, -1, -1), key.expand(2, -1, -1, -1),
                                                  value.expand(2, -1, -1, -1), None, cu_seq_lens_q=cu)
