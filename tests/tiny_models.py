"""Tiny Qwen3.5 models built from configs: no downloads, seconds on a CPU."""

import torch

from q35lab.runtime import device

TEXT = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
)


def _randomise_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Zero-initialised norm weights would hide a wrong offset: give them random values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    return model.to(device())


def causal_lm() -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return _randomise_norms(Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=96, **TEXT)))


def lora_causal_lm(seed: int = 0, rank: int = 4, targets="all-linear", dropout: float = 0.0) -> torch.nn.Module:
    """``causal_lm`` in PEFT's LoRA (alpha = 2·rank), built after ``torch.manual_seed(seed)``, with B
    random: LoRA starts at B = 0, which would hide a wrong adapter gradient."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                             lora_dropout=dropout))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model


def multimodal() -> torch.nn.Module:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
    text = Qwen3_5TextConfig(intermediate_size=96, **TEXT).to_dict()
    return _randomise_norms(Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)))


def moe_causal_lm() -> torch.nn.Module:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                  num_experts=4, num_experts_per_tok=2, **TEXT)
    return _randomise_norms(Qwen3_5MoeForCausalLM(config))


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor | None = None, run=None):
    """One causal-LM loss (labels = ids unless given) and the gradient of every parameter that gets one.
    ``run``: what computes the forward instead of ``model`` (``torch.compile(model)``); the gradients
    are read off ``model``'s own parameter names either way."""
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(input_ids=ids, labels=ids if labels is None else labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_grads(a, b, rtol=1e-5, atol=1e-6):
    """Two (loss, {name: grad}) results: the same loss, the same parameters with a gradient, the same gradients."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def count_forward_calls(monkeypatch, function_class) -> list:
    """Make ``function_class.forward`` (an autograd Function) record each call in the returned list."""
    calls = []
    original = function_class.forward
    monkeypatch.setattr(function_class, "forward", staticmethod(lambda ctx, *a: calls.append(1) or original(ctx, *a)))
    return calls


def recording_backend(graphs: list, inner: str = "aot_eager"):
    """A torch.compile backend that appends each graph Dynamo hands it to ``graphs`` (graph breaks
    show as several) and compiles it with the backend ``inner``."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(inner)(gm, example_inputs)

    return backend
