"""The MoE's routed experts (q35lab.ops.routed_experts) against transformers' expert loop, by the
numerics rule, and the patch that runs them in a Qwen3.5 MoE model."""

import copy
import pickle

import pytest
import torch
from conftest import MODEL_COMPILER

import q35lab
from q35lab.numerics import compare, scaled_atol
from q35lab.ops import routed_experts as ops
from q35lab.runtime import device
from tiny_models import loss_and_grads, moe_causal_lm


def _routed(tokens, hidden, experts, width, k, dtype, seed):
    """Fresh inputs: x, router logits (the weights' gradient reaches them), top-k ids and
    normalised weights as transformers' router makes them, and frozen expert weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device(), dtype).requires_grad_()
    logits = torch.randn(tokens, experts, generator=gen).to(device()).requires_grad_()
    gate_up = (torch.randn(experts, 2 * width, hidden, generator=gen) * hidden ** -0.5).to(device(), dtype)
    down = (torch.randn(experts, hidden, width, generator=gen) * width ** -0.5).to(device(), dtype)
    return x, logits, gate_up, down


def _top_k(logits, k, dtype):
    weights, index = logits.softmax(-1).topk(k, dim=-1)
    return index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("tokens, hidden, experts, width, k", [
    (37, 48, 6, 20, 3),      # odd widths, rows not a multiple of the block
    (1, 64, 8, 16, 2),       # one token: most experts get no rows
    (50, 33, 4, 1100, 2),    # an intermediate width wider than one column block (1024)
    (19, 2048, 16, 24, 8),   # the 35B-A3B's hidden size and top-8
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routed_experts_by_the_numerics_rule(tokens, hidden, experts, width, k, dtype):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    x, logits, gate_up, down = _routed(tokens, hidden, experts, width, k, dtype, seed)
    index, weights = _top_k(logits, k, dtype)
    weights = weights.detach().requires_grad_()  # the op's input; the router's logits are checked in fp32 below
    out = ops.routed_experts(x, index, weights, gate_up, down)
    ref = ops.routed_experts_ref(x, index, weights, gate_up, down)
    weights64 = weights.detach().double().requires_grad_()
    ref64 = ops.routed_experts_ref(x.double(), index, weights64, gate_up.double(), down.double())
    assert out.dtype == dtype and out.shape == x.shape
    # upstream gradients well below one, as in training (the loss is a mean over tokens): the rule's
    # atol is absolute (0.01) above one, less than a bf16 ulp of a weight gradient of 16
    d_out = torch.randn_like(out) / 16
    ours = torch.autograd.grad(out, [x, weights], d_out)
    theirs = torch.autograd.grad(ref, [x, weights], d_out)
    exact = torch.autograd.grad(ref64, [x, weights64], d_out.double())
    for name, a, b, c in zip(("out", "dx", "d_top_k_weights"), (out, *ours), (ref, *theirs), (ref64, *exact)):
        result = compare(name, a, b, c, atol=scaled_atol(c, a.dtype))
        assert result.ok, f"seed {seed}: {result}"


def test_the_router_gets_its_gradient():
    """Through the weights to the router's logits (softmax, top-k, renormalised), in fp32: in bf16 the
    logits' gradient is a difference of nearly equal bf16 weight gradients, rounding noise in any path."""
    x, logits, gate_up, down = _routed(23, 40, 6, 12, 3, torch.float32, seed=int(torch.randint(0, 2**31 - 1, ())))
    index, weights = _top_k(logits, 3, torch.float32)
    d_out = torch.randn_like(x)
    ours = torch.autograd.grad(ops.routed_experts(x, index, weights, gate_up, down), logits, d_out,
                               retain_graph=True)[0]
    theirs = torch.autograd.grad(ops.routed_experts_ref(x, index, weights, gate_up, down), logits, d_out)[0]
    assert ours.abs().max() > 0
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the 35B-A3B's sizes: a GPU's grouped GEMM (too slow interpreted)")
def test_routed_experts_at_the_35b_a3b_sizes():
    """Hidden 2048, 256 experts of width 512, top-8, 4096 tokens: torch's grouped GEMM in bf16."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    x, logits, gate_up, down = _routed(4096, 2048, 256, 512, 8, torch.bfloat16, seed)
    index, weights = _top_k(logits, 8, torch.bfloat16)
    weights = weights.detach().requires_grad_()
    weights64 = weights.detach().double().requires_grad_()
    out = ops.routed_experts(x, index, weights, gate_up, down)
    ref = ops.routed_experts_ref(x, index, weights, gate_up, down)
    ref64 = ops.routed_experts_ref(x.double(), index, weights64, gate_up.double(), down.double())
    d_out = torch.randn_like(out)
    grads = [torch.autograd.grad(o, [x, w], d) for o, w, d in ((out, weights, d_out), (ref, weights, d_out),
                                                                (ref64, weights64, d_out.double()))]
    for name, a, b, c in zip(("out", "dx", "d_top_k_weights"), (out, *grads[0]), (ref, *grads[1]), (ref64, *grads[2])):
        result = compare(name, a, b, c, atol=scaled_atol(c, a.dtype))
        assert result.ok, f"seed {seed}: {result}"


def test_the_reference_is_transformers_experts_module():
    """routed_experts_ref, the tests' same-dtype reference, is what transformers' eager module computes."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    config = Qwen3_5MoeTextConfig(hidden_size=40, moe_intermediate_size=12, num_experts=5, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    module = Qwen3_5MoeExperts(config).to(device(), torch.bfloat16)
    x, logits, gate_up, down = _routed(13, 40, 5, 12, 2, torch.bfloat16, seed=3)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    index, weights = _top_k(logits, 2, torch.bfloat16)
    torch.testing.assert_close(module(x, index, weights), ops.routed_experts_ref(x, index, weights, gate_up, down),
                               rtol=0, atol=0)


def test_gather_and_slot_sum_are_adjoint_and_exact():
    """sum_slots(gather_rows(x)) = k·x exactly in fp32 for integers, and each is the other's backward."""
    index = torch.stack([torch.randperm(7)[:3] for _ in range(11)]).to(device())
    route = ops.routing(index, 7)
    x = torch.randint(-50, 50, (11, 5)).to(device(), torch.float32).requires_grad_()
    rows = ops.gather_rows(x, route)
    torch.testing.assert_close(rows, x.detach()[route.token], rtol=0, atol=0)
    torch.testing.assert_close(ops.sum_slots(rows, route), 3 * x.detach(), rtol=0, atol=0)
    d_rows = torch.randint(-50, 50, rows.shape).to(device(), torch.float32)
    (dx,) = torch.autograd.grad(rows, x, d_rows)
    torch.testing.assert_close(dx, torch.zeros_like(dx).index_add_(0, route.token, d_rows), rtol=0, atol=0)
    # the routing: rows sorted by expert, each slot once, offsets ending each expert's rows
    flat = index.reshape(-1)
    assert torch.equal(flat[route.order], flat[route.order].sort().values)
    assert torch.equal(route.order[route.slots.reshape(-1)], torch.arange(flat.numel(), device=flat.device))
    torch.testing.assert_close(route.offsets.long(), torch.bincount(flat, minlength=7).cumsum(0))


def test_weighted_swiglu_gradient_of_the_weights():
    """d w[s] = Σ_j dh·silu(g)·u, by autograd of the fp64 formula."""
    gate_up = torch.randn(9, 2 * 13, dtype=torch.float32, device=device(), requires_grad=True)
    w = torch.rand(9, dtype=torch.float32, device=device(), requires_grad=True)
    h = ops.weighted_swiglu(gate_up, w)
    w64 = w.detach().double().requires_grad_()
    gu64 = gate_up.detach().double().requires_grad_()
    g64, u64 = gu64.chunk(2, dim=-1)
    h64 = w64[:, None] * torch.nn.functional.silu(g64) * u64
    dh = torch.randn_like(h)
    for ours, exact in zip(torch.autograd.grad(h, [gate_up, w], dh),
                           torch.autograd.grad(h64, [gu64, w64], dh.double())):
        torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.double(), h64.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    (lambda a: {**a, "top_k_index": a["top_k_index"].float()}, "top_k_index: expected an integer dtype"),
    (lambda a: {**a, "top_k_index": a["top_k_index"][:-1]}, "top_k_index and top_k_weights"),
    (lambda a: {**a, "top_k_index": a["top_k_index"] + 6}, r"top_k_index: expected expert ids in \[0, 6\)"),
    (lambda a: {**a, "top_k_index": a["top_k_index"] - 6}, r"top_k_index: expected expert ids in \[0, 6\)"),
    (lambda a: {**a, "down_proj": a["down_proj"][:, :, :-1]}, "down_proj: expected"),
    (lambda a: {**a, "gate_up_proj": a["gate_up_proj"][:, :, :-1]}, "gate_up_proj: expected"),
    (lambda a: {**a, "gate_up_proj": a["gate_up_proj"].detach().requires_grad_()}, "expected frozen expert weights"),
    (lambda a: {**a, "x": a["x"][None]}, r"x: expected \[tokens, hidden\], got shape \(1, 5, 16\)"),
    (lambda a: {**a, "top_k_index": a["top_k_index"].tolist()}, "top_k_index: expected an integer tensor, got list"),
])
def test_bad_input_names_the_argument(bad, message):
    x, logits, gate_up, down = _routed(5, 16, 6, 8, 2, torch.float32, seed=0)
    index, weights = _top_k(logits, 2, torch.float32)
    args = dict(x=x, top_k_index=index, top_k_weights=weights, gate_up_proj=gate_up, down_proj=down)
    with pytest.raises((ValueError, TypeError), match=message):
        ops.routed_experts(**bad(args))


def test_no_second_derivative():
    x, logits, gate_up, down = _routed(5, 16, 6, 8, 2, torch.float32, seed=1)
    index, weights = _top_k(logits, 2, torch.float32)
    (dx,) = torch.autograd.grad(ops.routed_experts(x, index, weights, gate_up, down).square().sum(), x,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        dx.sum().backward()


# ---------------------------------------------------------------------------------------------
# The patch: a PEFT MoE model (frozen experts) gets the routed path, the same loss and gradients.
# ---------------------------------------------------------------------------------------------
def _peft_moe():
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(moe_causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def test_patched_moe_model_same_loss_and_gradients(monkeypatch):
    model = _peft_moe()
    ids = torch.randint(0, 128, (2, 13), device=device())
    reference = loss_and_grads(model, ids)
    report = q35lab.apply_to_qwen3_5(model, rms_norm=False, gated_norm=False, lora=False, in_proj=False, flce=False,
                                     conv=False, swiglu=False, varlen_attention=False)
    assert report.replaced == {"Qwen3_5MoeExperts (routed experts)": 2}
    calls = []
    forward = ops.WeightedSwiGLU.forward
    monkeypatch.setattr(ops.WeightedSwiGLU, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))
    ours = loss_and_grads(model, ids)
    assert len(calls) == 2
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-5, atol=1e-6)
    assert ours[1].keys() == reference[1].keys()
    for name in reference[1]:
        torch.testing.assert_close(ours[1][name], reference[1][name], rtol=1e-4, atol=1e-6, msg=name)
    assert q35lab.revert(model).reverted == {"Qwen3_5MoeExperts (routed experts)": 2}
    assert all("forward" not in vars(m) for m in model.modules() if type(m).__name__ == "Qwen3_5MoeExperts")


def test_trainable_experts_keep_transformers_forward():
    model = moe_causal_lm()  # full fine-tune: every weight trains
    report = q35lab.apply_to_qwen3_5(model)
    assert any(k.startswith("Qwen3_5MoeExperts (routed experts): trainable expert weights") for k in report.left_alone)
    assert not any("routed experts" in k for k in report.replaced)
    # unfrozen after the patch: the call falls back to transformers' forward (a weight gradient)
    peft_model = _peft_moe()
    q35lab.apply_to_qwen3_5(peft_model)
    experts = next(m for m in peft_model.modules() if type(m).__name__ == "Qwen3_5MoeExperts")
    experts.gate_up_proj.requires_grad_(True)
    peft_model(input_ids=torch.randint(0, 128, (1, 7), device=device()), labels=None).logits.sum().backward()
    assert experts.gate_up_proj.grad is not None


def test_patched_moe_model_copies_and_pickles():
    model = _peft_moe()
    q35lab.apply_to_qwen3_5(model)
    ids = torch.randint(0, 128, (1, 9), device=device())
    expected = model(input_ids=ids, labels=ids).loss
    copied = copy.deepcopy(model)
    torch.testing.assert_close(copied(input_ids=ids, labels=ids).loss, expected, rtol=0, atol=0)
    experts = [m for m in copied.modules() if type(m).__name__ == "Qwen3_5MoeExperts"]
    assert all(vars(m)["forward"].module is m for m in experts)  # the copy's forward computes with its own weights
    loaded = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(loaded(input_ids=ids, labels=ids).loss, expected, rtol=0, atol=0)


def test_torch_compile_of_a_patched_moe_model_matches_eager():
    """The routed experts are a graph break (opaque to the compiler)."""
    model = _peft_moe()
    q35lab.apply_to_qwen3_5(model)
    ids = torch.randint(0, 128, (2, 9), device=device())
    eager = loss_and_grads(model, ids)
    torch._dynamo.reset()
    loss, grads = loss_and_grads(model, ids, run=torch.compile(model, backend=MODEL_COMPILER))
    torch.testing.assert_close(loss, eager[0], rtol=1e-5, atol=1e-5)
    assert grads.keys() == eager[1].keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager[1][name], rtol=1e-4, atol=1e-5, msg=name)
