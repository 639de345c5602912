"""Bad arguments to every public function: the error's type, and a message that names the argument
as the caller spelled it and says what was expected. And the public API documents itself: Args,
Returns and Raises in every docstring, no history in them, ``dir(long_context)`` the names users call."""

import inspect
import math
import re
import warnings

import pytest
import torch

import q35lab
from q35lab import long_context as lc
from q35lab.ops.fused_projections import Projection
from q35lab.ops.lora import dropout_mask, lora_linear_ref
from q35lab.patch.lora import route_lora
from q35lab.runtime import device
from tiny_models import TEXT, causal_lm, moe_causal_lm

peft = pytest.importorskip("peft")
GiB = 2**30

BOOL_FLAGS = ("rms_norm", "gated_norm", "lora", "in_proj", "flce", "conv", "swiglu", "experts", "varlen_attention",
              "strict", "fused_linear_cross_entropy")


def _untouched(model) -> bool:
    """Nothing of q35lab's on ``model``: no instance forward, no replaced norm."""
    return not any("forward" in vars(m) or type(m).__module__.startswith("q35lab") for m in model.modules())


def _dense_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(intermediate_size=96, **TEXT)


def _moe_config():
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, **TEXT)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1)).to(device())


# ---------------------------------------------------------------------------------------------
# apply_to_qwen3_5
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return causal_lm()


@pytest.mark.parametrize("flag", BOOL_FLAGS)
@pytest.mark.parametrize("value", ["yes", 1, 1.0, 0, None])
def test_a_flag_must_be_a_bool(model, flag, value):
    if value is None and flag in ("flce", "fused_linear_cross_entropy"):  # None: the other name decides
        return
    with pytest.raises(TypeError, match=rf"^{flag}: expected True or False, got {re.escape(repr(value))}"):
        q35lab.apply_to_qwen3_5(model, **{flag: value})
    assert _untouched(model)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"tiled_mlp": True}, TypeError, r"^tiled_mlp: expected a positive int \(tokens per tile\), got True"),
    ({"tiled_mlp": 8.0}, TypeError, r"^tiled_mlp: expected a positive int"),
    ({"tiled_gdn": -8}, ValueError, r"^tiled_gdn: expected a positive int \(tokens per tile\), got -8"),
    ({"tiled_gdn": "8"}, TypeError, r"^tiled_gdn: expected a positive int"),
    ({"offload_checkpoints": 1.5}, ValueError, r"^offload_checkpoints: expected a fraction in \[0, 1\]"),
    ({"offload_checkpoints": 5}, ValueError, r"^offload_checkpoints: expected a count in \[0, 2\] \(the model's"),
    ({"offload_checkpoints": -1}, ValueError, r"^offload_checkpoints: expected a count in \[0, 2\]"),
    ({"offload_checkpoints": float("nan")}, ValueError, r"^offload_checkpoints: expected a fraction in \[0, 1\]"),
    ({"offload_checkpoints": "all"}, TypeError, r"^offload_checkpoints: expected a fraction of the decoder layers "
                                                r"\(a float in \[0, 1\]\) or a count \(an int\), got 'all'"),
    ({"offload_checkpoints": True}, TypeError, r"^offload_checkpoints: expected a fraction"),
    ({"long_context": 4096.0}, TypeError, r"^long_context: expected a positive int \(the longest step's tokens\)"),
    ({"long_context": True}, TypeError, r"^long_context: expected a positive int"),
    ({"long_context": -1}, ValueError, r"^long_context: expected a positive int"),
    ({"long_context": 4096, "offload_checkpoints": 1}, ValueError, r"^long_context: it plans tiled_mlp, tiled_gdn"),
    ({"flce": False, "fused_linear_cross_entropy": False}, TypeError,
     r"^flce, fused_linear_cross_entropy: expected one of the two \(they are one switch\), got both"),
])
def test_a_bad_option_is_refused_before_anything_is_patched(model, kwargs, error, message):
    with pytest.raises(error, match=message):
        q35lab.apply_to_qwen3_5(model, **kwargs)
    assert _untouched(model)


def test_a_model_that_is_not_a_module_is_named():
    with pytest.raises(TypeError, match="^model: expected a torch.nn.Module, got str"):
        q35lab.apply_to_qwen3_5("Qwen/Qwen3.5-9B")
    for function in (q35lab.revert, route_lora):
        with pytest.raises(TypeError, match="^model: expected a torch.nn.Module, got dict"):
            function({})


def test_fused_linear_cross_entropy_is_the_flce_switch_under_liger_s_name():
    results = []
    for kwargs in ({"flce": False}, {"fused_linear_cross_entropy": False}, {"fused_linear_cross_entropy": True}, {}):
        patched = causal_lm()
        report = q35lab.apply_to_qwen3_5(patched, **kwargs)
        results.append((report, "forward" in vars(patched)))  # the causal LM's own forward: the fused loss
    off, liger_off, liger_on, default = results
    assert off == liger_off and liger_on == default
    assert off[0].not_applied["flce"] == "disabled by the caller" and not off[1] and default[1]


def test_a_model_without_qwen3_5_modules_is_left_alone_with_a_warning_that_names_what_it_looks_for():
    llama = _llama()
    looked_for = (r"looked for transformers' Qwen3_5RMSNorm, Qwen3_5MoeRMSNorm, Qwen3_5RMSNormGated, .*Qwen3_5MLP, "
                  r".*Qwen3_5MoeExperts, .*Qwen3_5ForCausalLM, .*and GatedDeltaNet")
    with pytest.warns(UserWarning, match=rf"model: no Qwen3\.5 module found in LlamaForCausalLM \({looked_for}\); "
                                         r"nothing was patched.*strict=True makes this an error"):
        report = q35lab.apply_to_qwen3_5(llama)
    assert not report.qwen3_5 and report.total == 0 and _untouched(llama)
    with pytest.raises(ValueError, match=r"^model: no Qwen3\.5 module found in LlamaForCausalLM"):
        q35lab.apply_to_qwen3_5(llama, strict=True)
    assert _untouched(llama)


def test_the_lora_layers_of_a_model_that_is_not_qwen3_5_are_left_to_peft_unless_routed_by_route_lora():
    wrapped = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules="all-linear"))
    with pytest.warns(UserWarning, match="no Qwen3.5 module found in PeftModel"):
        report = q35lab.apply_to_qwen3_5(wrapped)
    assert report.replaced == {} and _untouched(wrapped)
    routed = route_lora(wrapped)  # asked for by name: any model's LoRA layers
    assert routed.replaced == {"PEFT lora.Linear (forward)": 2 * 7} and "not a Qwen3.5" not in str(routed)
    assert q35lab.revert(wrapped).reverted == {"PEFT lora.Linear (forward)": 2 * 7} and _untouched(wrapped)


# ---------------------------------------------------------------------------------------------
# long_context
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda c: lc.plan_long_context(c, 4096, host_bytes=0),
    lambda c: lc.longest_planned_step(c, host_bytes=0),
    lambda c: lc.plan_offload_layers(c, 4096, host_bytes=0),
    lambda c: lc.bytes_per_token(c),
    lambda c: lc.parameter_count(c),
])
def test_the_planner_refuses_a_moe_config_and_a_foreign_one_naming_config(call):
    from transformers import LlamaConfig

    with pytest.raises(NotImplementedError, match=r"^config: expected a dense Qwen3.5 config, got a MoE one "
                                                  r"\(Qwen3_5MoeTextConfig\): the memory model does not cover"):
        call(_moe_config())
    with pytest.raises(TypeError, match=r"^config: expected a dense Qwen3.5 config .*got LlamaConfig without "
                                        r"linear_num_key_heads"):
        call(LlamaConfig())
    with pytest.raises(TypeError, match="^config: expected a dense Qwen3.5 config"):
        call({"hidden_size": 64})


def test_a_moe_model_s_long_context_is_refused_by_the_patch_too():
    with pytest.raises(NotImplementedError, match="long_context: the memory model covers the dense"):
        q35lab.apply_to_qwen3_5(moe_causal_lm(), long_context=4096)


@pytest.mark.parametrize("call", [
    lambda **kw: lc.plan_long_context(_dense_config(), 4096, host_bytes=64 * GiB, **kw),
    lambda **kw: lc.longest_planned_step(_dense_config(), host_bytes=64 * GiB, multiple=2**16, **kw),
    lambda **kw: lc.plan_offload_layers(_dense_config(), 4096, host_bytes=64 * GiB, **kw),
])
def test_host_reserve_bytes_must_be_bytes(call):
    for bad, error in ((-1, ValueError), (-64 * GiB, ValueError), (math.inf, ValueError), ("16GiB", TypeError),
                       (False, TypeError)):
        with pytest.raises(error, match=r"^host_reserve_bytes: expected a finite number of at least 0 \(bytes\)"):
            call(host_reserve_bytes=bad)
    call(host_reserve_bytes=0)


@pytest.mark.parametrize("call, error, message", [
    (lambda: lc.plan_long_context(_dense_config(), 0), ValueError, r"^tokens: expected a positive int"),
    (lambda: lc.plan_long_context(_dense_config(), 4096.0), TypeError, r"^tokens: expected a positive int"),
    (lambda: lc.plan_long_context(_dense_config(), 4096, host_bytes="128"), TypeError, r"^host_bytes: expected"),
    (lambda: lc.plan_long_context(_dense_config(), 4096, host_bytes=-1), ValueError, r"^host_bytes: expected"),
    (lambda: lc.plan_long_context(_dense_config(), 4096, lora_rank="16"), TypeError,
     r"^lora_rank: expected an int of at least 0 \(the adapters' rank\), got '16'"),
    (lambda: lc.longest_planned_step(_dense_config(), multiple=True), TypeError, r"^multiple: expected"),
    (lambda: lc.longest_planned_step(_dense_config(), gpu_bytes="139"), TypeError, r"^gpu_bytes: expected"),
    (lambda: lc.plan_offload_layers(_dense_config(), -5), ValueError, r"^tokens: expected a positive int"),
    (lambda: lc.bytes_per_token(_dense_config(), lora_rank=-1), ValueError, r"^lora_rank: expected an int of at least"),
    (lambda: lc.bytes_per_token(_dense_config(), dtype_bytes=0), ValueError, r"^dtype_bytes: expected a positive int"),
    (lambda: lc.bytes_per_token(_dense_config(), dtype_bytes=2.0), TypeError, r"^dtype_bytes: expected a positive int"),
    (lambda: lc.bytes_per_token(_dense_config(), weight_bytes=0), ValueError, r"^weight_bytes: expected"),
    (lambda: lc.bytes_per_token(_dense_config(), adapter_bytes="4"), TypeError, r"^adapter_bytes: expected"),
    (lambda: lc.bytes_per_token(_dense_config(), batch=0), ValueError, r"^batch: expected a positive int"),
    (lambda: lc.bytes_per_token(_dense_config(), loss_chunk_bytes=-1), ValueError, r"^loss_chunk_bytes: expected"),
    (lambda: lc.bytes_per_token(_dense_config(), slack_bytes=-1), ValueError, r"^slack_bytes: expected"),
    (lambda: lc.bytes_per_token(_dense_config(), other_trainable_parameters=-1), ValueError,
     r"^other_trainable_parameters: expected"),
    (lambda: lc.bytes_per_token(_dense_config(), tiled_mlp_tokens=0), ValueError, r"^tiled_mlp_tokens: expected"),
    (lambda: lc.bytes_per_token(_dense_config(), tiled_gdn_tokens=1.5), TypeError, r"^tiled_gdn_tokens: expected"),
    (lambda: lc.bytes_per_token(_dense_config(), offload=1.5), ValueError, r"^offload: expected a fraction in \[0, 1"),
    (lambda: lc.bytes_per_token(_dense_config(), offload=3), ValueError, r"^offload: expected a count in \[0, 2\]"),
    (lambda: lc.bytes_per_token(_dense_config(), offload="all"), TypeError, r"^offload: expected a fraction"),
    (lambda: lc.bytes_per_token(_dense_config()).longest_fit(multiple=0), ValueError, r"^multiple: expected"),
    (lambda: lc.bytes_per_token(_dense_config()).longest_fit(gpu_bytes=-1), ValueError, r"^gpu_bytes: expected"),
    (lambda: lc.bytes_per_token(_dense_config()).peak("4096"), TypeError, r"^tokens: expected"),
    (lambda: lc.lora_parameter_count(_dense_config(), rank=-1), ValueError, r"^rank: expected"),
    (lambda: lc.lora_parameter_count(_dense_config(), targets="mlp"), ValueError, r"^targets: expected 'all-linear'"),
    (lambda: lc.default_host_reserve(-1), ValueError, r"^total_bytes: expected a finite number of at least 0"),
    (lambda: lc.default_host_reserve("64"), TypeError, r"^total_bytes: expected"),
    (lambda: lc.usable_gpu_bytes(1.5), TypeError, r"^device: expected a torch.device"),
    (lambda: lc.tile_only_above("model", 0), TypeError, r"^model: expected a torch.nn.Module, got str"),
    (lambda: lc.restore_decoder_layers(None), TypeError, r"^model: expected a torch.nn.Module, got NoneType"),
    (lambda: lc.enable_checkpointing(torch.nn.Linear(2, 2)), TypeError, r"^model: expected a transformers model"),
    (lambda: lc.CheckpointOffloader(prefetch="yes"), TypeError, r"^prefetch: expected True or False, got 'yes'"),
    (lambda: lc.CheckpointOffloader(pin_memory=1), TypeError, r"^pin_memory: expected True or False, got 1"),
    (lambda: lc.CheckpointOffloader(layers=-1), ValueError, r"^layers: expected an int of at least 0"),
    (lambda: lc.CheckpointOffloader(min_bytes=1.0), TypeError, r"^min_bytes: expected an int of at least 0"),
    (lambda: lc.CheckpointOffloader(chunk_bytes=0), ValueError, r"^chunk_bytes: expected a positive int"),
    (lambda: lc.CheckpointOffloader(host_reserve_bytes=-1), ValueError, r"^host_reserve_bytes: expected an int"),
])
def test_a_bad_planner_or_offload_argument_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_offload_decoder_layers_names_its_own_arguments():
    model = causal_lm()
    for bad, error, message in ((1.5, ValueError, r"^layers: expected a fraction in \[0, 1\]"),
                                (3, ValueError, r"^layers: expected a count in \[0, 2\]"),
                                ("all", TypeError, r"^layers: expected a fraction of the decoder layers"),
                                (None, TypeError, r"^layers: expected a fraction")):
        with pytest.raises(error, match=message):
            lc.offload_decoder_layers(model, bad)
    with pytest.raises(TypeError, match="^offloader: expected a CheckpointOffloader or None, got str"):
        lc.offload_decoder_layers(model, offloader="yes")
    with pytest.raises(TypeError, match="^min_bytes: settings of a new CheckpointOffloader, not with offloader"):
        lc.offload_decoder_layers(model, offloader=lc.CheckpointOffloader(), min_bytes=0)
    with pytest.raises(TypeError, match="^model: expected a torch.nn.Module"):
        with lc.offloaded_checkpoints("model"):
            pass
    assert not lc.has_long_context_options(model)


def test_enable_checkpointing_takes_the_call_the_installed_transformers_offers_without_a_deprecation_warning():
    model = causal_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        lc.enable_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)

    class Older(torch.nn.Module):  # a transformers release without activation_checkpointing_enable
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.kwargs = gradient_checkpointing_kwargs

    older = Older()
    lc.enable_checkpointing(older, preserve_rng_state=False)
    assert older.kwargs == {"use_reentrant": False, "preserve_rng_state": False}


# ---------------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------------
def _lora_args():
    return torch.randn(3, 8), torch.randn(5, 8), torch.randn(2, 8), torch.randn(5, 2)


@pytest.mark.parametrize("call, error, message", [
    (lambda: q35lab.OffsetRMSNorm(0), ValueError, r"^hidden_size: expected a positive int \(the width\), got 0"),
    (lambda: q35lab.OffsetRMSNorm(8.0), TypeError, r"^hidden_size: expected a positive int"),
    (lambda: q35lab.OffsetRMSNorm(True), TypeError, r"^hidden_size: expected a positive int"),
    (lambda: q35lab.OffsetRMSNorm(8, eps=0), ValueError, r"^eps: expected a positive finite number"),
    (lambda: q35lab.OffsetRMSNorm(8, eps=-1e-6), ValueError, r"^eps: expected a positive finite number"),
    (lambda: q35lab.OffsetRMSNorm(8, eps=math.inf), ValueError, r"^eps: expected a positive finite number"),
    (lambda: q35lab.OffsetRMSNorm(8, eps="1e-6"), TypeError, r"^eps: expected a positive finite number"),
    (lambda: q35lab.OffsetRMSNorm(8, eps=None), TypeError, r"^eps: expected a positive finite number"),
    (lambda: q35lab.GatedRMSNorm(-4), ValueError, r"^hidden_size: expected a positive int"),
    (lambda: q35lab.GatedRMSNorm(8, eps=True), TypeError, r"^eps: expected a positive finite number"),
    (lambda: q35lab.GatedRMSNorm(8, rounding="bf16"), ValueError, r"^rounding: expected one of \('hf', 'fused'\)"),
    (lambda: q35lab.offset_rms_norm(torch.randn(2, 8), torch.zeros(8), "1e-6"), TypeError, r"^eps: expected"),
    (lambda: q35lab.gated_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), True), TypeError,
     r"^eps: expected"),
    (lambda: q35lab.gated_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), rounding=["hf"]), ValueError,
     r"^rounding: expected one of"),
    (lambda: q35lab.lora_linear(*_lora_args(), 1.0, None, "0.1"), TypeError, r"^dropout: expected a real number"),
    (lambda: lora_linear_ref(*_lora_args(), 1.0, None, "0.1"), TypeError, r"^dropout: expected a real number"),
    (lambda: lora_linear_ref(*_lora_args(), "2"), TypeError, r"^scaling: expected a real number"),
    (lambda: dropout_mask(torch.randn(3, 8), "0.1", 0), TypeError, r"^p: expected a real number"),
    (lambda: dropout_mask(torch.randn(3, 8), 1.0, 0), ValueError, r"^p: expected a probability in \[0, 1\)"),
    (lambda: Projection(torch.randn(5, 8), dropout="0.1"), TypeError, r"^dropout: expected a real number .*got str"),
    (lambda: Projection(torch.randn(5, 8), dropout=1.0), ValueError, r"^dropout: expected a probability"),
    (lambda: Projection(torch.randn(5, 8), scaling=True), TypeError, r"^scaling: expected a real number .*got bool"),
    (lambda: q35lab.fused_lora_projections(torch.randn(3, 8), [Projection(torch.randn(5, 8))], cache={}), TypeError,
     r"^cache: expected a ConcatCache or None, got dict"),
    (lambda: q35lab.fused_lora_projections(torch.randn(3, 8), 5), TypeError, r"^projections: expected a list"),
    (lambda: q35lab.linear_cross_entropy(torch.randn(3, 8), torch.randn(7, 8), torch.zeros(3, dtype=torch.long),
                                         ignore_index=1.5), TypeError, r"^ignore_index: expected an int"),
    (lambda: q35lab.linear_cross_entropy(torch.randn(3, 8), torch.randn(7, 8), torch.zeros(3, dtype=torch.long),
                                         chunk_size=True), TypeError, r"^chunk_size: expected a positive int"),
    (lambda: q35lab.linear_cross_entropy(torch.randn(3, 8), torch.randn(7, 8), torch.zeros(3, dtype=torch.long),
                                         reduction=None), ValueError, r"^reduction: expected one of"),
    (lambda: q35lab.causal_conv1d(torch.randn(1, 5, 4), torch.randn(4, 3), return_final_rows="yes"), TypeError,
     r"^return_final_rows: expected True or False, got 'yes'"),
    (lambda: q35lab.causal_conv1d(torch.randn(1, 5, 4), torch.randn(4, 3), return_final_rows=1), TypeError,
     r"^return_final_rows: expected True or False, got 1"),
    (lambda: q35lab.swiglu(torch.randn(2, 4), torch.randn(2, 4), inplace_backward=1), TypeError,
     r"^inplace_backward: expected a bool"),
    (lambda: q35lab.routed_experts(torch.randn(2, 3, 8), torch.zeros(6, 2, dtype=torch.long), torch.rand(6, 2),
                                   torch.randn(4, 6, 8), torch.randn(4, 8, 3)), ValueError,
     r"^x: expected \[tokens, hidden\], got shape \(2, 3, 8\)"),
    (lambda: q35lab.routed_experts(torch.randn(6, 8), [[0, 1]] * 6, torch.rand(6, 2), torch.randn(4, 6, 8),
                                   torch.randn(4, 8, 3)), TypeError, r"^top_k_index: expected an integer tensor"),
])
def test_a_bad_op_argument_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_norms_keep_a_valid_eps_as_a_float():
    assert q35lab.OffsetRMSNorm(8, eps=1).eps == 1.0 and isinstance(q35lab.GatedRMSNorm(8, eps=1).eps, float)


# ---------------------------------------------------------------------------------------------
# The API documents itself
# ---------------------------------------------------------------------------------------------
def _public():
    """(qualified name, object) of everything q35lab exports, and long_context's functions and classes."""
    found = [(f"q35lab.{n}", getattr(q35lab, n)) for n in q35lab.__all__ if n != "__version__"]
    found += [(f"q35lab.long_context.{n}", getattr(lc, n)) for n in lc.__all__ if callable(getattr(lc, n))]
    return found + [("q35lab.patch.route_lora", route_lora)]


def _section(doc: str, title: str) -> str | None:
    match = re.search(rf"^{title}:\n((?:    .*\n|\s*\n)+)", doc + "\n", re.M)
    return match.group(1) if match else None


def _documented(args: str) -> set[str]:
    """The argument names an Args section lists: entries start 4 spaces in (``name (type): ...``,
    ``a, b: ...``, ``**settings: ...``)."""
    names = set()
    for line in args.splitlines():
        entry = re.match(r"^    (?! )([^:(]+?)(?: \([^)]*\))?:", line)
        if entry:
            names |= {name.strip().lstrip("*") for name in entry.group(1).split(",")}
    return names


@pytest.mark.parametrize("name, obj", _public(), ids=[name for name, _ in _public()])
def test_every_public_function_documents_its_args_returns_and_raises(name, obj):
    doc = inspect.getdoc(obj)
    assert doc, name
    if inspect.isclass(obj) and _section(doc, "Attributes") is not None:  # a result's type: its fields
        return
    function = obj.__init__ if inspect.isclass(obj) else obj
    parameters = [p for p in inspect.signature(function).parameters if p != "self"]
    if parameters:
        args = _section(doc, "Args")
        assert args is not None and _section(doc, "Raises") is not None, f"{name}: no Args or no Raises section"
        assert set(parameters) <= _documented(args), f"{name}: undocumented {set(parameters) - _documented(args)}"
    if not inspect.isclass(obj) and inspect.signature(obj).return_annotation not in ("None", None):
        assert _section(doc, "Returns") or _section(doc, "Yields"), f"{name}: no Returns section"


@pytest.mark.parametrize("name, obj", _public(), ids=[name for name, _ in _public()])
def test_public_docstrings_carry_no_history(name, obj):
    doc = inspect.getdoc(obj)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", doc), f"{name}: a date"
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", doc), f"{name}: a commit hash"
    assert not re.search(r"[+-]?\d+(\.\d+)?%", doc), f"{name}: a measured percentage"


def test_long_context_lists_what_users_call_and_keeps_every_other_name_importable():
    assert dir(lc) == sorted(lc.__all__) and len(lc.__all__) < 20
    assert not any(inspect.ismodule(getattr(lc, n)) for n in lc.__all__)
    # what README.md, DESIGN.md, the notebooks and the CLI call
    for name in ("plan_long_context", "longest_planned_step", "LongContextPlan", "usable_gpu_bytes", "bytes_per_token",
                 "tile_only_above", "offload_decoder_layers", "plan_offload_layers", "CheckpointOffloader",
                 "HOST_RESERVE_BYTES", "H200_USABLE_BYTES", "default_host_reserve", "host_memory_available"):
        assert name in lc.__all__, name
    # what the notebooks, tests and q35lab's own modules import beyond it
    for name in ("GiB", "KiB", "tiled_mlp", "tile_mlp", "untile_mlp", "tile_gated_delta_net", "tile_gated_delta_nets",
                 "tiled_gated_delta_net_layer", "TiledGDNForward", "TiledMLPFunction", "MLP_CLASSES", "PLAN_TILES",
                 "has_long_context_options", "expandable_segments", "parameter_count", "lora_parameter_count"):
        assert hasattr(lc, name), name
