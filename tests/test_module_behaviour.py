"""A patched model is still a torch module: deepcopy, pickle, hooks and compile behave as on the
unpatched one (issue 14). Each test compares against the unpatched model by the same steps."""

import copy
import io

import pytest
import torch
from conftest import MODEL_COMPILER

import q35lab
from q35lab.ops.fused_projections import FusedLoRAProjectionsFunction
from q35lab.runtime import device
from tiny_models import causal_lm, count_forward_calls, loss_and_grads

IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _frozen_in_proj_model():
    """A bare tiny Qwen3.5 whose GatedDeltaNet projections are frozen, so the in_proj fusion applies."""
    model = causal_lm()
    for name, p in model.named_parameters():
        if any(f"{proj}." in name for proj in IN_PROJ):
            p.requires_grad_(False)
    return model


def _peft_model():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "out_proj", *IN_PROJ,
                                                                 "gate_proj", "down_proj"])
    return peft.get_peft_model(causal_lm(), config)


def _perturb(model, seed):
    """Change every parameter by the same seeded noise (the same on two models with the same names)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))


def _assert_close_step(a, b, rtol=1e-4):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol / 10, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("build", [_frozen_in_proj_model, _peft_model], ids=["bare", "peft"])
def test_a_deep_copy_computes_with_its_own_weights_and_owns_its_gradients(build):
    """Each side is compared with a model patched on its own (not copied) with the same weights: the
    same kernels on the same numbers, so only a wrong weight or a lost gradient can tell them apart
    (against the unpatched model a GPU's other summation orders show through at 1e-4)."""
    reference = build()  # stays unpatched
    model = copy.deepcopy(reference)
    report = q35lab.apply_to_qwen3_5(model)
    assert any("in_proj" in label for label in report.replaced) and any("loss" in label for label in report.replaced)
    ids = torch.randint(0, 128, (2, 9), device=device())

    twin = copy.deepcopy(model)  # what EMA, TRL's reference model and many loops do
    twin_reference = copy.deepcopy(reference)
    _perturb(twin, seed=1)
    _perturb(twin_reference, seed=1)
    q35lab.apply_to_qwen3_5(twin_reference)
    model.zero_grad(set_to_none=True)
    _assert_close_step(loss_and_grads(twin, ids), loss_and_grads(twin_reference, ids))
    assert all(p.grad is None for p in model.parameters()), "the copy's backward wrote into the original"
    # the original still computes with its own (unperturbed) weights
    patched_reference = copy.deepcopy(reference)
    q35lab.apply_to_qwen3_5(patched_reference)
    _assert_close_step(loss_and_grads(model, ids), loss_and_grads(patched_reference, ids))
    # and the copy is patched: its in_proj runs as one fused node, each GatedDeltaNet once
    assert any(type(m.forward).__module__.startswith("q35lab.patch") for m in twin.modules() if "forward" in vars(m))


def test_pickle_round_trip_gives_a_working_patched_model(monkeypatch):
    model = _frozen_in_proj_model()
    q35lab.apply_to_qwen3_5(model)
    ids = torch.randint(0, 128, (1, 8), device=device())
    expected = loss_and_grads(model, ids)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    calls = count_forward_calls(monkeypatch, FusedLoRAProjectionsFunction)
    _assert_close_step(loss_and_grads(loaded, ids), expected)
    assert len(calls) == 1, "the loaded model's in_proj should still be one fused node"
    report = q35lab.revert(loaded)
    assert report.reverted and not any("forward" in vars(m) for m in loaded.modules())
    _assert_close_step(loss_and_grads(loaded, ids), expected)


def test_a_forward_hook_on_lm_head_fires_with_logits_and_the_loss_is_unchanged():
    reference = causal_lm()
    model = copy.deepcopy(reference)
    q35lab.apply_to_qwen3_5(model)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    ids = torch.randint(0, 128, (2, 7), device=device())
    _assert_close_step(loss_and_grads(model, ids), loss_and_grads(reference, ids))
    assert seen == [torch.Size([2, 7, 128])]


def test_a_model_that_is_not_qwen3_5_is_left_alone_with_a_warning_or_refused_with_strict():
    peft = pytest.importorskip("peft")
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    wrapped = peft.get_peft_model(plain, peft.LoraConfig(r=2, target_modules=["0", "2"]))
    with pytest.warns(UserWarning, match=r"model: no Qwen3\.5 module found in PeftModel \(looked for transformers' "
                                         r"Qwen3_5RMSNorm, .*Qwen3_5ForCausalLM.*\); nothing was patched"):
        report = q35lab.apply_to_qwen3_5(wrapped)
    assert report.replaced == {} and not report.qwen3_5 and "not a Qwen3.5 model" in str(report)
    assert not any("forward" in vars(m) for m in wrapped.modules())  # its LoRA layers too are left as they are
    with pytest.raises(ValueError, match=r"model: no Qwen3\.5 module found in PeftModel"):
        q35lab.apply_to_qwen3_5(wrapped, strict=True)
    assert not any("forward" in vars(m) for m in wrapped.modules())
    assert q35lab.apply_to_qwen3_5(causal_lm(), strict=True).qwen3_5
    patched = causal_lm()
    q35lab.apply_to_qwen3_5(patched)
    assert q35lab.apply_to_qwen3_5(patched, strict=True).already_patched  # a patched model is still one


def test_lora_layers_added_after_patching_are_named_and_a_second_call_routes_them(monkeypatch):
    peft = pytest.importorskip("peft")
    model = causal_lm()
    first = q35lab.apply_to_qwen3_5(model)
    assert "call apply_to_qwen3_5 again" in first.not_applied["lora"]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    second = q35lab.apply_to_qwen3_5(wrapped)
    assert second.replaced["PEFT lora.Linear (forward)"] == 2 + 2  # q, v of the attention layer; 2 MLPs' down
    assert "lora" not in second.not_applied


#: The ops that are torch.library custom ops (ops/_compile.py): a compiled model traces through them.
CUSTOM_OPS = ("offset_rms_norm", "gated_rms_norm", "causal_conv1d", "lora_linear")
#: Ops still opaque to the compiler: each call is a graph break, named in the break's reason.
OPAQUE_OPS = ("fused_lora_projections", "swiglu_down", "linear_cross_entropy")


def test_torch_compile_of_a_patched_peft_model_matches_eager_and_breaks_at_no_custom_op():
    """The compiled step is eager's, twice (the second call reuses the graphs); Dynamo's graph-break
    reasons name the opaque ops (so this test sees breaks where there are some) and none of the
    custom ops, whose calls sit inside the captured graphs. MODEL_COMPILER compiles the graphs:
    inductor, the backend users compile with, on a GPU; aot_eager (its trace) on the CPU."""
    from torch._dynamo.utils import counters

    from tiny_models import recording_backend

    model = _peft_model()
    q35lab.apply_to_qwen3_5(model)
    ids = torch.randint(0, 128, (2, 9), device=device())
    eager = loss_and_grads(model, ids)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    compiled = torch.compile(model, backend=recording_backend(graphs, MODEL_COMPILER))
    _assert_close_step(loss_and_grads(model, ids, run=compiled), eager)
    reasons = list(counters["graph_break"])
    _assert_close_step(loss_and_grads(model, ids, run=compiled), eager)
    for op in OPAQUE_OPS:
        assert any(f"function {op} at" in r for r in reasons), f"no graph break at the opaque {op}"
    for op in CUSTOM_OPS:
        assert not any(op in r for r in reasons), f"{op} broke the graph: {[r for r in reasons if op in r]}"
    traced = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    for op in CUSTOM_OPS:
        assert f"q35lab.{op}_fwd.default" in traced, f"no captured graph calls q35lab::{op}_fwd"


def _first_order_cases():
    from q35lab.ops.causal_conv1d import causal_conv1d
    from q35lab.ops.swiglu import swiglu

    x = torch.randn(2, 5, 8, device=device())
    w = torch.randn(8, device=device())
    lora = (torch.randn(6, 8, device=device()), torch.randn(3, 8, device=device()), torch.randn(6, 3, device=device()))
    head, target = torch.randn(11, 8, device=device()), torch.randint(0, 11, (10,), device=device())
    return {
        "offset_rms_norm": (lambda x, w: q35lab.offset_rms_norm(x, w), (x, w)),
        "gated_rms_norm": (lambda x, w: q35lab.gated_rms_norm(x, x.sin(), w), (x, w)),
        "lora_linear": (lambda x, a: q35lab.lora_linear(x, lora[0], a, lora[2], 2.0), (x, lora[1])),
        "fused_lora_projections": (lambda x, a: q35lab.fused_lora_projections(
            x, [q35lab.Projection(lora[0], lora_A=a, lora_B=lora[2], scaling=2.0)])[0], (x, lora[1])),
        "linear_cross_entropy": (lambda x, h: q35lab.linear_cross_entropy(x.reshape(10, 8), h, target), (x, head)),
        "causal_conv1d": (lambda x, w: causal_conv1d(x, w.reshape(2, 4).repeat(4, 1)), (x, w)),
        "swiglu": (lambda x, w: swiglu(x * w, x), (x, w)),
    }


@pytest.mark.parametrize("op", list(_first_order_cases()))
def test_a_second_derivative_through_an_op_raises_a_q35lab_error_first_derivatives_stay_right(op):
    fn, inputs = _first_order_cases()[op]
    inputs = [t.detach().requires_grad_() for t in inputs]
    first = torch.autograd.grad(fn(*inputs).sum(), inputs)
    with_graph = torch.autograd.grad(fn(*inputs).sum(), inputs, create_graph=True)
    for a, b in zip(first, with_graph):
        torch.testing.assert_close(a, b.detach())
    with pytest.raises(RuntimeError, match="q35lab: .* has no second derivative"):
        sum(g.sum() for g in with_graph).backward()


def test_retain_graph_backward_twice_through_a_patched_model_accumulates_like_the_unpatched():
    reference = _peft_model()
    model = copy.deepcopy(reference)
    q35lab.apply_to_qwen3_5(model)
    ids = torch.randint(0, 128, (2, 9), device=device())

    def twice(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    _assert_close_step(twice(model), twice(reference))
