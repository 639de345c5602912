"""The causal conv1d kernels against transformers' math, by the numerics rule of DESIGN.md.

Shapes are tiny (the interpreter is slow); small launch configurations make them span several
token and channel tiles, so halos cross tile edges and dW/dbias are reduced over programs.
"""

import dataclasses

import pytest
import torch
from conftest import NEEDS_CXX, assert_one_graph, graph_recorder

from q35lab.numerics import ATOL, agreement, assert_close_by_rule
from q35lab.ops.causal_conv1d import LaunchConfig, causal_conv1d, causal_conv1d_ref, launch_config
from q35lab.runtime import device

#: Tiles of 4 tokens × 16 channels: T = 11 spans 3 tiles, C = 37 spans 3 channel blocks. A
#: backward tile of 8 tokens owns 8 - (K-1) of them (5 at K = 4: T = 11 spans 3 tiles again);
#: with dW its channel block is 8 wide.
SMALL = LaunchConfig(block_t=4, block_c=16, num_warps=1, bwd_block_t=8, bwd_block_c=16, bwd_warps=1,
                     dw_block_t=8, dw_block_c=8, dw_warps=1, dw_programs_per_sm=1)


def _inputs(B, T, C, K, dtype, bias=True, w_shape="2d"):
    dev = device()
    x = torch.randn(B, T, C, device=dev).to(dtype)
    w = (0.5 * torch.randn(C, K, device=dev)).to(dtype)
    if w_shape == "3d":
        w = w.unsqueeze(1)
    b = (0.5 * torch.randn(C, device=dev)).to(dtype) if bias else None
    dy = torch.randn(B, T, C, device=dev).to(dtype)
    return x, w, b, dy


def _run(fn, x, w, b, dy, **kwargs):
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    y = fn(x, w, b, **kwargs)
    return y, torch.autograd.grad(y, leaves, dy) if leaves else ()


def _check(x, w, b, dy, activation="silu", cu_seqlens=None, config=SMALL, grads=("x", "w", "b"), grad_ulps=0):
    """The rule for y and every gradient asked for: kernel, reference in x's dtype, fp64.
    ``grad_ulps``: the gradients' absolute slack in units of their largest exact entry's spacing,
    for sums whose reference lands within an ulp of exact by luck (the rule's ratio then measures
    that luck, not the kernel)."""
    leaf = lambda t, name: None if t is None else t.detach().clone().requires_grad_(name in grads)  # noqa: E731
    x, w, b = leaf(x, "x"), leaf(w, "w"), leaf(b, "b")
    out = _run(causal_conv1d, x, w, b, dy, activation=activation, cu_seqlens=cu_seqlens, config=config)
    ref = _run(causal_conv1d_ref, x, w, b, dy, activation=activation, cu_seqlens=cu_seqlens)
    d64 = lambda t: None if t is None else t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    ref64 = _run(causal_conv1d_ref, d64(x), d64(w), d64(b), dy.double(), activation=activation, cu_seqlens=cu_seqlens)

    y = out[0]
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert torch.isfinite(y).all()
    assert_close_by_rule("y", y, ref[0], ref64[0])
    names = [n for n, t in (("dx", x), ("dw", w), ("db", b)) if t is not None and t.requires_grad]
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    for name, g, gr, g64, t in zip(names, out[1], ref[1], ref64[1], leaves):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        atol = None
        if grad_ulps:  # the spacing of fp numbers at the largest exact entry
            spacing = torch.finfo(g.dtype).eps * 2.0 ** torch.floor(torch.log2(g64.abs().max())).item()
            atol = max(ATOL[g.dtype], grad_ulps * spacing)
        assert_close_by_rule(name, g, gr, g64, atol=atol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,C,K", [(1, 1, 37, 4), (2, 11, 37, 4), (1, 9, 16, 1), (1, 7, 20, 2), (1, 21, 5, 3)],
                         ids=lambda v: str(v))
def test_forward_and_gradients_match_reference(B, T, C, K, dtype):
    _check(*_inputs(B, T, C, K, dtype))


def _segment_outputs(fn, x, w, b, h, dy, dfinal, **kwargs):
    """``y``, the final rows and the gradients of ``Σ y·dy + Σ final·dfinal`` for those of x, w, b
    and h that require grad."""
    leaves = [t for t in (x, w, b, h) if t is not None and t.requires_grad]
    y, final = fn(x, w, b, initial_rows=h, return_final_rows=True, **kwargs)
    grads = torch.autograd.grad([y, final], leaves, [dy, dfinal])
    return [y, final, *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,C,K", [(2, 11, 37, 4), (1, 1, 37, 4), (1, 2, 16, 4), (1, 3, 20, 4), (1, 13, 5, 3),
                                     (1, 9, 16, 1)], ids=lambda v: str(v))
@pytest.mark.parametrize("dx_only", [False, True], ids=["all grads", "dx and dh"])
def test_initial_and_final_rows_match_the_convolution_of_the_concatenation(B, T, C, K, dtype, dx_only):
    """A segment convolved from the previous segment's last K-1 rows, handing on its own: the output,
    the final rows and every gradient (x, w, b, the initial rows; the final rows' gradient flowing
    back too) by the rule, against the reference's convolution of [h | x]. T < K-1 takes rows of h
    into the final rows; the dx-only backward and the one with dW take different tiles."""
    x, w, b, dy = _inputs(B, T, C, K, dtype)
    h = torch.randn(B, K - 1, C, device=device()).to(dtype)
    dfinal = torch.randn(B, K - 1, C, device=device()).to(dtype)
    trains = not dx_only  # w and b: frozen in the dx-only backward, as in LoRA

    def inputs(cast=lambda t: t.detach().clone()):
        return tuple(cast(t).requires_grad_(g) for t, g in ((x, True), (w, trains), (b, trains), (h, True)))

    given = inputs()
    out = _segment_outputs(causal_conv1d, *given, dy, dfinal, config=SMALL)
    ref = _segment_outputs(causal_conv1d_ref, *inputs(), dy, dfinal)
    ref64 = _segment_outputs(causal_conv1d_ref, *inputs(lambda t: t.detach().double()), dy.double(), dfinal.double())
    names = ["y", "final rows", "dx", "dw", "db", "dh"] if trains else ["y", "final rows", "dx", "dh"]
    assert out[1].shape == (B, K - 1, C) and out[1].is_contiguous()
    # a copy: a view of x would keep all of x alive wherever the final rows are kept (a tiled layer's carries)
    assert out[1].untyped_storage().data_ptr() != given[0].untyped_storage().data_ptr()
    for name, got, expected, exact in zip(names, out, ref, ref64):
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        assert_close_by_rule(name, got, expected, exact)


def test_segments_handing_on_their_rows_give_the_whole_sequences_output_and_gradients():
    """A sequence of 19 tokens in segments of 7, 1, 2 and 9, each starting from the rows the one
    before handed on: the whole sequence's convolution and gradients (x, w, b), to rounding."""
    x, w, b, dy = _inputs(2, 19, 24, 4, torch.float32)
    w, b = w.requires_grad_(), b.requires_grad_()
    xs = x.detach().clone().requires_grad_()
    whole = _run(causal_conv1d, x.requires_grad_(), w, b, dy, config=SMALL)
    ys, rows, start = [], None, 0
    for length in (7, 1, 2, 9):
        y, rows = causal_conv1d(xs[:, start:start + length], w, b, initial_rows=rows, return_final_rows=True,
                                config=SMALL)
        ys.append(y)
        start += length
    y = torch.cat(ys, dim=1)
    segmented = (y, torch.autograd.grad(y, [xs, w, b], dy))
    torch.testing.assert_close(segmented[0], whole[0], rtol=1e-5, atol=1e-6)
    for name, got, expected in zip(("dx", "dw", "db"), segmented[1], whole[1]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_default_launch_config_and_fp16():
    x, w, b, dy = _inputs(1, 40, 24, 4, torch.float16)
    _check(x, w, b, dy, config=None)
    cfg = launch_config(8192, 4)
    assert cfg.block_c == 128 and cfg.block_t & (cfg.block_t - 1) == 0 and launch_config(37, 4).block_c == 64


@pytest.mark.parametrize("K,activation", [(2, None), (4, "swish"), (8, "silu")])
def test_no_bias_activations_and_3d_weight(K, activation):
    _check(*_inputs(1, 9, 17, K, torch.float32, bias=False, w_shape="3d"), activation=activation)


def test_frozen_weight_and_bias_and_weight_only_gradients():
    x, w, b, dy = _inputs(1, 9, 12, 4, torch.bfloat16)
    _check(x, w, b, dy, grads=("x",))
    _check(x, w, b, dy, grads=("w", "b"))
    _check(x, w, b, dy, grads=("b",))
    x0, w0 = x.clone().requires_grad_(), w.clone()
    causal_conv1d(x0, w0, b, config=SMALL).sum().backward()
    assert x0.grad is not None and w0.grad is None


def test_column_slice_of_a_wider_buffer_is_read_in_place():
    """x as in_proj outputs it: a column slice of [T, 3C+] with unit channel stride."""
    buf = torch.randn(1, 9, 3 * 19 + 5, device=device(), dtype=torch.bfloat16)
    x = buf[:, :, 19:38]
    assert not x.is_contiguous() and x.stride(-1) == 1
    _, w, b, dy = _inputs(1, 9, 19, 4, torch.bfloat16)
    _check(x, w, b, dy)
    xt = torch.randn(1, 19, 9, device=device()).transpose(1, 2)  # channels strided: copied once
    _check(xt, w.float(), b.float(), dy.float())
    dy_strided = torch.randn(1, 9, 40, device=device(), dtype=torch.bfloat16)[:, :, 3:22]
    _check(x, w, b, dy_strided)


LENGTHS = [1, 2, 3, 7, 1, 5]  # boundaries inside every K = 4 window at the short sequences


def _packed(lengths, C, K, dtype):
    x, w, b, dy = _inputs(1, sum(lengths), C, K, dtype)
    cu = torch.tensor([0] + lengths, device=device()).cumsum(0).to(torch.int32)
    return x, w, b, dy, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cu_seqlens_matches_reference(dtype):
    x, w, b, dy, cu = _packed(LENGTHS, 21, 4, dtype)
    _check(x, w, b, dy, cu_seqlens=cu)


def test_cu_seqlens_nothing_leaks_across_boundaries():
    """Each sequence of a packed batch gives what it gives alone (y and dx bit for bit), even
    when a neighbouring sequence is all NaN; dW/dbias equal the sum over the sequences."""
    lengths = [1, 2, 3, 6, 2]
    x, w, b, dy, cu = _packed(lengths, 9, 4, torch.float32)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y, (dx, dw, db) = _run(causal_conv1d, x, w, b, dy, cu_seqlens=cu, config=SMALL)
    bounds = cu.tolist()
    dw_sum, db_sum = torch.zeros_like(w), torch.zeros_like(b)
    for a, e in zip(bounds[:-1], bounds[1:]):
        xs = x[:, a:e].detach().clone().requires_grad_()
        ys, (dxs, dws, dbs) = _run(causal_conv1d, xs, w, b, dy[:, a:e].contiguous(), config=SMALL)
        assert torch.equal(y[:, a:e], ys) and torch.equal(dx[:, a:e], dxs)
        dw_sum, db_sum = dw_sum + dws, db_sum + dbs
    torch.testing.assert_close(dw, dw_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, db_sum, rtol=1e-5, atol=1e-5)

    poisoned, dy_poisoned = x.detach().clone().requires_grad_(), dy.clone()
    a, e = bounds[3], bounds[4]  # the 6-token sequence, between a 3- and a 2-token one
    with torch.no_grad():
        poisoned[:, a:e] = float("nan")
    dy_poisoned[:, a:e] = float("nan")
    yp, (dxp,) = _run(causal_conv1d, poisoned, w.detach(), b.detach(), dy_poisoned, cu_seqlens=cu, config=SMALL)
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[a:e] = False
    assert torch.equal(yp[:, keep], y[:, keep]) and torch.equal(dxp[:, keep], dx[:, keep])


def test_cu_seqlens_int64_with_empty_sequences():
    lengths = [0, 4, 0, 0, 3, 1]
    x, w, b, dy, cu = _packed(lengths, 9, 3, torch.float32)
    _check(x, w, b, dy, cu_seqlens=cu.to(torch.int64))


def test_output_can_be_edited_in_place():
    x, w, b, dy = _inputs(1, 9, 17, 4, torch.float32)
    x, w = x.requires_grad_(), w.requires_grad_()
    y = causal_conv1d(x, w, b, config=SMALL)
    assert y._base is None
    expected = torch.autograd.grad(causal_conv1d_ref(x, w, b) * 2 + 1, [x, w], dy)
    y.mul_(2).add_(1)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    torch.testing.assert_close(dx, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, expected[1], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The custom ops q35lab::causal_conv1d_fwd / _bwd: what torch.compile traces through.
# --------------------------------------------------------------------------------------------
def _opcheck_cases():
    """(dtype, B, T, C, K, bias, initial rows, packed, final, config): tiles crossed, T below K-1
    with initial rows, a packed batch, a 1-tap filter, the default launch configuration."""
    return [pytest.param(*case, id=name) for name, case in {
        "fp32-bias-final-small_tiles": (torch.float32, 2, 6, 18, 4, True, False, False, True, SMALL),
        "bf16-initial_rows-T_below_K": (torch.bfloat16, 2, 2, 7, 4, False, True, False, True, None),
        "fp32-packed": (torch.float32, 1, 9, 6, 3, True, False, True, False, SMALL),
        "bf16-one_tap": (torch.bfloat16, 1, 5, 9, 1, True, False, False, False, None),
    }.items()]


@pytest.mark.parametrize("dtype,B,T,C,K,bias,init,packed,final,config", _opcheck_cases())
def test_custom_ops_pass_opcheck(dtype, B, T, C, K, bias, init, packed, final, config):
    """Schema (no mutation, no alias), fake against real, autograd registration, AOT dispatch with
    dynamic shapes: the forward with every input trainable and with a frozen weight and bias, the
    backward for every subset of gradients asked for, the final rows' gradient included."""
    from q35lab.ops.causal_conv1d import _config_arg, _sequence_starts

    fwd, bwd = torch.ops.q35lab.causal_conv1d_fwd.default, torch.ops.q35lab.causal_conv1d_bwd.default
    x, w, b, dy = _inputs(B, T, C, K, dtype, bias=bias)
    x = torch.cat([x, x], dim=-1)[..., :C] if packed else x  # a column slice: token stride 2C
    h = torch.randn(B, K - 1, C, device=device()).to(dtype) if init else None
    seq = _sequence_starts(torch.tensor([0, 4, 4, T], device=device()), B, T) if packed else None
    fields = _config_arg(config)
    for trainable in (True, False):
        grad = lambda t, wanted: None if t is None else t.clone().requires_grad_(wanted)  # noqa: E731
        args = (grad(x, True), grad(w, trainable), grad(b, trainable), seq, grad(h, True), True, final, fields)
        torch.library.opcheck(fwd, args)
    dfinal = torch.randn(B, K - 1, C, device=device()).to(dtype) if final else None
    for dx, dw, db, dh in ((True, True, True, True), (True, False, False, False), (False, True, True, False),
                           (False, False, False, True)):
        torch.library.opcheck(bwd, (dy, x, w, b, seq, h, dfinal, True, dx, dw, db and bias, dh and init, fields))


def _layer(conv, final):
    """A linear before and a sine after the convolution (with initial rows and the final rows when
    given ``h``): code around the op for the compiler to fuse."""
    def layer(x, lin, w, b, h):
        out = conv(x @ lin.t(), w, b, activation="silu", initial_rows=h, return_final_rows=final)
        return (torch.sin(out[0]) * 2, out[1] * 3) if final else (torch.sin(out) * 2,)
    return layer


def _values_and_grads(fn, inputs, douts):
    outs = fn(*inputs)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    return (*outs, *torch.autograd.grad(outs, leaves, douts))


def _compile_cases():
    """aot_eager for each dtype, a frozen and a trainable filter, with and without the rows a
    segment hands on; inductor (seconds a compile on a CPU) for one of them."""
    cases = [("aot_eager", torch.float32, True, False), ("aot_eager", torch.bfloat16, False, True),
             ("aot_eager", torch.float32, False, True), ("inductor", torch.bfloat16, True, True)]
    return [pytest.param(*case, marks=NEEDS_CXX if case[0] == "inductor" else (),
                         id=f"{case[0]}-{str(case[1])[6:]}-{'trainable' if case[2] else 'frozen'}_w"
                            f"{'-segment' if case[3] else ''}") for case in cases]


@pytest.mark.parametrize("backend,dtype,trainable,segment", _compile_cases())
def test_fullgraph_compile_matches_eager_by_the_rule(backend, dtype, trainable, segment, monkeypatch):
    """fullgraph=True (a graph break would raise) over three shapes (the second compiles with
    dynamic shapes, the third is one token, below K-1); output and every gradient by the numerics
    rule against eager and against the reference with fp64. The launch configuration is chosen
    when the compiled code runs."""
    from q35lab.ops import causal_conv1d as op

    chosen = []
    record = lambda C, K, choose=op.launch_config: chosen.append((C, K)) or choose(C, K)  # noqa: E731
    monkeypatch.setattr(op, "launch_config", record)
    torch._dynamo.reset()
    compiled = torch.compile(_layer(causal_conv1d, segment), fullgraph=True, backend=backend)
    C, K = 37, 4
    for B, T in [(2, 7), (1, 11), (1, 1)]:
        x = torch.randn(B, T, 24, device=device()).to(dtype).requires_grad_()
        lin = (0.2 * torch.randn(C, 24, device=device())).to(dtype).requires_grad_()
        w = (0.5 * torch.randn(C, K, device=device())).to(dtype).requires_grad_(trainable)
        b = (0.5 * torch.randn(C, device=device())).to(dtype).requires_grad_(trainable)
        h = torch.randn(B, K - 1, C, device=device()).to(dtype).requires_grad_() if segment else None
        douts = [torch.randn(B, T, C, device=device()).to(dtype)]
        douts += [torch.randn(B, K - 1, C, device=device()).to(dtype)] if segment else []
        inputs = (x, lin, w, b, h)
        inputs64 = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
        got = _values_and_grads(compiled, inputs, douts)
        eager = _values_and_grads(_layer(causal_conv1d, segment), inputs, douts)
        ref = _values_and_grads(_layer(causal_conv1d_ref, segment), inputs, douts)
        exact = _values_and_grads(_layer(causal_conv1d_ref, segment), inputs64, [d.double() for d in douts])
        names = ["y", *(["final"] if segment else []), "dx", "dlin", *(["dw", "db"] if trainable else []),
                 *(["dh"] if segment else [])]
        assert len(got) == len(names)
        for name, a, e, r, r64 in zip(names, got, eager, ref, exact):
            assert a.dtype == e.dtype == r.dtype and a.shape == e.shape == r.shape, name
            assert_close_by_rule(f"{name} (compiled vs eager)", a, e, r64)
            assert_close_by_rule(f"{name} (compiled vs reference)", a, r, r64)
    assert set(chosen) == {(C, K)}


def test_compiled_function_is_one_graph_holding_both_custom_ops():
    """explain: no graph break; the forward graph calls the forward op, the backward graph the backward op."""
    x, w, b, _ = _inputs(2, 6, 12, 4, torch.float32)
    lin = torch.randn(12, 12, device=device(), requires_grad=True)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    assert_one_graph(_layer(causal_conv1d, False), x, lin, w, b, None)
    backend, graphs = graph_recorder()
    compiled = torch.compile(_layer(causal_conv1d, False), fullgraph=True,
                             backend=backend)
    compiled(x, lin, w, b, None)[0].sum().backward()
    assert torch.ops.q35lab.causal_conv1d_fwd.default in graphs["fwd"]
    assert torch.ops.q35lab.causal_conv1d_bwd.default in graphs["bwd"]


def test_a_packed_batch_compiles_with_one_break_before_the_op():
    """cu_seqlens' check reads values back to the host (one graph break, ops/_compile.py); the
    convolution itself is still traced, and the result is eager's."""
    from torch._dynamo.utils import counters

    x, w, b, dy = _inputs(1, 12, 10, 4, torch.float32)
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=device())

    def block(x, w, b):
        return causal_conv1d(x * 1.5, w, b, cu_seqlens=cu).sin() + 1

    torch._dynamo.reset()
    counters.clear()
    leaves = [[t.clone().requires_grad_() for t in (x, w, b)] for _ in range(2)]
    eager = block(*leaves[0])
    compiled = torch.compile(block, backend="aot_eager")(*leaves[1])
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for ge, gc in zip(torch.autograd.grad(eager, leaves[0], dy), torch.autograd.grad(compiled, leaves[1], dy)):
        torch.testing.assert_close(gc, ge, rtol=0, atol=0)
    breaks = [reason for reason in counters["graph_break"] if "_sequence_starts" in reason]
    assert breaks and sum(counters["graph_break"].values()) == sum(counters["graph_break"][r] for r in breaks)


def test_a_second_derivative_through_the_compiled_op_raises():
    """Eager raises q35lab's error (test_module_behaviour); a compiled graph refuses double backward first."""
    x, w, b, _ = _inputs(1, 5, 8, 4, torch.float32)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: causal_conv1d(x, w, b).sin(), fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(x, w, b).sum(), [x, w, b], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        sum(g.sum() for g in grads).backward()


def test_empty_sequence_axis():
    x = torch.randn(1, 0, 8, device=device(), requires_grad=True)
    w = torch.randn(8, 4, device=device(), requires_grad=True)
    y = causal_conv1d(x, w)
    assert y.shape == (1, 0, 8)
    dx, dw = torch.autograd.grad(y, [x, w], torch.ones_like(y))
    assert dx.shape == x.shape and torch.all(dw == 0)


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        ((_t(1, 4, 8, dtype=torch.int32), _t(8, 4)), {}, TypeError, "x: expected dtype"),
        ((_t(1, 4, 8, dtype=torch.float64), _t(8, 4)), {}, TypeError, "x: expected dtype"),
        ((_t(4, 8), _t(8, 4)), {}, ValueError, r"x: expected a 3-D tensor \[B, T, C\]"),
        ((_t(1, 4, 8), _t(8, 4).tolist()), {}, TypeError, "weight: expected a torch.Tensor"),
        ((_t(1, 4, 8), _t(9, 4)), {}, ValueError, r"weight: expected shape \[C, K\] or \[C, 1, K\] with C = 8"),
        ((_t(1, 4, 8), _t(8, 2, 4)), {}, ValueError, "weight: expected shape"),
        ((_t(1, 4, 8), _t(8, 9)), {}, ValueError, "weight: kernel width K = 9"),
        ((_t(1, 4, 8), _t(8, 0)), {}, ValueError, "weight: kernel width K = 0"),
        ((_t(1, 4, 8), _t(8, 4), _t(7)), {}, ValueError, "bias: expected a 1-D tensor of size 8"),
        ((_t(1, 4, 8), _t(8, 4), _t(8, dtype=torch.int64)), {}, TypeError, "bias: expected dtype"),
        ((_t(1, 4, 8), _t(8, 4)), {"activation": "gelu"}, ValueError, "activation: expected None, 'silu' or 'swish'"),
        ((_t(1, 4, 8), _t(8, 4)), {"cu_seqlens": torch.tensor([0.0, 4.0])}, TypeError,
         "cu_seqlens: expected dtype int32"),
        ((_t(1, 4, 8), _t(8, 4)), {"cu_seqlens": [0, 4]}, TypeError, "cu_seqlens: expected a torch.Tensor"),
        ((_t(1, 4, 8), _t(8, 4)), {"cu_seqlens": torch.tensor([4])}, ValueError, "cu_seqlens: expected a 1-D tensor"),
        ((_t(1, 4, 8), _t(8, 4)), {"cu_seqlens": torch.tensor([[0, 4]])}, ValueError, "cu_seqlens: expected a 1-D"),
        ((_t(1, 4, 8), _t(8, 4)), {"cu_seqlens": torch.tensor([1, 4])}, ValueError,
         "cu_seqlens: expected to start at 0"),
        ((_t(1, 4, 8), _t(8, 4)), {"cu_seqlens": torch.tensor([0, 3])}, ValueError,
         "cu_seqlens: expected to end at T = 4"),
        ((_t(1, 4, 8), _t(8, 4)), {"cu_seqlens": torch.tensor([0, 3, 2, 4])}, ValueError,
         "cu_seqlens: expected non-decreasing"),
        ((_t(2, 4, 8), _t(8, 4)), {"cu_seqlens": torch.tensor([0, 4])}, ValueError,
         "cu_seqlens: a packed batch needs x of batch size 1"),
        ((_t(1, 4, 8), _t(8, 4)), {"config": {"block_t": 4}}, TypeError, "config: expected a LaunchConfig"),
        ((_t(1, 4, 8), _t(8, 4)), {"initial_rows": _t(1, 4, 8)}, ValueError,
         r"initial_rows: expected shape \(1, 3, 8\)"),
        ((_t(2, 4, 8), _t(8, 4)), {"initial_rows": _t(1, 3, 8)}, ValueError,
         r"initial_rows: expected shape \(2, 3, 8\)"),
        ((_t(1, 4, 8), _t(8, 4)), {"initial_rows": _t(1, 3, 8, dtype=torch.int32)}, TypeError,
         "initial_rows: expected dtype"),
        ((_t(1, 4, 8), _t(8, 4)), {"initial_rows": _t(1, 3, 8), "cu_seqlens": torch.tensor([0, 4])}, ValueError,
         "initial_rows: not with cu_seqlens"),
    ],
)
def test_bad_input_raises_naming_the_argument(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        on_device = lambda a: a.to(device()) if isinstance(a, torch.Tensor) else a  # noqa: E731
        causal_conv1d(*map(on_device, args), **{k: on_device(v) for k, v in kwargs.items()})


def test_mismatched_devices_and_bad_config_raise():
    with pytest.raises(ValueError, match="one device"):
        causal_conv1d(torch.zeros(1, 4, 8, device="meta"), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="LaunchConfig.block_t: expected a power of two"):
        dataclasses.replace(SMALL, block_t=3)
    with pytest.raises(ValueError, match="LaunchConfig.dw_programs_per_sm: expected >= 1"):
        dataclasses.replace(SMALL, dw_programs_per_sm=0)
    x, w, b, dy = _inputs(1, 9, 16, 8, torch.float32)
    four = dataclasses.replace(SMALL, bwd_block_t=4, dw_block_t=4)  # a tile of 4 would own none at K = 8
    with pytest.raises(ValueError, match="config.bwd_block_t: expected at least K = 8"):
        _check(x, w, b, dy, config=four, grads=("x",))
    with pytest.raises(ValueError, match="config.dw_block_t: expected at least K = 8"):
        _check(x, w, b, dy, config=four)


def test_long_fp32_weight_and_bias_gradients_keep_sequential_sums_short(monkeypatch):
    """dW and dbias in fp32 over many tiles: each program sums at most MAX_TILES_PER_PROGRAM of
    them, however few programs the launch would give (here one), and the rule holds."""
    import q35lab.ops.causal_conv1d as op
    monkeypatch.setattr(op, "persistent_programs", lambda device, per_sm: 1)
    one_token_tiles = dataclasses.replace(SMALL, dw_block_t=4, dw_block_c=8)  # K = 4: a tile owns one token
    # 320 one-token tiles: 10 programs of MAX_TILES_PER_PROGRAM = 32, their partial sums then added
    x, w, b, dy = _inputs(1, 320, 6, 4, torch.float32)
    x, dy = 4 * x + 3, dy + 2  # a biased dz: its sum over the tokens is large, as in a real step
    # dW's entries reach ~2,000 (an ulp of 1.2e-4): the kernel's sums land within a few ulps, and
    # PyTorch's now and then within 1 (the bare rule then failed about 1 run in 10 on the CPU); a
    # sum that lost its fp32 accumulation would be off by thousands of ulps
    _check(x, w, b, dy, config=one_token_tiles, grads=("w", "b"), grad_ulps=4)


@pytest.mark.parametrize("programs_per_sm", [1, 64], ids=["walks tiles", "one tile a program"])
def test_backward_tiles_owning_one_token(programs_per_sm):
    """A backward tile of K tokens owns one: every dz it uses past that token comes from its own
    registers, and dW/dbias count each token once across the overlapping tiles."""
    one_owned = dataclasses.replace(SMALL, bwd_block_t=4, dw_block_t=4, dw_programs_per_sm=programs_per_sm)
    _check(*_inputs(2, 7, 19, 4, torch.float32), config=one_owned)
    _check(*_inputs(2, 7, 19, 4, torch.float32), config=one_owned, grads=("x",))
    x, w, b, dy, cu = _packed([2, 1, 4], 9, 4, torch.float32)
    _check(x, w, b, dy, cu_seqlens=cu, config=one_owned)



def test_bf16_agrees_with_transformers_module():
    """transformers rounds twice (the conv output, then SiLU); the kernel once, so it is never
    further from the fp64 result. The share of outputs that differ is reported by the bench."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, w, b, _ = _inputs(1, 33, 40, 4, torch.bfloat16)
    hf = causal_conv1d_fn(x.transpose(1, 2), w, b, activation="silu").transpose(1, 2)
    ours = causal_conv1d(x, w, b)
    exact = causal_conv1d_ref(x.double(), w.double(), b.double())
    stats = agreement(ours, hf.contiguous())
    assert (ours.double() - exact).abs().max() <= (hf.double() - exact).abs().max()
    assert stats["rel_err"] < 1e-2 and stats["frac_differ"] < 0.5
