"""Long-context pieces (q35lab.long_context): the sequence-tiled MLP and GatedDeltaNet, offloaded
checkpoint inputs, and the memory-per-token model — on tiny Qwen3.5 models with PEFT LoRA, on the CPU."""

import contextlib
import copy
import functools
import inspect
import io
import math
import pickle
import sys

import peft
import pytest
import torch
from conftest import MODEL_COMPILER, patch_everywhere
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import q35lab
from q35lab import long_context as lc
from q35lab.hf import gated_delta_net as hf_gdn
from q35lab.hf import modules as hf_modules
from q35lab.long_context import gated_delta_net as lc_gated_delta_net
from q35lab.long_context import memory as lc_memory
from q35lab.long_context import offload as lc_offload
from q35lab.long_context import tiles as lc_tiles
from q35lab.numerics import assert_close_by_rule
from q35lab.ops.causal_conv1d import causal_conv1d
from q35lab.ops.swiglu_down import is_unread, swiglu_down, unread_down_outputs
from q35lab.runtime import device
from tiny_models import TEXT, assert_same_loss_and_grads, causal_lm, lora_causal_lm

MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]


def _model(dropout=0.0, rank=4, checkpointing=True, targets=MLP_TARGETS, seed=0):
    """The tiny Qwen3.5 (2 layers: a GatedDeltaNet and an attention layer) with LoRA on the MLPs,
    B random (LoRA starts at B = 0, which would hide a wrong adapter gradient)."""
    model = lora_causal_lm(seed, rank, targets, dropout)
    if checkpointing:
        lc.enable_checkpointing(model)
    model.train()
    return model


def _mlps(model):
    return [m for m in model.modules() if type(m).__name__ == "Qwen3_5MLP"]


def _step(model, ids, autocast=False, backward=True):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device().type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    if backward:
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, rtol=1e-5, atol=1e-6):
    assert_same_loss_and_grads(a, b, rtol=rtol, atol=atol)


def _count_mlp_calls(model):
    """Record the tokens of every call of each tiled MLP's wrapped forward (one entry a tile)."""
    calls = []
    for mlp in _mlps(model):
        forward = vars(mlp)["forward"]
        inner = forward.untiled

        def counted(x, *args, _inner=inner, **kwargs):
            calls.append(x.shape[-2])
            return _inner(x, *args, **kwargs)

        forward.untiled = counted
    return calls


class _LoopTiles:
    """The reference tiling: the same tiles, in the same order, as ordinary autograd (each tile's
    graph kept). Its forward draws the same dropout masks as tiled_mlp's forward."""

    def __init__(self, module, tile):
        self.module, self.tile = module, tile

    def __call__(self, x):
        f = type(self.module).forward
        return torch.cat([f(self.module, x[..., s:s + self.tile, :]) for s in range(0, x.shape[-2], self.tile)], -2)


# ----------------------------------------------------------------------------------------------
# tiled_mlp
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tile", [1, 4, 16, 17, 40])
def test_tiled_mlp_gives_the_output_and_every_gradient_of_the_mlp(tile):
    mlp = _mlps(_model(checkpointing=False))[0]
    mlp64 = copy.deepcopy(mlp).double()
    x = torch.randn(2, 17, TEXT["hidden_size"], device=device())
    w = torch.randn(2, 17, TEXT["hidden_size"], device=device())

    def run(module, tiled, dtype=torch.float32):
        calls = []
        params = [p for p in module.parameters() if p.requires_grad]
        assert len(params) == 6  # the LoRA A and B of gate, up and down; the bases are frozen
        xs = x.to(dtype).requires_grad_()

        def forward(t):
            calls.append(t.shape[-2])
            return module(t)

        y = lc.tiled_mlp(forward, xs, tile, params=params) if tiled else module(xs)
        grads = torch.autograd.grad((y * w.to(dtype)).sum(), [xs, *params])
        return [y.detach(), *grads], calls

    ref, _ = run(mlp, False)
    ref64, _ = run(mlp64, False, torch.float64)
    out, calls = run(mlp, True)
    # tiles change the GEMMs' row counts (on a GPU: other kernels, other summation orders), so the
    # tiled MLP is held to the numerics rule against the fp64 MLP, not to the untiled one's bits
    for name, a, b, b64 in zip(["y", "dx", *map(str, range(6))], out, ref, ref64):
        assert_close_by_rule(name, a, b, b64)
    tiles = math.ceil(17 / tile)
    # a tile ≥ T is the MLP as it is (one call, no recompute); else each tile forward, then again in backward
    assert calls == ([17] if tile >= 17 else [min(tile, 17 - s) for s in range(0, 17, tile)] * 2)
    assert tile >= 17 or len(calls) == 2 * tiles


def test_model_under_checkpointing_and_bf16_autocast_patched_by_q35lab_computes_each_tile_twice_not_three_times():
    ids = torch.randint(0, 128, (1, 11), device=device())
    reference = _model()
    ref64 = _step(_on_pytorch_core(copy.deepcopy(reference).double()), ids)
    q35lab.apply_to_qwen3_5(reference)
    expected = _step(reference, ids, autocast=True)
    model = _model()
    q35lab.apply_to_qwen3_5(model)
    assert lc.tile_mlps(model, 4) == 2
    assert all(type(vars(m)["forward"].inner).__name__ == "_MLPForward" for m in _mlps(model))  # wraps q35lab's
    calls = _count_mlp_calls(model)
    got = _step(model, ids, autocast=True)
    # 2 MLPs × 3 tiles × (forward, backward): the layer's recompute stopped before the tiles
    assert calls == [4, 4, 3] * 4
    # bf16 on both sides; tiles change the GEMMs' row counts (on a GPU: other kernels), so the rule against fp64
    # (and, on the CPU, bf16-sized differences from the untiled step)
    _assert_tiled_step(got, expected, ref64, _fla_runs(model), rtol=2e-2, atol=2e-3)


def test_a_patched_tiled_mlp_recomputes_each_tile_without_its_down_gemm_and_keeps_every_gradient(monkeypatch):
    """The tile's recompute roots the backward on the down projection's output, which it leaves
    uncomputed (swiglu_down's frozen GEMM): every tile skips it, and the gradients are the untiled ones."""
    ids = torch.randint(0, 128, (1, 11), device=device())
    reference = _model()
    q35lab.apply_to_qwen3_5(reference)
    expected = _step(reference, ids)
    model = _model()
    q35lab.apply_to_qwen3_5(model)
    assert lc.tile_mlps(model, 4) == 2
    verdicts = []
    real = is_unread
    patch_everywhere(monkeypatch, "is_unread", lambda y, skipped: verdicts.append((len(skipped), real(y, skipped))) or
                        verdicts[-1][1])
    got = _step(model, ids)
    assert verdicts == [(1, True)] * 6  # 2 MLPs × 3 tiles, each one skipped GEMM, none recomputed in full
    _assert_same(got, expected, rtol=1e-4, atol=1e-5)  # fp32: tiles change only the GEMMs' row counts


@pytest.mark.parametrize("reads", ["scaled", "in_place", "slice", "chained"])
def test_a_tile_whose_output_is_not_the_unread_down_projection_is_recomputed_in_full(reads):
    """An mlp_forward that reads, scales in place or slices swiglu_down's output: the skipped
    (uncomputed) values must not reach a gradient, so that tile runs again with the GEMM."""
    torch.manual_seed(1)
    H, I, r = 24, 40, 4
    wg, wu, wd = (torch.randn(I, H, device=device()) / H**0.5, torch.randn(I, H, device=device()) / H**0.5,
                  torch.randn(H + 3, I, device=device()) / I**0.5)
    lora_A = (torch.randn(r, I, device=device()) / I**0.5).requires_grad_()
    lora_B = (torch.randn(H + 3, r, device=device()) * 0.2).requires_grad_()
    scale = torch.randn(H + 3, device=device()).requires_grad_()
    x = torch.randn(2, 9, H, device=device(), requires_grad=True)

    def mlp(t):
        y = swiglu_down(t @ wg.t(), t @ wu.t(), wd, lora_A, lora_B, 0.5)
        if reads == "chained":  # a second MLP on the first's output: its own output unmodified, its input read
            z = y[..., :H] * scale[:H]
            return swiglu_down(z @ wg.t(), z @ wu.t(), wd, lora_A, lora_B, 0.5)
        if reads == "scaled":
            return y * scale  # d(scale) reads y's values
        if reads == "in_place":
            return y.mul_(scale)  # the same, in place: y's version moves
        return y[..., :H] + scale[:H]  # a part of y

    def grads(tiled):
        out = lc.tiled_mlp(mlp, x, 4, params=(lora_A, lora_B, scale)) if tiled else mlp(x)
        w = torch.randn_like(out, generator=torch.Generator(device()).manual_seed(2))
        return [out.detach(), *torch.autograd.grad((out * w).sum(), [x, lora_A, lora_B, scale])]

    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_is_unread_accepts_the_skipped_output_or_a_whole_view_of_it_and_nothing_written_or_partial():
    gate, up = torch.randn(6, 8, device=device()), torch.randn(6, 8, device=device())
    weight = torch.randn(5, 8, device=device())
    with unread_down_outputs() as skipped:
        y = swiglu_down(gate.requires_grad_(), up, weight)
    assert len(skipped) == 1 and is_unread(y, skipped) and is_unread(y.view(30), skipped)
    assert not is_unread(y[:3], skipped) and not is_unread(y * 1, skipped)
    y.add_(1)
    assert not is_unread(y, skipped)
    z = swiglu_down(gate, up, weight)  # outside the context: computed
    torch.testing.assert_close(z, (torch.nn.functional.silu(gate) * up) @ weight.t())


@pytest.mark.parametrize("forward_autocast", [True, False])
def test_the_recompute_runs_under_the_autocast_state_of_the_forward(forward_autocast):
    mlp = _mlps(_model(checkpointing=False))[0]
    x = torch.randn(1, 7, TEXT["hidden_size"], device=device(), requires_grad=True)
    seen = []

    def forward(t):
        seen.append(torch.is_autocast_enabled(device().type))
        return mlp(t)

    with torch.autocast(device().type, dtype=torch.bfloat16, enabled=forward_autocast):
        y = lc.tiled_mlp(forward, x, 3, params=[p for p in mlp.parameters() if p.requires_grad])
    assert y.dtype == (torch.bfloat16 if forward_autocast else torch.float32)
    with torch.autocast(device().type, dtype=torch.bfloat16, enabled=not forward_autocast):  # the opposite state
        y.float().sum().backward()
    assert seen == [forward_autocast] * 6 and x.grad.dtype == torch.float32


def test_without_checkpoint_early_stop_the_recompute_runs_the_tiles_once_more_and_is_still_exact():
    ids = torch.randint(0, 128, (1, 13), device=device())
    expected = _step(_model(), ids)
    model = _model()
    lc.tile_mlps(model, 5)
    calls = _count_mlp_calls(model)
    assert _step(model, ids) and calls == [5, 5, 3] * 4  # early stop (the default): 2 passes
    calls.clear()
    with set_checkpoint_early_stop(False):
        got = _step(model, ids)
    assert calls == [5, 5, 3] * 6  # forward, the layer's full recompute, backward
    _assert_same(got, expected)


def test_lora_dropout_masks_of_each_tile_are_replayed_in_backward_and_the_rng_is_left_alone():
    ids = torch.randint(0, 128, (1, 13), device=device())

    def run(kind):
        model = _model(dropout=0.4)
        for mlp in _mlps(model):
            if kind == "tiled":
                lc.tile_mlp(mlp, 4)
            else:
                mlp.forward = _LoopTiles(mlp, 4)
        torch.manual_seed(123)
        result = _step(model, ids)
        return result, torch.get_rng_state()

    (reference, rng_reference), (tiled, rng_tiled) = run("loop"), run("tiled")
    _assert_same(tiled, reference)
    assert torch.equal(rng_tiled, rng_reference)  # the backward's replays forked the RNG
    torch.manual_seed(123)
    other_masks = _step(_model(dropout=0.4), ids)[0]
    assert not torch.isclose(other_masks, reference[0])  # the masks matter: another draw changes the loss


def test_patched_mlp_with_dropout_replays_its_seeds_per_tile():
    model = _model(dropout=0.3, checkpointing=False)
    q35lab.apply_to_qwen3_5(model)
    mlp = _mlps(model)[0]
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(1, 9, TEXT["hidden_size"], device=device(), requires_grad=True)
    inner = vars(mlp)["forward"]

    def run(tiled):
        torch.manual_seed(7)
        if tiled:
            y = lc.tiled_mlp(inner, x, 4, params=params)
        else:
            y = torch.cat([inner(x[:, s:s + 4]) for s in range(0, 9, 4)], 1)
        return torch.autograd.grad(y.square().sum(), [x, *params])

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_retain_graph_twice_through_a_checkpointed_tiled_mlp_doubles_every_gradient():
    mlp = _mlps(_model(checkpointing=False))[0]
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(1, 10, TEXT["hidden_size"], device=device(), requires_grad=True)

    def block(t, tiled):
        h = torch.nn.functional.rms_norm(t, (t.shape[-1],))
        return t + (lc.tiled_mlp(mlp, h, 3) if tiled else mlp(h))

    def grads(tiled, times):
        for p in [x, *params]:
            p.grad = None
        loss = checkpoint(block, x, tiled, use_reentrant=False).square().sum()
        for _ in range(times):
            loss.backward(retain_graph=True)
        return [p.grad.clone() for p in [x, *params]]

    once, twice, untiled = grads(True, 1), grads(True, 2), grads(False, 1)
    for a, b, c in zip(once, twice, untiled):
        torch.testing.assert_close(b, 2 * a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_a_second_derivative_through_the_tiled_mlp_raises_first_derivatives_stay_right():
    mlp = _mlps(_model(checkpointing=False))[0]
    x = torch.randn(1, 7, TEXT["hidden_size"], device=device(), requires_grad=True)
    (dx,) = torch.autograd.grad(lc.tiled_mlp(mlp, x, 3).sum(), x, create_graph=True)
    (dx_ref,) = torch.autograd.grad(mlp(x).sum(), x)
    torch.testing.assert_close(dx.detach(), dx_ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="TiledMLPFunction has no second derivative"):
        dx.sum().backward()


def test_frozen_or_trainable_parameters_and_an_input_without_grad():
    torch.manual_seed(0)
    full = causal_lm().model.layers[0].mlp  # no LoRA: the base weights are trained (full fine-tuning)
    x = torch.randn(1, 9, TEXT["hidden_size"], device=device())
    for x_grad, train in ((True, True), (True, False), (False, True)):
        for p in full.parameters():
            p.requires_grad_(train)
        x.requires_grad_(x_grad)
        wanted = ([x] if x_grad else []) + ([p for p in full.parameters()] if train else [])
        ref = torch.autograd.grad(full(x).square().sum(), wanted)
        got = torch.autograd.grad(lc.tiled_mlp(full, x, 4).square().sum(), wanted)  # params found on the module
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # no graph: tile by tile, the same output
        torch.testing.assert_close(lc.tiled_mlp(full, x, 4), full(x))


def test_wrong_arguments_are_errors_that_name_them():
    mlp = _mlps(_model(checkpointing=False))[0]
    x = torch.randn(1, 5, TEXT["hidden_size"], requires_grad=True)
    for tile, error in ((0, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(error, match="tile_tokens"):
            lc.tiled_mlp(mlp, x, tile)
    with pytest.raises(ValueError, match="mlp_forward: expected a tensor of shape"):
        lc.tiled_mlp(lambda t: t.sum(-2), x, 2, params=())
    with pytest.raises(TypeError, match="params"):
        lc.tiled_mlp(lambda t: mlp(t), x, 2)


def test_a_tiled_model_deep_copies_pickles_and_untiles_to_the_forward_it_wrapped():
    ids = torch.randint(0, 128, (1, 9), device=device())
    model = _model(checkpointing=False)  # transformers' checkpointing adds an input hook pickle cannot store
    q35lab.apply_to_qwen3_5(model, flce=False, conv=False, in_proj=False, rms_norm=False, gated_norm=False)
    before = _step(model, ids)
    lc.tile_mlps(model, 4)
    twin = copy.deepcopy(model)
    for mlp in _mlps(twin):
        forward = vars(mlp)["forward"]
        assert isinstance(forward, lc.TiledMLPForward) and forward.module is mlp and forward.inner.module is mlp
    _assert_same(_step(twin, ids), before)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_same(_step(loaded, ids), before)
    assert pickle.loads(pickle.dumps(vars(_mlps(model)[0])["forward"])).tile_tokens == 4
    assert lc.untile_mlps(model) == 2
    assert all(type(vars(m)["forward"]).__name__ == "_MLPForward" for m in _mlps(model))
    assert q35lab.revert(model).reverted


# ----------------------------------------------------------------------------------------------
# offloaded checkpoint inputs
# ----------------------------------------------------------------------------------------------
def _record_packs(offloader):
    """Keep (source tensor's data pointer, device, handle) of every pack."""
    packs = []
    pack = offloader.pack

    def recording(t):
        handle = pack(t)
        packs.append((t.untyped_storage().data_ptr(), isinstance(t, torch.nn.Parameter), handle))
        return handle

    offloader.pack = recording
    return packs


def _drop_empty(packs):
    """Remove the packs of empty tensors (torch 2.11's checkpoint saves one a call; 2.13's none),
    returning how many there were."""
    nonempty = [p for p in packs if not (isinstance(p[2], lc_offload._Kept) and p[2].tensor.numel() == 0)]
    dropped = len(packs) - len(nonempty)
    packs[:] = nonempty
    return dropped


def test_offloaded_checkpoint_inputs_live_in_distinct_host_copies_and_give_the_same_gradients():
    B, T, H, L = 2, 9, TEXT["hidden_size"], TEXT["num_hidden_layers"]
    ids = torch.randint(0, 128, (B, T), device=device())
    expected = _step(_model(), ids)
    model = _model()
    offloader = lc.offload_decoder_layers(model, 1.0, min_bytes=0, chunk_bytes=1000)  # several blocks a copy
    packs = _record_packs(offloader)
    got = _step(model, ids)
    _assert_same(got, expected)
    # exactly one saved tensor a layer, the checkpoint's input [B, T, H], moved to the host (and, with
    # torch 2.11, an empty tensor a checkpoint call, kept)
    empty = _drop_empty(packs)
    kept = {"kept": empty} if empty else {}
    assert offloader.stats == {"packed": L + empty, "offloaded": L, "offloaded_bytes": L * B * T * H * 4,
                               "unpacked": L + empty, "prefetched": L - 1, **kept}
    for source, _, handle in packs:
        assert isinstance(handle, lc_offload._HostCopy) and tuple(handle.shape) == (B, T, H) and len(handle.chunks) > 1
        assert all(c.device.type == "cpu" and c.untyped_storage().data_ptr() != source for c in handle.chunks)

    # the backward reads the host copies: spoil one between forward and backward and the gradients change
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    for chunk in packs[-1][2].chunks:
        chunk.mul_(0.5)
    loss.backward()
    spoiled = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(not torch.allclose(spoiled[n], expected[1][n]) for n in spoiled)

    assert lc.restore_decoder_layers(model) == L
    assert not any("forward" in vars(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))


def test_checkpointing_enabled_after_the_offload_and_a_deep_copy_offload_only_checkpoint_inputs():
    """Enabling checkpointing puts a fresh checkpoint function on every layer (Trainer
    calls it when training starts, after the user patched): the next forward wraps them again.
    A deep copy offloads with an offloader of its own."""
    B, T, L = 1, 9, TEXT["num_hidden_layers"]
    ids = torch.randint(0, 128, (B, T), device=device())
    expected = _step(_model(), ids)
    model = _model(checkpointing=False)
    offloader = lc.offload_decoder_layers(model, 1.0, min_bytes=0)
    lc.enable_checkpointing(model)
    packs = _record_packs(offloader)
    _assert_same(_step(model, ids), expected)
    empty = _drop_empty(packs)
    assert offloader.stats["packed"] - empty == offloader.stats["offloaded"] == L  # one [B, T, H] input a layer
    twin = copy.deepcopy(model)
    _assert_same(_step(twin, ids), expected)
    twins = {hook.offloader for stack in hf_modules.layer_stacks(twin) for hook in lc_offload._guards(stack).values()}
    assert len(twins) == 1 and offloader not in twins and next(iter(twins)).stats["offloaded"] == L
    assert lc.restore_decoder_layers(twin) == L
    assert not any(isinstance(vars(m).get("_gradient_checkpointing_func"), lc_offload._OffloadedCheckpoint)
                   for m in twin.modules())


def test_an_offload_that_would_leave_the_host_too_little_is_a_clear_error(monkeypatch):
    ids = torch.randint(0, 128, (1, 9), device=device())
    layer_bytes = 9 * TEXT["hidden_size"] * 4  # one [1, 9, H] fp32 checkpoint input

    def host(offloader, room):  # what the OS reports: the room less what this step pinned before this copy
        return lambda: 1000 + room - (offloader._chain_bytes - layer_bytes)

    model = _model()
    offloader = lc.offload_decoder_layers(model, 1.0, min_bytes=0, host_reserve_bytes=1000)
    patch_everywhere(monkeypatch, "host_memory_available", host(offloader, 2 * layer_bytes))  # room for both layers
    _step(model, ids)
    patch_everywhere(monkeypatch, "host_memory_available", lambda: 0)
    _step(model, ids)  # the second step reuses the first one's pinned blocks: nothing new is claimed
    assert offloader.stats["offloaded"] == 4
    tight = _model()
    offloader = lc.offload_decoder_layers(tight, 1.0, min_bytes=0, host_reserve_bytes=1000)
    patch_everywhere(monkeypatch, "host_memory_available", host(offloader, layer_bytes))  # room for one
    with pytest.raises(MemoryError, match="q35lab: offloading .* offload fewer decoder layers"):
        _step(tight, ids)
    with pytest.raises(ValueError, match="host_reserve_bytes"):
        lc.CheckpointOffloader(host_reserve_bytes=-1)


def test_the_default_reserve_is_16_gib_or_a_quarter_of_a_smaller_host(monkeypatch):
    GiB = 2**30
    hosts = {"H200 host": (125 * GiB, None, 16 * GiB), "Colab": (int(12.7 * GiB), None, int(12.7 * GiB) // 4),
             "a container's limit": (125 * GiB, (8 * GiB, GiB), 2 * GiB), "unknown": (None, None, 16 * GiB)}
    for name, (total, cgroup, reserve) in hosts.items():
        patch_everywhere(monkeypatch, "_meminfo", lambda field, total=total: total if field == "MemTotal" else None)
        patch_everywhere(monkeypatch, "_cgroup_limit_and_usage", lambda cgroup=cgroup: cgroup)
        assert lc.default_host_reserve() == reserve, name
        assert lc.CheckpointOffloader().host_reserve_bytes == reserve, name
    monkeypatch.undo()  # (the conftest's roomy host too: read this machine's own numbers)
    assert lc.host_memory_available() is None or 0 < lc.host_memory_available() < 2**50
    assert 0 < lc.default_host_reserve() <= lc.HOST_RESERVE_BYTES


def test_host_memory_available_takes_the_tighter_of_meminfo_and_the_cgroup(monkeypatch):
    GiB = 2**30
    monkeypatch.undo()  # the conftest's roomy host: test the real function
    patch_everywhere(monkeypatch, "_meminfo", lambda field: 10 * GiB if field == "MemAvailable" else None)
    patch_everywhere(monkeypatch, "_cgroup_limit_and_usage", lambda: (8 * GiB, 5 * GiB))
    assert lc.host_memory_available() == 3 * GiB
    patch_everywhere(monkeypatch, "_cgroup_limit_and_usage", lambda: None)
    assert lc.host_memory_available() == 10 * GiB


def test_offload_a_fraction_of_layers_or_nothing_below_the_threshold():
    ids = torch.randint(0, 128, (1, 9), device=device())
    expected = _step(_model(), ids)
    model = _model()
    offloader = lc.offload_decoder_layers(model, 0.5, min_bytes=0)
    packs = _record_packs(offloader)
    _assert_same(_step(model, ids), expected)
    _drop_empty(packs)
    assert [type(h).__name__ for _, _, h in packs] == ["_HostCopy", "_Kept"]  # the first layer's only
    assert offloader.stats["prefetched"] == 1  # the kept layer's unpacking fetched the first one's early
    big = lc.offload_decoder_layers(model, 2, min_bytes=2**20)  # a [1, 9, 64] fp32 input is 2 KiB: stays
    assert big is not offloader
    big_packs = _record_packs(big)
    _step(model, ids)
    assert big.stats["offloaded"] == 0 and big.stats["kept"] - _drop_empty(big_packs) == 2
    with pytest.raises(ValueError, match="layers"):
        lc.offload_decoder_layers(model, 1.5)


def test_offloaded_checkpoints_context_moves_activations_never_parameters():
    ids = torch.randint(0, 128, (1, 9), device=device())
    expected = _step(_model(), ids)
    model = _model()
    model.zero_grad(set_to_none=True)
    offloader = lc.CheckpointOffloader(min_bytes=0)
    packs = _record_packs(offloader)
    with lc.offloaded_checkpoints(model, offloader=offloader):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    _assert_same((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}), expected)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert offloader.stats["offloaded"] >= 2  # both checkpoint inputs, and what the loss saved
    _drop_empty(packs)
    for source, is_parameter, handle in packs:
        assert isinstance(handle, lc_offload._Kept) == (is_parameter or source in parameter_storages)
    # a tensor that is not a Parameter but holds one's memory (packed weights, a detached weight) stays
    linear = torch.nn.Linear(64, 64)
    offloader = lc.CheckpointOffloader(min_bytes=0)
    offloader.exclude_parameters_of(linear)
    assert isinstance(offloader.pack(linear.weight.detach()), lc_offload._Kept)
    assert isinstance(offloader.pack(torch.randn(4, 64)), lc_offload._HostCopy)


@pytest.mark.parametrize("exclude_parameters", [False, True])
def test_an_empty_saved_tensor_is_kept_whatever_the_parameters(exclude_parameters):
    """An empty tensor moves nothing, and is kept whether or not parameters are excluded. On an
    H100 (torch 2.11) every non-reentrant checkpoint call saved an empty CPU tensor besides the
    layer's input, and it was counted as offloaded: twice the tensors the offload is meant to move."""
    offloader = lc.CheckpointOffloader(min_bytes=0)
    linear = torch.nn.Linear(8, 8, device=device())  # alive: a freed weight's memory would be the next tensor's
    if exclude_parameters:
        offloader.exclude_parameters_of(linear)
    with offloader.hooks():
        assert isinstance(offloader.pack(torch.empty(0)), lc_offload._Kept)
        assert isinstance(offloader.pack(torch.empty(0, 64, device=device())), lc_offload._Kept)
        assert isinstance(offloader.pack(torch.randn(2, 64, device=device())), lc_offload._HostCopy)
    assert offloader.stats["offloaded"] == 1 and offloader.stats["kept"] == 2


def test_a_freed_models_parameter_memory_is_offloaded_when_reused():
    """The excluded model is gone and its weight's memory is another tensor's now (CUDA's caching
    allocator does this at once): that tensor is an activation, and is offloaded."""
    import gc

    linear = torch.nn.Linear(64, 64, device=device())
    offloader = lc.CheckpointOffloader(min_bytes=0)
    offloader.exclude_parameters_of(linear)
    reused = linear.weight.detach()  # stands for the next tensor given the weight's memory
    with offloader.hooks():
        assert isinstance(offloader.pack(reused), lc_offload._Kept)  # while the model lives: its parameter
        del linear
        gc.collect()
        assert isinstance(offloader.pack(reused), lc_offload._HostCopy)


def test_an_empty_saved_tensor_between_two_inputs_leaves_the_prefetch_chain_whole():
    """torch 2.11's checkpoint saves an empty tensor beside each layer's input: unpacking the later
    input must still prefetch the earlier one, not the empty tensor between them."""
    offloader = lc.CheckpointOffloader(min_bytes=0)
    with offloader.hooks():
        first = offloader.pack(torch.randn(2, 64, device=device()))
        empty = offloader.pack(torch.empty(0, device=device()))
        second = offloader.pack(torch.randn(3, 64, device=device()))
    assert offloader.unpack(second).shape == (3, 64) and offloader.stats["prefetched"] == 1
    assert first.fetched is not None and offloader.unpack(empty).numel() == 0


def test_offload_and_tiling_together_with_retain_graph_twice():
    ids = torch.randint(0, 128, (1, 11), device=device())
    reference = _model()
    once = _step(reference, ids)
    model = _model()
    lc.tile_mlps(model, 4)
    offloader = lc.offload_decoder_layers(model, 1.0, min_bytes=0)
    packs = _record_packs(offloader)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    loss.backward()
    twice = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    _assert_same((loss.detach(), {n: g / 2 for n, g in twice.items()}), once)
    # each host copy fetched again by the second backward (and torch 2.11's empty tensors read twice)
    assert offloader.stats["unpacked"] - 2 * _drop_empty(packs) == 4


# ----------------------------------------------------------------------------------------------
# the memory model
# ----------------------------------------------------------------------------------------------
def _tiny_config():
    return causal_lm().config


def test_parameter_counts_match_the_models():
    config = _tiny_config()
    assert lc.parameter_count(config) == sum(p.numel() for p in causal_lm().parameters())
    for targets, kinds in ((MLP_TARGETS, ("mlp",)), ("all-linear", "all-linear")):
        model = _model(rank=8, targets=targets, checkpointing=False)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert lc.lora_parameter_count(config, 8, kinds) == trainable


def test_the_terms_for_the_tiny_config_by_hand():
    # tiny: H 64, I 96, 2 layers (a GatedDeltaNet, an attention), Hk 2 × 16, Hv 4 × 16, 2 heads of 32
    # (1 kv), RoPE 8 of 32 dims; fp32 activations (e = 4), r = 4
    model = lc.bytes_per_token(_tiny_config(), lora_rank=4, dtype_bytes=4, loss_chunk_bytes=0, slack_bytes=0)
    mlp = model.phases["MLP backward (GatedDeltaNet layer)"]
    # checkpoints 2·64·4 = 512, residual grads 3·64·4 = 768, ids/labels/positions/RoPE 8+8+32+2·8·4 = 112
    # GDN saved: input 256, in_proj [qkv|b|a] (128 + 8)·4 = 544 [conv_dim = 2·32 + 64], z in its own buffer
    #   64·4 = 256 (no copy of it), gates 4·(4+12) = 64, q/k 2·(32·4 + 4·2) = 272, v 256, A 4·64·4 = 1024,
    #   core out 256, gated-norm out 256, xa 5·4·4 = 80
    # norms 256 + 4 + 4; MLP: input 256, gate/up 768, xa 48, dh 384 (no SwiGLU output: swiglu_down)
    gdn_saved = 256 + 544 + 256 + 64 + 272 + 256 + 1024 + 256 + 256 + 80
    assert gdn_saved == 3264
    assert mlp == 512 + 768 + 112 + gdn_saved + 264 + 1456
    # GDN backward: d(out), dz 2·256, w, u, v_new 3·256, h, dh 2·4·16·16·4/64 = 128, dv, dw 512, dq, dk 512
    gdn = 512 + 768 + 112 + gdn_saved + 512 + 768 + 128 + 512 + 512 + 4
    assert model.phases["GatedDeltaNet backward"] == gdn
    # attention saved: input 256, q-norm in 256, k-norm in 128, q/k/v 512, out ×2 512, gate/gated 512,
    #   lse 8, xa 64 = 2248; backward: 3·256 + (64·4 + 128·4)·... = 768 + 256 + 512
    assert model.phases["attention backward"] == 512 + 768 + 112 + 2248 + 768 + 256 + 512 + 4
    assert model.phases["loss (end of forward)"] == 512 + 512 + 256 + 112
    assert gdn > mlp and model.phase == "GatedDeltaNet backward" and model.per_token == gdn
    tiled = lc.bytes_per_token(_tiny_config(), lora_rank=4, dtype_bytes=4, tiled_mlp_tokens=8, loss_chunk_bytes=0)
    assert tiled.phases["MLP backward (GatedDeltaNet layer)"] == mlp - 1456 + 512
    assert tiled.fixed["MLP: one tile's working set"] == 8 * (64 + 3 * 96) * 4
    offloaded = lc.bytes_per_token(_tiny_config(), lora_rank=4, dtype_bytes=4, offload=True, loss_chunk_bytes=0)
    assert offloaded.host_per_token == 512 and offloaded.per_token == model.per_token  # 2 layers: max(0, 2) = 2


def test_the_modelled_terms_are_what_the_tiny_model_saves():
    config, (B, T) = _tiny_config(), (1, 12)
    e, H = 4, TEXT["hidden_size"]
    # checkpoint inputs: what the offloader moved per token
    model = _model()
    offloader = lc.offload_decoder_layers(model, 1.0, min_bytes=0)
    _step(model, torch.randint(0, 128, (B, T), device=device()))
    predicted = lc.bytes_per_token(config, dtype_bytes=e, offload=True, loss_chunk_bytes=0)
    assert offloader.stats["offloaded_bytes"] / (B * T) == predicted.host_per_token == 2 * H * e

    # the patched MLP's saved tensors (activations, not weights), untiled and tiled
    model = _model(rank=4, checkpointing=False)
    q35lab.apply_to_qwen3_5(model)
    mlp = _mlps(model)[0]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_bytes(call):
        seen = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
            return t

        x = torch.randn(B, T, H, device=device(), requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call(x)
        return sum(seen.values()) / (B * T) - H * e  # the input itself is the caller's

    terms = lc.bytes_per_token(config, lora_rank=4, dtype_bytes=e).phases
    untiled_terms = lc_memory._phase_terms(lc_memory.dims(config), e, 4, tiled=False)
    untiled_terms = untiled_terms["MLP backward (GatedDeltaNet layer)"]
    saved_by_mlp = sum(v for k, v in untiled_terms.items() if k.startswith("MLP:")) - H * e
    assert saved_bytes(mlp) == saved_by_mlp == (2 * 96 + 3 * 4) * e  # gate/up output, 3 adapters' x·Aᵀ; no h
    # with dropout on the down adapter, the down projection runs its own forward and keeps h [I] as well
    mlp.down_proj.lora_dropout["default"] = torch.nn.Dropout(0.1)
    assert saved_bytes(mlp) == saved_by_mlp + 96 * e + 8 / (B * T)  # and the mask's seed, one int64
    mlp.down_proj.lora_dropout["default"] = torch.nn.Identity()
    assert saved_bytes(lambda x: lc.tiled_mlp(mlp, x, 5)) == 0  # only x (the stash), nothing of a tile
    assert terms  # the phases exist for this config


def test_qwen3_5_9b_predictions_and_the_offload_plan():
    from q35lab import e2e

    config = e2e.config("9b")
    base = lc.bytes_per_token(config)
    assert base.terms["checkpoint inputs (32 of 32 layers on the GPU)"] == 256 * 1024  # 32 · 4096 · 2
    assert 8.9e9 < lc.parameter_count(config) < 9.1e9
    tiled = lc.bytes_per_token(config, tiled_mlp_tokens=8192)
    offloaded = lc.bytes_per_token(config, tiled_mlp_tokens=8192, offload=True)
    assert offloaded.per_token < tiled.per_token <= base.per_token
    assert offloaded.host_per_token == 256 * 1024
    # the MLP keeps less than the GatedDeltaNet's backward needs: tiling it alone lowers its own phase,
    # not the peak (and adds a tile's working set); the offload moves the peak's checkpoints
    mlp = "MLP backward (GatedDeltaNet layer)"
    assert base.phase == tiled.phase == "GatedDeltaNet backward" and tiled.phases[mlp] < base.phases[mlp]
    assert tiled.longest_fit() <= base.longest_fit() < offloaded.longest_fit()
    # all 32 layers at 512k need 128 GiB of host memory: not on a 128 GiB host
    assert offloaded.longest_fit(host_bytes=128 * 2**30 - 16 * 2**30) < 512 * 1024
    layers, fits = lc.plan_offload_layers(config, 384 * 1024, host_bytes=1e15, tiled_mlp_tokens=8192)
    assert fits and 0 < layers < 32
    assert lc.plan_offload_layers(config, 2**22, host_bytes=128 * 2**30)[1] is False
    assert "checkpoint inputs" in base.table()


def test_apply_to_qwen3_5_long_context_options_same_loss_and_gradients_and_revert():
    """The options as a user turns them on: through apply_to_qwen3_5, on a gradient-checkpointed
    PEFT model, against the same model patched without them; revert takes them off again."""
    import copy

    import q35lab
    from tiny_models import causal_lm, loss_and_grads

    base = peft.get_peft_model(causal_lm(), peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    lc.enable_checkpointing(base)
    base.train()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    plain, long = copy.deepcopy(base), copy.deepcopy(base)
    q35lab.apply_to_qwen3_5(plain)
    report = q35lab.apply_to_qwen3_5(long, tiled_mlp=3, offload_checkpoints=1.0)
    assert report.replaced["Qwen3_5MLP (tiled, 3 tokens a tile)"] == 2
    assert any(label.startswith("decoder-layer checkpoints offloaded") for label in report.replaced)
    ids = torch.randint(0, 128, (1, 11), device=device())
    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(plain, ids), loss_and_grads(long, ids)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=name)
    reverted = q35lab.revert(long)
    assert reverted.reverted["Qwen3_5MLP (tiled)"] == 2 and reverted.reverted["decoder-layer checkpoint offload"] == 1
    assert not any(type(vars(m).get("forward")).__module__.startswith("q35lab.long_context") for m in long.modules())


# ----------------------------------------------------------------------------------------------
# the sequence-tiled GatedDeltaNet
# ----------------------------------------------------------------------------------------------
GDN_TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
K = 4  # the tiny model's conv window (transformers' default linear_conv_kernel_dim)


def _gdn(model):
    return next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")


def _count_tiles(gdn):
    """Record the tokens of every call of the GatedDeltaNet's in_proj (one entry a tile, or an untiled call)."""
    calls = []
    gdn.in_proj_qkv.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    return calls


def _on_pytorch_core(module):
    """``module`` (a GatedDeltaNet, or a model) on transformers' PyTorch delta rule, for an fp64
    reference: fla's kernels, which transformers takes on the GPU, do not compile for fp64. Each
    GatedDeltaNet's forward runs with its modeling module's core unwrapped (the hub wrapper and
    q35lab's switch, ``__wrapped__``, down to transformers' function) and puts the module's back after."""
    for gdn in module.modules():
        if type(gdn).__name__.endswith("GatedDeltaNet"):
            gdn.forward = functools.partial(_forward_on_pytorch_core, gdn)
    return module


def _forward_on_pytorch_core(gdn, *args, **kwargs):
    with _pytorch_core_installed(gdn):
        return type(gdn).forward(gdn, *args, **kwargs)


@contextlib.contextmanager
def _pytorch_core_installed(gdn):
    """transformers' PyTorch delta rule as ``gdn``'s modeling module's core while the block runs."""
    modeling = sys.modules[type(gdn).__module__]
    core = modeling.torch_chunk_gated_delta_rule
    pytorch = (functools.partial(inspect.unwrap(core.func), *core.args, **core.keywords)  # a test's chunk size kept
               if isinstance(core, functools.partial) else inspect.unwrap(core))
    modeling.torch_chunk_gated_delta_rule = pytorch
    try:
        yield
    finally:
        modeling.torch_chunk_gated_delta_rule = core


def _fla_runs(module) -> bool:
    """Whether ``module``'s GatedDeltaNets run fla's core: chunked as fla chunks (64 tokens, TF32
    products), the tiled and untiled steps then differ by more than rounding order, and the tests
    hold both to the numerics rule against fp64 instead of to each other."""

    return any(hf_gdn.core_is_fla(m) for m in module.modules() if type(m).__name__.endswith("GatedDeltaNet"))


def _assert_tiled_step(got, expected, ref64, fla, rtol, atol):
    """The tiled step against the untiled one: by the numerics rule against fp64 (loss and every
    gradient); and, on the CPU and transformers' PyTorch core, close to each other (on a GPU, tiles'
    row counts choose other GEMM kernels, and fla's core rounds at its own chunks: the rule alone)."""
    (loss, grads), (loss_ref, grads_ref), (loss64, grads64) = got, expected, ref64
    assert_close_by_rule("loss", loss, loss_ref, loss64)
    assert grads.keys() == grads_ref.keys() == grads64.keys()
    for name in grads:
        assert_close_by_rule(name, grads[name], grads_ref[name], grads64[name])
    if not fla and device().type == "cpu":
        _assert_same(got, expected, rtol=rtol, atol=atol)


def _gdn_outputs(gdn, x, w, tile, dtype=torch.float32, forward=None, **kwargs):
    """The output and the gradients of ``sum(y · w)`` for x and every trainable parameter, tiled
    (``tile`` tokens) or not (``tile=None``: ``forward``, by default the module's own)."""
    params = [p for p in gdn.parameters() if p.requires_grad]
    xs = x.to(dtype).requires_grad_()
    forward = gdn if forward is None else forward
    y = lc.tiled_gated_delta_net(gdn, xs, tile, **kwargs) if tile else forward(hidden_states=xs, **kwargs)
    return [y.detach(), *torch.autograd.grad((y * w.to(dtype)).sum(), [xs, *params])]


@pytest.mark.parametrize("tile", [1, 2, K - 1, 4, 11, 16])  # T = 11: odd, divided by none of 2, 3, 4
def test_tiled_gated_delta_net_gives_the_output_and_every_gradient_of_the_module(tile):
    gdn = _gdn(_model(targets=GDN_TARGETS, checkpointing=False))
    for p in (gdn.A_log, gdn.dt_bias, gdn.conv1d.weight, gdn.norm.weight):  # trainable too: their gradients
        p.requires_grad_(True)  # sum over tiles, and the conv's and the state's carries feed them
    gdn64 = _on_pytorch_core(copy.deepcopy(gdn).double())
    names = ["y", "dx"] + [n for n, p in gdn.named_parameters() if p.requires_grad]
    assert len(names) == 2 + 10 + 4  # LoRA A and B of the five projections, A_log, dt_bias, conv, norm
    x = torch.randn(2, 11, TEXT["hidden_size"], device=device())
    w = torch.randn(2, 11, TEXT["hidden_size"], device=device())
    ref, ref64 = _gdn_outputs(gdn, x, w, None), _gdn_outputs(gdn64, x, w, None, torch.float64)
    calls = _count_tiles(gdn)
    out = _gdn_outputs(gdn, x, w, tile)
    # other chunkings of the core, other GEMM row counts: held to the rule against fp64, not to the bits
    for name, a, b, b64 in zip(names, out, ref, ref64):
        assert_close_by_rule(name, a, b, b64)
    sizes = [min(tile, 11 - s) for s in range(0, 11, tile)]
    # a tile ≥ T is the module's math once; else each tile forward, then again (in reverse) in backward
    assert calls == ([11] if tile >= 11 else sizes + sizes[::-1])


def test_tiled_gated_delta_net_patched_by_q35lab_fused_in_proj_triton_conv_and_gated_norm(monkeypatch):

    model = _model(targets=GDN_TARGETS, checkpointing=False)
    gdn64 = _on_pytorch_core(copy.deepcopy(_gdn(model)).double())  # transformers' own modules in fp64
    q35lab.apply_to_qwen3_5(model)
    gdn = _gdn(model)
    assert type(vars(gdn)["forward"]).__name__ == "_SwitchedConvForward"
    # every tile's core goes through q35lab's wrapper of it, as the patched forward's does (on the GPU: q, k, v
    # copied by contiguous_rows before fla, not by fla at a third of the copy rate)
    switch, wrapped = hf_gdn.DELTA_RULE_SWITCHES[type(gdn).__module__], []
    replacement = switch.replacement
    monkeypatch.setattr(switch, "replacement", lambda: wrapped.append(1) or replacement())
    x = torch.randn(1, 7, TEXT["hidden_size"], device=device())
    w = torch.randn(1, 7, TEXT["hidden_size"], device=device())
    ref, ref64 = _gdn_outputs(gdn, x, w, None), _gdn_outputs(gdn64, x, w, None, torch.float64)
    assert len(wrapped) == 1  # the untiled patched forward: one call
    # q35lab's conv reads each carry as its initial rows (no concatenation of the carry and the tile)
    carried, conv = [], causal_conv1d
    patch_everywhere(monkeypatch, "causal_conv1d",
                     lambda *a, **k: carried.append(k["initial_rows"] is not None) or conv(*a, **k))
    out = _gdn_outputs(gdn, x, w, 2)  # tiles shorter than K − 1: a carry holds rows of two tiles
    assert len(wrapped) == 1 + 2 * 4  # 4 tiles, each in the forward and again in the backward
    assert carried == [False, True, True, True] + [True, True, True, False]  # the backward in reverse
    for i, (a, b, b64) in enumerate(zip(out, ref, ref64)):
        assert_close_by_rule(str(i), a, b, b64)


def _step_without_cache(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # no DynamicCache in a training forward
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_patched_model_with_every_long_context_option_under_checkpointing_and_bf16_autocast(monkeypatch):
    # Both delta-rule cores round the recurrent state to bf16 at each chunk boundary under autocast
    # (transformers' PyTorch core multiplies it into the chunk in bf16; fla stores it so). Tiles on the
    # chunks' boundaries make the untiled step, with the same core, round where the tiled one does: it is
    # the reference. fla chunks 64 tokens: tiles of 64 on 150 tokens; the PyTorch core is chunked as the
    # tiles, 4 on 11 tokens (a tenth of the interpreter's time). (Tiles of 4 on fla added two roundings the
    # one-chunk untiled step lacks: 3x its loss error, H100, ffbcd4d.)
    probe = _model(checkpointing=False)
    modeling, fla = sys.modules[type(_gdn(probe)).__module__], _fla_runs(probe)
    tile, T = (64, 150) if fla else (4, 11)  # three tiles, the last short
    if not fla:
        core = modeling.torch_chunk_gated_delta_rule
        monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule",
                            functools.partial(inspect.unwrap(core), chunk_size=tile))
    ids = torch.randint(0, 128, (1, T), device=device())
    reference = _model(targets="all-linear")
    ref64 = _step(_on_pytorch_core(copy.deepcopy(reference).double()), ids)
    q35lab.apply_to_qwen3_5(reference)
    expected = _step(reference, ids, autocast=True)
    model = _model(targets="all-linear")
    report = q35lab.apply_to_qwen3_5(model, tiled_gdn=tile, tiled_mlp=tile, offload_checkpoints=1.0)
    assert report.replaced[f"Qwen3_5GatedDeltaNet (tiled, {tile} tokens a tile)"] == 1
    assert report.replaced[f"Qwen3_5MLP (tiled, {tile} tokens a tile)"] == 2 and "tiled GatedDeltaNet" in report.runs
    assert report.replaced[f"Qwen3_5DecoderLayer (GatedDeltaNet and MLP tiled together, {tile} tokens a tile)"] == 1
    tiles, mlp_calls = _count_tiles(_gdn(model)), _count_mlp_calls(model)
    got = _step(model, ids, autocast=True)
    # the GatedDeltaNet's layer is tiled whole: its checkpoint's recompute stops at the layer's input, so each
    # tile runs in the forward and once more in the backward (in reverse), as the untiled layer runs twice
    sizes = [tile, tile, T - 2 * tile]
    assert tiles == sizes + sizes[::-1]
    # every MLP twice too: the GatedDeltaNet layer's in its tiles, the attention layer's (forward, then backward)
    assert mlp_calls == sizes + sizes * 2 + sizes[::-1]
    _assert_tiled_step(got, expected, ref64, _fla_runs(model), rtol=2e-2, atol=2e-3)  # bf16 both sides


def test_a_patched_model_with_tiled_gated_delta_nets_without_checkpointing_same_loss_and_gradients():
    ids = torch.randint(0, 128, (2, 9), device=device())
    reference = _model(targets="all-linear", checkpointing=False)
    ref64 = _step_without_cache(_on_pytorch_core(copy.deepcopy(reference).double()), ids)
    q35lab.apply_to_qwen3_5(reference)
    expected = _step_without_cache(reference, ids)
    model = _model(targets="all-linear", checkpointing=False)
    q35lab.apply_to_qwen3_5(model, tiled_gdn=5, tiled_mlp=4)
    tiles = _count_tiles(_gdn(model))
    _assert_tiled_step(_step_without_cache(model, ids), expected, ref64, _fla_runs(model), rtol=1e-4, atol=1e-5)
    assert tiles == [5, 4, 4, 5]  # each tile twice: forward, backward
    with torch.no_grad():  # eval / no grad: the module's own forward, one call
        tiles.clear()
        model(input_ids=ids)
        assert tiles == [9]


def test_lora_dropout_in_the_gated_delta_net_replays_each_tiles_masks_and_leaves_the_rng_alone():
    gdn = _gdn(_model(dropout=0.4, targets=GDN_TARGETS, checkpointing=False))
    params = [p for p in gdn.parameters() if p.requires_grad]
    x = torch.randn(1, 10, TEXT["hidden_size"], device=device(), requires_grad=True)

    def loop(t):  # the same tiles, in the same order, as ordinary autograd: the same draws as the forward
        step, carry, outs = lc_gated_delta_net._GatedDeltaNetTile(gdn, None, {}), None, []
        for s in range(0, 10, 4):
            y, carry = step(t[:, s:s + 4], carry, (s, min(s + 4, 10)))
            outs.append(y)
        return torch.cat(outs, 1)

    def run(f):
        torch.manual_seed(5)
        grads = torch.autograd.grad(f(x).square().sum(), [x, *params])
        return grads, torch.get_rng_state()

    (tiled, rng_tiled), (reference, rng_reference) = run(lambda t: lc.tiled_gated_delta_net(gdn, t, 4)), run(loop)
    for a, b in zip(tiled, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(rng_tiled, rng_reference)
    torch.manual_seed(6)
    assert not torch.allclose(torch.autograd.grad(loop(x).square().sum(), x)[0], reference[0])  # masks matter


def test_retain_graph_twice_and_a_second_derivative_through_the_tiled_gated_delta_net():
    gdn = _gdn(_model(targets=GDN_TARGETS, checkpointing=False))
    params = [p for p in gdn.parameters() if p.requires_grad]
    x = torch.randn(1, 9, TEXT["hidden_size"], device=device(), requires_grad=True)

    def block(t):
        return t + lc.tiled_gated_delta_net(gdn, torch.nn.functional.rms_norm(t, (t.shape[-1],)), 4)

    def grads(times):
        for p in [x, *params]:
            p.grad = None
        loss = checkpoint(block, x, use_reentrant=False).square().sum()
        for _ in range(times):
            loss.backward(retain_graph=True)
        return [p.grad.clone() for p in [x, *params]]

    for a, b in zip(grads(1), grads(2)):
        torch.testing.assert_close(b, 2 * a, rtol=1e-6, atol=1e-7)
    (dx,) = torch.autograd.grad(lc.tiled_gated_delta_net(gdn, x, 4).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="TiledGDNFunction has no second derivative"):
        dx.sum().backward()


def test_tiled_gated_delta_net_saves_its_input_and_one_carry_a_tile_nothing_of_a_tile():
    gdn = _gdn(_model(targets=GDN_TARGETS, checkpointing=False))
    B, T, e = 2, 10, 4
    x = torch.randn(B, T, TEXT["hidden_size"], device=device(), requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in gdn.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = lc.tiled_gated_delta_net(gdn, x, 4)
    assert saved[0] is x  # the caller's input, not a copy
    carries = saved[1:]  # into tiles 2 and 3: the K − 1 conv rows and the fp32 state each
    assert [tuple(c.shape) for c in carries] == [(B, K - 1, gdn.conv_dim), (B, 4, 16, 16)] * 2
    assert carries[1].dtype == torch.float32
    carry_bytes = lc_memory._gdn_carry_bytes(lc_memory.dims(_tiny_config()), e)
    assert sum(c.numel() * c.element_size() for c in carries) == 2 * B * carry_bytes
    assert y.grad_fn.name() == "TiledGDNFunctionBackward"


def test_padding_masks_are_tiled_packed_sequences_and_caches_run_untiled_with_a_warning():
    model = _model(targets=GDN_TARGETS, checkpointing=False)
    gdn64 = _on_pytorch_core(copy.deepcopy(_gdn(model)).double())  # transformers' own module in fp64
    q35lab.apply_to_qwen3_5(model, tiled_gdn=3)
    gdn = _gdn(model)
    inner = vars(gdn)["forward"].inner  # q35lab's untiled forward
    x = torch.randn(2, 8, TEXT["hidden_size"], device=device())
    w = torch.randn(2, 8, TEXT["hidden_size"], device=device())
    mask = torch.ones(2, 8, dtype=torch.long, device=device())
    mask[1, :3] = 0  # left padding
    tiles = _count_tiles(gdn)
    got = _gdn_outputs(gdn, x, w, None, attention_mask=mask)  # the module's forward: tiled
    assert tiles == [3, 3, 2, 2, 3, 3]
    expected = _gdn_outputs(gdn, x, w, None, forward=inner, attention_mask=mask)
    exact = _gdn_outputs(gdn64, x, w, None, torch.float64, attention_mask=mask)
    fla = _fla_runs(model)
    for i, (a, b, b64) in enumerate(zip(got, expected, exact)):
        assert_close_by_rule(str(i), a, b, b64)
        if not fla:  # the PyTorch core: tiles change only the rounding order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[0][1, :3].abs().max() == 0 < got[0][0, :3].abs().max()  # padding rows zeroed before the in_proj
    # packed sequences in one row: their boundaries do not line up with tiles — the module's own forward
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device())
    row = x[:1].clone().requires_grad_()
    tiles.clear()
    with pytest.warns(UserWarning, match="runs untiled here: packed sequences"):
        packed = gdn(hidden_states=row, cu_seq_lens_q=cu)
    assert tiles == [8]
    torch.testing.assert_close(packed, inner(hidden_states=row, cu_seq_lens_q=cu))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        lc.tiled_gated_delta_net(gdn, row, 3, cu_seq_lens_q=cu)
    from transformers import DynamicCache

    tiles.clear()
    name = "cache_params" if "cache_params" in inspect.signature(type(gdn).forward).parameters else "cache"
    with pytest.warns(UserWarning, match="a cache was passed"):
        gdn(hidden_states=row, **{name: DynamicCache(config=model.config)})
    assert tiles == [8]


def test_a_tiled_gated_delta_net_deep_copies_pickles_and_reverts():
    ids = torch.randint(0, 128, (1, 9), device=device())
    model = _model(targets="all-linear", checkpointing=False)
    report = q35lab.apply_to_qwen3_5(model, tiled_gdn=4)
    again = q35lab.apply_to_qwen3_5(model, tiled_gdn=3)  # idempotent: the tile size updated
    assert report.replaced["Qwen3_5GatedDeltaNet (tiled, 4 tokens a tile)"] == 1 and not any(
        "tiled" in name for name in again.replaced)
    forward = vars(_gdn(model))["forward"]
    assert isinstance(forward, lc.TiledGDNForward) and forward.tile_tokens == 3
    before = _step_without_cache(model, ids)
    twin = copy.deepcopy(model)
    twin_forward = vars(_gdn(twin))["forward"]
    assert twin_forward.module is _gdn(twin) and twin_forward.inner.module is _gdn(twin)
    _assert_same(_step_without_cache(twin, ids), before)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    _assert_same(_step_without_cache(torch.load(buffer, weights_only=False), ids), before)
    assert pickle.loads(pickle.dumps(forward)).tile_tokens == 3
    reverted = q35lab.revert(model)
    assert reverted.reverted["Qwen3_5GatedDeltaNet (tiled)"] == 1
    assert "forward" not in vars(_gdn(model))  # the conv's forward under it came off too


def test_wrong_tiled_gated_delta_net_arguments_are_errors_that_name_them():
    model = _model(targets=GDN_TARGETS, checkpointing=False)
    gdn = _gdn(model)
    x = torch.randn(1, 5, TEXT["hidden_size"], requires_grad=True)
    for value, error in ((-1, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(error, match="tiled_gdn"):
            q35lab.apply_to_qwen3_5(model, tiled_gdn=value)
        with pytest.raises(error, match="tiled_mlp"):
            q35lab.apply_to_qwen3_5(model, tiled_mlp=value)
        with pytest.raises(error, match="tile_tokens"):
            lc.tiled_gated_delta_net(gdn, x, value)
    assert not any("tiled" in name for name in q35lab.apply_to_qwen3_5(model, tiled_gdn=0).replaced)  # off
    with pytest.raises(TypeError, match="gdn"):
        lc.tiled_gated_delta_net(_mlps(model)[0], x, 2)
    with pytest.raises(ValueError, match=r"x: expected \[B, T, 64\]"):
        lc.tiled_gated_delta_net(gdn, x[0], 2)
    with pytest.raises(ValueError, match="attention_mask"):
        lc.tiled_gated_delta_net(gdn, x, 2, attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="tiled_gdn_tokens"):
        lc.bytes_per_token(_tiny_config(), tiled_gdn_tokens=0)


def test_the_tiled_gated_delta_net_terms_and_the_9b_at_half_a_million_tokens():
    d = lc_memory.dims(_tiny_config())
    untiled = lc.bytes_per_token(_tiny_config(), lora_rank=4, dtype_bytes=4, tiled_mlp_tokens=8, loss_chunk_bytes=0)
    tiled = lc.bytes_per_token(_tiny_config(), lora_rank=4, dtype_bytes=4, tiled_mlp_tokens=8, tiled_gdn_tokens=16,
                               loss_chunk_bytes=0)
    # the carry a tile: state 4·16·16·4 = 4096, conv rows 3·128·4 = 1536; per token at 16 a tile: 352, held by
    # every tiled layer (the tiny config's one GatedDeltaNet layer) from its forward to its backward
    assert lc_memory._gdn_carry_bytes(d, 4) == 4096 + 1536
    common = 512 + 768 + 112  # checkpoints, residual grads, ids/labels/positions/RoPE (as above)
    assert tiled.phases["GatedDeltaNet layer backward (tiled)"] == common + 352 + 256 + 256  # carries, input, dx
    assert "GatedDeltaNet backward" not in tiled.phases and "MLP backward (GatedDeltaNet layer)" not in tiled.phases
    gdn_untiled = untiled.phases["GatedDeltaNet backward"] - common - 4  # the untiled GDN's per-token terms
    # + the norms' inputs and rstd, the MLP's untiled terms ((H + 3I + 3r)·e), two carries, and the conv's input
    # of a later tile, (16 + 3) rows of 128 channels in fp32
    mlp = (64 + 3 * 96 + 3 * 4) * 4
    assert tiled.fixed["GatedDeltaNet layer: one tile's working set"] == (
        16 * (gdn_untiled + 2 * (64 * 4 + 4) + mlp) + 2 * (4096 + 1536) + 19 * 128 * 4)
    assert tiled.phases["attention backward"] == untiled.phases["attention backward"] + 352

    from q35lab import e2e

    config, GiB = e2e.config("9b"), 2**30
    before = lc.bytes_per_token(config, tiled_mlp_tokens=8192, offload=True)
    after = lc.bytes_per_token(config, tiled_mlp_tokens=8192, tiled_gdn_tokens=8192, offload=True)
    assert before.phase == "GatedDeltaNet backward" and 212 * 1024 < before.per_token < 214 * 1024
    # tiled, the GatedDeltaNet's layer keeps 2·H·e a token (+ checkpoints, residual, every layer's carries):
    # attention is the peak
    assert after.phases["GatedDeltaNet layer backward (tiled)"] < 63 * 1024 and after.phase == "attention backward"
    assert after.longest_fit() > 1.3 * before.longest_fit()
    # half a million tokens on one H200 with 109 GiB of host memory for checkpoints: some layers kept on the GPU
    assert lc.plan_offload_layers(config, 512 * 1024, host_bytes=125 * GiB, tiled_mlp_tokens=8192) == (27, True)
    layers, fits = lc.plan_offload_layers(config, 512 * 1024, host_bytes=125 * GiB, tiled_mlp_tokens=8192,
                                          tiled_gdn_tokens=8192)
    assert fits and layers < 27


def test_the_long_variant_tiles_the_gated_delta_nets_too():
    from q35lab import e2e

    report = e2e.prepare(e2e.build("tiny", 2, rank=8, device=device(), dtype=torch.float32), "q35lab+long", tokens=16)
    assert any(name.startswith("Qwen3_5GatedDeltaNet (tiled, 8192") for name in report.replaced), report
    assert any(name.startswith("Qwen3_5MLP (tiled, 8192") for name in report.replaced), report


# ----------------------------------------------------------------------------------------------
# the one switch: long_context=N plans the three options
# ----------------------------------------------------------------------------------------------
def _plan(config, tokens, **settings):  # the H200 machine's reserve, whatever this machine's memory
    return lc.plan_long_context(config, tokens, host_reserve_bytes=lc.HOST_RESERVE_BYTES, **settings)


def _fits(config, tokens, gpu_bytes, host_bytes, **settings):
    return lc.plan_offload_layers(config, tokens, gpu_bytes=gpu_bytes, host_bytes=host_bytes, **settings)[1]


@pytest.mark.parametrize("tokens, gpu_gib", [(32768, 139), (300 * 1024, 139), (524288, 139), (524288, 125),
                                             (557056, 139)])
def test_the_plan_takes_the_cheapest_options_that_fit_with_the_largest_tiles(tokens, gpu_gib):
    from q35lab import e2e

    config, GiB = e2e.config("9b"), 2**30
    gpu, host = gpu_gib * GiB, 125 * GiB
    plan = _plan(config, tokens, gpu_bytes=gpu, host_bytes=host)
    assert plan.fits and plan.model.peak(tokens) <= gpu and plan.model.host_per_token * tokens <= host
    settings = {"tiled_mlp_tokens": plan.tiled_mlp, "tiled_gdn_tokens": plan.tiled_gdn}
    settings = {k: v for k, v in settings.items() if v}
    assert plan.model.per_token == lc.bytes_per_token(config, offload=plan.offload_layers, **settings).per_token
    if plan.offload_layers:  # the fewest layers
        assert lc.bytes_per_token(config, offload=plan.offload_layers - 1, **settings).peak(tokens) > gpu
    if plan.tiled_mlp or plan.tiled_gdn:  # nothing cheaper fits: no offload alone, and no MLP tile alone
        assert not _fits(config, tokens, gpu, host)
    if plan.tiled_gdn:
        assert plan.tiled_mlp == plan.tiled_gdn
        assert not any(_fits(config, tokens, gpu, host, tiled_mlp_tokens=t) for t in lc.PLAN_TILES if t < tokens)
    for tile in (plan.tiled_mlp, plan.tiled_gdn):  # the largest tile that fits, shorter than the step
        if tile:
            assert tile < tokens and tile in lc.PLAN_TILES
            larger = [t for t in lc.PLAN_TILES if tile < t < tokens]
            assert not any(_fits(config, tokens, gpu, host, **{k: t for k in settings}) for t in larger)
    assert f"planned for {tokens:,} tokens" in str(plan) and "(fits)" in str(plan)
    assert plan.options() == {"tiled_mlp": plan.tiled_mlp, "tiled_gdn": plan.tiled_gdn,
                              "offload_checkpoints": plan.offload_layers}


def test_the_plan_at_32k_is_nothing_and_beyond_the_host_the_most_frugal_plan_does_not_fit():
    from q35lab import e2e

    config, GiB = e2e.config("9b"), 2**30
    short = _plan(config, 32768, host_bytes=125 * GiB)
    assert short.fits and (short.tiled_mlp, short.tiled_gdn, short.offload_layers) == (None, None, 0)
    assert "nothing (the step fits as it is)" in str(short)
    # the plan for half a million tokens on an H200 whose usable memory is 125 GiB tiles at 32k tokens or more:
    # a 32k step under it runs untiled (a module tiles only a longer sequence)
    long = _plan(config, 524288, gpu_bytes=125 * GiB, host_bytes=125 * GiB)
    assert long.fits and long.tiled_gdn and long.tiled_gdn >= 32768
    huge = _plan(config, 2**22, host_bytes=125 * GiB)
    assert not huge.fits and huge.tiled_mlp == huge.tiled_gdn == min(lc.PLAN_TILES)
    assert huge.model.host_per_token * 2**22 <= 125 * GiB - lc.HOST_RESERVE_BYTES
    assert "does not fit even so" in str(huge)
    with pytest.raises(ValueError, match=r"tokens: expected a positive int \(the longest step's tokens\), got 0"):
        lc.plan_long_context(config, 0)
    with pytest.raises(TypeError, match="tokens: expected a positive int"):
        lc.plan_long_context(config, 1.5)


@pytest.mark.parametrize("setting, expandable", [(None, False), ("expandable_segments:True", True),
                                                 ("max_split_size_mb:512, expandable_segments:true", True),
                                                 ("expandable_segments:False", False)])
def test_a_plan_that_tiles_or_offloads_advises_expandable_segments_unless_they_are_on(monkeypatch, setting, expandable):
    from q35lab import e2e

    if setting is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", setting)
    config, GiB = e2e.config("9b"), 2**30
    assert lc.expandable_segments() is expandable
    long, short = (_plan(config, tokens, host_bytes=125 * GiB) for tokens in (524288, 32768))
    assert long.expandable_segments is expandable and long.offload_layers > 0
    assert ("expandable_segments:True before CUDA starts" in str(long)) is not expandable
    assert "expandable" not in str(short)  # a step that fits as it is needs no advice


def test_apply_to_qwen3_5_long_context_plans_the_options_says_so_and_refuses_them_twice(monkeypatch):
    config = _model().config
    tokens, rank = 2**20, 4
    frugal = lc.bytes_per_token(config, tiled_mlp_tokens=4096, tiled_gdn_tokens=4096, lora_rank=rank, dtype_bytes=4)
    gpu = frugal.peak(tokens) + 1  # only tiles fit: the plan must tile both
    patch_everywhere(monkeypatch, "usable_gpu_bytes", lambda device=None: gpu)
    patch_everywhere(monkeypatch, "host_memory_available", lambda: 0)  # no host memory: no offload
    expected = lc.plan_long_context(config, tokens, gpu_bytes=gpu, host_bytes=0, lora_rank=rank, dtype_bytes=4)
    assert expected.fits and expected.tiled_gdn and expected.offload_layers == 0
    model = _model(rank=rank, targets=GDN_TARGETS + MLP_TARGETS)
    report = q35lab.apply_to_qwen3_5(model, long_context=tokens)
    assert report.runs["long context"] == str(expected)
    # a step the plan predicts to fit untiled runs untiled: every tiled forward knows how long that is
    assert 0 < expected.untiled_up_to < tokens
    assert f"tiles only in steps over {expected.untiled_up_to:,} tokens" in str(expected)
    forwards = [vars(m)["forward"] for m in model.modules()
                if isinstance(vars(m).get("forward"), lc_tiles.TiledForward)]
    assert len(forwards) == 4 and {f.untiled_up_to for f in forwards} == {expected.untiled_up_to}
    assert report.replaced[f"Qwen3_5MLP (tiled, {expected.tiled_mlp} tokens a tile)"] == 2
    assert report.replaced[f"Qwen3_5GatedDeltaNet (tiled, {expected.tiled_gdn} tokens a tile)"] == 1
    assert not any("offloaded" in name for name in report.replaced)
    reverted = q35lab.revert(model)
    assert reverted.reverted["Qwen3_5MLP (tiled)"] == 2
    with pytest.raises(ValueError, match="long_context: it plans tiled_mlp, tiled_gdn and offload_checkpoints"):
        q35lab.apply_to_qwen3_5(_model(), long_context=tokens, tiled_mlp=8)
    with pytest.raises(ValueError, match=r"long_context: expected a positive int \(the longest step's tokens\)"):
        q35lab.apply_to_qwen3_5(_model(), long_context=0)
    with pytest.warns(UserWarning, match="no Qwen3.5 module found in Linear"):  # nothing to plan for
        assert q35lab.apply_to_qwen3_5(torch.nn.Linear(4, 4), long_context=tokens).nothing_to_patch


def test_the_plan_runs_untiled_every_step_its_memory_model_fits_untiled_with_the_same_offload():
    from q35lab import e2e

    config, GiB = e2e.config("9b"), 2**30
    plan = _plan(config, 524288, gpu_bytes=125 * GiB, host_bytes=125 * GiB)
    assert plan.tiled_gdn and plan.offload_layers
    untiled = lc.bytes_per_token(config, offload=plan.offload_layers)
    assert plan.untiled_up_to % 1024 == 0 and plan.tiled_gdn < plan.untiled_up_to < 524288
    assert untiled.peak(plan.untiled_up_to) <= 125 * GiB < untiled.peak(plan.untiled_up_to + 1024)
    assert _plan(config, 32768, host_bytes=125 * GiB).untiled_up_to == 0  # nothing tiled: nothing to say
    assert _plan(config, 393216, gpu_bytes=139 * GiB, host_bytes=125 * GiB).untiled_up_to == 0  # offload only


def test_tile_only_above_runs_steps_up_to_its_tokens_untiled_and_longer_ones_in_tiles(monkeypatch):
    ids = torch.randint(0, 128, (2, 9), device=device())
    reference = _model(targets="all-linear")
    ref64 = _step(_on_pytorch_core(copy.deepcopy(reference).double()), ids)
    plain, model = copy.deepcopy(reference), copy.deepcopy(reference)
    q35lab.apply_to_qwen3_5(plain)
    q35lab.apply_to_qwen3_5(model, tiled_gdn=4, tiled_mlp=4)
    calls = []
    for name in ("tiled_mlp", "tiled_gated_delta_net_layer"):
        def counted(*args, _real=getattr(lc, name), _name=name, **kwargs):  # noqa: B008 (bound per name)
            calls.append(_name)
            return _real(*args, **kwargs)
        patch_everywhere(monkeypatch, name, counted)
    tiled = _step(model, ids)
    assert set(calls) == {"tiled_mlp", "tiled_gated_delta_net_layer"}
    assert lc.tile_only_above(model, 18) == 4  # 2 rows of 9 tokens: untiled (a layer, its GatedDeltaNet, 2 MLPs)
    calls.clear()
    untiled = _step(model, ids)
    assert calls == []
    fla = _fla_runs(model)
    _assert_tiled_step(untiled, _step(plain, ids), ref64, fla, rtol=1e-5, atol=1e-6)  # the untiled model's step
    _assert_tiled_step(tiled, untiled, ref64, fla, rtol=1e-4, atol=1e-5)
    lc.tile_only_above(model, 17)  # one token over: tiled again
    calls.clear()
    _step(model, ids)
    assert "tiled_gated_delta_net_layer" in calls
    lc.tile_only_above(model, 18)
    assert pickle.loads(pickle.dumps(vars(_gdn(model))["forward"])).untiled_up_to == 18
    q35lab.apply_to_qwen3_5(model, tiled_gdn=4, tiled_mlp=4)  # tiles given again: every longer sequence tiled
    assert {vars(m)["forward"].untiled_up_to for m in model.modules()
            if isinstance(vars(m).get("forward"), lc_tiles.TiledForward)} == {0}
    for value, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError)):
        with pytest.raises(error, match="tokens: expected an int of at least 0"):
            lc.tile_only_above(model, value)


def test_the_long_context_variant_plans_for_half_a_million_tokens_even_at_a_short_step():
    from q35lab import e2e

    model = e2e.build("tiny", 2, rank=8, device=device(), dtype=torch.float32)
    report = e2e.prepare(model, "q35lab+long_context", tokens=16)
    assert report.runs["long context"].startswith("planned for 524,288 tokens: nothing"), report


def test_the_switch_refuses_a_moe_model_and_a_model_planned_already_and_counts_other_trainable_weights():
    from tiny_models import moe_causal_lm

    with pytest.raises(NotImplementedError, match="long_context: the memory model covers the dense"):
        q35lab.apply_to_qwen3_5(moe_causal_lm(), long_context=4096)
    model = _model()
    q35lab.apply_to_qwen3_5(model, tiled_mlp=8)
    assert lc.has_long_context_options(model)
    with pytest.raises(ValueError, match="long_context: the model carries long-context options already"):
        q35lab.apply_to_qwen3_5(model, long_context=4096)
    q35lab.revert(model)
    assert not lc.has_long_context_options(model)
    offloaded = _model()
    lc.offload_decoder_layers(offloaded, 1.0)
    assert lc.has_long_context_options(offloaded)
    # weights that train besides the adapters (modules_to_save, a full fine-tune): their gradients and AdamW moments
    whole = _model()
    whole.base_model.model.lm_head.weight.requires_grad_(True)
    report = q35lab.apply_to_qwen3_5(whole, long_context=4096)
    n = whole.base_model.model.lm_head.weight.numel()
    plan = lc.plan_long_context(whole.config, 4096, gpu_bytes=lc.usable_gpu_bytes(whole.device), lora_rank=4,
                                dtype_bytes=4, other_trainable_parameters=n)
    assert plan.model.fixed["other trainable parameters: gradients + AdamW moments"] == n * (4 + 8)
    assert report.runs["long context"] == str(plan)


def test_a_plan_without_host_memory_does_not_offload_and_one_that_cannot_fit_warns(monkeypatch):
    from q35lab import e2e

    config, GiB = e2e.config("9b"), 2**30
    patch_everywhere(monkeypatch, "host_memory_available", lambda: None)  # unknown: no offload planned
    plan = lc.plan_long_context(config, 524288)
    assert plan.offload_layers == 0 and plan.tiled_gdn and "host memory for checkpoints: none (unknown)" in str(plan)
    tight = lc.plan_long_context(config, 4096, gpu_bytes=1 * GiB, host_bytes=0)
    assert not tight.fits and "no option that helps" in str(tight) and "fits as it is" not in str(tight)
    for bad, error in ((-1, ValueError), (float("nan"), ValueError), ("139", TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"gpu_bytes: expected a finite number of at least 0 \(bytes\)"):
            lc.plan_long_context(config, 4096, gpu_bytes=bad)
    patch_everywhere(monkeypatch, "usable_gpu_bytes", lambda device=None: 1.0)  # nothing fits
    with pytest.warns(UserWarning, match=r"long_context=4096: .*does not fit even so"):
        q35lab.apply_to_qwen3_5(_model(), long_context=4096)


@pytest.mark.parametrize("gpu_gib, host_gib, multiple", [(139, 128, 1024), (139, 100, 4096), (79.18, 128, 1024),
                                                         (139, 0, 1024), (47.5, 31, 3072)])
def test_the_longest_planned_step_fits_and_one_multiple_more_does_not(gpu_gib, host_gib, multiple):
    from q35lab import e2e

    config, GiB = e2e.config("9b"), 2**30
    settings = dict(gpu_bytes=gpu_gib * GiB, host_bytes=host_gib * GiB, host_reserve_bytes=lc.HOST_RESERVE_BYTES)
    longest = lc.longest_planned_step(config, multiple=multiple, **settings)
    assert longest.fits and longest.tokens % multiple == 0
    assert longest.model.peak(longest.tokens) <= settings["gpu_bytes"]
    assert longest.tokens * longest.model.host_per_token <= max(0, settings["host_bytes"] - lc.HOST_RESERVE_BYTES)
    assert longest == lc.plan_long_context(config, longest.tokens, **settings)  # the plan a user gets for it
    assert not lc.plan_long_context(config, longest.tokens + multiple, **settings).fits
    # what the bisection takes for granted, on a grid below: every shorter step fits too
    for tokens in range(multiple, longest.tokens, max(multiple, longest.tokens // 37 // multiple * multiple)):
        assert lc.plan_long_context(config, tokens, **settings).fits, tokens
    # beyond what fits untiled only with options (and offload only where the host has room)
    untiled = lc.bytes_per_token(config).longest_fit(settings["gpu_bytes"])
    assert longest.tokens > untiled and (longest.tiled_gdn or longest.offload_layers)
    assert bool(longest.offload_layers) == (host_gib * GiB > lc.HOST_RESERVE_BYTES)


def test_the_longest_planned_step_where_nothing_fits_and_bad_arguments():
    from q35lab import e2e

    config, GiB = e2e.config("9b"), 2**30
    none = lc.longest_planned_step(config, gpu_bytes=1 * GiB, host_bytes=0, multiple=2048)
    assert not none.fits and none.tokens == 2048 and "does not fit even so" in str(none)
    with pytest.raises(ValueError, match=r"multiple: expected a positive int \(the step's granularity in tokens\)"):
        lc.longest_planned_step(config, host_bytes=0, multiple=0)
    with pytest.raises(TypeError, match="multiple: expected a positive int"):
        lc.longest_planned_step(config, host_bytes=0, multiple=1024.0)
    with pytest.raises(ValueError, match="gpu_bytes: expected a finite number of at least 0"):
        lc.longest_planned_step(config, gpu_bytes=-1)


def test_the_options_are_off_unless_asked_for_and_the_patched_step_is_the_same_either_way():
    """Off costs nothing because nothing is installed: the default patch adds no tile, no offload, and
    no report entry, and its step is the one a patch with the options left at their defaults makes."""
    plain, spelled_out = _model(), _model()
    spelled_out.load_state_dict(plain.state_dict())
    report = q35lab.apply_to_qwen3_5(plain)
    q35lab.apply_to_qwen3_5(spelled_out, tiled_mlp=None, tiled_gdn=None, offload_checkpoints=None, long_context=None)
    assert not lc.has_long_context_options(plain) and not lc.has_long_context_options(spelled_out)
    assert "long context" not in report.runs and "tiled" not in str(report)
    ids = torch.randint(0, plain.config.vocab_size, (1, 11), device=device())
    for model in (plain, spelled_out):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), spelled_out.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name


def _padded_step(model, ids, mask):
    model.zero_grad(set_to_none=True)
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _checkpoint_the_call(layer, *args, **kwargs):
    """transformers 5.17's ``GradientCheckpointingLayer.__call__``: the checkpoint around the module call."""
    if layer.gradient_checkpointing and layer.training:
        return layer._gradient_checkpointing_func(functools.partial(torch.nn.Module.__call__, layer, **kwargs), *args)
    return torch.nn.Module.__call__(layer, *args, **kwargs)


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("checkpointed", ["forward", "__call__"])
def test_the_tiled_gated_delta_net_layer_under_checkpointing_runs_each_tile_twice_with_a_padding_mask(
        early_stop, checkpointed, monkeypatch):
    """The whole GatedDeltaNet decoder layer in each tile, fp32, left padding, tiles not dividing T:
    the untiled step's loss and gradients; each tile forward twice (once more with early stop off),
    whether transformers checkpoints the layer's class forward (5.2x) or its call (5.17, simulated)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if checkpointed == "__call__" and "__call__" not in vars(GradientCheckpointingLayer):
        monkeypatch.setattr(GradientCheckpointingLayer, "__call__", _checkpoint_the_call, raising=False)
    ids = torch.randint(0, 128, (2, 13), device=device())
    mask = torch.ones(2, 13, dtype=torch.long, device=device())
    mask[1, :4] = 0
    reference = _model(targets="all-linear")
    ref64 = _padded_step(_on_pytorch_core(copy.deepcopy(reference).double()), ids, mask)
    q35lab.apply_to_qwen3_5(reference)
    expected = _padded_step(reference, ids, mask)
    model = _model(targets="all-linear")
    q35lab.apply_to_qwen3_5(model, tiled_gdn=5)
    layer = next(m for m in model.modules() if hf_modules.is_gated_delta_net_layer(m))
    assert isinstance(vars(layer)["forward"], lc.TiledGDNLayerForward)
    tiles = _count_tiles(_gdn(model))
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        got = _padded_step(model, ids, mask)
    _assert_tiled_step(got, expected, ref64, _fla_runs(model), rtol=1e-4, atol=1e-5)
    passes = [5, 5, 3] + ([] if early_stop else [5, 5, 3]) + [3, 5, 5]
    assert tiles == passes


def test_the_tiled_layers_carries_are_hidden_from_the_offload_and_freed_by_its_backward():
    """The carries are the node's saved tensors, packed as they are: the offload moves one tensor a layer
    (its checkpoint input), and the carries are gone once the layer's backward has run, the loss still alive."""
    import gc
    import weakref

    ids = torch.randint(0, 128, (1, 12), device=device())
    reference = _model(targets="all-linear")
    ref64 = _step(_on_pytorch_core(copy.deepcopy(reference).double()), ids)
    q35lab.apply_to_qwen3_5(reference)
    expected = _step(reference, ids)
    model = _model(targets="all-linear")
    report = q35lab.apply_to_qwen3_5(model, tiled_gdn=4, offload_checkpoints=1.0, tiled_mlp=4)
    offloader = next(v.offloader for m in model.modules()
                     for v in [vars(m).get("_gradient_checkpointing_func")]
                     if isinstance(v, lc_offload._OffloadedCheckpoint))
    offloader.min_bytes = 0  # the tiny model's checkpoints are small
    carries = []
    original = lc_tiles._run_tiles

    def run_tiles(tiles, x, record_rng, keep_carries=True):  # weak references to the carries the layer saves
        out, kept = original(tiles, x, record_rng, keep_carries)
        if tiles.name == "GatedDeltaNet layer tile" and keep_carries:
            carries.extend(weakref.ref(t) for carry in kept if carry is not None for t in carry)
        return out, kept

    with pytest.MonkeyPatch.context() as patched:
        patch_everywhere(patched, "_run_tiles", run_tiles)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        assert len(carries) == 2 * 2 and all(ref() is not None for ref in carries)  # tiles 2 and 3: (conv rows, S)
        loss.backward()
        gc.collect()
        assert all(ref() is None for ref in carries)  # freed by the backward, though `loss` lives on
    got = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_tiled_step(got, expected, ref64, _fla_runs(model), rtol=1e-4, atol=1e-5)
    assert offloader.stats["offloaded"] == model.config.num_hidden_layers  # one [B, T, H] input a layer, no carry
    assert "GatedDeltaNet and MLP tiled together" in str(report)


def test_hooks_on_the_layers_gated_delta_net_or_mlp_run_the_layer_untiled_and_see_every_call():
    ids = torch.randint(0, 128, (1, 12), device=device())
    for part in ("linear_attn", "mlp"):
        model = _model(targets="all-linear")
        q35lab.apply_to_qwen3_5(model, tiled_gdn=4)
        layer = next(m for m in model.modules() if hf_modules.is_gated_delta_net_layer(m))
        seen = []
        getattr(layer, part).register_forward_hook(lambda module, args, out, seen=seen: seen.append(out.shape[1]))
        tiles = _count_tiles(_gdn(model))
        _step(model, ids)
        assert seen and all(tokens == 12 for tokens in seen), (part, seen)  # whole calls, never a tile's
        assert tiles == [4, 4, 4] * 2 + [4, 4, 4], (part, tiles)  # the GatedDeltaNet tiled alone: three passes


def test_a_tiled_layer_reverts_copies_and_refuses_what_it_cannot_tile():
    model = _model(targets="all-linear")
    q35lab.apply_to_qwen3_5(model, tiled_gdn=4)
    layer = next(m for m in model.modules() if hf_modules.is_gated_delta_net_layer(m))
    copied = copy.deepcopy(model)
    copied_layer = next(m for m in copied.modules() if hf_modules.is_gated_delta_net_layer(m))
    assert vars(copied_layer)["forward"].module is copied_layer  # bound to the copy, not the original
    ids = torch.randint(0, 128, (1, 9), device=device())
    _assert_same(_step(copied, ids), _step(model, ids))
    x = torch.randn(1, 6, TEXT["hidden_size"], device=device())
    with pytest.raises(ValueError, match="cu_seq_lens_q: packed sequences are not tiled"):
        lc.tiled_gated_delta_net_layer(layer, x, 2, cu_seq_lens_q=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match=r"x: expected \[B, T, "):
        lc.tiled_gated_delta_net_layer(layer, x[0], 2)
    with pytest.raises(ValueError, match="attention_mask: expected a 2-D padding mask of shape"):
        lc.tiled_gated_delta_net_layer(layer, x, 2, attention_mask=torch.ones(1, 5))
    with pytest.raises(TypeError, match="layer: expected a transformers GatedDeltaNet decoder layer"):
        lc.tile_gated_delta_net_layer(layer.mlp, 4)
    attention_layer = next(m for m in model.modules()
                           if hf_modules._is_decoder_layer(m) and not hf_modules.is_gated_delta_net_layer(m))
    with pytest.raises(TypeError, match="layer: expected a transformers GatedDeltaNet decoder layer"):
        lc.tiled_gated_delta_net_layer(attention_layer, x, 2)
    report = q35lab.revert(model)
    assert report.reverted["Qwen3_5DecoderLayer (tiled)"] == 1
    assert "forward" not in vars(layer) and not lc.has_long_context_options(model)


def test_the_tiled_layers_recompute_leaves_its_mlps_down_gemm_out_and_keeps_every_gradient(monkeypatch):
    """The layer tile's output comes as (residual, MLP output): its backward roots the MLP's part on the
    down projection's output, left uncomputed in every tile, as a tiled MLP's recompute does."""
    ids = torch.randint(0, 128, (1, 11), device=device())
    reference = _model()
    q35lab.apply_to_qwen3_5(reference)
    expected = _step(reference, ids)
    model = _model()
    q35lab.apply_to_qwen3_5(model, tiled_gdn=4)
    verdicts = []
    real = is_unread
    patch_everywhere(monkeypatch, "is_unread", lambda y, skipped: verdicts.append((len(skipped), real(y, skipped))) or
                        verdicts[-1][1])
    got = _step(model, ids)
    assert verdicts == [(1, True)] * 3  # the GatedDeltaNet layer's 3 tiles, one skipped GEMM each, none redone
    _assert_same(got, expected, rtol=1e-4, atol=1e-5)


def test_torch_compile_of_a_model_with_both_tiles_matches_eager():
    """A model whose GatedDeltaNet layers and MLPs are tiled, compiled with inductor: the step is eager's."""
    from tiny_models import loss_and_grads

    model = _model(targets="all-linear")
    q35lab.apply_to_qwen3_5(model, tiled_gdn=4, tiled_mlp=4)
    ids = torch.randint(0, 128, (2, 9), device=device())
    eager = loss_and_grads(model, ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=MODEL_COMPILER)
    _assert_same(loss_and_grads(model, ids, run=compiled), eager, rtol=1e-4, atol=1e-5)


def test_a_pickled_model_with_both_tiles_loads_tiled_and_trains_the_same():
    import io

    # without checkpointing: the input-grad hook transformers adds for it (enable_input_require_grads) is a
    # local function, which pickle refuses, patched or not
    model = _model(targets="all-linear", checkpointing=False)
    q35lab.apply_to_qwen3_5(model, tiled_gdn=4, tiled_mlp=4)
    ids = torch.randint(0, 128, (1, 9), device=device())
    expected = _step_without_cache(model, ids)
    saved = io.BytesIO()
    torch.save(model, saved)
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
    layer = next(m for m in loaded.modules() if hf_modules.is_gated_delta_net_layer(m))
    assert isinstance(vars(layer)["forward"], lc.TiledGDNLayerForward) and vars(layer)["forward"].module is layer
    _assert_same(_step_without_cache(loaded, ids), expected)


def test_a_tiled_layer_whose_input_needs_no_grad_still_runs_each_tile_twice_under_a_checkpoint():
    """QLoRA's first layer without enable_input_require_grads: no stash, the input kept by the node (hidden
    from the checkpoint with the carries), so the checkpoint's recompute still has nothing to run."""
    model, model64 = _model(targets="all-linear"), _model(targets="all-linear").double()  # the same weights
    q35lab.apply_to_qwen3_5(model)
    layer, layer64 = (next(m for m in m_.modules() if hf_modules.is_gated_delta_net_layer(m))
                      for m_ in (model, model64))
    x = torch.randn(1, 12, TEXT["hidden_size"], device=device())  # requires no grad
    w = torch.randn(1, 12, TEXT["hidden_size"], device=device())

    def grads(layer_, tile, dtype=torch.float32):
        params = {n: p for n, p in layer_.named_parameters() if p.requires_grad}
        run = functools.partial(lc.tiled_gated_delta_net_layer, layer_, tile_tokens=tile)
        out = torch.utils.checkpoint.checkpoint(run, x.to(dtype), use_reentrant=False)
        return dict(zip(params, torch.autograd.grad((out * w.to(dtype)).sum(), list(params.values()))))

    expected = grads(layer, 12)  # one tile: the layer's own math
    with _pytorch_core_installed(layer64.linear_attn):  # fla does not run fp64
        expected64 = grads(layer64, 12, torch.float64)  # transformers' own layer, unpatched
    tiles = _count_tiles(layer.linear_attn)
    got = grads(layer, 5)
    assert tiles == [5, 5, 2] + [2, 5, 5]
    assert got.keys() == expected64.keys() and len(got) > 0
    for name in got:  # fla's core (on a GPU) chunks as it does, not as the tiles: the rule against fp64
        assert_close_by_rule(name, got[name], expected[name], expected64[name])


def test_a_tiled_model_steps_under_torchs_flop_counter_with_the_same_loss_and_gradients():
    """FlopCounterMode registers global module hooks (torch's ModuleTracker) that hook the gradients of
    every input requiring grad: the layers then run untiled with the GatedDeltaNet tiled alone
    (hooks see whole calls), whose tiles must hand its projections inputs the tracker accepts."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(0, 128, (1, 11), device=device())
    reference = _model(targets="all-linear")
    ref64 = _step(_on_pytorch_core(copy.deepcopy(reference).double()), ids)
    counted = {}
    for tile in (None, 4):
        model = copy.deepcopy(reference)
        q35lab.apply_to_qwen3_5(model, **({"tiled_gdn": tile, "tiled_mlp": tile} if tile else {}))
        with FlopCounterMode(display=False) as flops:
            counted[tile] = _step(model, ids), flops.get_total_flops()
    (untiled, untiled_flops), (tiled, tiled_flops) = counted[None], counted[4]
    _assert_tiled_step(tiled, untiled, ref64, _fla_runs(model), rtol=1e-4, atol=1e-5)
    # the GatedDeltaNet tiled alone runs each tile's forward three times under the layer's checkpoint, the
    # untiled one twice
    assert untiled_flops > 0 and tiled_flops > untiled_flops
