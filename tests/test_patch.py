"""apply_to_qwen3_5 / revert on tiny transformers Qwen3.5 models, bare and under PEFT."""

import copy
import importlib.util
import sys

import pytest
import torch

import q35lab
from q35lab.hf import gated_delta_net as hf_gdn
from q35lab.hf import modules as hf_modules
from q35lab.ops import gated_rms_norm as gated_rms_norm_op
from q35lab.ops import offset_rms_norm as offset_rms_norm_op
from q35lab.ops.gated_rms_norm import GatedRMSNorm
from q35lab.ops.offset_rms_norm import OffsetRMSNorm
from q35lab.runtime import device
from tiny_models import causal_lm, count_forward_calls, loss_and_grads, moe_causal_lm, multimodal


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_same_step(a, b):
    logits_a, loss_a, grads_a = a
    logits_b, loss_b, grads_b = b
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "build,norm_class,gated_class",
    [(causal_lm, "Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"),
     (moe_causal_lm, "Qwen3_5MoeRMSNorm", "Qwen3_5MoeRMSNormGated")],
)
def test_same_logits_loss_and_gradients_patched_unpatched_reverted(build, norm_class, gated_class):
    model = build()
    ids = torch.randint(0, 128, (2, 11), device=device())
    before = _loss_and_grads(model, ids)
    n_norms = sum(type(m).__name__ == norm_class for m in model.modules())
    n_gated = sum(type(m).__name__ == gated_class for m in model.modules())

    # logits are compared: keep them
    report = q35lab.apply_to_qwen3_5(model, flce=False, swiglu=False, conv=False, varlen_attention=False)
    # 2 layers × 2, q/k norm of the attention layer, final norm; one gated norm per GatedDeltaNet
    assert report.replaced == {norm_class: 7, gated_class: 1} and (n_norms, n_gated) == (7, 1)
    assert not any(type(m).__name__ in (norm_class, gated_class) for m in model.modules())
    _assert_same_step(before, _loss_and_grads(model, ids))

    undone = q35lab.revert(model)
    assert undone.reverted == {norm_class: 7, gated_class: 1}
    assert not any(isinstance(m, (OffsetRMSNorm, GatedRMSNorm)) for m in model.modules())
    _assert_same_step(before, _loss_and_grads(model, ids))


def test_forward_goes_through_the_kernel(monkeypatch):
    model = causal_lm()
    q35lab.apply_to_qwen3_5(model)
    calls = _count_calls(monkeypatch, offset_rms_norm_op, "offset_rms_norm_fwd")
    model(input_ids=torch.randint(0, 128, (1, 5), device=device()))
    assert len(calls) == 7


def test_parameters_are_shared_not_copied():
    model = causal_lm()
    params_before = {n: p for n, p in model.named_parameters()}
    state_before = copy.deepcopy(model.state_dict())
    q35lab.apply_to_qwen3_5(model)
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is params_before[n] for n in params_before)
    assert model.state_dict().keys() == state_before.keys()
    # an optimizer step taken while patched is seen after revert
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    q35lab.revert(model)
    torch.testing.assert_close(model.model.norm.weight, state_before["model.norm.weight"] + 1.0)


def _switched_attention(cls: str = "Qwen3_5Attention") -> dict:
    """The report's line for the one full-attention layer switched to q35lab's packed-row
    attention (q35lab.packed_attention), where this torch has varlen_attn."""
    from q35lab import packed_attention

    switched = packed_attention.varlen_attention_function()
    return {f"{cls} (SDPA; packed rows: varlen flash attention)": 1} if switched else {}


def test_multimodal_model_is_patched():
    model = multimodal()
    n_norms = sum(type(m).__name__ == "Qwen3_5RMSNorm" for m in model.modules())
    skipped = _skipped_key_repeat(model)
    report = q35lab.apply_to_qwen3_5(model)
    assert report.replaced == {"Qwen3_5RMSNorm": n_norms, "Qwen3_5RMSNormGated": 1, "Qwen3_5MLP (SwiGLU)": 2,
                               "Qwen3_5GatedDeltaNet causal conv1d": 1,
                               "Qwen3_5ForConditionalGeneration loss (fused linear cross entropy)": 1,
                               **_switched_attention(), **skipped} and n_norms >= 7
    ids = torch.randint(0, 100, (1, 6), device=device())
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_patching_twice_is_harmless_and_reported():
    model = causal_lm()
    first = q35lab.apply_to_qwen3_5(model)
    second = q35lab.apply_to_qwen3_5(model)
    # 7 + 1 + 2 MLPs + conv + loss (+ the attention's switch, + the q/k repeat's skip where this machine has it)
    n = 12 + sum(_switched_attention().values()) + sum(_skipped_key_repeat(causal_lm()).values())
    assert first.total == n and second.total == 0 and second.already_patched == n
    assert "already patched" in str(second)
    q35lab.revert(model)
    assert q35lab.revert(model).reverted == {}


def test_model_with_nothing_to_patch():
    with pytest.warns(UserWarning, match="no Qwen3.5 module found in Sequential"):
        report = q35lab.apply_to_qwen3_5(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
    assert report.nothing_to_patch and "nothing to patch" in str(report)


def test_flags_of_later_optimizations_are_reported_not_applied():
    report = q35lab.apply_to_qwen3_5(causal_lm(), gated_norm=True, lora=True, in_proj=True, flce=True)
    assert list(report.not_applied) == ["lora"]  # a bare model has no LoRA layers: the report says so
    off = q35lab.apply_to_qwen3_5(causal_lm(), rms_norm=False, gated_norm=False, lora=False, in_proj=False, flce=False,
                                  swiglu=False, conv=False, varlen_attention=False)
    assert off.total == 0
    assert off.not_applied == {flag: "disabled by the caller" for flag in
                               ("rms_norm", "gated_norm", "lora", "in_proj", "flce", "conv", "swiglu",
                                "varlen_attention")}
    only_gated = q35lab.apply_to_qwen3_5(causal_lm(), rms_norm=False, flce=False, swiglu=False, conv=False,
                                         varlen_attention=False)
    assert only_gated.replaced == {"Qwen3_5RMSNormGated": 1}


def _skipped_key_repeat(model, reverted: bool = False) -> dict:
    """The report's line for the GatedDeltaNets whose q/k head repeat this machine skips (fla as
    the core on a transformers whose forward repeats: the H200's), asked before patching."""

    n = sum(hf_gdn.repeats_key_heads(m) and hf_gdn.core_groups_key_heads(m)
            for m in model.modules() if hf_modules.is_gated_delta_net(m))
    label = "Qwen3_5GatedDeltaNet q/k head repeat" + ("" if reverted else " (skipped: fla's core groups the key heads)")
    return {label: n} if n else {}


def test_bad_model_argument():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        q35lab.apply_to_qwen3_5("Qwen/Qwen3.5-9B")


def test_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    model = causal_lm()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "out_proj"])
    peft_model = peft.get_peft_model(model, config)
    ids = torch.randint(0, 128, (2, 7), device=device())
    before = _loss_and_grads(peft_model, ids)
    assert all(not p.requires_grad for n, p in peft_model.named_parameters() if "norm" in n)

    skipped, unskipped = _skipped_key_repeat(peft_model), _skipped_key_repeat(peft_model, reverted=True)
    report = q35lab.apply_to_qwen3_5(peft_model, flce=False)  # logits are compared: keep them
    # q_proj, v_proj, out_proj routed; the GatedDeltaNet's four (frozen, no adapter) in_proj fused
    patched = {"Qwen3_5RMSNorm": 7, "Qwen3_5RMSNormGated": 1, "PEFT lora.Linear (forward)": 3,
               "Qwen3_5GatedDeltaNet in_proj (4 projections, 1 node)": 1, "Qwen3_5MLP (SwiGLU)": 2,
               "Qwen3_5MLP gate/up (2 projections, 1 node)": 2, "Qwen3_5GatedDeltaNet causal conv1d": 1,
               **_switched_attention(), **skipped}
    assert report.replaced == patched
    _assert_same_step(before, _loss_and_grads(peft_model, ids))
    assert q35lab.revert(peft_model).reverted == {"Qwen3_5RMSNorm": 7, "Qwen3_5RMSNormGated": 1,
                                                  "PEFT lora.Linear (forward)": 3, "GatedDeltaNet in_proj": 1,
                                                  "Qwen3_5MLP (SwiGLU)": 2, "Qwen3_5GatedDeltaNet causal conv1d": 1,
                                                  **({"Qwen3_5Attention (SDPA)": 1} if _switched_attention() else {}),
                                                  **unskipped}
    _assert_same_step(before, _loss_and_grads(peft_model, ids))


def _count_calls(monkeypatch, module, host):
    """Make ``module.host`` (the host function the op's custom op launches its forward kernel from)
    record the shape of each call's input in the returned list."""
    calls = []
    original = getattr(module, host)

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, host, counting)
    return calls


class _FlaStandIn(torch.nn.Module):
    """The attributes and forward of flash-linear-attention's FusedRMSNormGated (fused rounding).

    Its module path mimics fla's, so the patch sees what it would see with fla installed; on a
    machine that has fla, the real class is tested too (test_real_fla_norm_is_patched).
    """

    def __init__(self, hidden_size, eps=1e-6, activation="swish"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.register_parameter("bias", None)
        self.eps, self.activation = eps, activation

    def forward(self, x, g):
        from q35lab.ops.gated_rms_norm import gated_rms_norm_ref

        return gated_rms_norm_ref(x, g, self.weight, self.eps, rounding="fused")


_FlaStandIn.__name__ = "FusedRMSNormGated"
_FlaStandIn.__module__ = "fla.modules.fused_norm_gate"


def _gdn_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


@pytest.mark.parametrize("norm_source", ["transformers", "fla"])
def test_patch_reaches_the_gated_norm_the_forward_calls(monkeypatch, norm_source):
    """Whichever class sits in the GatedDeltaNet, the forward must go through our kernel."""
    model = causal_lm()
    gdns = _gdn_layers(model)
    assert len(gdns) == 1
    if norm_source == "fla":  # as transformers builds the layer when fla is installed
        for gdn in gdns:
            stand_in = _FlaStandIn(gdn.norm.weight.shape[0], eps=gdn.norm.variance_epsilon).to(device())
            with torch.no_grad():
                stand_in.weight.copy_(gdn.norm.weight)
            gdn.norm = stand_in
    ids = torch.randint(0, 128, (2, 9), device=device())
    before = _loss_and_grads(model, ids)
    report = q35lab.apply_to_qwen3_5(model, rms_norm=False, flce=False, swiglu=False, conv=False,
                                     varlen_attention=False)
    expected_class = "FusedRMSNormGated" if norm_source == "fla" else "Qwen3_5RMSNormGated"
    assert report.replaced == {expected_class: 1}
    assert all(isinstance(g.norm, GatedRMSNorm) for g in gdns)
    assert gdns[0].norm.rounding == ("fused" if norm_source == "fla" else "hf")
    calls = _count_calls(monkeypatch, gated_rms_norm_op, "gated_rms_norm_fwd")
    _assert_same_step(before, _loss_and_grads(model, ids))
    assert len(calls) == len(gdns)


def test_fla_norm_with_another_activation_is_left_alone():
    model = causal_lm()
    gdn = _gdn_layers(model)[0]
    gdn.norm = _FlaStandIn(gdn.norm.weight.shape[0], activation="sigmoid").to(device())
    report = q35lab.apply_to_qwen3_5(model, rms_norm=False, in_proj=False, flce=False, swiglu=False, conv=False,
                                     varlen_attention=False)
    assert report.replaced == {} and sum(report.left_alone.values()) == 1
    assert "sigmoid" in str(report)


def test_a_same_named_class_from_elsewhere_is_not_mistaken_for_fla():
    model = causal_lm()
    gdn = _gdn_layers(model)[0]
    other = type("FusedRMSNormGated", (_FlaStandIn,), {"__module__": "axolotl.kernels.rms_norm_gated"})
    gdn.norm = other(gdn.norm.weight.shape[0]).to(device())
    assert q35lab.apply_to_qwen3_5(model, rms_norm=False, flce=False, swiglu=False, conv=False,
                                   varlen_attention=False).replaced == {}


def test_real_fla_norm_is_patched():
    fla_norm = pytest.importorskip("fla.modules").FusedRMSNormGated
    model = causal_lm()
    gdn = _gdn_layers(model)[0]
    gdn.norm = fla_norm(gdn.norm.weight.shape[0], eps=1e-6, activation="silu").to(device())
    report = q35lab.apply_to_qwen3_5(model, rms_norm=False, flce=False, swiglu=False, conv=False,
                                     varlen_attention=False)
    assert report.replaced == {"FusedRMSNormGated": 1} and gdn.norm.rounding == "fused"


# ---------------------------------------------------------------------------------------------
# The loss through linear_cross_entropy.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [causal_lm, moe_causal_lm])
def test_loss_without_logits_same_loss_and_gradients(build):
    model = build()
    ids = torch.randint(0, 128, (2, 11), device=device())
    labels = ids.clone()
    labels[0, :3] = -100
    reference = loss_and_grads(model, ids, labels)
    report = q35lab.apply_to_qwen3_5(model, rms_norm=False, gated_norm=False, lora=False, in_proj=False, swiglu=False,
                                     conv=False, varlen_attention=False)
    assert report.replaced == {f"{type(model).__name__} loss (fused linear cross entropy)": 1}
    ours = loss_and_grads(model, ids, labels)
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-5, atol=1e-6)
    for name in reference[1]:
        torch.testing.assert_close(ours[1][name], reference[1][name], rtol=1e-4, atol=1e-6, msg=name)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # documented: with labels, no logits are made
    assert model(input_ids=ids).logits.shape == (2, 11, 128)  # without labels: the model's own forward
    # gradient accumulation: num_items_in_batch turns the mean into sum / n, as transformers does
    n = torch.tensor(37)
    loss_n = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    q35lab.revert(model)
    torch.testing.assert_close(loss_n, model(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
                               rtol=1e-5, atol=1e-6)


def test_loss_of_a_peft_model_goes_through_the_fused_loss(monkeypatch):
    peft = pytest.importorskip("peft")
    from q35lab.ops.linear_cross_entropy import LinearCrossEntropyFunction

    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "out_proj"]))
    ids = torch.randint(0, 128, (2, 9), device=device())
    reference = loss_and_grads(model, ids)
    q35lab.apply_to_qwen3_5(model)
    calls = count_forward_calls(monkeypatch, LinearCrossEntropyFunction)
    ours = loss_and_grads(model, ids)
    assert len(calls) == 1
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-5, atol=1e-6)
    for name in reference[1]:
        torch.testing.assert_close(ours[1][name], reference[1][name], rtol=1e-3, atol=1e-5, msg=name)


def test_a_lora_head_keeps_the_models_loss():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]))
    report = q35lab.apply_to_qwen3_5(model)
    assert not any("loss (fused" in k for k in report.replaced)
    assert any("lm_head is" in k for k in report.left_alone)


def test_a_head_trained_whole_by_peft_goes_through_the_fused_loss(monkeypatch):
    """modules_to_save=["lm_head"] (new tokens): the active copy's weight is used and trained;
    with the adapters disabled, the original head's."""
    peft = pytest.importorskip("peft")
    from q35lab.ops.linear_cross_entropy import LinearCrossEntropyFunction

    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                             modules_to_save=["lm_head"]))
    with torch.no_grad():  # the copy and the original differ, so using the wrong one shows
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    ids = torch.randint(0, 128, (2, 9), device=device())
    reference = loss_and_grads(model, ids)
    with model.disable_adapter():
        reference_disabled = model(input_ids=ids, labels=ids).loss.detach()
    report = q35lab.apply_to_qwen3_5(model)
    assert report.replaced["Qwen3_5ForCausalLM loss (fused linear cross entropy)"] == 1
    calls = count_forward_calls(monkeypatch, LinearCrossEntropyFunction)
    ours = loss_and_grads(model, ids)
    assert len(calls) == 1 and any("modules_to_save" in name for name in ours[1])
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-5, atol=1e-6)
    for name in reference[1]:
        torch.testing.assert_close(ours[1][name], reference[1][name], rtol=1e-3, atol=1e-5, msg=name)
    with model.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss.detach(), reference_disabled,
                                   rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The MLP: gate and up as one fused node, the SwiGLU kernel between them and down_proj.
# ---------------------------------------------------------------------------------------------
def test_mlp_down_projection_runs_its_own_forward_with_dropout_or_a_hook(monkeypatch):
    """swiglu_down leaves out the down projection's module call: where that call matters (a
    dropout mask on the adapter's input, a forward hook) the module runs, with the SwiGLU node."""
    peft = pytest.importorskip("peft")
    from q35lab.ops.swiglu import SwiGLUFunction
    from q35lab.ops.swiglu_down import SwiGLUDownFunction

    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"]))
    q35lab.apply_to_qwen3_5(model)
    ids = torch.randint(0, 128, (2, 9), device=device())
    down = model.get_base_model().model.layers[0].mlp.down_proj
    seen = []
    handle = down.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    swiglu = count_forward_calls(monkeypatch, SwiGLUFunction)
    swiglu_down = count_forward_calls(monkeypatch, SwiGLUDownFunction)
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen == [(2, 9, 64)] and len(swiglu) == 1 and len(swiglu_down) == 1  # layer 0 hooked, layer 1 fused
    handle.remove()
    down.lora_dropout["default"] = torch.nn.Dropout(0.25)
    swiglu.clear(), swiglu_down.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(swiglu) == 1 and len(swiglu_down) == 1  # layer 0's adapter has dropout now
    model.eval()  # no dropout outside training: fused again
    swiglu.clear(), swiglu_down.clear()
    model(input_ids=ids, labels=ids)
    assert not swiglu and len(swiglu_down) == 2
    # a backward hook acts through the module call too: the module runs, and its hook fires
    model.train()
    down.lora_dropout["default"] = torch.nn.Identity()
    handle = down.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append("backward"))
    seen.clear(), swiglu.clear(), swiglu_down.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen == ["backward"] and len(swiglu) == 1 and len(swiglu_down) == 1
    handle.remove()


def test_a_mixed_adapter_batch_and_hooks_on_gate_or_up_get_their_module_calls():
    """PEFT's adapter_names (one adapter per row) works through pre-hooks on each LoRA layer, which
    the fused gate/up node would leave out: the logits must be PEFT's, row by row."""
    peft = pytest.importorskip("peft")
    targets = ["gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    model.add_adapter("other", peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    model.eval()
    reference = copy.deepcopy(model)
    q35lab.apply_to_qwen3_5(model)
    ids = torch.randint(0, 128, (2, 7), device=device())
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=["default", "other"]).logits
        expected = reference(input_ids=ids, adapter_names=["default", "other"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    seen = []
    gate = model.get_base_model().model.layers[1].mlp.gate_proj
    handle = gate.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    assert seen == [(2, 7, 96)]


def test_with_lora_off_the_down_adapter_keeps_peft_s_forward(monkeypatch):
    """lora=False leaves every adapter's math to PEFT: the down projection's too (its frozen base
    alone, with no adapter, still joins the SwiGLU's node)."""
    peft = pytest.importorskip("peft")
    from q35lab.ops.swiglu_down import SwiGLUDownFunction

    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj", "q_proj"]))
    q35lab.apply_to_qwen3_5(model, lora=False)
    swiglu_down = count_forward_calls(monkeypatch, SwiGLUDownFunction)
    ids = torch.randint(0, 128, (2, 9), device=device())
    model(input_ids=ids, labels=ids).loss.backward()
    assert not swiglu_down
    plain = causal_lm().requires_grad_(False)  # frozen bases, no adapters
    q35lab.apply_to_qwen3_5(plain, lora=False)
    plain(input_ids=ids, labels=ids)
    assert len(swiglu_down) == 2


def test_merged_adapters_with_adapters_disabled_compute_what_peft_computes():
    """PEFT's forward of a merged layer with its adapters disabled unmerges first: the fused paths
    (gate/up, in_proj, the down projection) must not use the merged weight as the base."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    ids = torch.randint(0, 128, (2, 9), device=device())
    patched = copy.deepcopy(model)
    q35lab.apply_to_qwen3_5(patched)  # then merged, as a user merges a trained model
    for m in (model, patched):
        m.merge_adapter()
    with torch.no_grad(), model.disable_adapter():
        expected = model(input_ids=ids, labels=ids).loss
    with torch.no_grad(), patched.disable_adapter():
        got = patched(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("targets", [["gate_proj", "up_proj", "down_proj"], ["up_proj"], []],
                         ids=["lora-on-all-three", "lora-on-up", "no-mlp-lora"])
def test_mlp_same_loss_and_gradients_through_one_fused_node_and_the_swiglu_kernel(monkeypatch, targets):
    peft = pytest.importorskip("peft")
    from q35lab.ops.fused_projections import FusedLoRAProjectionsFunction
    from q35lab.ops.swiglu import SwiGLUFunction
    from q35lab.ops.swiglu_down import SwiGLUDownFunction

    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", *targets]))
    with torch.no_grad():  # B = 0 at init would hide the adapters' path
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    ids = torch.randint(0, 128, (2, 9), device=device())
    before = _loss_and_grads(model, ids)
    weights_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = q35lab.apply_to_qwen3_5(model, flce=False, in_proj=False)
    assert report.replaced["Qwen3_5MLP (SwiGLU)"] == 2
    assert report.replaced["Qwen3_5MLP gate/up (2 projections, 1 node)"] == 2
    fused = count_forward_calls(monkeypatch, FusedLoRAProjectionsFunction)
    swiglu = count_forward_calls(monkeypatch, SwiGLUFunction)
    swiglu_down = count_forward_calls(monkeypatch, SwiGLUDownFunction)
    _assert_same_step(before, _loss_and_grads(model, ids))
    # one of each per MLP: the down projection (with its adapter or without one) in the SwiGLU's node
    assert len(fused) == 2 and len(swiglu_down) == 2 and not swiglu
    mlp = model.get_base_model().model.layers[0].mlp
    gate, up = (getattr(getattr(mlp, n), "base_layer", getattr(mlp, n)).weight for n in ("gate_proj", "up_proj"))
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()  # packed into one buffer
    assert q35lab.revert(model).reverted["Qwen3_5MLP (SwiGLU)"] == 2
    assert gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
    assert all(torch.equal(p, weights_before[n]) for n, p in model.named_parameters())
    _assert_same_step(before, _loss_and_grads(model, ids))


# ---------------------------------------------------------------------------------------------
# The causal convolution and the report of what runs.
# ---------------------------------------------------------------------------------------------
def test_conv_same_loss_and_gradients_through_the_kernel_and_an_unpatched_model_keeps_its_own(monkeypatch):
    from q35lab.ops import causal_conv1d as conv_op

    model, other = causal_lm(), causal_lm()
    ids = torch.randint(0, 128, (2, 9), device=device())
    before, other_before = _loss_and_grads(model, ids), _loss_and_grads(other, ids)
    skipped, unskipped = _skipped_key_repeat(model), _skipped_key_repeat(model, reverted=True)
    report = q35lab.apply_to_qwen3_5(model, rms_norm=False, gated_norm=False, flce=False, swiglu=False, in_proj=False,
                                     varlen_attention=False)
    assert report.replaced == {"Qwen3_5GatedDeltaNet causal conv1d": 1, **skipped}
    assert report.runs["causal conv1d"].startswith("q35lab's")
    calls = _count_calls(monkeypatch, conv_op, "causal_conv1d_fwd")
    _assert_same_step(before, _loss_and_grads(model, ids))
    assert len(calls) == 1
    _assert_same_step(other_before, _loss_and_grads(other, ids))  # same process, not patched
    assert len(calls) == 1, "an unpatched model ran q35lab's convolution"
    assert q35lab.revert(model).reverted == {"Qwen3_5GatedDeltaNet causal conv1d": 1, **unskipped}
    _loss_and_grads(model, ids)
    assert len(calls) == 1


def test_conv_of_a_packed_batch_does_not_leak_across_sequences():
    from q35lab.hf.gated_delta_net import CausalConv

    C, lengths = 6, [3, 1, 5]
    x = torch.randn(1, C, sum(lengths), device=device())
    weight, bias = torch.randn(C, 4, device=device()), torch.randn(C, device=device())
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32, device=device())
    packed = CausalConv()(x, weight, bias, activation="silu", cu_seq_lens_q=cu)
    alone = torch.cat([CausalConv()(part, weight, bias, activation="silu") for part in x.split(lengths, dim=2)], dim=2)
    torch.testing.assert_close(packed, alone)


def test_the_report_says_which_delta_rule_core_and_convolution_run():
    report = q35lab.apply_to_qwen3_5(causal_lm(), conv=False)
    fla = importlib.util.find_spec("fla") is not None
    assert ("flash-linear-attention" in report.runs["delta-rule core"]) if fla else (
        "PyTorch fallback" in report.runs["delta-rule core"] and "pip install flash-linear-attention" in str(report))
    assert "fallback" in report.runs["causal conv1d"] and "conv=True" in str(report)
    with pytest.warns(UserWarning, match="no Qwen3.5 module found"):
        assert q35lab.apply_to_qwen3_5(torch.nn.Linear(2, 2)).runs == {}  # no GatedDeltaNet, nothing to say


def test_an_installed_switch_rebuilds_the_type_it_wraps_when_called_without_arguments():
    """transformers >= 5.25 makes the modeling module's functions `kernels` objects, and unpickles
    one as type(the module's attribute)(): with q35lab's switch installed there, that call must
    give a fresh object of the wrapped type (a plain function is never rebuilt so)."""

    class KernelFunction:  # the shape of kernels' function objects: called, and rebuilt without arguments
        def __call__(self, x):
            return x + 1

    switch = hf_gdn.ConvSwitch.install(KernelFunction())
    assert isinstance(switch, hf_gdn.ConvSwitch) and switch(1) == 2 and switch.active == 0
    assert isinstance(type(switch)(), KernelFunction)
    other = hf_gdn.DeltaRuleSwitch.install(KernelFunction())
    assert type(other) is not type(switch) and isinstance(type(other)(), KernelFunction)  # a class each
    plain = hf_gdn.ConvSwitch.install(lambda x: x)
    with pytest.raises(TypeError, match="original"):
        type(plain)()


def test_the_report_says_whether_fla_runs_flash_qla_and_why_not(monkeypatch):
    """fla (0.6 on) hands the chunked delta rule to FlashQLA where its backend is installed and
    enabled, on SM90/SM100, for 128-wide heads: the report's core line says which runs, and why."""
    import types

    from q35lab.patch import conv as patch_conv

    backend = types.SimpleNamespace(available=True, enabled=True)

    class FlashQLABackend:
        @classmethod
        def is_available(cls):
            return backend.available

        def is_enabled(self):
            return backend.enabled

    fake = types.ModuleType("fla.ops.gated_delta_rule.backends.flash_qla")
    fake.FlashQLABackend = FlashQLABackend
    gdn = next(m for m in causal_lm().modules() if hf_modules.is_gated_delta_net(m))
    monkeypatch.setattr(patch_conv, "core_is_fla", lambda gdn: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, fake.__name__, None)  # an fla without the backend
    assert hf_gdn.flash_qla_problem(gdn) == "this flash-linear-attention has no FlashQLA backend (it came in 0.6)"
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(gdn, "head_k_dim", 128)
    monkeypatch.setattr(gdn, "head_v_dim", 128)
    assert hf_gdn.flash_qla_problem(gdn) is None
    assert "runs FlashQLA's fused kernels" in patch_conv.delta_rule_core(gdn)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert hf_gdn.flash_qla_problem(gdn) == "FlashQLA trains only on SM90/SM100/SM103, not on this SM80"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert hf_gdn.flash_qla_problem(gdn) is None
    # on Hopper with a Triton fla's Triton backward refuses, FlashQLA's path still runs (it uses none of them)
    monkeypatch.setattr(patch_conv, "triton_at_least", lambda version: False)
    assert "runs FlashQLA's fused kernels" in patch_conv.delta_rule_core(gdn)
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")
    assert hf_gdn.flash_qla_problem(gdn) == "fla's backends are turned off (FLA_DISABLE_BACKEND_DISPATCH=1)"
    assert "refuses Hopper with this Triton" in patch_conv.delta_rule_core(gdn)
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH")
    monkeypatch.setattr(gdn, "head_v_dim", 64)
    assert hf_gdn.flash_qla_problem(gdn) == "FlashQLA takes 128-wide heads, not 128 and 64"
    backend.enabled = False
    assert hf_gdn.flash_qla_problem(gdn) == "FlashQLA is installed but turned off (FLA_FLASH_QLA=0)"
    backend.available = False
    why = "FlashQLA is not installed (pip install flash-qla, which brings tilelang)"
    assert hf_gdn.flash_qla_problem(gdn) == why
    monkeypatch.setattr(patch_conv, "triton_at_least", lambda version: True)
    core = patch_conv.delta_rule_core(gdn)
    assert core == f"flash-linear-attention's chunk_gated_delta_rule, its Triton kernels: {why}"
