"""fused_lora_projections against the unfused computation, and the in_proj fusion of a model."""

import pytest
import torch

import q35lab
from q35lab.long_context import enable_checkpointing
from q35lab.numerics import assert_close_by_rule
from q35lab.ops.fused_projections import (
    ConcatCache,
    FusedLoRAProjectionsFunction,
    Projection,
    fused_lora_projections,
    fused_lora_projections_ref,
    pack_rows,
    unpack_rows,
)
from q35lab.runtime import device
from tiny_models import count_forward_calls, loss_and_grads, recording_backend

K = 64
OUT = (96, 48, 8, 8)  # qkv, z, b, a in miniature


def _projections(with_adapter=(True, True, True, True), dtype=torch.float32, dropout=0.0, bias=False, rank=4, width=K):
    ps = []
    for n, adapter in zip(OUT, with_adapter):
        p = Projection((0.1 * torch.randn(n, width, device=device())).to(dtype),
                       bias=(0.1 * torch.randn(n, device=device())).to(dtype) if bias else None)
        if adapter:
            p.lora_A = (0.1 * torch.randn(rank, width, device=device())).requires_grad_()
            p.lora_B = (0.1 * torch.randn(n, rank, device=device())).requires_grad_()
            p.scaling, p.dropout = 2.0, dropout
        ps.append(p)
    return ps


def _adapters(ps):
    return [t for p in ps if p.has_adapter for t in (p.lora_A, p.lora_B)]


def _assert_same_outputs_and_gradients(outs, refs, x, ps):
    dys = [torch.randn_like(o) for o in outs]
    wanted = [x, *_adapters(ps)]
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(torch.autograd.grad(outs, wanted, dys), torch.autograd.grad(refs, wanted, dys)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_adapter",
                         [(True,) * 4, (True, False, True, False), (False,) * 4, (False, False, False, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_outputs_and_every_gradient_match_the_unfused_computation(with_adapter, bias):
    ps = _projections(with_adapter, bias=bias)
    x = torch.randn(2, 7, K, device=device(), requires_grad=True)
    outs, refs = fused_lora_projections(x, ps), fused_lora_projections_ref(x, ps)
    assert [o.shape[-1] for o in outs] == list(OUT)
    _assert_same_outputs_and_gradients(outs, refs, x, ps)


def test_unused_outputs_get_no_gradient_and_cost_nothing_wrong():
    ps = _projections()
    x = torch.randn(5, K, device=device(), requires_grad=True)
    outs, refs = fused_lora_projections(x, ps), fused_lora_projections_ref(x, ps)
    used = [0, 2]
    wanted = [x, *_adapters(ps)]
    ours = torch.autograd.grad(sum(outs[i].square().sum() for i in used), wanted)
    theirs = torch.autograd.grad(sum(refs[i].square().sum() for i in used), wanted, allow_unused=True)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("narrow", [0, 16, 1000])  # every projection wide / b, a narrow / all narrow
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_input_gradient_whichever_projections_join_the_thin_gemm(monkeypatch, narrow, dropout):
    from q35lab.ops import fused_projections

    monkeypatch.setattr(fused_projections, "NARROW_FEATURES", narrow)
    ps = _projections((True, False, True, True), dropout=dropout)
    x = torch.randn(3, 5, K, device=device(), requires_grad=True)
    torch.manual_seed(11)
    outs = fused_lora_projections(x, ps)
    torch.manual_seed(11)
    draws = iter([int(torch.randint(0, 2**62, (1,)).item()) for p in ps if p.has_adapter])  # one per adapter
    seeds = [next(draws) if p.has_adapter else None for p in ps]
    refs = fused_lora_projections_ref(x, ps, seeds)
    _assert_same_outputs_and_gradients(outs, refs, x, ps)


def test_dropout_uses_one_mask_per_projection_like_peft():
    ps = _projections(dropout=0.25)
    x = torch.randn(6, K, device=device(), requires_grad=True)
    torch.manual_seed(7)
    outs = fused_lora_projections(x, ps)
    torch.manual_seed(7)
    seeds = [int(torch.randint(0, 2**62, (1,)).item()) for _ in ps]  # the draws it made, in order
    refs = fused_lora_projections_ref(x, ps, seeds)
    _assert_same_outputs_and_gradients(outs, refs, x, ps)


def test_bf16_activations_by_the_numerics_rule():
    ps = _projections(dtype=torch.bfloat16)
    x = torch.randn(33, K, device=device()).bfloat16().requires_grad_()
    outs, refs = fused_lora_projections(x, ps), fused_lora_projections_ref(x, ps)
    x64 = x.detach().double().requires_grad_()
    ps64 = [Projection(p.weight.double(), None, p.lora_A.detach().double().requires_grad_(),
                       p.lora_B.detach().double().requires_grad_(), p.scaling) for p in ps]
    refs64 = fused_lora_projections_ref(x64, ps64)
    dys = [torch.randn_like(o) for o in outs]
    for i, (o, r, e) in enumerate(zip(outs, refs, refs64)):
        assert o.dtype == torch.bfloat16
        assert_close_by_rule(f"y{i}", o, r, e)
    names = ["dx"] + [f"d{n}{i}" for i in range(4) for n in ("A", "B")]
    ours = torch.autograd.grad(outs, [x, *_adapters(ps)], dys)
    theirs = torch.autograd.grad(refs, [x, *_adapters(ps)], dys)
    exact = torch.autograd.grad(refs64, [x64, *_adapters(ps64)], [d.double() for d in dys])
    for name, a, b, c in zip(names, ours, theirs, exact):
        assert_close_by_rule(name, a.to(b.dtype), b, c)


def test_an_optimizer_step_between_two_forwards_is_seen():
    ps = _projections()
    cache = ConcatCache()
    x = torch.randn(4, K, device=device())
    opt = torch.optim.SGD(_adapters(ps), lr=0.1)
    first = fused_lora_projections(x, ps, cache=cache)
    sum(o.sum() for o in first).backward()
    opt.step()
    second, expected = fused_lora_projections(x, ps, cache=cache), fused_lora_projections_ref(x, ps)
    for o, r, f in zip(second, expected, first):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)  # fp32, different summation order
        assert (o - f).abs().max() > 1e-2  # the step moved every output
    with torch.no_grad():  # an in-place change of a frozen base weight (e.g. a merge) rebuilds the cache
        ps[1].weight.add_(1.0)
    third = fused_lora_projections(x, ps, cache=cache)
    torch.testing.assert_close(third[1], fused_lora_projections_ref(x, ps)[1], rtol=1e-4, atol=1e-4)


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_packed_base_weights_make_the_cached_concatenation_a_view():
    ps = _projections(bias=True)
    weights = [p.weight for p in ps]
    before = [w.clone() for w in weights]
    assert pack_rows(weights)
    assert len(_storages(weights)) == 1
    for w, b in zip(weights, before):
        assert w.is_contiguous() and torch.equal(w, b)
    x, cache = torch.randn(5, K, device=device()).requires_grad_(), ConcatCache()
    concatenated, _ = cache.get(ps, x.dtype)
    assert concatenated.data_ptr() == weights[0].data_ptr() and torch.equal(concatenated, torch.cat(before))
    _assert_same_outputs_and_gradients(fused_lora_projections(x, ps, cache=cache), fused_lora_projections_ref(x, ps),
                                       x, ps)
    with torch.no_grad():  # an in-place change (a merge) is in the view at once
        weights[2].mul_(3.0)
    torch.testing.assert_close(fused_lora_projections(x, ps, cache=cache)[2], fused_lora_projections_ref(x, ps)[2],
                               rtol=1e-4, atol=1e-4)
    in_bf16, _ = cache.get(ps, torch.bfloat16)  # another dtype (autocast): a cast copy, as before
    assert in_bf16.dtype == torch.bfloat16 and _storages([in_bf16]) != _storages(weights[:1])
    unpack_rows(weights)
    assert len(_storages(weights)) == len(weights)
    concatenated, _ = cache.get(ps, x.dtype)  # no longer one buffer: concatenated by copy
    assert _storages([concatenated]).isdisjoint(_storages(weights))
    torch.testing.assert_close(concatenated, torch.cat([w for w in weights]))


def test_a_cache_that_keeps_no_copies_holds_a_concatenation_only_while_backward_needs_it():
    import gc
    import weakref

    ps = _projections(bias=True)  # four buffers: the concatenation is a copy
    weights = [p.weight for p in ps]
    x = torch.randn(5, K, device=device()).requires_grad_()
    kept, weak = ConcatCache(), ConcatCache(keep_copies=False)
    assert kept.get(ps, x.dtype)[0] is kept.get(ps, x.dtype)[0]  # the default: one copy, kept
    copy, _ = weak.get(ps, x.dtype)
    assert weak.get(ps, x.dtype)[0] is copy  # while something holds it, it is reused
    held = weakref.ref(copy)
    del copy
    gc.collect()
    assert held() is None  # the cache alone does not keep it
    outputs = fused_lora_projections(x, ps, cache=weak)
    during, _ = weak.get(ps, x.dtype)  # autograd keeps the forward's copy for backward: the same one
    assert during.data_ptr() in {t.data_ptr() for t in outputs[0].grad_fn.saved_tensors}
    held = weakref.ref(during)
    assert _storages([during]).isdisjoint(_storages(weights))
    del during
    _assert_same_outputs_and_gradients(outputs, fused_lora_projections_ref(x, ps), x, ps)
    gc.collect()
    assert held() is None  # freed with the backward's saved tensors
    again = fused_lora_projections(x, ps, cache=weak)  # made anew: the same outputs
    for o, r in zip(again, fused_lora_projections_ref(x, ps)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    assert pack_rows(weights)  # one buffer: a view, kept either way (it holds no memory of its own)
    view, _ = weak.get(ps, x.dtype)
    assert view.data_ptr() == weights[0].data_ptr() and weak.get(ps, x.dtype)[0] is view


@pytest.mark.parametrize("weights", [
    lambda: [torch.randn(3, K), torch.randn(2, K, dtype=torch.float64)],  # dtypes differ
    lambda: [torch.randn(3, K), torch.randn(2, K + 1)],  # widths differ
    lambda: [torch.randn(3, K, device="meta"), torch.randn(2, K, device="meta")],  # nothing to move
])
def test_pack_rows_leaves_alone_weights_that_cannot_share_a_buffer(weights):
    weights = weights()
    pointers = [w.data_ptr() for w in weights]
    assert not pack_rows(weights)
    assert [w.data_ptr() for w in weights] == pointers


@pytest.mark.parametrize(
    "change,error,message",
    [
        (lambda ps: setattr(ps[0], "weight", torch.randn(96, K + 1)), ValueError, r"projections\[0\].weight: expected"),
        (lambda ps: setattr(ps[1], "lora_B", torch.randn(48, 3)), ValueError, r"projections\[1\].lora_B: expected"),
        (lambda ps: setattr(ps[2], "lora_B", None), ValueError, "must be given together"),
        (lambda ps: ps[3].weight.requires_grad_(), ValueError, "must be frozen"),
        (lambda ps: setattr(ps[0], "dropout", 1.5), ValueError, r"projections\[0\].dropout: expected a probability"),
        (lambda ps: setattr(ps[1], "weight", torch.ones(48, K, dtype=torch.int64)), TypeError,
         r"projections\[1\].weight: expected dtype bfloat16, float16 or float32, got torch.int64"),
        (lambda ps: ps.__setitem__(2, (ps[2].weight, None)), TypeError,
         r"projections\[2\]: expected a q35lab Projection, got tuple"),
        (lambda ps: setattr(ps[3], "lora_A", ps[3].lora_A.detach().half().to(torch.int32)), TypeError,
         r"projections\[3\].lora_A: expected dtype"),
        (lambda ps: setattr(ps[0], "bias", torch.randn(95)), ValueError,
         r"projections\[0\].bias: expected \[96\], got \(95,\)"),
        (lambda ps: setattr(ps[1], "bias", torch.ones(48, dtype=torch.bool)), TypeError,
         r"projections\[1\].bias: expected dtype"),
        (lambda ps: setattr(ps[2], "lora_A", torch.randn(K)), ValueError,
         r"projections\[2\].lora_A: expected \[r, 64\]"),
        (lambda ps: setattr(ps[0], "lora_B", torch.randn(96, 4, 1)), ValueError,
         r"projections\[0\].lora_B: expected \[96, 4\]"),
        (lambda ps: setattr(ps[3], "scaling", "two"), TypeError,
         r"projections\[3\].scaling: expected a real number .*got str"),
        (lambda ps: setattr(ps[1], "scaling", float("nan")), ValueError,
         r"projections\[1\].scaling: expected a finite real number"),
        (lambda ps: setattr(ps[2], "dropout", True), TypeError,
         r"projections\[2\].dropout: expected a real number .*got bool"),
        (lambda ps: setattr(ps[0], "lora_B", torch.randn(96, 4, device="meta")), ValueError,
         r"expected all tensors on one device, got .*projections\[0\].lora_B on meta"),
    ],
)
def test_bad_input_raises_naming_the_argument(change, error, message):
    ps = _projections()
    change(ps)
    with pytest.raises(error, match=message):
        fused_lora_projections(torch.randn(3, K, device=device()), ps)


# ---------------------------------------------------------------------------------------------
# Behaving like four nn.Linear modules: in-place edits of the outputs, no tokens, torch.compile.
# ---------------------------------------------------------------------------------------------
def _in_fp64(ps):
    def leaf(t):
        return None if t is None else t.detach().double().requires_grad_(t.requires_grad)

    return [Projection(leaf(p.weight), leaf(p.bias), leaf(p.lora_A), leaf(p.lora_B), p.scaling, p.dropout) for p in ps]


def _assert_every_result_by_rule(run, x, ps):
    """``run(fn, x, ps)`` with the fused op, with the unfused reference in x's dtype and in fp64:
    every output and the gradient of x and of every adapter by the numerics rule."""
    x64, ps64 = x.detach().double().requires_grad_(), _in_fp64(ps)
    outs, refs = run(fused_lora_projections, x, ps), run(fused_lora_projections_ref, x, ps)
    refs64 = run(fused_lora_projections_ref, x64, ps64)
    for i, (o, r, e) in enumerate(zip(outs, refs, refs64)):
        assert o.shape == e.shape and o.dtype == r.dtype
        assert_close_by_rule(f"y{i}", o, r, e)
    dys = [torch.randn_like(e) for e in refs64]
    names = ["dx"] + [f"d{n}{i}" for i, p in enumerate(ps) if p.has_adapter for n in ("A", "B")]
    ours = torch.autograd.grad(outs, [x, *_adapters(ps)], [d.to(o.dtype) for d, o in zip(dys, outs)])
    theirs = torch.autograd.grad(refs, [x, *_adapters(ps)], [d.to(r.dtype) for d, r in zip(dys, refs)])
    exact = torch.autograd.grad(refs64, [x64, *_adapters(ps64)], dys)
    for name, a, b, c in zip(names, ours, theirs, exact):
        assert a.shape == c.shape and a.dtype == b.dtype, name
        assert_close_by_rule(name, a, b, c)


@pytest.mark.parametrize("lead,dtype", [
    ((7,), torch.float32), ((2, 5), torch.float32), ((), torch.float32),
    ((3, 43), torch.bfloat16),  # bf16 with enough elements for the rule's maxima to be stable
])
@pytest.mark.parametrize("with_adapter,bias", [((True,) * 4, False), ((True, False, False, True), True)])
def test_each_output_can_be_edited_in_place_like_a_linear_output(lead, dtype, with_adapter, bias):
    ps = _projections(with_adapter, dtype=dtype, bias=bias)
    x = torch.randn(*lead, K, device=device()).to(dtype).requires_grad_()
    fused = fused_lora_projections(x, ps)
    assert len(_storages(fused)) == 1  # still one buffer: no output was copied out of it

    def edited(fn, x, ps):
        qkv, z, b, a = fn(x, ps)
        # saves z: editing the others must not disturb it
        z_scaled = z * z.new_full(z.shape[-1:], 1.5, requires_grad=True)
        qkv.mul_(2.0)
        b[..., :3].sub_(1.0).mul_(-0.5)  # a view of an output, edited
        a.add_(z[..., :8])
        return qkv, z_scaled, b, a

    _assert_every_result_by_rule(edited, x, ps)


@pytest.mark.parametrize("own_buffer", [(1,), (0,), (3,), (0, 1, 2, 3), (1, 2)])
@pytest.mark.parametrize("lead,dtype", [((2, 37), torch.float32), ((1,), torch.float32), ((3, 43), torch.bfloat16)])
@pytest.mark.parametrize("with_adapter,bias", [((True,) * 4, False), ((True, False, False, True), True)])
def test_an_output_in_a_buffer_of_its_own_is_contiguous_and_computes_the_same(own_buffer, lead, dtype, with_adapter,
                                                                              bias):
    ps = _projections(with_adapter, dtype=dtype, bias=bias)
    x = torch.randn(*lead, K, device=device()).to(dtype).requires_grad_()
    outs = fused_lora_projections(x, ps, own_buffer=own_buffer)
    for i, out in enumerate(outs):
        if i in own_buffer:  # a reshape across its rows is a view (the GatedDeltaNet's z: no copy)
            assert out.is_contiguous() and out.reshape(-1, 8).data_ptr() == out.data_ptr()
            assert all(o.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
                       for j, o in enumerate(outs) if j != i)
    shared = [i for i in range(len(ps)) if i not in own_buffer]
    runs = sum(1 for i in shared if i - 1 not in shared)  # neighbours share one buffer
    assert len(_storages(outs)) == len(own_buffer) + runs

    def edited(fn, x, ps):  # in-place edits of every output, as of separate Linear outputs
        kwargs = {"own_buffer": own_buffer} if fn is fused_lora_projections else {}
        qkv, z, b, a = fn(x, ps, **kwargs)
        z_scaled = z * z.new_full(z.shape[-1:], 1.5, requires_grad=True)
        qkv.mul_(2.0)
        b[..., :3].sub_(1.0).mul_(-0.5)
        a.add_(z[..., :8])
        return qkv, z_scaled, b, a

    _assert_every_result_by_rule(edited, x, ps)


@pytest.mark.parametrize("own_buffer,error,message", [
    ((4,), ValueError, r"own_buffer: expected indices of the 4 projections \(0 to 3\), got 4"),
    ((-1,), ValueError, r"own_buffer: expected indices .* got -1"),
    ((True,), ValueError, r"own_buffer: expected indices .* got True"),
    ((1.0,), ValueError, r"own_buffer: expected indices .* got 1.0"),
    (1, TypeError, r"own_buffer: expected projection indices \(ints\), got int"),
])
def test_a_bad_own_buffer_raises_naming_it(own_buffer, error, message):
    with pytest.raises(error, match=message):
        fused_lora_projections(torch.randn(3, K, device=device()), _projections(), own_buffer=own_buffer)


@pytest.mark.parametrize("lead,width", [((0,), K), ((3, 0), K), ((5,), 0)])  # no tokens (flat, batched); no features
@pytest.mark.parametrize("bias", [False, True])
def test_no_tokens_or_no_features_forward_and_backward(lead, width, bias):
    ps = _projections((True, False, True, True), bias=bias, width=width)
    x = torch.randn(*lead, width, device=device(), requires_grad=True)
    _assert_every_result_by_rule(lambda fn, x, ps: fn(x, ps), x, ps)


def test_torch_compile_breaks_the_graph_at_the_op_and_matches_eager():
    """As the patch calls it (a cache, frozen bases): the op runs eagerly between the graph before
    it and the graph after it; output and gradients are eager's."""
    import inspect

    ps, cache = _projections((True, True, False, True), bias=True), ConcatCache()
    x = torch.randn(2, 5, K, device=device(), requires_grad=True)
    leaves = [x, *_adapters(ps)]

    def step(x):
        qkv, z, b, a = fused_lora_projections(torch.cos(x) * 0.5, ps, cache=cache)
        return qkv.transpose(0, 1).square().mean() + (torch.sigmoid(b) * z[..., :8] * a).sum()

    graphs = []
    torch._dynamo.reset()
    loss = torch.compile(step, backend=recording_backend(graphs))(x)
    grads = torch.autograd.grad(loss, leaves)
    assert len(graphs) == 2  # a graph break at the op, not traced into it
    expected = step(x)
    torch.testing.assert_close(loss, expected)
    for ours, theirs in zip(grads, torch.autograd.grad(expected, leaves)):
        torch.testing.assert_close(ours, theirs)
    assert list(inspect.signature(fused_lora_projections).parameters) == ["x", "projections", "cache", "own_buffer"]
    assert fused_lora_projections.__doc__.startswith("All ``projections`` of ``x``")
    assert q35lab.fused_lora_projections is fused_lora_projections



# ---------------------------------------------------------------------------------------------
# The model: four in_proj LoRA projections of every GatedDeltaNet as one node.
# ---------------------------------------------------------------------------------------------
def _peft_tiny(targets):
    peft = pytest.importorskip("peft")
    from tiny_models import causal_lm

    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, 0, 0.05)
    return model


@pytest.mark.parametrize("targets", [
    ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj"],
    ["in_proj_qkv", "in_proj_b"],  # LoRA on some of the four only
])
def test_tiny_peft_model_same_loss_and_gradients_and_the_fused_path_is_taken(monkeypatch, targets):
    model = _peft_tiny(targets)
    ids = torch.randint(0, 128, (2, 9), device=device())
    loss_peft, grads_peft = loss_and_grads(model, ids)
    report = q35lab.apply_to_qwen3_5(model)
    assert report.replaced["Qwen3_5GatedDeltaNet in_proj (4 projections, 1 node)"] == 1
    calls = count_forward_calls(monkeypatch, FusedLoRAProjectionsFunction)
    loss_ours, grads_ours = loss_and_grads(model, ids)
    assert len(calls) == 1 + 2  # one GatedDeltaNet's in_proj and two MLPs' gate/up, a fused node each
    torch.testing.assert_close(loss_ours, loss_peft, rtol=1e-5, atol=1e-6)
    assert grads_ours.keys() == grads_peft.keys()
    for name in grads_peft:
        torch.testing.assert_close(grads_ours[name], grads_peft[name], rtol=1e-3, atol=1e-5, msg=name)
    q35lab.revert(model)
    loss_back, _ = loss_and_grads(model, ids)
    assert len(calls) == 1 + 2  # no more after revert
    torch.testing.assert_close(loss_back, loss_peft, rtol=1e-6, atol=1e-6)


def test_disabled_adapters_and_gradient_checkpointing():
    model = _peft_tiny(["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])
    ids = torch.randint(0, 128, (1, 8), device=device())
    with model.disable_adapter():
        base_loss = model(input_ids=ids, labels=ids).loss.detach()
    loss_peft, grads_peft = loss_and_grads(model, ids)
    q35lab.apply_to_qwen3_5(model)
    with model.disable_adapter():  # fused, base projections only
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss.detach(), base_loss, rtol=1e-5, atol=1e-6)
    enable_checkpointing(model.base_model.model)
    model.train()
    loss_ckpt, grads_ckpt = loss_and_grads(model, ids)
    torch.testing.assert_close(loss_ckpt, loss_peft, rtol=1e-5, atol=1e-6)
    for name in grads_peft:
        torch.testing.assert_close(grads_ckpt[name], grads_peft[name], rtol=1e-3, atol=1e-5, msg=name)


def test_the_patched_gated_delta_net_gets_z_in_a_buffer_of_its_own():
    """z is reshaped to [T·heads, head_dim] for the gated norm: contiguous, that is a view, not a
    copy; qkv, b and a stay column blocks of one buffer (read where they lie)."""
    from tiny_models import causal_lm

    for model in (causal_lm().requires_grad_(False), _peft_tiny("all-linear")):  # frozen bases: fused
        report = q35lab.apply_to_qwen3_5(model, flce=False)
        assert report.replaced["Qwen3_5GatedDeltaNet in_proj (4 projections, 1 node)"] == 1
        gdn = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
        seen = {}
        hooks = [getattr(gdn, name).register_forward_hook(
                     lambda m, args, out, name=name: seen.__setitem__(name, out))  # noqa: B023 (removed below)
                 for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
        ids = torch.randint(0, 128, (2, 9), device=device())
        logits = model(input_ids=ids).logits
        if logits.requires_grad:  # the PEFT model's adapters: the backward runs too
            logits.float().square().mean().backward()
        for hook in hooks:
            hook.remove()
        z, qkv, b, a = seen["in_proj_z"], seen["in_proj_qkv"], seen["in_proj_b"], seen["in_proj_a"]
        assert z.is_contiguous() and not qkv.is_contiguous()
        assert len(_storages([qkv, b, a])) == 1 and len(_storages([qkv, z])) == 2


def test_the_patch_packs_the_four_base_weights_and_revert_separates_them(tmp_path):
    """One buffer while patched (no second copy for the fused GEMM); the model saves and loads the
    same weights meanwhile (transformers clones disjoint views of one buffer); revert splits them."""
    from q35lab.hf.modules import IN_PROJ_NAMES
    from tiny_models import causal_lm

    model = causal_lm().requires_grad_(False)  # frozen bases, no adapters: the fusion still applies
    gdn = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
    weights = lambda: [getattr(gdn, name).weight for name in IN_PROJ_NAMES]  # noqa: E731
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (1, 7), device=device())
    expected = model(input_ids=ids).logits
    q35lab.apply_to_qwen3_5(model, flce=False)
    assert len(_storages(weights())) == 1
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).state_dict()
    q35lab.revert(model)
    assert len(_storages(weights())) == len(IN_PROJ_NAMES)
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name
        assert torch.equal(loaded[name].to(value.device), value), name
