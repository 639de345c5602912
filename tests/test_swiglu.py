"""The SwiGLU kernel against transformers' math (numerics rule of DESIGN.md), its layouts, and
when its backward may write the gradients over the saved activations."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from q35lab.numerics import agreement, assert_close_by_rule
from q35lab.ops import _launch, _ownership
from q35lab.ops import swiglu as swiglu_module
from q35lab.ops import swiglu_down as swiglu_down_module
from q35lab.ops.swiglu import (
    LaunchConfig,
    SwiGLUFunction,
    launch_config,
    swiglu,
    swiglu_bwd,
    swiglu_fwd,
    swiglu_packed,
    swiglu_packed_ref,
    swiglu_ref,
)
from q35lab.runtime import INTERPRET, device


def _inputs(shape, dtype, scale=2.0):
    dev = device()
    g = (scale * torch.randn(shape, device=dev)).to(dtype)
    u = torch.randn(shape, device=dev).to(dtype)
    dh = torch.randn(shape, device=dev).to(dtype)
    return g, u, dh


def _check_rule(fn, ref_fn, tensors, dh, names, fresh=False):
    """The rule for the output and every gradient: ``fn`` on copies of ``tensors`` — leaves, or
    with ``fresh`` non-leaf tensors nothing else holds (the backward then writes over them) —
    against ``ref_fn`` in the same dtype and in fp64."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*[leaf * 1 for leaf in leaves]) if fresh else fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dh)
    ref_leaves = [t.detach().clone().requires_grad_() for t in tensors]
    ref = ref_fn(*ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dh)
    leaves64 = [t.detach().double().requires_grad_() for t in tensors]
    ref64 = ref_fn(*leaves64)
    ref64_grads = torch.autograd.grad(ref64, leaves64, dh.double())
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert torch.isfinite(out).all()
    for name, a, b, c in zip(names, (out, *grads), (ref, *ref_grads), (ref64, *ref64_grads)):
        assert a.dtype == b.dtype, name
        assert_close_by_rule(name, a, b, c)
    return out, grads


SHAPES = [(1, 1), (3, 37), (4, 5120), (2, 3, 4100), (7, 1000), (1, 12288)]  # 4x5120: tiles cover it exactly


@pytest.mark.parametrize("inputs", ["fresh", "leaf"])
@pytest.mark.parametrize("rounding", ["hf", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_gradients_match_reference(shape, dtype, rounding, inputs):
    """"fresh": gradients written over the saved activations; "leaf": into new buffers."""
    g, u, dh = _inputs(shape, dtype)
    _check_rule(lambda a, b: swiglu(a, b, rounding=rounding), lambda a, b: swiglu_ref(a, b, rounding),
                (g, u), dh, ("h", "dgate", "dup"), fresh=inputs == "fresh")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy says so
@pytest.mark.parametrize("rounding", ["hf", "fused"])
def test_fp16_and_extreme_gates(rounding):
    g, u, dh = _inputs((5, 130), torch.float16)
    _check_rule(lambda a, b: swiglu(a, b, rounding=rounding), lambda a, b: swiglu_ref(a, b, rounding),
                (g, u), dh, ("h", "dgate", "dup"))
    for dtype in (torch.float32, torch.bfloat16):  # e^-g overflows past |g| = 88: σ = 0, not NaN
        g, u, dh = _inputs((3, 64), dtype, scale=150.0)
        _check_rule(lambda a, b: swiglu(a, b, rounding=rounding), lambda a, b: swiglu_ref(a, b, rounding),
                    (g, u), dh, ("h", "dgate", "dup"))


def test_hf_rounding_is_not_the_fused_one():
    """bf16: "hf" rounds silu(g) before the product, so some outputs differ from "fused"."""
    g, u, _ = _inputs((4, 512), torch.bfloat16)
    hf, fused = swiglu(g, u, rounding="hf"), swiglu(g, u, rounding="fused")
    assert torch.equal(hf, swiglu_ref(g, u, "hf"))
    assert not torch.equal(hf, fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiles_smaller_than_the_row(dtype):
    """An explicit config: 4-row × 16-column tiles over 7 rows of 37 (partial tiles both ways)."""
    g, u, dh = _inputs((7, 37), dtype)
    config = LaunchConfig(block_rows=4, block_cols=16, fwd_warps=4, bwd_warps=4)
    h = swiglu_fwd(g, u, "hf", config=config)
    dg, du = swiglu_bwd(dh, g, u, config=config)
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    ref64 = swiglu_ref(g64, u64)
    ref = swiglu_ref(g.requires_grad_(), u.requires_grad_())
    assert_close_by_rule("h", h, ref, ref64)
    for name, ours, r, r64 in zip(("dgate", "dup"), (dg, du), torch.autograd.grad(ref, [g, u], dh),
                                  torch.autograd.grad(ref64, [g64, u64], dh.double())):
        assert_close_by_rule(name, ours, r, r64)
    only_du = swiglu_bwd(dh, g.detach(), u.detach(), need_dg=False, config=config)
    assert only_du[0] is None and torch.equal(only_du[1], du)


def test_default_launch_configs():
    for width, rows, cols in [(12288, 2, 2048), (17408, 4, 1024), (5120, 4, 1024), (4100, 4, 1024), (1000, 4, 1024),
                              (37, 64, 64), (1, 256, 16)]:
        config = launch_config(width)
        assert (config.block_rows, config.block_cols) == (rows, cols), width
    assert swiglu_module._even(8, 12288, launch_config(12288))
    assert not swiglu_module._even(7, 12288, launch_config(12288))
    for width in (1, 37, 128, 1000, 4100, 12288, 17408):
        c = launch_config(width)
        assert c.block_rows & (c.block_rows - 1) == 0 and c.block_cols & (c.block_cols - 1) == 0
        assert 1024 <= c.block_rows * c.block_cols <= 4096 and 4 <= c.fwd_warps <= 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch_config(64).block_cols = 8
    # Narrow slices of very long rows: a tile's int32 offsets would overflow, so one-row tiles.
    long_rows = torch.empty(2**26 + 64, dtype=torch.uint8).as_strided((2, 37), (2**26, 1))
    assert swiglu_module._fit(None, 37, long_rows).block_rows == 1
    with pytest.raises(ValueError, match="config.block_cols: expected a power of two"):
        swiglu_fwd(*_inputs((2, 8), torch.float32)[:2], config=LaunchConfig(1, 12, 4, 4))


@pytest.mark.parametrize("rounding", ["hf", "fused"])
def test_strided_column_slices_are_read_without_copies(rounding):
    """gate and up as column slices of one [B, T, 2I + pad] buffer (a fused GEMM's output)."""
    width = 300
    buffer = (2 * torch.randn(2, 3, 2 * width + 24, device=device())).to(torch.bfloat16)
    g, u = buffer[..., :width], buffer[..., width + 8: 2 * width + 8]
    assert not g.is_contiguous() and not u.is_contiguous()
    assert not _launch.row_view(g)[1] and not _launch.row_view(u)[1]  # views, no copies
    dh = torch.randn(2, 3, width, device=device()).to(torch.bfloat16)
    _check_rule(lambda a, b: swiglu(a[..., :width], b[..., width + 8: 2 * width + 8], rounding=rounding),
                lambda a, b: swiglu_ref(a[..., :width], b[..., width + 8: 2 * width + 8], rounding),
                (buffer, buffer.clone()), dh, ("h", "dbuffer(gate)", "dbuffer(up)"))
    # Layouts without a row stride (transposed) are copied once, and still right.
    gt, ut = (torch.randn(40, 6, device=device()).t() for _ in range(2))
    torch.testing.assert_close(swiglu(gt, ut, rounding=rounding), swiglu_ref(gt, ut, rounding))


@pytest.mark.parametrize("rounding", ["hf", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_gate_up(dtype, rounding):
    gu, _, _ = _inputs((2, 3, 2 * 37), dtype)
    dh = torch.randn(2, 3, 37, device=device()).to(dtype)
    out, (dgu,) = _check_rule(lambda a: swiglu_packed(a, rounding=rounding),
                              lambda a: swiglu_packed_ref(a, rounding), (gu,), dh, ("h", "dgate_up"), fresh=True)
    assert out.shape == (2, 3, 37) and dgu.shape == gu.shape and dgu.is_contiguous()
    # A strided [.., 2I] slice of a wider buffer.
    wide = torch.randn(5, 2 * 37 + 6, device=device()).to(dtype)
    torch.testing.assert_close(swiglu_packed(wide[:, 3: 3 + 74], rounding=rounding),
                               swiglu_packed_ref(wide[:, 3: 3 + 74], rounding))


# --------------------------------------------------------------------------------------------
# The backward writes over the saved activations only when it is their last reader.
# --------------------------------------------------------------------------------------------
def _projections(x, width):
    """Two fresh non-leaf activations, as the gate and up projections produce them."""
    w_g = torch.randn(x.shape[-1], width, device=x.device, dtype=x.dtype)
    w_u = torch.randn(x.shape[-1], width, device=x.device, dtype=x.dtype)
    return x @ w_g, x @ w_u, w_g, w_u


def _grad_pointer(t, seen, name):
    """Record where ``t`` lives and where its gradient arrives (the hook keeps no reference)."""
    seen[name] = t.data_ptr()
    t.register_hook(lambda grad: seen.__setitem__(name + ".grad", grad.data_ptr()))
    return t


def test_backward_overwrites_fresh_activations_and_gets_the_same_gradients():
    x = torch.randn(5, 8, device=device(), requires_grad=True)
    seen = {}
    g, u, w_g, w_u = _projections(x, 37)
    _grad_pointer(g, seen, "g"), _grad_pointer(u, seen, "u")
    dh = torch.randn(5, 37, device=device())
    h = swiglu(g, u)
    del g, u  # now only the node holds them
    h.backward(dh)
    assert seen["g.grad"] == seen["g"] and seen["u.grad"] == seen["u"]  # no new buffers

    x_ref = x.detach().clone().requires_grad_()
    swiglu_ref(x_ref @ w_g, x_ref @ w_u).backward(dh)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)

    seen.clear()
    gu = _grad_pointer(x @ torch.randn(8, 74, device=device()), seen, "gu")
    h = swiglu_packed(gu)
    del gu
    h.sum().backward()
    assert seen["gu.grad"] == seen["gu"]  # the one [.., 2I] gradient is the saved buffer


def test_backward_leaves_tensors_others_can_read():
    x = torch.randn(4, 8, device=device(), requires_grad=True)
    dh = torch.randn(4, 16, device=device())
    # The caller still holds them.
    g, u, _, _ = _projections(x, 16)
    g_before, u_before = g.detach().clone(), u.detach().clone()
    swiglu(g, u).backward(dh)
    assert torch.equal(g, g_before) and torch.equal(u, u_before)
    # autograd.grad with respect to the activations themselves.
    dg, du = torch.autograd.grad(swiglu(g, u), [g, u], dh)
    assert torch.equal(g, g_before) and torch.equal(u, u_before)
    ref = torch.autograd.grad(swiglu_ref(g, u), [g, u], dh)
    torch.testing.assert_close((dg, du), ref)
    # Leaves are the user's tensors.
    gl, ul = g_before.clone().requires_grad_(), u_before.clone().requires_grad_()
    swiglu(gl, ul).backward(dh)
    assert torch.equal(gl, g_before) and torch.equal(ul, u_before)


def test_backward_leaves_an_activation_that_another_node_saved():
    """relu saves its output: the gate's memory must survive our backward for relu's."""
    x = torch.randn(6, 8, device=device(), requires_grad=True)
    w_g, w_u = torch.randn(8, 24, device=device()), torch.randn(8, 24, device=device())
    x_ref = x.detach().clone().requires_grad_()
    swiglu(torch.relu(x @ w_g), torch.sigmoid(x @ w_u)).sum().backward()
    swiglu_ref(torch.relu(x_ref @ w_g), torch.sigmoid(x_ref @ w_u)).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    # gate and up one tensor: neither may take the other's gradient.
    x.grad, x_ref.grad = None, None
    swiglu(*([x @ w_g] * 2)).sum().backward()
    (lambda t: swiglu_ref(t, t))(x_ref @ w_g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


def _fused_gate_up(x, width, extra=0):
    """gate and up (and an ``extra``-wide third block if asked) as the patched MLP gets them: the
    column blocks of one fused GEMM's output, each a tensor of its own on the one buffer."""
    from q35lab.ops.fused_projections import Projection, fused_lora_projections

    widths = [width, width] + ([extra] if extra else [])
    weights = [torch.randn(n, x.shape[-1], device=x.device, dtype=x.dtype) for n in widths]
    return fused_lora_projections(x, [Projection(w) for w in weights]), weights


@pytest.mark.parametrize("rows, width", [(5, 37), (1, 64), (9, 1)])
def test_the_halves_of_a_fused_gate_up_output_are_written_over_together(rows, width):
    """The patched MLP's case: gate and up side by side in one buffer, nothing else holding it.
    Their gradients land where they were (no new buffers) and are the reference's."""
    x = torch.randn(rows, 8, device=device(), requires_grad=True)
    (gate, up), weights = _fused_gate_up(x, width)
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    seen = {}
    _grad_pointer(gate, seen, "g"), _grad_pointer(up, seen, "u")
    dh = torch.randn(rows, width, device=device())
    h = swiglu(gate, up)
    del gate, up
    h.backward(dh)
    assert seen["g.grad"] == seen["g"] and seen["u.grad"] == seen["u"]
    x_ref = x.detach().clone().requires_grad_()
    swiglu_ref(x_ref @ weights[0].t(), x_ref @ weights[1].t()).backward(dh)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


def test_halves_of_a_buffer_someone_else_reads_are_left_alone():
    x = torch.randn(6, 8, device=device(), requires_grad=True)
    dh = torch.randn(6, 24, device=device())
    # a third block of the same buffer is alive: the memory has a reader besides the pair
    (gate, up, extra), _ = _fused_gate_up(x, 24, extra=5)
    seen, extra_before = {}, extra.detach().clone()
    _grad_pointer(gate, seen, "g")
    h = swiglu(gate, up)
    del gate, up
    h.backward(dh)
    assert seen["g.grad"] != seen["g"] and torch.equal(extra, extra_before)
    # the caller keeps the gate: neither half is written over
    (gate, up), _ = _fused_gate_up(x, 24)
    gate_before = gate.detach().clone()
    h = swiglu(gate, up)
    del up
    h.backward(dh)
    assert torch.equal(gate, gate_before)
    # halves that overlap are not a pair
    buffer = torch.randn(4, 50, device=device())
    assert not _ownership.side_by_side(buffer[:, 0:30], buffer[:, 20:50])
    assert _ownership.side_by_side(buffer[:, 0:25], buffer[:, 25:50])
    assert _ownership.side_by_side(buffer[:, 25:50], buffer[:, 0:25])  # up before gate: still apart
    assert not _ownership.side_by_side(buffer[:, 0:25], buffer[:, 0:25])
    assert not _ownership.side_by_side(buffer[:, 0:20], torch.randn(4, 20, device=device()))
    assert _ownership.side_by_side(buffer[:1, 0:25], buffer[:1, 25:50])  # one row
    assert not _ownership.side_by_side(buffer.view(-1)[3:28].view(1, 25), buffer.view(-1)[20:45].view(1, 25))


def test_retain_graph_twice_through_fused_halves_gives_twice_the_gradients():
    x = torch.randn(3, 8, device=device(), requires_grad=True)
    (gate, up), _ = _fused_gate_up(x, 40)
    h = swiglu(gate, up)
    del gate, up
    loss = (h * torch.randn(3, 40, device=device())).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_retain_graph_twice_gives_twice_the_gradients(packed):
    x = torch.randn(3, 8, device=device(), requires_grad=True)
    weight = torch.randn(8, 2 * 40, device=device())
    gu = x @ weight
    h = swiglu_packed(gu) if packed else swiglu(gu[:, :40] * 1.0, gu[:, 40:] * 1.0)  # fresh, non-leaf
    del gu
    loss = (h * torch.randn(3, 40, device=device())).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward(retain_graph=True)
    torch.testing.assert_close(x.grad, 2 * first)
    loss.backward()
    torch.testing.assert_close(x.grad, 3 * first)


def test_create_graph_keeps_the_activations():
    x = torch.randn(3, 8, device=device(), requires_grad=True)
    g, u, _, _ = _projections(x, 12)
    h = swiglu(g * 1.0, u * 1.0)
    (dx,) = torch.autograd.grad(h.sum(), [x], create_graph=True)
    (dx_again,) = torch.autograd.grad(h.sum(), [x])
    torch.testing.assert_close(dx, dx_again)


def test_gradient_checkpointing_and_the_never_mode():
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(4, 8, device=device(), requires_grad=True)
    w_g, w_u = torch.randn(8, 20, device=device()), torch.randn(8, 20, device=device())
    x_ref = x.detach().clone().requires_grad_()
    for reentrant in (False, True):
        x.grad, x_ref.grad = None, None
        checkpoint(lambda t: swiglu(t @ w_g, t @ w_u), x, use_reentrant=reentrant).sum().backward()
        swiglu_ref(x_ref @ w_g, x_ref @ w_u).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    seen = {}
    g, u, _, _ = _projections(x, 20)
    _grad_pointer(g, seen, "g")
    h = swiglu(g, u, inplace_backward=False)
    del g, u
    h.sum().backward()
    assert seen["g.grad"] != seen["g"]


def test_in_place_edit_of_the_output():
    g, u, dh = _inputs((3, 50), torch.float32)
    g.requires_grad_(), u.requires_grad_()
    h = swiglu(g, u)
    h.mul_(3.0)
    h.backward(dh)
    ref_g, ref_u = torch.autograd.grad(swiglu_ref(g, u) * 3.0, [g, u], dh)
    torch.testing.assert_close((g.grad, u.grad), (ref_g, ref_u), rtol=1e-5, atol=1e-5)
    hp = swiglu_packed(torch.cat([g, u], -1).detach())
    hp.add_(1.0)  # no grad needed: still a plain tensor
    assert hp._base is None


def test_torch_compile_around_it():
    compiled = torch.compile(lambda x, w: swiglu(x @ w[:, :24], torch.tanh(x @ w[:, 24:])) * 2, backend="aot_eager")
    x = torch.randn(5, 8, device=device(), requires_grad=True)
    w = torch.randn(8, 48, device=device(), requires_grad=True)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = compiled(x, w)
    ref = swiglu_ref(x_ref @ w_ref[:, :24], torch.tanh(x_ref @ w_ref[:, 24:])) * 2
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close((x.grad, w.grad), (x_ref.grad, w_ref.grad), rtol=1e-5, atol=1e-5)


def test_empty_inputs():
    for shape in [(0, 16), (4, 0)]:
        g = torch.randn(shape, device=device(), requires_grad=True)
        u = torch.randn(shape, device=device(), requires_grad=True)
        h = swiglu(g, u)
        assert h.shape == shape
        dg, du = torch.autograd.grad(h, [g, u], torch.ones_like(h))
        assert dg.shape == shape and du.shape == shape
    gu = torch.randn(0, 8, device=device(), requires_grad=True)
    (dgu,) = torch.autograd.grad(swiglu_packed(gu).sum(), [gu])
    assert dgu.shape == (0, 8)


def test_bf16_agrees_with_transformers_mlp():
    """rounding="hf" against Qwen3_5MLP's own line, act_fn(gate_proj(x)) * up_proj(x)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP

    mlp = Qwen3_5MLP(Qwen3_5TextConfig(hidden_size=64, intermediate_size=160), 160)
    mlp = mlp.to(device=device(), dtype=torch.bfloat16)
    x = torch.randn(33, 64, device=device(), dtype=torch.bfloat16)
    with torch.no_grad():
        g, u = mlp.gate_proj(x), mlp.up_proj(x)
        ours, hf = swiglu(g, u, rounding="hf"), mlp.act_fn(g) * u
        stats = agreement(ours, hf)
        if INTERPRET:  # the interpreter's exp is numpy's; on a GPU Triton's may round otherwise
            assert stats["frac_differ"] == 0.0, stats
            assert torch.equal(mlp.down_proj(ours), mlp(x))
        assert stats["frac_differ"] <= 1e-3 and stats["max_ulp"] <= 1, stats
        fused = agreement(swiglu(g, u, rounding="fused"), hf)  # ~26 % differ: hf rounds twice
        assert 0.0 < fused["frac_differ"] < 0.5 and fused["max_ulp"] <= 1, fused
    # Gradients: ours round once, transformers' autograd rounds dh·u before silu's backward,
    # so ~1/4 of them differ, by one ulp.
    dh = torch.randn_like(g)
    g, u = g.requires_grad_(), u.requires_grad_()
    ours_grads = torch.autograd.grad(swiglu(g, u, rounding="hf"), [g, u], dh)
    hf_grads = torch.autograd.grad(mlp.act_fn(g) * u, [g, u], dh)
    for ours_grad, hf_grad in zip(ours_grads, hf_grads):
        assert agreement(ours_grad, hf_grad)["max_ulp"] <= 1


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 9)), ValueError, r"up: expected the shape of gate \(4, 8\)"),
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 8).double()), TypeError, "gate: expected dtype|up: expected"),
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 8).half()), TypeError, r"up: expected the dtype of gate"),
        (lambda: swiglu(torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)), TypeError,
         "gate: expected dtype"),
        (lambda: swiglu(torch.randn(4, 8), [1.0] * 8), TypeError, "up: expected a torch.Tensor"),
        (lambda: swiglu(torch.tensor(1.0), torch.tensor(1.0)), ValueError, "gate: expected at least one dimension"),
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 8), rounding="bf16"), ValueError,
         r"rounding: expected one of \('hf', 'fused'\), got 'bf16'"),
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 8), inplace_backward="yes"), TypeError,
         "inplace_backward: expected a bool"),
        (lambda: swiglu_packed(torch.randn(4, 7)), ValueError, "gate_up: expected an even last dimension"),
        (lambda: swiglu_packed(torch.randn(4, 8).double()), TypeError, "gate_up: expected dtype"),
        (lambda: swiglu_packed(torch.randn(4, 8), rounding=None), ValueError, "rounding: expected one of"),
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 8, device="meta")), ValueError, "one device"),
    ],
)
def test_bad_input_raises_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_public_names():
    import q35lab

    assert SwiGLUFunction.__name__ == "SwiGLUFunction"
    if hasattr(q35lab, "swiglu"):  # re-exported once the package lists it
        assert q35lab.swiglu is swiglu


def test_bench_spec_runs_on_a_cpu():
    from q35lab import bench
    from q35lab.bench import swiglu as swiglu_bench

    spec = bench.discover()["swiglu"]
    assert spec.ours in spec.impls and {"transformers", "torch.compile", "liger"} <= set(spec.impls)
    per_tensor = 1024 * 12288 * 2
    assert [spec.bytes_model(1024, p) for p in ("fwd", "bwd", "fwd+bwd")] == [3 * per_tensor, 5 * per_tensor,
                                                                             8 * per_tensor]
    data = swiglu_bench.make_inputs(2, device(), width=40)
    for impl, (make, needs) in spec.impls.items():
        if bench._missing(needs) or impl == "torch.compile" or impl.startswith("liger"):
            continue  # Inductor needs a C++ toolchain on a CPU; Liger's kernels want a GPU
        for pass_ in spec.passes:
            fresh = {k: v.clone() for k, v in data.items()}  # forced in-place backwards overwrite
            result = bench._pass_calls(make, [fresh], pass_)[0]()
            if pass_ == "fwd":
                assert result.shape[-2:] == (2, 40), impl


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_the_patched_mlp_writes_its_swiglu_gradients_over_the_fused_gate_up_output(monkeypatch, checkpointing):
    """At 9B and 32k tokens that is 1.5 GiB a layer not allocated in the MLP's backward."""
    import q35lab
    from q35lab import e2e

    decisions = []
    may_overwrite = _ownership.may_overwrite

    def recorded(*args, **kwargs):
        decisions.append((may_overwrite(*args, **kwargs), kwargs.get("sibling") is not None))
        return decisions[-1][0]

    monkeypatch.setattr(_ownership, "may_overwrite", recorded)
    model = e2e.build("tiny", layers=4, rank=4, device=device(), dtype=torch.float32, checkpointing=checkpointing)
    report = q35lab.apply_to_qwen3_5(model)
    assert report.replaced["Qwen3_5MLP gate/up (2 projections, 1 node)"] == 4
    ids = torch.randint(0, 100, (1, 11), device=device())
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert decisions == [(True, True)] * 8  # gate and up of each of the 4 MLPs, as a pair


# --------------------------------------------------------------------------------------------
# swiglu_down: the SwiGLU and the down projection, two nodes that keep no h and no down GEMM to recompute.
# --------------------------------------------------------------------------------------------
def _down_case(rows, width, out, rank, dtype, adapter, bias):
    x = torch.randn(rows, 8, device=device(), dtype=dtype, requires_grad=True)
    w_g, w_u = torch.randn(8, width, device=device(), dtype=dtype), torch.randn(8, width, device=device(), dtype=dtype)
    weight = torch.randn(out, width, device=device(), dtype=dtype) / width**0.5
    lora_A = torch.randn(rank, width, device=device(), requires_grad=True) if adapter else None  # fp32 masters
    lora_B = torch.randn(out, rank, device=device(), requires_grad=True) if adapter else None
    b = torch.randn(out, device=device(), dtype=dtype, requires_grad=True) if bias else None
    return x, w_g, w_u, weight, lora_A, lora_B, b


@pytest.mark.parametrize("rows, width, out, rank", [(5, 37, 11, 3), (1, 64, 8, 4), (7, 1, 5, 2), (33, 300, 17, 16),
                                                    (3, 8, 0, 2), (0, 8, 5, 2), (3, 0, 5, 2), (4, 6, 5, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("adapter, bias", [(True, False), (False, False), (True, True)],
                         ids=["lora", "base", "lora-bias"])
def test_swiglu_down_gives_the_bits_of_lora_linear_after_swiglu(rows, width, out, rank, dtype, adapter, bias):
    """The same kernels and GEMMs in the same order, h rebuilt by the forward's own formula: the
    output and every gradient are the unfused path's, bit for bit on the CPU (and so the
    reference's by the numerics rule wherever the unfused path is, tests/test_lora.py)."""
    from q35lab.ops.lora import lora_linear
    from q35lab.ops.swiglu_down import swiglu_down

    x, w_g, w_u, weight, lora_A, lora_B, b = _down_case(rows, width, out, rank, dtype, adapter, bias)
    dy = torch.randn(rows, out, device=device(), dtype=dtype)
    leaves = [t for t in (x, lora_A, lora_B, b) if t is not None]

    def run(fused):
        g, u = x @ w_g, x @ w_u
        if fused:
            y = swiglu_down(g, u, weight, lora_A, lora_B, 0.5, b)
        elif adapter:
            y = lora_linear(swiglu(g, u), weight, lora_A, lora_B, 0.5, b)
        else:
            y = torch.nn.functional.linear(swiglu(g, u), weight, b)
        return (y, *torch.autograd.grad(y, leaves, dy))

    for ours, theirs in zip(run(True), run(False)):
        assert ours.dtype == theirs.dtype
        if device().type == "cpu":  # the interpreter evaluates both kernels' formulas alike: the same bits
            assert torch.equal(ours, theirs)
        else:  # two compiled variants of the backward kernel may contract the gradient's products differently
            torch.testing.assert_close(ours, theirs)


def test_swiglu_down_keeps_no_h_for_the_backward():
    from q35lab.ops.swiglu_down import swiglu_down

    x, w_g, w_u, weight, lora_A, lora_B, _ = _down_case(6, 40, 9, 4, torch.float32, True, False)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        g, u = x @ w_g, x @ w_u
        saved.clear()  # what the node itself saves
        y = swiglu_down(g, u, weight, lora_A, lora_B, 2.0)
    assert saved.count((6, 40)) == 2 and (6, 4) in saved  # g and u, the adapter's [T, r]; no h
    y.sum().backward(retain_graph=True)  # a retained graph may be run again
    first = [t.grad.clone() for t in (x, lora_A, lora_B)]
    y.sum().backward()
    for t, once in zip((x, lora_A, lora_B), first):
        torch.testing.assert_close(t.grad, 2 * once)


class _ForwardGemmsOf(TorchDispatchMode):
    """Counts the matrix products ``x·Wᵀ`` of a weight: those whose right operand is ``W``
    transposed (the backward's ``dy·W`` reads it as it is)."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.count = weight, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            right = args[-1]
            self.count += right.data_ptr() == self.weight.data_ptr() and right.stride() == self.weight.t().stride()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "whole-recompute"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("adapter, bias", [(True, False), (False, False), (False, True), (True, True)],
                         ids=["lora", "base", "base-bias", "lora-bias"])
def test_checkpointing_recomputes_no_frozen_down_projection(early_stop, trainable, adapter, bias):
    """Non-reentrant checkpointing stops its recompute once the last saved tensor is made again.
    The down projection's node saves nothing when its weight is frozen, so the recompute stops
    before its GEMM: one forward GEMM a step, not two (with early stop off: two). A trainable
    weight saves h for dW, and its GEMM is recomputed; its gradients are the unfused path's."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    from q35lab.ops.swiglu_down import swiglu_down

    x, w_g, w_u, weight, lora_A, lora_B, b = _down_case(6, 40, 9, 4, torch.float32, adapter, bias)
    weight.requires_grad_(trainable)
    block = lambda x: swiglu_down(x @ w_g, x @ w_u, weight, lora_A, lora_B, 2.0, b)  # noqa: E731
    counter = _ForwardGemmsOf(weight)
    with counter, set_checkpoint_early_stop(early_stop):
        y = checkpoint(block, x, use_reentrant=False)
        y.square().sum().backward()
    assert counter.count == (1 if early_stop and not trainable else 2)
    leaves = [t for t in (x, lora_A, lora_B, weight, b) if t is not None and t.requires_grad]
    grads = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    from q35lab.ops.lora import lora_linear

    h = swiglu(x @ w_g, x @ w_u)
    unfused = lora_linear(h, weight, lora_A, lora_B, 2.0, b) if adapter else torch.nn.functional.linear(h, weight, b)
    unfused.square().sum().backward()
    for ours, theirs in zip(grads, [t.grad for t in leaves]):
        torch.testing.assert_close(ours, theirs)


def test_a_gradient_for_the_down_weight_alone_runs_no_swiglu_backward():
    """The first node gets W detached, so a gradient asked for W alone does not run its backward:
    no h gradient ([T, I]), no SwiGLU backward; the gradient is the unfused path's."""
    from q35lab.ops.lora import lora_linear
    from q35lab.ops.swiglu_down import swiglu_down

    x, w_g, w_u, weight, lora_A, lora_B, _ = _down_case(6, 40, 9, 4, torch.float32, True, False)
    weight.requires_grad_(True)
    calls = []
    original = swiglu_down_module.swiglu_bwd
    try:
        swiglu_down_module.swiglu_bwd = lambda *a, **k: calls.append(1) or original(*a, **k)
        y = swiglu_down(x @ w_g, x @ w_u, weight, lora_A, lora_B, 2.0)
        ours = torch.autograd.grad(y.square().sum(), [weight])
    finally:
        swiglu_down_module.swiglu_bwd = original
    assert not calls
    theirs = torch.autograd.grad(lora_linear(swiglu(x @ w_g, x @ w_u), weight, lora_A, lora_B, 2.0).square().sum(),
                                 [weight])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_an_in_place_edit_of_the_down_weight_before_the_backward_raises():
    """W is saved (detached, sharing its version counter): editing it in place between the forward
    and the backward is caught, as for any autograd op, rather than read silently."""
    from q35lab.ops.swiglu_down import swiglu_down

    x, w_g, w_u, weight, lora_A, lora_B, _ = _down_case(6, 40, 9, 4, torch.float32, True, False)
    y = swiglu_down(x @ w_g, x @ w_u, weight, lora_A, lora_B, 2.0)
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_the_down_projections_input_gradient_is_made_after_the_recompute():
    """Under checkpointing, ``dh = dy·W`` ([T, I]) is made by the first node after it unpacks its
    saved tensors, i.e. after the layer's recompute, so it is never alive beside the recompute's
    ``h`` ([T, I] too): the order of the GEMMs that read the gate weight and the down weight (a
    second node that made dh in its own backward, before the recompute, would put it second)."""
    from torch.utils.checkpoint import checkpoint

    from q35lab.ops.swiglu_down import swiglu_down

    x, w_g, w_u, weight, lora_A, lora_B, _ = _down_case(6, 40, 9, 4, torch.float32, True, False)
    order = []

    class Order(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                right = args[-1]
                if right.data_ptr() == w_g.data_ptr():
                    order.append("gate")
                elif right.data_ptr() == weight.data_ptr() and right.stride() == weight.stride():
                    order.append("dh")  # dy·W: the down projection's input gradient
            return func(*args, **(kwargs or {}))

    with Order():
        y = checkpoint(lambda x: swiglu_down(x @ w_g, x @ w_u, weight, lora_A, lora_B, 2.0), x, use_reentrant=False)
        y.square().sum().backward()
    assert order == ["gate", "gate", "dh", "gate"]  # forward, recompute, dh, then the gate GEMM's own dx


def test_swiglu_down_errors_name_the_argument():
    from q35lab.ops.swiglu_down import swiglu_down

    g = u = torch.randn(3, 10, device=device())
    w = torch.randn(4, 10, device=device())
    for call, match in (
            (lambda: swiglu_down(g, u, torch.randn(4, 9, device=device())), "weight: expected"),
            (lambda: swiglu_down(g, u, w, torch.randn(2, 10, device=device())), "lora_A, lora_B: expected both"),
            (lambda: swiglu_down(g, u, w, torch.randn(2, 9, device=device()), torch.randn(4, 2, device=device())),
             "lora_A: expected"),
            (lambda: swiglu_down(g, u, w, torch.randn(2, 10, device=device()), torch.randn(4, 3, device=device())),
             "lora_B: expected"),
            (lambda: swiglu_down(g, u, w, bias=torch.randn(5, device=device())), "bias: expected"),
            (lambda: swiglu_down(g, u, w, scaling="two"), "scaling"),
            (lambda: swiglu_down(g, u[:, :9], w), "up")):
        with pytest.raises((TypeError, ValueError), match=match):
            call()


@pytest.mark.parametrize("op", ["swiglu", "swiglu_never", "swiglu_down"])
def test_broadcast_rows_of_one_buffer_are_not_a_pair(op):
    """gate and up expanded from one [1, 2I] row (row stride 0): not two blocks side by side, and
    their gradients are the reference's (summed over the broadcast rows)."""
    from q35lab.ops.swiglu_down import swiglu_down

    base = torch.randn(1, 20, device=device(), requires_grad=True)
    weight = torch.randn(3, 10, device=device())

    def run(fn, b):
        gu = b * 1.0
        gate, up = gu[:, :10].expand(4, 10), gu[:, 10:].expand(4, 10)
        return fn(gate, up)

    ops = {"swiglu": lambda g, u: swiglu(g, u), "swiglu_never": lambda g, u: swiglu(g, u, inplace_backward=False),
           "swiglu_down": lambda g, u: swiglu_down(g, u, weight)}
    refs = {"swiglu": swiglu_ref, "swiglu_never": swiglu_ref, "swiglu_down": lambda g, u: swiglu_ref(g, u) @ weight.t()}
    run(ops[op], base).sum().backward()
    ref_base = base.detach().clone().requires_grad_()
    run(refs[op], ref_base).sum().backward()
    torch.testing.assert_close(base.grad, ref_base.grad, rtol=1e-5, atol=1e-6)
