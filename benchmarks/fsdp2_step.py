"""Training steps of Qwen3.5 + PEFT LoRA under FSDP2, patched or not: one process a GPU (or a CPU
process over gloo), launched by torchrun.

The model is the end-to-end benchmark's (``q35lab.bench.e2e``): ``build`` (real dimensions, random
seeded weights in bf16, LoRA on every linear layer with fp32 adapters, gradient checkpointing),
``prepare`` (the variant: ``q35lab``, ``peft+liger``, ``peft``, ...), then sharded by ``fully_shard``,
each decoder layer and the root, with bf16 mixed precision (parameters gathered in bf16, gradients
reduced in fp32). The patch comes before the sharding: ``fully_shard`` records each parameter's
module, and q35lab replaces some modules (tests/test_fsdp2.py). The steps are ``e2e.step.measure``'s:
bf16 autocast, AdamW, warm-up steps, then the median of the measured ones; every rank trains the
same T random tokens (data parallel: world size × T tokens a step).

One JSON line on rank 0's stdout (and appended to --out): the step's time (the slowest rank's
median), the peak memory of each rank (GPU memory allocated; on a CPU the process's peak RSS), the
losses, the patch report::

    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp2_step.py --size 9b --T 32768 --variant q35lab
    torchrun --standalone --nproc_per_node=1 benchmarks/fsdp2_step.py --size tiny --T 64 --variant q35lab  # CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import traceback
from pathlib import Path

# NVLink multicast stays off wherever this runs unless asked for: a program using it can take shared
# GPUs out of service (the device machines set these; a launcher with an environment of its own may not)
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if importlib.util.find_spec("q35lab") is None:  # not installed: the checkout's, whatever the working directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from q35lab.bench.core import run_info  # noqa: E402  (imports q35lab first: compiled Triton or the interpreter)
from q35lab.bench.e2e.model import SIZES, build  # noqa: E402
from q35lab.bench.e2e.step import measure  # noqa: E402
from q35lab.bench.e2e.variants import VARIANTS, prepare, report_text  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="9b", choices=[*SIZES, "h200", "tiny"],
                        help="model dimensions, as python -m q35lab.e2e takes them (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: all of the size's)")
    parser.add_argument("--T", type=int, default=32768,
                        help="tokens a rank trains on a step, batch 1 (default: %(default)s)")
    parser.add_argument("--variant", default="q35lab", choices=sorted(VARIANTS), metavar="VARIANT",
                        help="what to train (default: %(default)s): " + ", ".join(sorted(VARIANTS)))
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank on every linear layer (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them (default: %(default)s)")
    parser.add_argument("--param-dtype", default="bf16", choices=["bf16", "none"],
                        help="FSDP2 mixed precision: gather parameters in bf16 and reduce gradients in fp32 (bf16), "
                        "or keep each parameter's own dtype (none: bf16 bases, fp32 adapters) (default: %(default)s)")
    parser.add_argument("--out", default=None, help="a .jsonl file to append the row to (rank 0)")
    return parser


def shard(model, mp_policy=None) -> int:
    """``fully_shard`` each decoder layer, then the root (the embedding, the final norm, lm_head);
    returns the number of layers."""
    from torch.distributed.fsdp import fully_shard

    layers = model.get_base_model().model.layers
    for layer in layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return len(layers)


def _host_peak_gib() -> float:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def _row(args, model, report, measured: list[dict], world: int, backend: str) -> dict:
    config = model.config.get_text_config()
    step_ms = [m["step_ms"] for m in measured]
    slowest = max(step_ms)
    losses = [json.loads(m["losses"]) for m in measured]
    return {
        "what": "fsdp2_step", "variant": args.variant, "size": args.size, "layers": config.num_hidden_layers,
        "T": args.T, "rank": args.rank, "world_size": world, "backend": backend, "param_dtype": args.param_dtype,
        "steps": args.steps, "warmup": args.warmup, "status": "ok",
        "step_ms": slowest, "step_ms_per_rank": step_ms,
        "tokens_per_s": world * args.T / slowest * 1e3,
        "core_ms": max(m["core_ms"] for m in measured),
        "peak_gib": max(m["peak_gib"] for m in measured), "peak_gib_per_rank": [m["peak_gib"] for m in measured],
        "host_peak_gib_per_rank": [m["host_peak_gib"] for m in measured],
        "loss": losses[0][-1], "losses_per_rank": losses,
        "report": report_text(report),
        **run_info(),
    }


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: the default env:// rendezvous
    dist.init_process_group(backend, device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        model = build(args.size, args.layers, args.rank, device=device)
        report = prepare(model, args.variant, tokens=args.T)  # before fully_shard (q35lab refuses a sharded model)
        mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                     if args.param_dtype == "bf16" else MixedPrecisionPolicy())
        shard(model, mp_policy)
        if cuda:
            torch.cuda.empty_cache()  # the unsharded weights the build made are gone: give their blocks back
        measured = measure(model, args.T, steps=args.steps, warmup=args.warmup)
        mine = {"step_ms": measured["step_ms"], "core_ms": measured["core_ms"], "peak_gib": measured["peak_gib"],
                "losses": measured["losses"], "host_peak_gib": _host_peak_gib()}
    except Exception as exc:  # this rank's row says why; the others would wait in a collective: end them all
        oom = cuda and isinstance(exc, torch.cuda.OutOfMemoryError)
        print(json.dumps({"what": "fsdp2_step", "variant": args.variant, "size": args.size, "T": args.T,
                          "world_size": world, "failed_rank": rank, "status": "oom" if oom else "error",
                          "note": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # torchrun stops the other ranks
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        row = _row(args, model, report, gathered, world, backend)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")
        print(f"{args.variant} {args.size} T={args.T} x{world} {backend}: step {row['step_ms']:.1f} ms, "
              f"{row['tokens_per_s']:.0f} tokens/s, peak {', '.join(f'{g:.1f}' for g in row['peak_gib_per_rank'])} GiB"
              f" (host {', '.join(f'{g:.1f}' for g in row['host_peak_gib_per_rank'])} GiB), loss {row['loss']:.4f}",
              file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
