"""What a Qwen3.5 attention layer's SDPA backward allocates per token (run on a GPU).

The H100 search of the longest 9B step ran out of memory at 389,120 and 397,312 tokens on
one allocation of ~32.8 KB a token made inside a C++ backward. The memory model counts SDPA's flash
backward as a fp32 dq accumulator (``4 · heads · head_dim`` bytes a token, 16 KiB at 9B) beside
dq, dk, dv. This measures the backward as the model calls it: transformers'
``sdpa_attention_forward`` (no mask, causal, GQA as it decides), the 9B's 16 query heads, 4 key/value
heads of 256, bf16, at each ``--T``. For each: the backend SDPA picks, the backward's peak above
what the forward left, and the largest single allocation the caching allocator saw during the
backward, each per token.

    python benchmarks/attention_backward_memory.py --out data/bench/<gpu>/attention_backward_memory.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch


class _Attention(torch.nn.Module):
    """The two attributes ``sdpa_attention_forward`` reads of a Qwen3.5 attention module."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.is_causal, self.num_key_value_groups = True, heads // kv_heads


def backend_name(q, k, v, enable_gqa: bool) -> str:
    """The backend SDPA dispatches these inputs to (no mask, causal)."""
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    try:
        return SDPBackend(choice).name
    except ValueError:
        return str(choice)


def largest_allocation_in_backward(run_backward) -> int:
    """Bytes of the largest block the caching allocator handed out while ``run_backward()`` ran."""
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        run_backward()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    sizes = [event["size"] for trace in snapshot["device_traces"] for event in trace if event["action"] == "alloc"]
    return max(sizes, default=0)


def measure(T: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa

    module = _Attention(heads, kv_heads)
    shape = lambda h: (1, h, T, head_dim)  # noqa: E731  transformers' layout [B, heads, T, D]
    q = torch.randn(shape(heads), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape(kv_heads), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape(kv_heads), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gqa = use_gqa_in_sdpa(None, k, v)
    backend = backend_name(q, k, v, gqa) if gqa else backend_name(q, k.repeat_interleave(heads // kv_heads, 1),
                                                                  v.repeat_interleave(heads // kv_heads, 1), False)
    out, _ = sdpa_attention_forward(module, q, k, v, None, scaling=head_dim ** -0.5)
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    largest = largest_allocation_in_backward(lambda: out.backward(grad))
    peak = torch.cuda.max_memory_allocated() - before
    return {"T": T, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "enable_gqa": gqa,
            "backend": backend, "backward_peak_bytes_per_token": peak / T,
            "largest_allocation_bytes_per_token": largest / T,
            "dq_fp32_bytes_per_token": 4 * heads * head_dim,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for T in args.T:
        rows.append(measure(T, args.heads, args.kv_heads, args.head_dim))
        torch.cuda.empty_cache()
    table = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(table.drop(columns=["gpu", "torch"]).to_string(index=False))


if __name__ == "__main__":
    main()
