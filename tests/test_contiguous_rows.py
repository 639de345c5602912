"""The strided-row copy (q35lab.ops.contiguous_rows) against torch's ``.contiguous()``: exact
values, the gradient of a copy (first and second order), the inputs it leaves to torch, and the
delta-rule switch that hands fla's core q, k and v through it."""

import pytest
import torch

from q35lab.hf import gated_delta_net as hf_gdn
from q35lab.ops.contiguous_rows import contiguous_rows, strided_rows
from q35lab.runtime import device


def _split_heads(batch, tokens, heads, head_dim, dtype, seed):
    """What transformers' GatedDeltaNet gives its core: q, k, v split out of one [B, T, C] tensor
    (a fresh leaf) as column blocks and viewed as [B, T, heads, head_dim]; v has twice the heads."""
    gen = torch.Generator().manual_seed(seed)
    widths = [heads * head_dim, heads * head_dim, 2 * heads * head_dim]
    mixed = torch.randn(batch, tokens, sum(widths), generator=gen).to(device(), dtype).requires_grad_()
    q, k, v = torch.split(mixed, widths, dim=-1)
    return mixed, [t.reshape(batch, tokens, -1, head_dim) for t in (q, k, v)]


@pytest.mark.parametrize("batch, tokens, heads, head_dim", [
    (1, 37, 3, 5),     # odd widths, rows not a multiple of the block
    (2, 1, 2, 16),     # one token a sequence, two sequences
    (1, 130, 4, 128),  # Qwen3.5's head width; v rows wider than one column block (1024)
    (3, 20, 1, 7),     # one head
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_views_are_copied_exactly_and_their_gradient_is_the_copy_s(batch, tokens, heads, head_dim, dtype):
    mixed, views = _split_heads(batch, tokens, heads, head_dim, dtype, seed=tokens)
    for view in views:
        assert not view.is_contiguous() and strided_rows(view) is not None  # the Triton path
        out = contiguous_rows(view)
        assert out.is_contiguous() and out.shape == view.shape and torch.equal(out, view.contiguous())
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(v.shape, generator=gen).to(device(), dtype) for v in views]
    ours = torch.autograd.grad(sum((contiguous_rows(v) * w).sum() for v, w in zip(views, weights)), mixed)[0]
    theirs = torch.autograd.grad(sum((v.contiguous() * w).sum() for v, w in zip(views, weights)), mixed)[0]
    assert torch.equal(ours, theirs)


def test_double_backward_through_the_copy_is_torch_s():
    mixed, (q, _, _) = _split_heads(1, 9, 2, 4, torch.float32, seed=3)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(device())

    def second(copy):
        first = torch.autograd.grad((copy(q) ** 3 * weight).sum(), mixed, create_graph=True)[0]
        return torch.autograd.grad(first.sum(), mixed)[0]

    assert torch.equal(second(contiguous_rows), second(torch.Tensor.contiguous))


def test_inputs_without_strided_rows_are_left_to_torch():
    x = torch.randn(6, 10, device=device())
    assert contiguous_rows(x) is x  # contiguous already: no copy
    transposed = x.t()
    assert strided_rows(transposed) is None
    assert torch.equal(contiguous_rows(transposed), transposed.contiguous())
    empty = torch.randn(1, 0, 12, device=device())[..., :5]
    assert contiguous_rows(empty).shape == (1, 0, 5)
    broadcast = torch.randn(1, 8, device=device()).expand(4, 8)  # rows 0 apart: each a copy of one
    assert torch.equal(contiguous_rows(broadcast), broadcast.contiguous())
    with pytest.raises(TypeError, match="x: expected a tensor"):
        contiguous_rows([1.0, 2.0])


def _recording_core(seen):
    def core(query, key, value, g, beta, *args, cu_seqlens=None, initial_state=None, **kwargs):
        seen.extend(t.is_contiguous() for t in (query, key, value))
        return query.sum() + key.sum() + value.sum(), None
    return core


def test_the_delta_rule_switch_hands_fla_s_core_contiguous_q_k_v_and_others_the_views():
    _, views = _split_heads(1, 11, 2, 8, torch.float32, seed=5)
    g = beta = torch.zeros(1, 11, 4, device=device())
    for fla_core, expected in ((True, [True] * 3), (False, [False] * 3)):
        seen = []
        out, _ = hf_gdn._PerSequenceDeltaRule(_recording_core(seen), fla_core)(*views, g, beta)
        assert seen == expected and torch.allclose(out, sum(v.sum() for v in views))


def test_the_switch_asks_whether_the_function_it_wraps_is_fla_s():
    fla_like = _recording_core([])
    fla_like.__module__ = "fla.ops.gated_delta_rule.chunk"
    assert hf_gdn.DeltaRuleSwitch.install(fla_like).replacement().fla_core
    assert not hf_gdn.DeltaRuleSwitch.install(_recording_core([])).replacement().fla_core


def test_the_benchmark_copies_what_fla_is_given_and_counts_its_bytes():
    from q35lab import bench, shapes

    spec = bench.discover()["contiguous_rows"]
    data = spec.make_inputs(5, device(), torch.bfloat16)
    outs = {name: make(data)[0]() for name, (make, _) in spec.impls.items()}
    assert all(a.is_contiguous() and torch.equal(a, b) for a, b in zip(outs["q35lab"], outs["torch"]))
    width = 2 * shapes.GDN_KEY_HEADS * shapes.GDN_HEAD_DIM + shapes.GDN_VALUE_HEADS * shapes.GDN_HEAD_DIM
    assert spec.bytes_model(5, "fwd") == 2 * 5 * width * 2 and width == 8192  # read and write, bf16
