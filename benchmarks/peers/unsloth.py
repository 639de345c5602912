"""Unsloth's Qwen3.5 LoRA path, as its users run it, on the same random weights as the other variants:
the ``unsloth`` variant of ``python -m q35lab.e2e`` (a peer's recipe, loaded from a checkout by
``q35lab.bench.e2e.peers``; not part of the wheel).

Unsloth does not patch a model it did not load: ``get_peft_model`` reads what its
``from_pretrained`` set (``max_seq_length``), and its compiler rewrites the modeling file while it
loads. Qwen3.5 has no class of its own there; ``FastLanguageModel.from_pretrained`` hands it to
``FastModel``, which compiles each decoder layer as one region, swaps fla's delta rule for its own
custom op around a vendored fla, and computes the loss in chunks (Unsloth 2026.10.9's source).
So this variant writes the seeded random model as a checkpoint (with a placeholder tokenizer, which
the loader requires), and loads it back the way a user loads a downloaded one: bf16, no 4-bit, LoRA
r on every linear layer, Unsloth's offloaded gradient checkpointing.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

#: Unsloth's own settings for a run on a machine without network: no statistics call, no hub lookups.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1"}


def write_checkpoint(model, folder: Path) -> Path:
    """``model`` (a transformers causal LM) saved to ``folder`` with a word-level placeholder
    tokenizer: what ``from_pretrained`` needs to load it. The tokens a step trains on are ids, so
    the tokenizer's vocabulary never meets them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    vocab = {"<|endoftext|>": 0, "<|im_end|>": 1, "<unk>": 2}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<|endoftext|>",
                            eos_token="<|im_end|>").save_pretrained(folder)
    return folder


def build(size: str, layers: int | None, rank: int, max_tokens: int, seed: int = 0):
    """The Unsloth LoRA model of ``size``: ``model.base_model``'s weights (same config and seed),
    written to a temporary checkpoint and loaded by ``FastLanguageModel``; LoRA as ``model.build``
    sets it (r = ``rank``, alpha 2r, every linear layer, B drawn non-zero). Raises ImportError where
    Unsloth is not installed (the row then says so)."""
    os.environ.update(OFFLINE)
    from unsloth import FastLanguageModel  # before the model is built: Unsloth patches at import and load

    from q35lab.bench.e2e.model import base_model, init_lora_b

    with tempfile.TemporaryDirectory(prefix=f"q35lab-unsloth-{size}-") as folder:  # 18 GB at 9B, read once
        write_checkpoint(base_model(size, layers, device="cuda", seed=seed), folder)
        torch.cuda.empty_cache()  # the model written is gone: its memory is the loaded one's
        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=max_tokens, dtype=torch.bfloat16,
                                                     load_in_4bit=False, load_in_16bit=True, local_files_only=True,
                                                     use_exact_model_name=True)
    model = FastLanguageModel.get_peft_model(model, r=rank, lora_alpha=2 * rank, lora_dropout=0, bias="none",
                                             target_modules="all-linear", use_gradient_checkpointing="unsloth",
                                             random_state=seed)
    FastLanguageModel.for_training(model)
    init_lora_b(model, seed)
    return model
