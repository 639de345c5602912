"""The fused gated RMSNorm against transformers' math (and fla's), by the DESIGN.md rule."""

import dataclasses

import pytest
import torch
from conftest import NEEDS_CXX, OPCHECK_SHAPES, assert_one_graph, fresh_rows, graph_recorder

import q35lab
from q35lab.numerics import agreement, assert_close_by_rule
from q35lab.ops.gated_rms_norm import GatedRMSNorm, gated_rms_norm, gated_rms_norm_ref
from q35lab.runtime import device

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run(fn, x, g, w, dy, rounding):
    y = fn(x, g, w, 1e-6, rounding)
    wanted = [t for t in (x, g, w) if t.requires_grad]
    return y, torch.autograd.grad(y, wanted, dy)


def _check(shape, dtype, rounding, w_requires_grad=True, w_dtype=None):
    dev = device()
    x = torch.randn(shape, device=dev).to(dtype).requires_grad_()
    g = (2 * torch.randn(shape, device=dev)).to(dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(shape[-1], device=dev)).to(w_dtype or dtype).requires_grad_(w_requires_grad)
    dy = torch.randn(shape, device=dev).to(dtype)
    out, out_grads = _run(gated_rms_norm, x, g, w, dy, rounding)
    ref, ref_grads = _run(gated_rms_norm_ref, x, g, w, dy, rounding)
    x64, g64 = x.detach().double().requires_grad_(), g.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_(w_requires_grad)
    ref64, ref64_grads = _run(gated_rms_norm_ref, x64, g64, w64, dy.double(), rounding)
    assert out.shape == x.shape and out.dtype == dtype and torch.isfinite(out).all()
    assert_close_by_rule("y", out, ref, ref64)
    names = ["dx", "dgate", "dw"][: len(out_grads)]
    for name, a, b, c in zip(names, out_grads, ref_grads, ref64_grads):
        assert a.dtype == b.dtype
        assert_close_by_rule(name, a, b, c)
    return out, ref


@pytest.mark.parametrize("rounding", ["hf", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 128), (67, 128), (2, 5, 64), (33, 100), (3, 7, 96)], ids=lambda s: "x".join(map(str, s))
)
def test_forward_and_all_gradients_match_reference(shape, dtype, rounding):
    _check(shape, dtype, rounding)


@pytest.mark.parametrize("rounding", ["hf", "fused"])
@pytest.mark.parametrize("n_rows", [1, 15, 16, 17, 200])  # tiles of 16/32 rows, 4 programs on CPU
def test_row_counts_around_the_tile(n_rows, rounding):
    _check((n_rows, 128), torch.bfloat16, rounding)


@pytest.mark.parametrize("rounding", ["hf", "fused"])
def test_frozen_weight(rounding):
    _check((40, 128), torch.bfloat16, rounding, w_requires_grad=False)
    x = torch.randn(4, 128, device=device(), requires_grad=True)
    w = torch.ones(128, device=device())
    gated_rms_norm(x, torch.randn_like(x), w, rounding=rounding).sum().backward()
    assert w.grad is None and x.grad is not None


def test_fp32_weight_with_bf16_activations():
    """transformers promotes w·bf16(x̂) to fp32 then: no rounding after the weight."""
    out, ref = _check((50, 128), torch.bfloat16, "hf", w_dtype=torch.float32)
    assert agreement(out.detach(), ref.detach())["frac_differ"] <= 1e-3


def test_hf_mode_is_bit_identical_to_the_transformers_module():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    hf = Qwen3_5RMSNormGated(128, eps=1e-6).to(device=device(), dtype=torch.bfloat16)
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.2)
    ours = GatedRMSNorm(128, eps=1e-6).to(device=device(), dtype=torch.bfloat16)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(32 * 9, 128, device=device(), dtype=torch.bfloat16)
    g = 2 * torch.randn_like(x)
    y, y_hf = ours(x, g), hf(x, g)
    stats = agreement(y, y_hf)
    assert stats["frac_differ"] <= 1e-3
    # A last-bit difference in rstd (sum order) can flip the first of transformers' three
    # roundings, x̂ → bf16; the flip can carry through the two later roundings, each ≤ 2⁻⁷
    # relative: a few ulps of y, rarely (seen: ≤ 3 ulps on ≤ 3 of 36,864 elements, ≤ 1.03e-2
    # relative over 60 seeds).
    differ = y != y_hf
    relative = ((y.float() - y_hf.float()).abs() / y_hf.float().abs())[differ]
    assert relative.numel() == 0 or relative.max().item() <= 3 * 2**-7


def test_fused_mode_rounds_once_and_is_closer_to_fp64():
    x = torch.randn(32 * 16, 128, device=device(), dtype=torch.bfloat16)
    g = 2 * torch.randn_like(x)
    w = (1 + 0.2 * torch.randn(128, device=device())).to(torch.bfloat16)
    exact = gated_rms_norm_ref(x.double(), g.double(), w.double())
    err = {r: (gated_rms_norm(x, g, w, rounding=r).double() - exact).norm().item() for r in ("hf", "fused")}
    assert err["fused"] < err["hf"]


def test_module_is_a_drop_in():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    ours, hf = GatedRMSNorm(128), Qwen3_5RMSNormGated(128)
    assert list(ours.state_dict()) == list(hf.state_dict()) == ["weight"]
    assert torch.all(ours.weight == 1)
    assert "rounding='hf'" in repr(ours)
    assert q35lab.GatedRMSNorm is GatedRMSNorm and q35lab.gated_rms_norm is gated_rms_norm


def test_non_contiguous_inputs():
    base = torch.randn(10, 2, 128, device=device())
    x, g = base[:, 0], base[:, 1]  # strided rows
    w = 1 + 0.1 * torch.randn(128, device=device())
    assert not x.is_contiguous()
    torch.testing.assert_close(gated_rms_norm(x, g, w), gated_rms_norm_ref(x, g, w), rtol=1e-5, atol=1e-5)


def test_empty_input():
    x = torch.randn(0, 128, device=device(), requires_grad=True)
    g = torch.randn(0, 128, device=device(), requires_grad=True)
    w = torch.ones(128, device=device(), requires_grad=True)
    y = gated_rms_norm(x, g, w)
    dx, dg, dw = torch.autograd.grad(y, [x, g, w], torch.ones_like(y))
    assert y.shape == (0, 128) and dx.shape == dg.shape == (0, 128) and torch.all(dw == 0)


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        ((torch.randn(4, 8), torch.randn(4, 9), torch.ones(8)), {}, ValueError, "gate: expected the shape of x"),
        ((torch.randn(4, 8), torch.randn(4, 8), torch.ones(9)), {}, ValueError,
         "weight: expected a 1-D tensor of size 8"),
        ((torch.ones(4, 8, dtype=torch.int32), torch.randn(4, 8), torch.ones(8)), {}, TypeError, "x: expected dtype"),
        ((torch.randn(4, 8), torch.ones(4, 8, dtype=torch.int64), torch.ones(8)), {}, TypeError,
         "gate: expected dtype"),
        ((torch.randn(4, 8), torch.randn(4, 8).half(), torch.ones(8)), {}, TypeError, "gate: expected the dtype of x"),
        ((torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)), {"rounding": "llama"}, ValueError,
         "rounding: expected"),
        ((torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)), {"eps": 0.0}, ValueError, "eps: expected a positive"),
    ],
)
def test_bad_input_raises_naming_the_argument(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        gated_rms_norm(*args, **kwargs)


def test_bad_rounding_in_module():
    with pytest.raises(ValueError, match="rounding"):
        GatedRMSNorm(128, rounding="exact")


@pytest.mark.parametrize("rounding", ["hf", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_may_be_edited_in_place(dtype, rounding):
    """``y.mul_(2)`` after the norm, as transformers' module allows; gradients by the rule."""
    def edit(fn):
        return lambda *args: fn(*args).mul_(2).sub_(0.5)

    shape = (3, 7, 96)
    dev = device()
    x = torch.randn(shape, device=dev).to(dtype).requires_grad_()
    g = (2 * torch.randn(shape, device=dev)).to(dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(shape[-1], device=dev)).to(dtype).requires_grad_()
    dy = torch.randn(shape, device=dev).to(dtype)
    assert gated_rms_norm(x, g, w, 1e-6, rounding)._base is None
    out = _run(edit(gated_rms_norm), x, g, w, dy, rounding)
    ref = _run(edit(gated_rms_norm_ref), x, g, w, dy, rounding)
    x64, g64, w64 = (t.detach().double().requires_grad_() for t in (x, g, w))
    ref64 = _run(edit(gated_rms_norm_ref), x64, g64, w64, dy.double(), rounding)
    assert_close_by_rule("y", out[0], ref[0], ref64[0])
    for name, a, b, c in zip(["dx", "dgate", "dw"], out[1], ref[1], ref64[1]):
        assert_close_by_rule(name, a, b, c)


@pytest.mark.parametrize("shape", [(4, 0), (2, 3, 0), (0, 0), (0, 128), (2, 0, 33)],
                         ids=lambda s: "x".join(map(str, s)))
def test_zero_width_and_zero_rows_give_what_the_reference_gives(shape):
    x = torch.randn(shape, device=device(), requires_grad=True)
    g = torch.randn(shape, device=device(), requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device())).requires_grad_()
    y, y_ref = gated_rms_norm(x, g, w), gated_rms_norm_ref(x, g, w)
    assert y.shape == y_ref.shape == x.shape
    dy = torch.randn(shape, device=device())
    for a, b in zip(torch.autograd.grad(y, [x, g, w], dy), torch.autograd.grad(y_ref, [x, g, w], dy)):
        assert a.shape == b.shape and torch.equal(a, b)


def test_compiled_function_matches_eager():
    """gated_rms_norm is a custom op (ops/_compile.py): one graph with the code around it."""
    torch._dynamo.reset()
    w = (1 + 0.1 * torch.randn(64, device=device())).requires_grad_()
    x = torch.randn(2, 6, 64, device=device(), requires_grad=True)
    z = torch.randn(2, 6, 64, device=device(), requires_grad=True)

    def layer(x, z):
        return gated_rms_norm(x * 0.5 + 1, torch.sigmoid(z) * z, w, rounding="fused").square().mean(-1)

    results = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        y = fn(x, z)
        results.append((y.detach(), *torch.autograd.grad(y.sum(), [x, z, w])))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    import inspect

    assert list(inspect.signature(gated_rms_norm).parameters) == ["x", "gate", "weight", "eps", "rounding"]
    assert gated_rms_norm.__doc__.startswith("Gated RMSNorm:")


# --------------------------------------------------------------------------------------------
# The custom ops q35lab::gated_rms_norm_fwd / _bwd: what torch.compile traces through.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@OPCHECK_SHAPES
def test_custom_ops_pass_opcheck(shape, dtype, strided):
    """Schema (no mutation, no alias), fake against real, autograd registration, AOT dispatch with
    dynamic shapes: forward in both roundings with a trainable and a frozen weight, backward with and
    without dW."""
    fwd, bwd = torch.ops.q35lab.gated_rms_norm_fwd.default, torch.ops.q35lab.gated_rms_norm_bwd.default
    x, gate = fresh_rows(shape, dtype, strided).requires_grad_(), (2 * fresh_rows(shape, dtype)).requires_grad_()
    w = (1 + 0.2 * torch.randn(shape[-1], device=device())).to(dtype)
    for rounding, trainable in (("hf", True), ("fused", False)):
        torch.library.opcheck(fwd, (x, gate, w.clone().requires_grad_(trainable), 1e-6, rounding))
    x2d, g2d = (t.detach().reshape(-1, shape[-1]).contiguous() for t in (x, gate))
    dy2d = torch.randn(x2d.shape, device=device()).to(dtype)
    for rounding, compute_dw in (("hf", False), ("fused", True)):
        torch.library.opcheck(bwd, (dy2d, x2d, g2d, w, 1e-6, rounding, compute_dw))


def _layer(norm, rounding):
    """A linear, the norm gated by a function of z, a sine: code around the op for the compiler to fuse."""
    return lambda x, lin, z, w: torch.sin(norm(x @ lin.t(), z * 2, w, 1e-6, rounding)) * 2


def _value_and_grads(fn, inputs, dy):
    y = fn(*inputs)
    return (y, *torch.autograd.grad(y, [t for t in inputs if t.requires_grad], dy))


def _compile_cases():
    """aot_eager for each dtype and weight (both roundings for each dtype); inductor (seconds a
    compile on a CPU) for one of them."""
    cases = [("aot_eager", torch.float32, True, "hf"), ("aot_eager", torch.float32, False, "fused"),
             ("aot_eager", torch.bfloat16, True, "fused"), ("aot_eager", torch.bfloat16, False, "hf"),
             ("inductor", torch.bfloat16, True, "fused")]
    return [pytest.param(*case, marks=NEEDS_CXX if case[0] == "inductor" else (),
                         id=f"{case[0]}-{str(case[1])[6:]}-{'trainable' if case[2] else 'frozen'}_w-{case[3]}")
            for case in cases]


@pytest.mark.parametrize("backend,dtype,trainable,rounding", _compile_cases())
def test_fullgraph_compile_matches_eager_by_the_rule(backend, dtype, trainable, rounding, monkeypatch):
    """fullgraph=True (a graph break would raise) over three shapes (the second compiles with
    dynamic shapes, the third is one row); output and every gradient by the numerics rule against
    eager and fp64. The launch configuration is chosen when the compiled code runs."""
    from q35lab.ops import gated_rms_norm as op

    widths = []
    monkeypatch.setattr(op, "launch_config", lambda n, choose=op.launch_config: widths.append(n) or choose(n))
    torch._dynamo.reset()
    compiled = torch.compile(_layer(gated_rms_norm, rounding), fullgraph=True, backend=backend)
    for lead in [(3, 5), (2, 7), (1, 1)]:
        x = torch.randn(*lead, 24, device=device()).to(dtype).requires_grad_()
        lin = (0.2 * torch.randn(40, 24, device=device())).to(dtype).requires_grad_()
        z = torch.randn(*lead, 40, device=device()).to(dtype).requires_grad_()
        w = (1 + 0.2 * torch.randn(40, device=device())).to(dtype).requires_grad_(trainable)
        dy = torch.randn(*lead, 40, device=device()).to(dtype)
        inputs = (x, lin, z, w)
        inputs64 = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
        got = _value_and_grads(compiled, inputs, dy)
        eager = _value_and_grads(_layer(gated_rms_norm, rounding), inputs, dy)
        exact = _value_and_grads(_layer(gated_rms_norm_ref, rounding), inputs64, dy.double())
        assert len(got) == (5 if trainable else 4)
        for name, a, b, c in zip(["y", "dx", "dlin", "dgate", "dw"], got, eager, exact):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert_close_by_rule(name, a, b, c)
    assert set(widths) == {40}


def test_compiled_function_is_one_graph_holding_both_custom_ops():
    """explain: no graph break; the forward graph calls the forward op, the backward graph the backward op."""
    x = torch.randn(4, 3, 24, device=device(), requires_grad=True)
    lin = torch.randn(40, 24, device=device(), requires_grad=True)
    z = torch.randn(4, 3, 40, device=device(), requires_grad=True)
    w = (1 + 0.1 * torch.randn(40, device=device())).requires_grad_()
    assert_one_graph(_layer(gated_rms_norm, "hf"), x, lin, z, w)
    backend, graphs = graph_recorder()
    compiled = torch.compile(_layer(gated_rms_norm, "hf"), fullgraph=True,
                             backend=backend)
    compiled(x, lin, z, w).sum().backward()
    assert torch.ops.q35lab.gated_rms_norm_fwd.default in graphs["fwd"]
    assert torch.ops.q35lab.gated_rms_norm_bwd.default in graphs["bwd"]


def test_a_second_derivative_through_the_compiled_op_raises():
    """Eager raises q35lab's error (test_module_behaviour); a compiled graph refuses double backward first."""
    x, z = (torch.randn(3, 40, device=device(), requires_grad=True) for _ in range(2))
    w = (1 + 0.1 * torch.randn(40, device=device())).requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, z, w: gated_rms_norm(x, z, w).sin(), fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(x, z, w).sum(), [x, z, w], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        sum(g.sum() for g in grads).backward()


def test_one_launch_configuration_mechanism(monkeypatch):
    """launch_config(width) = tuned.json's entry over the default; config= reaches the kernels."""
    from q35lab.ops import _tuned
    from q35lab.ops import gated_rms_norm as op

    assert not hasattr(op, "CONFIG_OVERRIDE")
    monkeypatch.setattr(_tuned, "tuned_fields", lambda name, key: {"fwd_block_rows": 2}
                        if (name, key) == ("gated_rms_norm", 100) else None)
    op.launch_config.cache_clear()
    try:
        assert op.launch_config(100) == dataclasses.replace(op._default_config(100), fwd_block_rows=2)
        assert op.launch_config(128) == op._default_config(128)
    finally:
        op.launch_config.cache_clear()
    x, g, dy = (torch.randn(37, 100, device=device()) for _ in range(3))
    w = 1 + 0.1 * torch.randn(100, device=device())
    grids = []
    kernel = op._gated_rms_norm_bwd_kernel
    monkeypatch.setattr(op, "_gated_rms_norm_bwd_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or kernel[grid]})())
    config = op.LaunchConfig(fwd_block_rows=4, fwd_warps=1, bwd_block_rows=2, bwd_warps=1, bwd_tiles_per_program=3,
                             frozen_block_rows=16, frozen_warps=1)
    y = op.gated_rms_norm_fwd(x, g, w, 1e-6, "hf", config=config)
    # other warps, another reduction order: fp32 rounding apart, not bits (on a GPU; the interpreter's are equal)
    torch.testing.assert_close(y, op.gated_rms_norm_fwd(x, g, w, 1e-6, "hf"), rtol=1e-5, atol=1e-5)
    for compute_dw, programs in ((True, -(-37 // 6)), (False, -(-37 // 16))):
        ours = op.gated_rms_norm_bwd(dy, x, g, w, 1e-6, "hf", compute_dw, config=config)
        assert grids[-1] == (programs,)
        default = op.gated_rms_norm_bwd(dy, x, g, w, 1e-6, "hf", compute_dw)
        for a, b in zip(ours, default):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_committed_tuned_entries_are_valid_configurations():
    """Every gated_rms_norm entry of ops/tuned.json names fields of LaunchConfig only."""
    import json

    from q35lab.ops import _tuned
    from q35lab.ops import gated_rms_norm as op

    entries = [(gpu, key, fields) for gpu, ops in json.loads(_tuned.TUNED_FILE.read_text()).items()
               for key, fields in ops.get("gated_rms_norm", {}).items()]
    assert entries  # the H200's
    for gpu, key, fields in entries:
        config = dataclasses.replace(op._default_config(int(key)), **fields)
        assert all(getattr(config, name) == value for name, value in fields.items()), (gpu, key)
