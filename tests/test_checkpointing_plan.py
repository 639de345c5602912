"""checkpointing="auto": the fewest gradient-checkpointed decoder layers that the memory model fits in a budget
(q35lab.long_context.plan_checkpointing), and the patch that runs the others without checkpointing."""

import copy
import io
import pickle
import warnings

import pytest
import torch

import q35lab
from q35lab import long_context as lc
from q35lab.hf import modules as hf_modules
from q35lab.long_context import checkpointing as lc_checkpointing
from q35lab.runtime import device
from tiny_models import assert_same_loss_and_grads, lora_causal_lm, moe_causal_lm

GiB = 2**30
T = 9  # the tiny model's step: one row of 9 tokens
#: the flags of every patched model here: the fused loss off, as test_long_context's models (it makes no logits,
#: which changes nothing the plan does; off, each step is a few kernels shorter under the interpreter)
FLAGS = {"flce": False}


def _nine_b():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig()  # transformers' default: the 9B's dimensions, 32 layers


def _model(checkpointing=True, seed=0):
    """The tiny Qwen3.5 (a GatedDeltaNet layer, then an attention layer) with LoRA on every linear layer, B random
    (LoRA starts at B = 0, which would hide a wrong adapter gradient)."""
    model = lora_causal_lm(seed)
    if checkpointing:
        lc.enable_checkpointing(model)
    return model.train()


def _settings(model):
    return dict(lora_rank=4, dtype_bytes=next(model.parameters()).element_size())


def _budget_for(model, plain: int, tokens: int = T) -> float:
    """A budget that the memory model fits with the first ``plain`` layers of ``checkpoint_order`` unchecked, and
    not with one more."""
    order = lc.checkpoint_order(model.config, **_settings(model))
    return lc.bytes_per_token(model.config, not_checkpointed=order[:plain], **_settings(model)).peak(tokens)


def _layers(model):
    return [layer for stack in hf_modules.layer_stacks(model) for layer in hf_modules.stack_layers(stack)]


def _count_layer_forwards(model) -> list:
    """Each decoder layer's index whenever its MLP runs: once in the forward, again in a checkpoint's recompute."""
    calls = []
    for index, layer in enumerate(_layers(model)):
        layer.mlp.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
    return calls


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _ids(tokens=T, seed=1):
    return torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(seed)).to(device())


# ----------------------------------------------------------------------------------------------
# the plan's arithmetic
# ----------------------------------------------------------------------------------------------
def test_no_layer_out_of_checkpointing_is_the_memory_model_as_it_was_and_each_one_adds_what_it_holds():
    config = _nine_b()
    base = lc.bytes_per_token(config)
    assert lc.bytes_per_token(config, not_checkpointed=()).terms == base.terms
    H, e = config.hidden_size, 2
    held = lc.memory._held_bytes(lc.memory.dims(config), e, 16)
    # a layer out of checkpointing trades its checkpoint input for its input and every activation it saves
    for index, kind in ((0, "linear_attention"), (3, "full_attention")):
        one = lc.bytes_per_token(config, not_checkpointed=[index])
        assert one.phase == base.phase and one.not_checkpointed == (index,)
        assert one.per_token - base.per_token == pytest.approx(held[kind] - H * e)
    assert 10 * H * e < held["full_attention"] < held["linear_attention"]  # many times a checkpoint input
    every = lc.bytes_per_token(config, not_checkpointed=range(32))
    assert every.per_token - base.per_token == pytest.approx(24 * held["linear_attention"] + 8 * held["full_attention"]
                                                             - 32 * H * e)


def test_a_larger_budget_checkpoints_fewer_layers_each_plan_the_most_that_fit():
    config = _nine_b()
    order = lc.checkpoint_order(config)
    # the attention layers hold the fewest bytes: they leave first, the last first
    assert order[:8] == (31, 27, 23, 19, 15, 11, 7, 3) and sorted(order) == list(range(32))
    tokens = 32 * 1024
    everything = lc.bytes_per_token(config).peak(tokens)
    counts = []
    for budget in [everything + k * GiB for k in range(0, 200, 7)]:
        plan = lc.plan_checkpointing(config, tokens, memory_budget=budget)
        plain = len(plan.not_checkpointed)
        assert plan.fits and plan.peak <= budget and plan.not_checkpointed == tuple(sorted(order[:plain]))
        assert sorted(plan.checkpointed + plan.not_checkpointed) == list(range(32))
        if plain < 32:  # one more would not fit
            assert lc.bytes_per_token(config, not_checkpointed=order[:plain + 1]).peak(tokens) > budget
        counts.append(len(plan.checkpointed))
    assert counts == sorted(counts, reverse=True) and counts[0] == 32 and counts[-1] == 0
    assert len(set(counts)) > 10  # each budget step frees a layer or so: the sweep saw the plan move


def test_a_budget_below_every_layer_checkpointed_plans_every_layer_and_says_it_may_not_fit():
    config = _nine_b()
    tokens = 32 * 1024
    plan = lc.plan_checkpointing(config, tokens, memory_budget=lc.bytes_per_token(config).peak(tokens) - 1)
    assert not plan.fits and plan.checkpointed == tuple(range(32)) and plan.not_checkpointed == ()
    assert "32 of 32 decoder layers checkpointed" in str(plan) and "may not fit" in str(plan)


def test_the_planners_arguments_are_checked_by_name():
    config = _nine_b()
    for kwargs, error, name in (({"memory_budget": -1.0}, ValueError, "memory_budget"),
                                ({"memory_budget": "80GB"}, TypeError, "memory_budget"),
                                ({"memory_budget": 1e12, "offload": 2}, ValueError, "offload"),
                                ({"memory_budget": 1e12, "tiled_mlp_tokens": 4096}, ValueError, "tiled_mlp_tokens")):
        with pytest.raises(error, match=name):
            lc.plan_checkpointing(config, 1024, **kwargs)
    with pytest.raises(ValueError, match="tokens"):
        lc.plan_checkpointing(config, 0, memory_budget=1e12)
    with pytest.raises(ValueError, match="not_checkpointed"):
        lc.bytes_per_token(config, not_checkpointed=[32])
    with pytest.raises(TypeError, match="not_checkpointed"):
        lc.bytes_per_token(config, not_checkpointed=3)
    with pytest.raises(ValueError, match="not_checkpointed: the tiles and the offload"):
        lc.bytes_per_token(config, not_checkpointed=[1], offload=1)
    with pytest.raises(ValueError, match="memory_budget: the model is on 'cpu'"):
        lc.checkpoint_budget("cpu")
    with pytest.raises(ValueError, match="margin"):
        lc.checkpoint_budget("cpu", margin=1.0)


# ----------------------------------------------------------------------------------------------
# the patch: the same numbers, each planned layer's forward once
# ----------------------------------------------------------------------------------------------
def test_the_plan_keeps_loss_and_every_lora_gradient_and_runs_unplanned_layers_once():
    """The tiny model with one layer out of checkpointing (the attention layer, which holds fewer bytes) computes
    what the same patch with every layer checkpointed does, bit for bit (checkpointing's recompute is the same
    arithmetic), and, by a few fp32 ulps, what the unpatched model computes."""
    ids = _ids()
    unpatched = _step(_model(), ids)
    full = _model()
    q35lab.apply_to_qwen3_5(full, **FLAGS)
    full_calls = _count_layer_forwards(full)
    expected = _step(full, ids)
    assert sorted(full_calls) == [0, 0, 1, 1]  # every layer: forward, recompute

    model = _model()
    report = q35lab.apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T,
                                     memory_budget=_budget_for(model, 1), **FLAGS)
    plan = report.checkpoint_plan
    assert plan.checkpointed == (0,) and plan.not_checkpointed == (1,) and plan.fits
    assert "1 of 2 decoder layers checkpointed" in report.runs["checkpointing"]
    assert "checkpointing: 1 of 2" in str(report)
    calls = _count_layer_forwards(model)
    got = _step(model, ids)
    assert sorted(calls) == [0, 0, 1]  # the attention layer once, the GatedDeltaNet layer twice
    loss, grads = got
    assert torch.equal(loss, expected[0]) and grads.keys() == expected[1].keys()
    assert any("lora_" in name for name in grads)
    for name in grads:
        assert torch.equal(grads[name], expected[1][name]), name
    assert_same_loss_and_grads(got, unpatched)


def test_a_budget_for_everything_runs_every_layer_once_and_one_for_nothing_checkpoints_every_layer():
    ids = _ids()
    roomy = _model()
    report = q35lab.apply_to_qwen3_5(roomy, checkpointing="auto", tokens_per_step=T, memory_budget=2**50, **FLAGS)
    assert report.checkpoint_plan.checkpointed == ()
    calls = _count_layer_forwards(roomy)
    _step(roomy, ids)
    assert sorted(calls) == [0, 1]
    tight = _model()
    with pytest.warns(UserWarning, match="checkpointing='auto': 2 of 2 decoder layers checkpointed.*may not fit"):
        report = q35lab.apply_to_qwen3_5(tight, checkpointing="auto", tokens_per_step=T, memory_budget=0, **FLAGS)
    assert not report.checkpoint_plan.fits and "may not fit" in report.runs["checkpointing"]
    calls = _count_layer_forwards(tight)
    _step(tight, ids)
    assert sorted(calls) == [0, 0, 1, 1]


def test_a_step_longer_than_planned_checkpoints_every_layer_with_a_warning_and_the_same_numbers():
    ids = _ids(T + 3)
    full = _model()
    q35lab.apply_to_qwen3_5(full, **FLAGS)
    expected = _step(full, ids)
    model = _model()
    q35lab.apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T, memory_budget=2**50, **FLAGS)
    calls = _count_layer_forwards(model)
    with pytest.warns(UserWarning, match="a step of 12 tokens is longer than the 9 tokens the checkpointing plan"):
        got = _step(model, ids)
    assert sorted(calls) == [0, 0, 1, 1]
    assert_same_loss_and_grads(got, expected, rtol=0, atol=0)
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _step(model, ids)
        _step(model, _ids(T))  # a step the plan is for: every layer once again
    assert sorted(calls) == [0, 0, 0, 1, 1, 1]  # 2 + 2, then 1 + 1


def test_checkpointing_off_is_turned_on_for_the_plan_and_off_again_by_revert():
    model = _model(checkpointing=False)
    report = q35lab.apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T,
                                     memory_budget=_budget_for(model, 1), **FLAGS)
    assert "gradient checkpointing turned on for it" in report.runs["checkpointing"]
    calls = _count_layer_forwards(model)
    _step(model, _ids())
    assert sorted(calls) == [0, 0, 1]
    assert "decoder-layer checkpointing plan" in q35lab.revert(model).reverted
    assert not any(layer.gradient_checkpointing for layer in _layers(model))
    calls.clear()
    _step(model, _ids())
    assert sorted(calls) == [0, 1]  # as before the patch: nothing checkpointed


def test_revert_restores_each_layers_checkpoint_function_and_enabling_again_keeps_the_plan():
    model = _model()
    functions = [vars(layer)["_gradient_checkpointing_func"] for layer in _layers(model)]
    q35lab.apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T, memory_budget=_budget_for(model, 1),
                            **FLAGS)
    assert isinstance(vars(_layers(model)[1])["_gradient_checkpointing_func"], lc_checkpointing._PlainCall)
    lc.enable_checkpointing(model)  # fresh checkpoint functions: the plan bypasses them again at the next forward
    calls = _count_layer_forwards(model)
    _step(model, _ids())
    assert sorted(calls) == [0, 0, 1] and lc.planned_layers(model) == (1,)
    q35lab.revert(model)
    assert lc.planned_layers(model) is None
    assert all(layer.gradient_checkpointing for layer in _layers(model))
    assert not any(isinstance(vars(layer)["_gradient_checkpointing_func"], lc_checkpointing._PlainCall)
                   for layer in _layers(model))
    assert not any(hf_modules.stack_pre_hooks(stack, lc_checkpointing._PlanGuard)
                   for stack in hf_modules.layer_stacks(model))
    calls.clear()
    _step(model, _ids())
    assert sorted(calls) == [0, 0, 1, 1]
    model = _model()
    functions = [vars(layer)["_gradient_checkpointing_func"] for layer in _layers(model)]
    q35lab.apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T, memory_budget=2**50, **FLAGS)
    q35lab.revert(model)
    assert [vars(layer)["_gradient_checkpointing_func"] for layer in _layers(model)] == functions


def test_a_planned_model_deep_copies_and_pickles_with_its_plan():
    ids = _ids()
    model = _model()
    q35lab.apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T, memory_budget=_budget_for(model, 1),
                            **FLAGS)
    before = _step(model, ids)
    twin = copy.deepcopy(model)
    bypass = vars(_layers(twin)[1])["_gradient_checkpointing_func"]
    guards = [g for stack in hf_modules.layer_stacks(twin)
              for g in hf_modules.stack_pre_hooks(stack, lc_checkpointing._PlanGuard).values()]
    assert isinstance(bypass, lc_checkpointing._PlainCall) and guards == [bypass.guard]
    assert bypass is not vars(_layers(model)[1])["_gradient_checkpointing_func"]
    calls = _count_layer_forwards(twin)
    assert_same_loss_and_grads(_step(twin, ids), before, rtol=0, atol=0)
    assert sorted(calls) == [0, 0, 1]
    # transformers' checkpointing adds an input hook (a closure) that pickle cannot store: without it the model
    # pickles, the plan with it
    model.disable_input_require_grads()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert lc.planned_layers(loaded) == (1,)
    calls = _count_layer_forwards(loaded)
    loaded.enable_input_require_grads()
    assert_same_loss_and_grads(_step(loaded, ids), before, rtol=0, atol=0)
    assert sorted(calls) == [0, 0, 1]
    assert pickle.loads(pickle.dumps(bypass)).guard.up_to_tokens == T


def test_a_packed_row_follows_the_plan_with_its_sequences_kept_apart():
    """Two sequences packed in one row (position_ids restarting): the row's tokens are the step's."""
    ids = _ids()
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]], device=device())

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full = _model()
    q35lab.apply_to_qwen3_5(full, **FLAGS)
    model = _model()
    q35lab.apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T, memory_budget=_budget_for(model, 1),
                            **FLAGS)
    calls = _count_layer_forwards(model)
    assert_same_loss_and_grads(step(model), step(full), rtol=0, atol=0)
    assert sorted(calls) == [0, 0, 1]


def test_wrong_arguments_and_combinations_are_errors_that_name_them():
    model = _model()
    auto = dict(checkpointing="auto", tokens_per_step=T, memory_budget=2**40)
    cases = [
        (dict(checkpointing=True), TypeError, "checkpointing: expected None or 'auto'"),
        (dict(checkpointing="all"), ValueError, "checkpointing: expected None"),
        (dict(checkpointing="auto"), ValueError, "tokens_per_step: checkpointing='auto' plans"),
        (dict(auto, tokens_per_step=0), ValueError, "tokens_per_step"),
        (dict(auto, tokens_per_step=2.5), TypeError, "tokens_per_step"),
        (dict(tokens_per_step=T), ValueError, "tokens_per_step: plans the checkpointing"),
        (dict(memory_budget=2**30), ValueError, "memory_budget: plans the checkpointing"),
        (dict(auto, memory_budget=-1), ValueError, "memory_budget"),
        (dict(auto, tiled_mlp=4), ValueError, "checkpointing: 'auto' .* tiled_mlp need every layer checkpointed"),
        (dict(auto, offload_checkpoints=1), ValueError, "offload_checkpoints need every layer"),
        (dict(auto, long_context=4096), ValueError, "long_context need every layer"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            q35lab.apply_to_qwen3_5(model, **kwargs)
    assert lc.planned_layers(model) is None and not any(q35lab.revert(model).reverted.values())
    if next(model.parameters()).device.type == "cpu":  # no GPU memory to plan against
        with pytest.raises(ValueError, match="memory_budget: the model is on 'cpu'.*pass memory_budget="):
            q35lab.apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T)
    with pytest.raises(NotImplementedError, match="checkpointing: the memory model covers the dense"):
        q35lab.apply_to_qwen3_5(moe_causal_lm(), **auto)
    # one on the model already, the other asked for: revert first
    q35lab.apply_to_qwen3_5(model, offload_checkpoints=1, **FLAGS)
    with pytest.raises(ValueError, match="checkpointing: the model carries long-context options"):
        q35lab.apply_to_qwen3_5(model, **auto)
    q35lab.revert(model)
    q35lab.apply_to_qwen3_5(model, **auto, **FLAGS)
    with pytest.raises(ValueError, match="tiled_gdn: the model runs decoder layers without checkpointing"):
        q35lab.apply_to_qwen3_5(model, tiled_gdn=4)
    with pytest.raises(ValueError, match="up_to_tokens"):
        lc.run_without_checkpointing(model, [0], up_to_tokens=0)
    with pytest.raises(ValueError, match="layers"):
        lc.run_without_checkpointing(model, [2], up_to_tokens=T)
