"""LoRA on the routed experts (q35lab.routed_experts with gate_up_lora/down_lora) against PEFT's
dense W + s·B·A by the numerics rule, and the patch that routes PEFT's ParamWrapper through it."""

import copy
import pickle

import pytest
import torch

import q35lab
from q35lab.numerics import compare, scaled_atol
from q35lab.ops import routed_experts as ops
from q35lab.runtime import device
from tiny_models import assert_same_loss_and_grads, count_forward_calls, loss_and_grads, moe_causal_lm

peft = pytest.importorskip("peft")

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _inputs(tokens, hidden, experts, width, k, rank, dtype, seed, factor_dtype=torch.float32, index=None):
    """Fresh x, top-k ids and router weights (renormalised softmax, as transformers' router), frozen
    expert weights of ``dtype`` and LoRA factors of ``factor_dtype`` (PEFT's default: fp32 adapters),
    B non-zero so that the LoRA path counts.

    The LoRA path is a tenth of the frozen one's size in bf16 (a quarter in fp32), as a fine-tune's update is smaller
    than the weights: the op adds two bf16 GEMM outputs (torch's grouped GEMM rounds each), PEFT
    rounds W + s·B·A once, and with a LoRA path as large as the weights' own the op's extra rounding
    passes the rule's 2× in about one draw in five. A wrong LoRA term (a transposed factor, a lost
    scaling) is of the path's size, far above either rounding."""
    b_scale = 0.1 if dtype == torch.bfloat16 else 0.25
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device(), dtype).requires_grad_()
    logits = torch.randn(tokens, experts, generator=gen)
    weights, top = logits.softmax(-1).topk(k, dim=-1)
    index = top if index is None else index
    weights = (weights / weights.sum(-1, keepdim=True)).to(device(), dtype).requires_grad_()
    gate_up = (torch.randn(experts, 2 * width, hidden, generator=gen) * hidden ** -0.5).to(device(), dtype)
    down = (torch.randn(experts, hidden, width, generator=gen) * width ** -0.5).to(device(), dtype)

    def factors(out, inner):
        a = (torch.randn(experts, rank, inner, generator=gen) * inner ** -0.5).to(device(), factor_dtype)
        b = (torch.randn(experts, out, rank, generator=gen) * b_scale * rank ** -0.5).to(device(), factor_dtype)
        return a.requires_grad_(), b.requires_grad_()

    return x, index.to(device()), weights, gate_up, down, factors(2 * width, hidden), factors(hidden, width)


def _run(fn, x, index, weights, gate_up, down, gu, dn, scaling, d_out, cast=None):
    """Output and the gradients of x, the router weights and the four factors; ``cast``: fp64 copies."""
    leaves = [x, weights, *gu, *dn]
    if cast is not None:
        leaves = [t.detach().to(cast).requires_grad_() for t in leaves]
        gate_up, down, d_out = gate_up.to(cast), down.to(cast), d_out.to(cast)
    x, weights, a1, b1, a2, b2 = leaves
    out = fn(x, index, weights, gate_up, down, gate_up_lora=ops.ExpertLoRA(a1, b1, scaling),
             down_lora=ops.ExpertLoRA(a2, b2, scaling))
    return (out, *torch.autograd.grad(out, leaves, d_out))


NAMES = ("out", "dx", "d_top_k_weights", "d_gate_up_A", "d_gate_up_B", "d_down_A", "d_down_B")


def _check_by_the_rule(seed, *inputs, scaling=2.0):
    x = inputs[0]
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device(), x.dtype) / 16
    ours = _run(ops.routed_experts, *inputs, scaling, d_out)
    theirs = _run(ops.routed_experts_ref, *inputs, scaling, d_out)
    exact = _run(ops.routed_experts_ref, *inputs, scaling, d_out, cast=torch.float64)
    for name, a, b, c in zip(NAMES, ours, theirs, exact):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        result = compare(name, a, b, c, atol=scaled_atol(c, x.dtype))
        assert result.ok, f"seed {seed}: {result}"
    return ours


CASES = {
    "odd widths, top-3": (37, 48, 6, 20, 3, 4),
    "wider than a column block, rank 1": (29, 33, 4, 1100, 2, 1),
}


@pytest.mark.parametrize("shape", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_lora_by_the_numerics_rule(shape, dtype):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    _check_by_the_rule(seed, *_inputs(*shape, dtype, seed))


def test_most_experts_without_rows():
    """4 tokens over 16 experts, rank 8 (fp32: experts of one row, see below)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    _check_by_the_rule(seed, *_inputs(4, 96, 16, 16, 2, 8, torch.float32, seed))


def test_awkward_routing():
    """Expert 0 gets no token, expert 1 exactly one, token 2 goes to expert 3 twice (its weights
    summed), the rest spread over experts 2–4. In fp32: the bookkeeping is dtype-free, and in bf16 an
    expert of one row has a d B that is one outer product ``dyᵀ·ts`` of bf16-rounded rows, where PEFT's
    rounding of ``dW`` averages out over ``A``'s hidden dimension: 2.0–2.3× PEFT's error in about one
    draw in a hundred (the rule's bound is 2×)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    index = torch.tensor([[2, 3], [4, 2], [3, 3], [1, 4], [2, 4], [4, 3], [3, 2]])
    ours = _check_by_the_rule(seed, *_inputs(7, 40, 5, 12, 2, 4, torch.float32, seed, index=index))
    for d_a, d_b in (ours[3:5], ours[5:7]):
        assert d_a[0].abs().max() == 0 and d_b[0].abs().max() == 0  # no rows, no gradient
        assert d_a[1].abs().max() > 0 and d_b[1].abs().max() > 0


def test_factors_of_the_weights_dtype_and_frozen_factors():
    """bf16 factors (PEFT's autocast_adapter_dtype=False), and frozen ones: no factor gradient asked."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    _check_by_the_rule(seed, *_inputs(21, 32, 4, 16, 2, 4, torch.bfloat16, seed, factor_dtype=torch.bfloat16))
    x, index, weights, gate_up, down, (a1, b1), (a2, b2) = _inputs(9, 32, 4, 16, 2, 4, torch.float32, seed)
    loras = [ops.ExpertLoRA(a.detach(), b.detach(), 0.5) for a, b in ((a1, b1), (a2, b2))]
    out = ops.routed_experts(x, index, weights, gate_up, down, gate_up_lora=loras[0], down_lora=loras[1])
    ref = ops.routed_experts_ref(x, index, weights, gate_up, down, gate_up_lora=loras[0], down_lora=loras[1])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0],
                               rtol=1e-5, atol=1e-6)


def test_one_projection_with_lora_the_other_without():
    seed = int(torch.randint(0, 2**31 - 1, ()))
    x, index, weights, gate_up, down, (a1, b1), _ = _inputs(13, 24, 4, 8, 2, 3, torch.float32, seed)
    lora = ops.ExpertLoRA(a1, b1, 1.5)
    out = ops.routed_experts(x, index, weights, gate_up, down, gate_up_lora=lora)
    ref = ops.routed_experts_ref(x, index, weights, gate_up, down, gate_up_lora=lora)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(torch.autograd.grad(out.sum(), [x, a1, b1]), torch.autograd.grad(ref.sum(), [x, a1, b1])):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_torch_grouped_gemm_calls_match_the_loop(monkeypatch):
    """The grouped GEMM path (a GPU's, in bf16) run on the CPU, where torch has it too: the same
    layouts and offsets as the per-expert loop, empty experts included (2-D by 2-D: zero)."""
    if getattr(torch, "_grouped_mm", None) is None:
        pytest.skip("this torch has no grouped GEMM")
    seed = int(torch.randint(0, 2**31 - 1, ()))
    index = torch.tensor([[1, 3]] * 5 + [[3, 2]] * 3)  # experts 0 and 4..7 get no rows
    inputs = _inputs(8, 64, 8, 32, 2, 8, torch.bfloat16, seed, index=index)
    d_out = torch.randn(8, 64).to(device(), torch.bfloat16)
    loop = _run(ops.routed_experts, *inputs, 2.0, d_out)
    calls = []
    aligned = ops._aligned
    monkeypatch.setattr(ops, "_use_grouped_gemm", lambda a, b, n: calls.append(1) or (
        a.dtype == torch.bfloat16 and aligned(a) and aligned(b) and n * a.element_size() % 16 == 0))
    grouped = _run(ops.routed_experts, *inputs, 2.0, d_out)
    assert len(calls) >= 10
    for name, a, b in zip(NAMES, grouped, loop):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.parametrize("bad, message", [
    (lambda a, b: {"gate_up_lora": (a, b)}, r"gate_up_lora: expected None or \(lora_A, lora_B, scaling\)"),
    (lambda a, b: {"gate_up_lora": (a[:, :, :-1], b, 1.0)}, r"gate_up_lora.lora_A: expected \[4, r, 16\]"),
    (lambda a, b: {"gate_up_lora": (a, b[:, :, :-1], 1.0)}, r"gate_up_lora.lora_B: expected \(4, 16, 3\)"),
    (lambda a, b: {"gate_up_lora": (a, b, "2")}, "gate_up_lora.scaling: expected a finite number"),
    (lambda a, b: {"gate_up_lora": (a.long(), b, 1.0)}, "gate_up_lora.lora_A: expected dtype"),
    (lambda a, b: {"down_lora": (a, b, 1.0)}, r"down_lora.lora_A: expected \[4, r, 8\]"),
])
def test_bad_lora_names_the_argument(bad, message):
    x, index, weights, gate_up, down, (a, b), _ = _inputs(5, 16, 4, 8, 2, 3, torch.float32, seed=0)
    with pytest.raises((ValueError, TypeError), match=message):
        ops.routed_experts(x, index, weights, gate_up, down, **bad(a, b))


def test_no_second_derivative():
    x, index, weights, gate_up, down, (a, b), _ = _inputs(5, 16, 4, 8, 2, 3, torch.float32, seed=1)
    out = ops.routed_experts(x, index, weights, gate_up, down, gate_up_lora=(a, b, 1.0))
    (da,) = torch.autograd.grad(out.square().sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        da.sum().backward()


# ---------------------------------------------------------------------------------------------
# The patch: PEFT's ParamWrappers on the experts, routed through the op.
# ---------------------------------------------------------------------------------------------
ONLY_EXPERTS = dict(rms_norm=False, gated_norm=False, lora=False, in_proj=False, flce=False, conv=False, swiglu=False,
                    varlen_attention=False)


def _peft_expert_lora(targets=TARGETS, base=None, **config):
    """A tiny MoE model (``base``, else a fresh one), LoRA r=4 on every linear layer and on the
    experts' parameters, B non-zero (fp32 weights: the comparison with PEFT is then tight)."""
    model = peft.get_peft_model(moe_causal_lm() if base is None else base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", target_parameters=targets, **config))
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _ids():
    return torch.randint(0, 128, (2, 11), device=device())


def test_patched_model_same_loss_and_every_lora_gradient(monkeypatch):
    model = _peft_expert_lora()
    ids = _ids()
    reference = loss_and_grads(model, ids)
    assert any("experts" in name and "lora_A" in name for name in reference[1])
    report = q35lab.apply_to_qwen3_5(model, **ONLY_EXPERTS)
    assert report.replaced["PEFT ParamWrapper (routed experts' LoRA)"] == 2, report
    calls = count_forward_calls(monkeypatch, ops.LoRAGroupedLinear)
    dense = []
    monkeypatch.setattr(torch, "baddbmm", lambda *a, **k: dense.append(1))  # PEFT's W + s·B·A: never built
    ours = loss_and_grads(model, ids)
    assert len(calls) == 4 and not dense  # gate/up and down in each of the 2 MoE layers
    assert_same_loss_and_grads(ours, reference, rtol=1e-4, atol=1e-6)
    assert q35lab.revert(model).reverted["PEFT ParamWrapper (routed experts' LoRA)"] == 2
    assert all("forward" not in vars(m) for m in model.modules())
    monkeypatch.undo()
    assert_same_loss_and_grads(loss_and_grads(model, ids), reference, rtol=1e-5, atol=1e-6)  # PEFT's forward again


def test_one_targeted_parameter():
    model = _peft_expert_lora(targets=["mlp.experts.down_proj"])
    ids = _ids()
    reference = loss_and_grads(model, ids)
    assert q35lab.apply_to_qwen3_5(model, **ONLY_EXPERTS).replaced["PEFT ParamWrapper (routed experts' LoRA)"] == 2
    assert_same_loss_and_grads(loss_and_grads(model, ids), reference, rtol=1e-4, atol=1e-6)


def test_calls_the_op_does_not_compute_run_peft(monkeypatch):
    """Adapters disabled, two active adapters, merged adapters: PEFT's forward, the same result."""
    model = _peft_expert_lora()
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules="all-linear", target_parameters=TARGETS))
    ids = _ids()
    q35lab.apply_to_qwen3_5(model, **ONLY_EXPERTS)
    calls = count_forward_calls(monkeypatch, ops.LoRAGroupedLinear)
    with model.disable_adapter():
        model(input_ids=ids)
    assert not calls
    model.base_model.set_adapter(["default", "other"])
    model(input_ids=ids)
    assert not calls
    model.base_model.set_adapter("default")
    model(input_ids=ids)
    assert len(calls) == 4


def test_merged_adapter_and_merge_and_unload():
    model = _peft_expert_lora()
    ids = _ids()
    q35lab.apply_to_qwen3_5(model, **ONLY_EXPERTS)
    expected = model(input_ids=ids).logits
    model.merge_adapter()
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    model.unmerge_adapter()
    merged = model.merge_and_unload()
    assert not any(type(m).__name__ == "ParamWrapper" for m in merged.modules())
    torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_left_alone_where_the_op_cannot_compute_it():
    """A wrapper whose adapter has dropout (set after PEFT built it: PEFT refuses it at construction)
    keeps PEFT's forward, and the report says why."""
    model = _peft_expert_lora()
    experts = model.base_model.model.model.layers[0].mlp.experts
    experts.lora_dropout["default"] = torch.nn.Dropout(0.1)
    report = q35lab.apply_to_qwen3_5(model, **ONLY_EXPERTS)
    assert report.replaced["PEFT ParamWrapper (routed experts' LoRA)"] == 1
    assert report.left_alone == {"PEFT ParamWrapper (routed experts' LoRA): down_proj: adapter dropout (Dropout), "
                                 "which the op does not apply": 1}
    assert "forward" not in vars(experts)


def test_patched_model_copies_pickles_saves_and_reloads(tmp_path):
    base = moe_causal_lm()
    untouched = copy.deepcopy(base)
    model = _peft_expert_lora(base=base)
    q35lab.apply_to_qwen3_5(model, **ONLY_EXPERTS)
    ids = _ids()
    expected = model(input_ids=ids, labels=ids).loss
    copied = copy.deepcopy(model)
    torch.testing.assert_close(copied(input_ids=ids, labels=ids).loss, expected, rtol=0, atol=0)
    forwards = [vars(m)["forward"] for m in copied.modules() if "_q35lab_expert_lora" in vars(m)]
    assert len(forwards) == 2 and all(f.module is m for f, m in zip(forwards, (f.module for f in forwards)))
    assert not any(f.module is m for f in forwards for m in model.modules())  # the copy's own modules
    loaded = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(loaded(input_ids=ids, labels=ids).loss, expected, rtol=0, atol=0)
    model.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(untouched, tmp_path)
    report = q35lab.apply_to_qwen3_5(reloaded, **ONLY_EXPERTS)
    assert report.replaced["PEFT ParamWrapper (routed experts' LoRA)"] == 2
    torch.testing.assert_close(reloaded(input_ids=ids, labels=ids).loss, expected, rtol=1e-5, atol=1e-6)
