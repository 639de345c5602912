"""linear_cross_entropy against cross_entropy(linear(...)), by the DESIGN.md rule."""

import pytest
import torch

import q35lab
from q35lab.numerics import assert_close_by_rule
from q35lab.ops import linear_cross_entropy as lce_op
from q35lab.ops.linear_cross_entropy import default_chunk_size, linear_cross_entropy, linear_cross_entropy_ref
from q35lab.runtime import device


def _check(shape, vocab, dtype, reduction, chunk_size, ignored=0.2, logit_scale=1.0, head_grad=True, relative_atol=False,
           weight_grad="auto"):
    hidden = shape[-1]
    x = (torch.randn(shape, device=device()) * logit_scale).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device()) / hidden**0.5).to(dtype).requires_grad_(head_grad)
    target = torch.randint(0, vocab, shape[:-1], device=device())
    target[torch.rand(shape[:-1], device=device()) < ignored] = -100
    target.view(-1)[0] = 0  # at least one counted token (all ignored: its own test; the reference gives NaN)
    g = torch.randn(shape[:-1], device=device()) if reduction == "none" else torch.tensor(0.75, device=device())
    wanted = [x, w] if head_grad else [x]

    def run(fn, x, w):
        ours = {"chunk_size": chunk_size, "weight_grad": weight_grad} if fn is linear_cross_entropy else {}
        loss = fn(x, w, target, reduction=reduction, **ours)
        return (loss, *torch.autograd.grad(loss, [x, w] if head_grad else [x], g.to(loss.dtype)))

    out = run(linear_cross_entropy, x, w)
    ref = run(linear_cross_entropy_ref, x, w)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_(head_grad)
    ref64 = run(linear_cross_entropy_ref, x64, w64)
    assert out[0].shape == ref[0].shape and torch.isfinite(out[0]).all()
    for name, a, b, c in zip(["loss", "dx", "dW"], out, ref, ref64):
        # logits of hundreds: rounding is relative, so the absolute slack scales with the values
        atol = 4 * torch.finfo(dtype).eps * c.abs().max().item() if relative_atol else None
        assert_close_by_rule(name, a.to(b.dtype), b, c, atol)
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,vocab,chunk", [((2, 7, 32), 101, 4), ((1, 48), 257, None), ((13, 16), 8200, 5)],
                         ids=["batch-several-chunks", "one-token", "vocab-over-one-block"])
def test_loss_and_gradients_match_the_reference(shape, vocab, chunk, dtype, reduction):
    _check(shape, vocab, dtype, reduction, chunk)


@pytest.mark.parametrize("split_cols", [64, 100, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_split_across_programs(monkeypatch, split_cols, dtype):
    """Rows cut into several splits (a last split shorter than the rest; odd widths), with
    the target in any split and large logits, so the combined max comes from another split."""
    monkeypatch.setattr(lce_op, "SPLIT_COLS", split_cols)
    _check((7, 24), 333, dtype, "mean", 3)
    _check((5, 16), 333, dtype, "none", 2, logit_scale=200.0, relative_atol=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_by_vocabulary_blocks(monkeypatch, dtype, reduction):
    """weight_grad="recompute": dW made block by block of the vocabulary (blocks of 7 classes
    here, the last one shorter) from the saved log-sum-exp, by the same rule. Logits in the
    hundreds only in bf16: the second pass's logits come from GEMMs of another shape, which may
    round differently in the last bit, and in fp32 that ulp of a logit of 300 is above the
    reference's own error (see the docstring of linear_cross_entropy)."""
    monkeypatch.setattr(lce_op, "CHUNK_BYTES", 13 * 7 * torch.empty((), dtype=dtype).element_size())
    _check((13, 16), 101, dtype, reduction, 4, weight_grad="recompute")
    if dtype == torch.bfloat16:
        _check((13, 16), 101, dtype, reduction, 4, weight_grad="recompute", logit_scale=200.0, relative_atol=True)


def test_both_weight_gradients_agree_for_an_fp32_head_with_bf16_activations():
    x = torch.randn(9, 32, device=device()).to(torch.bfloat16).requires_grad_()
    w = torch.randn(77, 32, device=device(), requires_grad=True)
    target = torch.randint(0, 77, (9,), device=device())
    grads = {}
    for mode in ("accumulate", "recompute"):
        loss = linear_cross_entropy(x, w, target, chunk_size=4, weight_grad=mode)
        grads[mode] = torch.autograd.grad(loss, [x, w])
    assert grads["recompute"][1].dtype == torch.float32
    for a, b in zip(grads["accumulate"], grads["recompute"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def test_large_logits_stay_finite():
    _check((9, 32), 300, torch.float32, "mean", 4, logit_scale=300.0, relative_atol=True)
    _check((9, 32), 300, torch.bfloat16, "sum", 4, logit_scale=300.0, relative_atol=True)


def test_frozen_head_gets_no_gradient():
    x = torch.randn(6, 16, device=device(), requires_grad=True)
    w = torch.randn(40, 16, device=device())
    target = torch.randint(0, 40, (6,), device=device())
    linear_cross_entropy(x, w, target, chunk_size=2).backward()
    assert w.grad is None and x.grad is not None
    _check((6, 16), 40, torch.bfloat16, "mean", 2, head_grad=False)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_target_ignored_gives_zero_not_nan(reduction):
    x = torch.randn(5, 16, device=device(), requires_grad=True)
    w = torch.randn(30, 16, device=device(), requires_grad=True)
    target = torch.full((5,), -100, device=device())
    loss = linear_cross_entropy(x, w, target, reduction=reduction)
    loss.sum().backward()
    assert torch.all(loss == 0) and torch.all(x.grad == 0) and torch.all(w.grad == 0)


def test_chunk_size_comes_from_memory_and_results_do_not_depend_on_it():
    assert default_chunk_size(100_000, 248_320, torch.bfloat16) == 512  # 242 MiB of bf16 logits
    assert default_chunk_size(3, 248_320, torch.bfloat16) == 3
    x = torch.randn(11, 16, device=device())
    w = torch.randn(50, 16, device=device())
    target = torch.randint(0, 50, (11,), device=device())
    losses = [linear_cross_entropy(x, w, target, chunk_size=c) for c in (1, 3, 11, 64)]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], rtol=1e-6, atol=1e-6)


def test_a_tuned_chunk_size_is_used_for_its_shape_and_head_mode(monkeypatch):
    tuned = {"248320x4096": {"chunk_rows_trainable": 2048, "chunk_rows_frozen": 1024}}
    monkeypatch.setattr(lce_op, "tuned_fields", lambda op, key: tuned.get(key) if op == "linear_cross_entropy" else None)
    assert default_chunk_size(100_000, 248_320, torch.bfloat16, 4096, head_trainable=True) == 2048
    assert default_chunk_size(100_000, 248_320, torch.bfloat16, 4096, head_trainable=False) == 1024
    assert default_chunk_size(700, 248_320, torch.bfloat16, 4096) == 700  # never more rows than there are
    assert default_chunk_size(100_000, 248_320, torch.bfloat16, 5120) == 512  # another shape: the memory rule


@pytest.mark.parametrize("head_trainable", [True, False])
def test_one_chunk_of_logits_alive_at_a_time(monkeypatch, head_trainable):
    """The chunk loop frees a chunk's logits before the next chunk's GEMM allocates its own."""
    import weakref

    chunks_seen, original_ce, original_chunks = [], lce_op._ce_rows, lce_op._chunks

    def ce_rows(logits, *args, **kwargs):
        chunks_seen.append(weakref.ref(logits))
        return original_ce(logits, *args, **kwargs)

    def chunks(*args, **kwargs):
        for rows in original_chunks(*args, **kwargs):
            assert all(ref() is None for ref in chunks_seen), "the previous chunk's logits are still alive"
            yield rows

    monkeypatch.setattr(lce_op, "_ce_rows", ce_rows)
    monkeypatch.setattr(lce_op, "_chunks", chunks)
    x = torch.randn(11, 16, device=device(), requires_grad=True)
    w = torch.randn(37, 16, device=device(), requires_grad=head_trainable)
    linear_cross_entropy(x, w, torch.randint(0, 37, (11,), device=device()), chunk_size=3).backward()
    assert len(chunks_seen) == 4


def test_the_loss_does_not_depend_on_the_order_the_splits_of_a_row_run(monkeypatch):
    """On a GPU the programs of one row run in no fixed order; the interpreter runs them in order.
    Run them backwards: a split that writes its gradient before the target logit is read must
    not change the loss."""
    import inspect
    import textwrap

    from triton.runtime import interpreter

    source = textwrap.dedent(inspect.getsource(interpreter.GridExecutor.__call__))
    if "for y in range(grid[1]):" not in source:
        pytest.skip("this Triton's interpreter loops over the grid differently")
    namespace = {}
    exec(source.replace("for y in range(grid[1]):", "for y in reversed(range(grid[1])):"), vars(interpreter), namespace)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", namespace["__call__"])
    monkeypatch.setattr(lce_op, "SPLIT_COLS", 64)  # 4 splits of 256 columns
    x = torch.randn(4, 32, device=device(), requires_grad=True)
    w = torch.randn(256, 32, device=device(), requires_grad=True)
    target = torch.tensor([200, 250, 3, 130], device=device())
    ours = linear_cross_entropy(x, w, target, reduction="sum", chunk_size=4)  # gradients made in the forward
    torch.testing.assert_close(ours, torch.nn.functional.cross_entropy(x @ w.t(), target, reduction="sum"))


@pytest.mark.parametrize("weight_grad", ["accumulate", "recompute"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_tokens_gives_loss_zero_and_zero_gradients(weight_grad, reduction):
    x = torch.randn(0, 16, device=device(), requires_grad=True)
    w = torch.randn(300, 16, device=device(), requires_grad=True)
    loss = linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long, device=device()), reduction=reduction,
                                weight_grad=weight_grad)
    loss.sum().backward()
    assert loss.numel() == (0 if reduction == "none" else 1) and not loss.isnan().any()
    assert x.grad.shape == x.shape and (w.grad == 0).all()


def test_public_name():
    assert q35lab.linear_cross_entropy is linear_cross_entropy


@pytest.mark.parametrize(
    "target,kwargs,error,message",
    [
        (torch.tensor([0, 1, 50]), {}, ValueError, r"target: class indices must be in \[0, 50\)"),
        (torch.tensor([0, -5, 1]), {}, ValueError, "target: class indices"),
        (torch.tensor([0, 1]), {}, ValueError, "target: expected shape"),
        (torch.tensor([0.0, 1.0, 2.0]), {}, TypeError, "target: expected an int64"),
        (torch.tensor([0, 1, 2]), {"reduction": "avg"}, ValueError, "reduction: expected"),
        (torch.tensor([0, 1, 2]), {"chunk_size": 0}, ValueError, "chunk_size: expected"),
    ],
)
def test_bad_input_raises_naming_the_argument(target, kwargs, error, message):
    with pytest.raises(error, match=message):
        linear_cross_entropy(torch.randn(3, 16), torch.randn(50, 16), target, **kwargs)


def test_mismatched_head_raises():
    with pytest.raises(ValueError, match="linear_weight: expected"):
        linear_cross_entropy(torch.randn(3, 16), torch.randn(50, 17), torch.tensor([0, 1, 2]))
