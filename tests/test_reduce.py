"""The deterministic reduction of per-program weight-gradient partials."""

import pytest
import torch

from q35lab.runtime import device


@pytest.mark.parametrize("n_partials,n_cols", [(1, 7), (33, 100), (70, 64), (600, 128)])  # 600: two levels
def test_partial_sums_are_reduced_exactly_once(n_partials, n_cols):
    from q35lab.ops._reduce import sum_partials

    partial = torch.randn(n_partials, n_cols, device=device())
    for dtype in (torch.float32, torch.bfloat16):
        out = sum_partials(partial, dtype)
        assert out.dtype == dtype
        exact = partial.double().sum(0)
        # fp32: up to 600 additions in another order; bf16: the fp32 sum may round to the neighbour
        tol = 1e-4 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(out.double(), exact, rtol=tol, atol=1e-5)
        assert torch.equal(out, sum_partials(partial, dtype))  # deterministic
