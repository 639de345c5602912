"""Host time per call (CPU enqueue cost) of the pieces of an offset-RMSNorm training step.

Tiny inputs (8 rows) so the GPU never waits on memory: the time per call is what Python, the
dispatcher and the Triton launcher cost. Run on a GPU: python benchmarks/host_overhead.py [out.csv]
"""

import sys
import time

import pandas as pd
import torch

from q35lab.bench import core
from q35lab.ops import offset_rms_norm as op


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    H = 4096
    x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    w = (0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    dy = torch.randn_like(x)
    y = torch.empty_like(x)
    rstd = torch.empty(8, device="cuda")
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    rows = {
        "eager x*2": lambda: x * 2,
        "torch.empty": lambda: torch.empty_like(x),
        "triton launch (fwd kernel)": lambda: op._offset_rms_norm_fwd_kernel[(8,)](
            x, w, y, rstd, 8, H, H, H, 1e-6, ROWS_PER_PROGRAM=1, BLOCK_COLS=4096, num_warps=8),
        "host fwd (alloc + launch)": lambda: op.offset_rms_norm_fwd(x, w, 1e-6),
        "host bwd with dW (2 launches)": lambda: op.offset_rms_norm_bwd(dy, x, w, rstd, True),
        "offset_rms_norm, no grad": lambda: op.offset_rms_norm(x, w),
        "offset_rms_norm fwd, grad on": lambda: op.offset_rms_norm(xg, wg),
        "q35lab fwd+bwd autograd.grad": lambda: torch.autograd.grad(op.offset_rms_norm(xg, wg), (xg, wg), dy),
        "eager ref fwd+bwd autograd.grad": lambda: torch.autograd.grad(op.offset_rms_norm_ref(xg, wg), (xg, wg), dy),
    }
    class Identity(torch.autograd.Function):
        """No kernels at all: the autograd machinery's own cost per custom node."""

        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return g

    rows["identity Function autograd.grad"] = lambda: torch.autograd.grad(Identity.apply(xg), (xg,), dy)
    rows["x*2 autograd.grad (one eager node)"] = lambda: torch.autograd.grad(xg * 2, (xg,), dy)
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNormForQwen3Next

        lig = LigerRMSNormForQwen3Next(H).cuda().to(torch.bfloat16)
        rows["liger fwd+bwd autograd.grad"] = lambda: torch.autograd.grad(lig(xg), (xg, lig.weight), dy)
    except ImportError:
        pass
    def single_threaded(fn):
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                return fn()
        return run

    for name in ("q35lab fwd+bwd autograd.grad", "eager ref fwd+bwd autograd.grad", "identity Function autograd.grad"):
        rows[name + " [backward on caller thread]"] = single_threaded(rows[name])
    results = []
    for name, fn in rows.items():
        us = per_call_us(fn)
        results.append({"what": name, "us_per_call": us, **core.run_info()})
        print(f"{name:<36} {us:8.1f} us/call")
    from torch.profiler import ProfilerActivity, profile

    fwd_bwd = rows["q35lab fwd+bwd autograd.grad"]
    for _ in range(10):
        fwd_bwd()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            fwd_bwd()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if len(sys.argv) > 1:
        pd.DataFrame(results).to_csv(sys.argv[1], index=False, float_format="%.4g")


if __name__ == "__main__":
    main()
