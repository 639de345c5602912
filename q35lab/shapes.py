"""Qwen3.5 dimensions, with their source, and the sweep sizes every benchmark uses.

Source: the defaults of ``transformers.Qwen3_5TextConfig`` (transformers 5.17 – 5.24), which
describe the 9B-class dense model: hidden 4096, 32 GatedDeltaNet value heads and 16 key heads of
width 128, vocabulary 248,320.
"""

from __future__ import annotations

HIDDEN = 4096  # Qwen3_5TextConfig.hidden_size
GDN_VALUE_HEADS = 32  # linear_num_value_heads: rows of the gated norm per token
GDN_KEY_HEADS = 16  # linear_num_key_heads
GDN_HEAD_DIM = 128  # linear_value_head_dim: width of the gated norm
VOCAB = 248_320  # vocab_size

#: Tokens per micro-batch (batch 1), 1k … 128k, on a GPU.
SWEEP_T = [1024 * 2**i for i in range(8)]
#: `--quick`: the sizes the goals are stated at.
QUICK_T = [8 * 1024, 32 * 1024, 128 * 1024]
#: The LoRA projections' sweeps (GEMM-bound, four setups × several variants each): 1k … 64k.
LORA_SWEEP_T = [1024, 4096, 16 * 1024, 32 * 1024, 64 * 1024]
LORA_QUICK_T = [8 * 1024, 32 * 1024]
#: GEMM-bound ops are timed on the pass a training step runs, where their goals are set.
TRAINING_PASS = ("fwd+bwd",)
#: Smoke mode (no GPU, through the interpreter): correctness only.
SMOKE_T = [3, 17]
