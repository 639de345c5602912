"""A whole Qwen3.5 + PEFT training run, patched and unpatched (tiny model, CPU interpreter)."""

import collections
import json
import math
import pathlib
import random
import re
import subprocess
import sys
import types

import pandas as pd
import pytest
import torch
import triton
import triton.language as tl
from conftest import patch_everywhere

import q35lab
from q35lab import e2e
from q35lab.bench.e2e import cli, peers
from q35lab.bench.e2e.timer import _Stamp
from q35lab.runtime import device
from tiny_models import loss_and_grads

LAYERS = 4  # three GatedDeltaNets and one full-attention layer, as the H200 model


def _model(seed=0):
    return e2e.build("tiny", LAYERS, rank=8, device=device(), dtype=torch.float32, seed=seed)


def _train(model, steps, accumulation=2, lr=2e-2, seq=16, batch=1):
    """A plain loop: bf16 autocast, gradient checkpointing (on in build), accumulation."""
    data = e2e.toy_corpus(steps * accumulation * batch, seq, model.get_input_embeddings().weight.shape[0], seed=3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accumulation):
            ids = data[batch * (step * accumulation + micro):][:batch].to(device())
            with torch.autocast(device_type=device().type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def test_three_steps_patched_follow_the_unpatched_loss_curve_and_revert_restores():
    reference = _model()
    unpatched = _train(reference, 3)
    model = _model()
    adapters_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    report = q35lab.apply_to_qwen3_5(model)
    assert set(report.replaced) >= {"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "PEFT lora.Linear (forward)",
                                    "Qwen3_5GatedDeltaNet in_proj (4 projections, 1 node)", "Qwen3_5MLP (SwiGLU)",
                                    "Qwen3_5GatedDeltaNet causal conv1d"}
    patched = _train(model, 3)
    # bf16 autocast on both sides; the kernels round in other places, so allow bf16-sized drift
    assert patched == pytest.approx(unpatched, rel=2e-2)
    trained = dict(model.named_parameters())
    moved = [n for n, p in adapters_before.items() if not torch.equal(p, trained[n])]
    assert len(moved) == len(adapters_before)  # every adapter was updated: the steps were real
    ids = e2e.toy_corpus(2, 24, 256, seed=9).to(device())
    with torch.no_grad():
        before = model(input_ids=ids, labels=ids).loss
        q35lab.revert(model)
        after = model(input_ids=ids, labels=ids).loss
    assert torch.isclose(before, after, rtol=1e-4)
    assert not any(type(m).__module__.startswith("q35lab") for m in model.modules())


def test_trainer_trains_the_patched_model_like_the_unpatched():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    data = e2e.toy_corpus(8, 16, 256, seed=5)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    def run(patched, tmp):
        model = _model()
        if patched:
            q35lab.apply_to_qwen3_5(model)
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
            learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=device().type == "cpu",
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, seed=0,
            data_seed=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows())
        trainer.train()
        return [log["loss"] for log in trainer.state.log_history if "loss" in log]

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        unpatched, patched = run(False, tmp), run(True, tmp)
    assert len(patched) == len(unpatched) == 2 and all(math.isfinite(v) for v in patched)
    assert patched == pytest.approx(unpatched, rel=1e-3)


def test_core_timer_covers_forward_recompute_and_backward_of_every_core_call():
    model = _model()
    result = e2e.measure(model, T=16, steps=1, warmup=0)
    assert result["core_functions"] >= 2  # the delta rule and the causal convolution
    assert 0 < result["core_ms"] < result["step_ms"]
    timer = e2e.RegionTimer()
    timer.start(device().type)
    with timer.functions(model):
        e2e.train_step(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                       e2e.tokens(16, 256, device()))
    # 3 GatedDeltaNets × 2 functions × (forward, checkpoint recompute, backward)
    assert len(timer.intervals) == 3 * 2 * 3


def test_region_union_counts_overlapping_intervals_once():
    timer = e2e.RegionTimer()
    timer.start("cpu")
    origin = timer.origin.time

    def stamp(ms):
        s = _Stamp("cpu")
        s.time = origin + ms / 1e3
        return s

    for a, b in [(5, 9), (0, 2), (1, 3), (8, 12), (20, 21)]:
        timer.intervals.append((stamp(a), stamp(b)))
    assert timer.total_ms() == pytest.approx(3 + 7 + 1)  # [0, 3] ∪ [5, 12] ∪ [20, 21]


@pytest.mark.parametrize("patched", [False, True])
def test_one_gated_delta_net_layer_is_timed_with_its_in_proj_share(patched):
    model = e2e.build("tiny", 1, rank=8, device=device(), dtype=torch.float32)
    if patched:
        q35lab.apply_to_qwen3_5(model)
    result = e2e.measure_layer(model, T=12, steps=1, warmup=0)
    assert 0 < result["in_proj_ms"] < result["layer_ms"] and 0 < result["core_ms"] < result["layer_ms"]
    assert 0 < result["in_proj_share"] < 1


def _search(peak, limit, budget=None, **options):
    """The --fit search against a simulated device: a step of T tokens peaks at ``peak(T)`` bytes
    and runs out of memory above ``limit``. Returns the T tried, in order, and the longest fit."""
    import argparse

    args = argparse.Namespace(**{**dict(T=[8192, 32768], fit=True, fit_max=10**7, fit_from=0, fit_step=1.03),
                                 **options})
    seen, tried = {}, []
    for T in cli._sizes(args, seen, budget):
        assert T not in seen and T % 4096 == 0 and T <= args.fit_max
        tried.append(T)
        seen[T] = ("ok", float(peak(T))) if peak(T) <= limit else ("oom", math.nan)
        assert len(tried) < 40
    return tried, max(T for T, (status, _) in seen.items() if status == "ok")


@pytest.mark.parametrize("fixed_gib, kib_per_token, limit_gib",
                         [(17.2, 437, 78.5), (17.2, 605, 139), (21.7, 154.5, 139),
                                                                 (3.0, 91.0, 10.0)])
def test_fit_search_brackets_the_longest_step_to_one_step(fixed_gib, kib_per_token, limit_gib):
    """The search ends with the longest fit known to one step: a fit, and the step above it out of memory."""
    rng = random.Random(fixed_gib)
    wiggle = {}  # the allocator's rounding: a peak a little off the line, the same for a T each time

    def peak(T):
        wiggle.setdefault(T, rng.uniform(0, 0.3) * 2**30)
        return fixed_gib * 2**30 + T * kib_per_token * 1024 + wiggle[T]

    limit = limit_gib * 2**30
    truth = max(T for T in range(4096, 10**7, 4096) if peak(T) <= limit)
    for budget in (limit, 0.9 * limit, 1.1 * limit, None):  # an exact, a low, a high and no line
        tried, found = _search(peak, limit, budget)
        step = max(4096, int(found * 0.03) // 4096 * 4096)
        assert found <= truth < found + step + 4096, (budget, tried)
        above = [T for T in tried if T > found]
        assert above and min(above) <= found + step  # the step above was tried, and did not fit
        if budget == limit:  # a true line: two steps near the limit after the two asked for
            assert len(tried) <= 5, tried


@pytest.mark.parametrize("optimism", [1.02, 1.05, 1.15, 1.5])
def test_fit_search_comes_down_from_a_guess_that_ran_out_in_few_steps(optimism):
    """A line that over-reaches (the H100's offload search of 2026-12-06: its guess at 311,296 ran out, the
    limit near 295k): down in doubling strides, not halfway back to 64k and up again."""
    peak = lambda T: 17.1 * 2**30 + T * 205 * 1024  # noqa: E731  (the offload's measured line)
    limit = 78.1 * 2**30
    tried, found = _search(peak, limit, budget=optimism * limit, T=[32768, 65536])
    guess = tried[2]
    truth = max(T for T in range(4096, 10**7, 4096) if peak(T) <= limit)
    assert peak(guess) > limit and found <= truth < found + max(4096, int(found * 0.03) // 4096 * 4096)
    assert len(tried) - 3 <= {1.02: 3, 1.05: 4, 1.15: 5, 1.5: 9}[optimism], tried  # a line half off: a bisection
    assert min(tried[3:]) > 65536 * 2  # never back near the lines' two points


def test_fit_search_starts_at_fit_from_stops_at_fit_max_and_at_an_error():
    import argparse

    line = lambda T: 2**30 + T * 2**19  # noqa: E731
    tried, _ = _search(line, 64 * 2**30, fit_from=100_000)
    assert tried[2] == 98304  # the guess given, to a multiple of 4096
    tried, found = _search(line, 10**15, budget=10**15, fit_max=200_000)
    assert found == tried[-1] == 196_608  # nothing beyond --fit-max (to a multiple of 4096)
    seen = {8192: ("ok", 1.0), 32768: ("error", math.nan)}
    sizes = cli._sizes(argparse.Namespace(T=[8192, 32768], fit=True, fit_max=10**6, fit_from=0, fit_step=1.03), seen)
    assert list(sizes) == [8192, 32768]  # an error is not a limit: the search ends
    args = argparse.Namespace(T=[4096], fit=False, fit_max=10**6, fit_from=0, fit_step=1.03)
    assert list(cli._sizes(args)) == [4096] and cli._longest_asked(args) == 4096
    assert cli._longest_asked(argparse.Namespace(T=[4096], fit=True, fit_max=300_000)) == 300_000


def test_an_out_of_memory_row_says_where_and_keeps_the_allocators_account():
    message = ("CUDA out of memory. Tried to allocate 5.72 GiB. GPU 0 has a total capacity of 139.80 GiB of "
               "which 3.30 GiB is free. Including non-PyTorch memory, this process has 136.49 GiB memory in use. "
               "Of the allocated memory 121.02 GiB is allocated by PyTorch, and 14.87 GiB is reserved by PyTorch "
               "but unallocated. If reserved but unallocated memory is large try setting "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")

    def allocate_dx():
        raise torch.cuda.OutOfMemoryError(message)

    try:
        allocate_dx()
    except torch.cuda.OutOfMemoryError as exc:
        note = e2e.out_of_memory_note(exc)
    assert note.startswith("out of memory in allocate_dx (test_end_to_end.py:")
    assert "Tried to allocate 5.72 GiB" in note and "14.87 GiB is reserved by PyTorch but unallocated" in note
    assert "expandable_segments" not in note


def test_a_row_runs_out_of_memory_whether_the_allocator_or_a_triton_launch_says_so(monkeypatch):
    from q35lab.bench.e2e import cli

    args = cli._parser().parse_args(["--out", "x.csv", "--T", "4096", "--fit"])
    for raised, status, said in [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), "oom", "Tried to allocate"),
        (RuntimeError("Triton Error [CUDA]: out of memory"), "oom", "Triton Error [CUDA]: out of memory"),
        (RuntimeError("shape '[4096, 32]' is invalid for input of size 7"), "error", "RuntimeError: shape"),
        (ValueError("out of memory in a message that is not CUDA's"), "error", "ValueError"),
    ]:
        def measure(*_, **__):
            raise raised  # noqa: B023 (called within this iteration, by the row below)

        monkeypatch.setattr(cli, "measure", measure)
        row = cli._measured(None, 4096, args)
        assert row["status"] == status and said in row["note"], (raised, row)


def test_peak_breakdown_replays_the_trace_to_its_highest_point():
    def frame(path, name):
        return {"filename": path, "name": name, "line": 1}

    ours = [frame("/x/site-packages/q35lab/ops/lora.py", "forward"), frame("/x/transformers/models/m.py", "forward")]
    core = [frame("/x/torch/nn/functional.py", "pad"), frame("/x/transformers/models/qwen3_5/m.py", "torch_chunk")]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 300, "frames": core},
        {"action": "free_requested", "addr": 1, "size": 100},  # still counted until completed
        {"action": "alloc", "addr": 3, "size": 50, "frames": []},  # the peak: 450 bytes
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 9, "size": 70},  # allocated before the recording
        {"action": "alloc", "addr": 4, "size": 160, "frames": ours},  # 440: below the peak
    ]
    peak, sources = e2e.peak_breakdown(events)
    assert peak == 450
    assert sources == [("transformers:torch_chunk", 300), ("q35lab:forward", 100),
                       ("no Python frame (autograd's own backward ops)", 50)]
    assert e2e.allocation_source([frame("/x/numpy/core.py", "f")]) == "other Python"
    assert e2e.peak_breakdown([]) == (0, [])


def test_toy_corpus_follows_its_rule():
    data = e2e.toy_corpus(50, 12, 97, seed=1)
    steps = (data[:, 1:] - data[:, :-1]) % 97
    assert (steps == steps[:, :1]).all() and set(steps[:, 0].tolist()) <= {1, 2, 3, 5, 7}
    assert torch.equal(data, e2e.toy_corpus(50, 12, 97, seed=1))


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="variant"):
        e2e.prepare(_model(), "fastest")


@pytest.mark.parametrize("batch, packing", [(None, None), ("packed", None), ("padded", False)])
@pytest.mark.parametrize("variant", ["peft+axolotl", "peft+liger+axolotl"])
def test_axolotl_packing_forward_only_where_the_batch_is_not_padded(monkeypatch, variant, batch, packing):
    """axolotl installs its packing forward for sample packing only; a padded run of several rows
    must not get it (it turns their position_ids into one set of cu_seqlens, which FLA refuses)."""
    seen = []
    monkeypatch.setattr(peers.recipe("axolotl"), "patch",
                        lambda model, packing=None, liger=False: seen.append((packing, liger)) or "patched")
    assert e2e.prepare(_model(), variant, tokens=16, batch=batch) == "patched"
    assert seen == [(packing, variant == "peft+liger+axolotl")]


def test_no_module_of_the_wheel_imports_a_peers_training_stack():
    """axolotl and Unsloth are imported only by the recipes of benchmarks/peers/ and by the per-op
    sweeps (q35lab/bench/<op>.py, which time a peer's kernel where it is installed)."""
    package = pathlib.Path(q35lab.__file__).parent
    importing = re.compile(r"^\s*(import|from)\s+(axolotl|unsloth)\b", re.M)
    sweeps = {path for path in (package / "bench").glob("*.py") if path.stem not in ("__init__", "core", "spec")}
    offenders = [str(path.relative_to(package)) for path in package.rglob("*.py")
                 if importing.search(path.read_text()) and path not in sweeps]
    assert offenders == []
    assert sweeps and any(importing.search(path.read_text()) for path in sweeps)  # the check sees an import


def test_a_peer_variant_without_a_checkout_says_where_its_recipe_lives(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(peers, "benchmarks_folder", lambda: None)
    monkeypatch.delitem(sys.modules, "q35lab_peers.axolotl", raising=False)
    with pytest.raises(peers.RecipeNotFound, match="run from a checkout of the repository: peers' recipes live in"):
        e2e.prepare(_model(), "peft+axolotl")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--variants", "q35lab", "unsloth", "--T", "16", "--out", str(tmp_path / "rows.csv")])
    assert exit_.value.code == 2
    assert "--variants unsloth: run from a checkout of the repository" in capsys.readouterr().err
    assert not (tmp_path / "rows.csv").exists()


def test_a_peer_recipe_is_found_in_the_checkout_and_loaded_once():
    axolotl = peers.recipe("axolotl")
    assert pathlib.Path(axolotl.__file__) == pathlib.Path(q35lab.__file__).parents[1] / "benchmarks/peers/axolotl.py"
    assert peers.recipe("axolotl") is axolotl and peers.missing(["q35lab", "unsloth", "peft+axolotl"]) == []
    assert set(peers.RECIPES) == {v for v in e2e.VARIANTS if "axolotl" in v or v == "unsloth"}


@pytest.mark.parametrize("flag", ["lora", "varlen_attention"])
def test_one_optimization_alone_or_all_but_one(flag):
    """"q35lab:<flag>" turns on that optimization only, "q35lab-<flag>" every one but it (the
    packed step with and without the varlen attention, say)."""
    from q35lab import packed_attention

    only, but = e2e.prepare(_model(), f"q35lab:{flag}"), e2e.prepare(_model(), f"q35lab-{flag}")
    others = [f for f in e2e.ALL_FLAGS if f != flag]
    unavailable = set() if packed_attention.varlen_attention_function() else {"varlen_attention"}  # torch < 2.9
    assert set(only.not_applied) == set(others) | (unavailable & {flag})
    assert all(only.not_applied[f] == "disabled by the caller" for f in others)
    assert set(but.not_applied) == {flag} | unavailable and but.not_applied[flag] == "disabled by the caller"


def test_long_context_variants_tile_the_mlps_and_offload_what_the_host_holds(monkeypatch):
    from q35lab.bench.e2e import variants

    model = _model()
    report = e2e.prepare(model, "q35lab+offload", tokens=16)  # the mechanism: every layer the host holds
    assert any("offloaded" in name for name in report.replaced), report
    # the long variant offloads what the memory model says the step needs: nothing at 16 tokens
    report = e2e.prepare(_model(), "q35lab+long", tokens=16)
    assert any("tiled" in name for name in report.replaced), report
    assert not any("offloaded" in name for name in report.replaced), report
    config = e2e.config("9b")
    patch_everywhere(monkeypatch, "host_memory_available", lambda: 125 * 2**30)
    big = types.SimpleNamespace(config=config, parameters=lambda: iter([torch.zeros(1)]))  # a model on the CPU
    planned = q35lab.long_context.plan_offload_layers(config, 512 * 1024, host_bytes=125 * 2**30,
                                                      tiled_mlp_tokens=8192, tiled_gdn_tokens=8192)
    assert planned[1] and variants.planned_offload_layers(big, 512 * 1024, tiled_mlp_tokens=8192,
                                                          tiled_gdn_tokens=8192) == planned[0] > 0
    # planned for the model's own GPU: on a smaller one, more layers for a shorter step
    smaller = 79 * 2**30
    patch_everywhere(monkeypatch, "usable_gpu_bytes", lambda device=None: smaller)
    on_smaller = q35lab.long_context.plan_offload_layers(config, 320 * 1024, gpu_bytes=smaller, host_bytes=125 * 2**30,
                                                         tiled_mlp_tokens=8192, tiled_gdn_tokens=8192)
    on_h200 = q35lab.long_context.plan_offload_layers(config, 320 * 1024, host_bytes=125 * 2**30,
                                                      tiled_mlp_tokens=8192, tiled_gdn_tokens=8192)
    assert on_smaller[1] and on_smaller[0] > on_h200[0]
    assert variants.planned_offload_layers(big, 320 * 1024, tiled_mlp_tokens=8192,
                                           tiled_gdn_tokens=8192) == on_smaller[0]
    monkeypatch.undo()
    patch_everywhere(monkeypatch, "host_memory_available", lambda: 125 * 2**30)
    assert variants.planned_offload_layers(big, 32768, tiled_mlp_tokens=8192, tiled_gdn_tokens=8192) == 0
    # where no fit is predicted, every layer the host holds: the attempt still runs
    assert variants.planned_offload_layers(big, 4 * 2**20, tiled_mlp_tokens=8192) == variants.offloadable_layers(
        big, 4 * 2**20)
    layers = model.config.get_text_config().num_hidden_layers
    per_layer = 4096 * model.config.get_text_config().hidden_size * 2
    patch_everywhere(monkeypatch, "host_memory_available",
                     lambda: q35lab.long_context.default_host_reserve() + 2.5 * per_layer)
    assert variants.offloadable_layers(model, 4096) == min(layers, 2)
    patch_everywhere(monkeypatch, "host_memory_available", lambda: None)
    assert variants.offloadable_layers(model, 4096) == layers
    tiled_only = e2e.prepare(_model(), "q35lab+tiled", tokens=16)
    assert not any("offloaded" in name for name in tiled_only.replaced), tiled_only
    gdn_only = e2e.prepare(_model(), "q35lab+tiled_gdn", tokens=16)
    assert not any("offloaded" in name for name in gdn_only.replaced), gdn_only
    # each option alone: the tiled GatedDeltaNet leaves the MLPs whole, the tiled MLP the GatedDeltaNets
    assert "GatedDeltaNet (tiled," in str(gdn_only) and "MLP (tiled," not in str(gdn_only), gdn_only
    assert "MLP (tiled," in str(tiled_only) and "GatedDeltaNet (tiled," not in str(tiled_only), tiled_only


def test_a_second_run_keeps_the_rows_it_did_not_measure_again(tmp_path):
    path = tmp_path / "end_to_end.csv"
    first = [{"variant": v, "T": t, "step_ms": 1.0} for v in ("peft", "q35lab") for t in (8192, 32768)]
    e2e.merge_rows(path, first).to_csv(path, index=False)
    merged = e2e.merge_rows(path, [{"variant": "q35lab", "T": 32768, "step_ms": 2.0},
                                   {"variant": "q35lab:flce", "T": 32768, "step_ms": 3.0}])
    assert len(merged) == 5
    assert merged.set_index(["variant", "T"]).loc[("q35lab", 32768), "step_ms"] == 2.0
    assert merged.set_index(["variant", "T"]).loc[("peft", 8192), "step_ms"] == 1.0
    assert len(e2e.merge_rows(tmp_path / "absent.csv", first)) == 4
    # a row without a size (an old failed process) must not turn 131072 into 1.3107e+05
    e2e.merge_rows(path, [{"variant": "peft", "status": "error"}, {"variant": "q35lab", "T": 131072}]).to_csv(
        path, index=False, float_format="%.5g")
    again = e2e.merge_rows(path, [{"variant": "q35lab", "T": 131072, "step_ms": 4.0}])
    assert sorted(again.loc[again.variant == "q35lab", "T"].tolist()) == [8192, 32768, 131072]
    assert again.loc[again["T"] == 131072, "step_ms"].item() == 4.0
    # a child writes a step's row, then the row again with its breakdown: the completed line wins
    done = e2e.merge_rows(path, [{"variant": "q35lab", "T": 32768, "step_ms": 5.0},
                                 {"variant": "q35lab", "T": 32768, "step_ms": 5.0, "floor_ms": 4.0}],
                                 last_line_wins=True)
    row = done.loc[(done.variant == "q35lab") & (done["T"] == 32768)]
    assert len(row) == 1 and row.floor_ms.item() == 4.0


# ----------------------------------------------------------------------------------------------
# peft+axolotl: axolotl's own patches (skipped without axolotl, bitsandbytes, addict or liger-kernel)
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def axolotl_on_this_device(monkeypatch):
    """axolotl importable, its class-level patches undone after the test (the forwards it rewrites,
    the classes its Liger integration swaps in the modeling module); on the CPU, stand-ins for
    the CUDA-only plumbing around its kernels (the Triton kernels and autograd functions stay its own):
    the gated norm's CUDA guard and SM-count query, the interpreter's missing libdevice ``rsqrt``,
    and the SwiGLU launcher's output hard-coded on ``device="cuda"``."""
    for name in ("bitsandbytes", "axolotl.kernels.lora", "axolotl.kernels.rms_norm_gated", "axolotl.utils.dict",
                 "liger_kernel", "axolotl.monkeypatch.models.qwen3_5.modeling",
                 "axolotl.integrations.liger.models.qwen3_5"):  # the last two import pydantic
        pytest.importorskip(name)
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    classes = [hf.Qwen3_5Attention, hf.Qwen3_5DecoderLayer, hf.Qwen3_5GatedDeltaNet, hf.Qwen3_5ForCausalLM]
    saved = [dict(vars(c)) for c in classes]
    for name in ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP"):
        monkeypatch.setattr(hf, name, getattr(hf, name))  # restored at teardown
    if device().type == "cpu":
        import types

        from axolotl.kernels import rms_norm_gated, swiglu

        def swiglu_forward(gate, up):
            out, n = torch.empty_like(gate), gate.numel()
            swiglu._swiglu_fwd_kernel[(triton.cdiv(n, 1024),)](gate_ptr=gate, up_ptr=up, out_ptr=out, n_elements=n,
                                                               block_size=1024)
            return out

        monkeypatch.setattr(rms_norm_gated, "rsqrt", _rsqrt)
        monkeypatch.setattr(rms_norm_gated.FusedRMSNormGated, "forward", lambda self, x, gate: (
            rms_norm_gated.FusedRMSNormGatedFunction.apply(x, gate, self.weight, self.variance_epsilon, self.offset)))
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d: types.SimpleNamespace(multi_processor_count=4))
        monkeypatch.setattr(swiglu, "swiglu_forward", swiglu_forward)
    yield
    for cls, attributes in zip(classes, saved):
        for name in set(vars(cls)) - set(attributes):
            delattr(cls, name)
        for name, value in attributes.items():
            if vars(cls).get(name) is not value:
                setattr(cls, name, value)


@triton.jit
def _rsqrt(x):  # libdevice's, which the Triton interpreter lacks
    return 1.0 / tl.sqrt(x)


def _loss_and_lora_grads(model, ids):
    loss, grads = loss_and_grads(model, ids)
    return loss.item(), {n: g for n, g in grads.items() if "lora_" in n}


def _counting(monkeypatch, module, names):
    """Counts the calls of each autograd function ``names`` of ``module``."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        function = getattr(module, name)

        def apply(*args, _name=name, _apply=function.apply, **kwargs):
            calls[_name] += 1
            return _apply(*args, **kwargs)

        monkeypatch.setattr(function, "apply", apply)
    return calls


def test_axolotl_patches_match_peft_loss_and_lora_gradients(axolotl_on_this_device, monkeypatch):
    from axolotl.kernels import lora

    ids = e2e.toy_corpus(2, 24, 256, seed=9).to(device())
    reference = _loss_and_lora_grads(_model(), ids)  # before axolotl's class-level patches
    model = _model()
    report = e2e.prepare(model, "peft+axolotl")
    assert "lora_mlp_kernel on 4 MLPs, qkv on 1 and o on 1 attentions" in report and "gated norm 3" in report
    calls = _counting(monkeypatch, lora, ["LoRA_MLP", "LoRA_QKV", "LoRA_O", "LoRA_FusedProj"])
    with torch.no_grad():
        model(input_ids=ids)
    packed = "in_proj fused on 3" in report  # axolotl's packing forward, only where FLA is installed
    assert calls == {"LoRA_MLP": 4, "LoRA_QKV": 1, "LoRA_O": 1 + 3 * packed, "LoRA_FusedProj": 3 * packed}
    loss, grads = _loss_and_lora_grads(model, ids)
    assert loss == pytest.approx(reference[0], rel=1e-5)
    assert grads.keys() == reference[1].keys() and len(grads) == 62
    for name, expected in reference[1].items():
        assert (grads[name] - expected).abs().max() <= 1e-3 * expected.abs().max(), name


def test_axolotl_packing_forward_runs_the_gated_delta_net_in_proj_and_out_proj_kernels(axolotl_on_this_device,
                                                                                        monkeypatch):
    """The forward axolotl installs for sample packing, on one GatedDeltaNet called without
    position_ids (its dense path, no FLA needed); the whole model always passes position_ids,
    which that forward hands to FLA's varlen kernels, so without FLA it refuses."""
    from axolotl.kernels import lora

    def layer_run(model):
        gdn = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
        generator = torch.Generator(device="cpu").manual_seed(4)
        x = torch.randn(2, 12, gdn.in_proj_qkv.in_features, generator=generator).to(device()).requires_grad_()
        out = gdn(x)
        out.backward(torch.randn(out.shape, generator=generator).to(device()))
        return out.detach(), x.grad, {n: p.grad for n, p in gdn.named_parameters() if "lora_" in n}

    reference = layer_run(_model())
    model = _model()
    report = peers.recipe("axolotl").patch(model, packing=True)
    assert "in_proj fused on 3 GatedDeltaNets, out_proj on 3" in report
    calls = _counting(monkeypatch, lora, ["LoRA_FusedProj", "LoRA_O"])
    out, dx, grads = layer_run(model)
    assert calls == {"LoRA_FusedProj": 1, "LoRA_O": 1}
    torch.testing.assert_close(out, reference[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx, reference[1], rtol=1e-4, atol=1e-5)
    assert grads.keys() == reference[2].keys() and len(grads) == 10
    for name, expected in reference[2].items():
        assert (grads[name] - expected).abs().max() <= 1e-3 * expected.abs().max(), name
    from axolotl.monkeypatch.models.qwen3_5 import modeling

    if modeling.fla_chunk_gated_delta_rule is None:
        with pytest.raises(RuntimeError, match="flash-linear-attention"):
            model(input_ids=e2e.toy_corpus(1, 8, 256).to(device()))


def test_axolotl_recipe_builds_liger_norms_and_loss_around_axolotl_lora_kernels(axolotl_on_this_device):
    """peft+liger+axolotl: Liger's RMSNorm and FLCE, axolotl's LoRA kernels and gated norm; the MLP is
    Liger's SwiGLU class, its forward axolotl's LoRA_MLP (bound later). The modules are rebuilt around
    the built model's own weights and PEFT layers: the parameters are the same ones."""
    model = _model()
    before = dict(model.named_parameters())
    report = e2e.prepare(model, "peft+liger+axolotl")
    from axolotl.integrations.liger.models.qwen3_5 import lce_forward  # (axolotl's training stack kept out by prepare)
    from axolotl.monkeypatch.lora_kernels import apply_lora_mlp_swiglu

    assert report.startswith("Liger: RMSNorm on 11, SwiGLU MLP class on 4 (its forward replaced by LoRA_MLP on 4), "
                             "Liger's fused linear cross entropy; axolotl: lora_mlp_kernel on 4 MLPs"), report
    assert "qkv on 1 and o on 1 attentions" in report and "gated norm 3" in report
    kinds = collections.Counter(type(m).__name__ for m in model.modules())
    assert (kinds["LigerSwiGLUMLP"], kinds["FusedRMSNormGated"], kinds["Qwen3_5RMSNorm"],
            kinds["Qwen3_5MLP"]) == (4, 3, 0, 0)
    norms = [m for m in model.modules() if type(m).__name__ == "LigerRMSNormForQwen3_5"]
    assert len(norms) == 11 and all((n.offset, n.casting_mode, n.in_place) == (1.0, "gemma", False) for n in norms)
    mlps = [m for m in model.modules() if type(m).__name__ == "LigerSwiGLUMLP"]
    assert all(m.forward.__func__ is apply_lora_mlp_swiglu for m in mlps)
    assert type(model.get_base_model()).forward is lce_forward
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is p for n, p in before.items())


@pytest.mark.skipif(device().type != "cuda", reason="Liger's Triton kernels do not run under the Triton interpreter")
def test_axolotl_recipe_matches_peft_loss_and_lora_gradients(axolotl_on_this_device, monkeypatch):
    """Liger's SwiGLU never runs (LoRA_MLP's own does); its norms run in the forward and in the
    recompute, its FLCE once; the loss and the LoRA gradients are PEFT's."""
    from axolotl.kernels import lora
    from liger_kernel import ops

    ids = e2e.toy_corpus(2, 24, 256, seed=9).to(device())
    reference = _loss_and_lora_grads(_model(), ids)  # before the class-level patches
    model = _model()
    e2e.prepare(model, "peft+liger+axolotl")
    axolotl_calls = _counting(monkeypatch, lora, ["LoRA_MLP", "LoRA_QKV"])
    liger_calls = _counting(monkeypatch, ops, ["LigerRMSNormFunction", "LigerSiLUMulFunction",
                                               "LigerFusedLinearCrossEntropyFunction"])
    loss, grads = _loss_and_lora_grads(model, ids)
    assert axolotl_calls == {"LoRA_MLP": 2 * 4, "LoRA_QKV": 2}  # forward and checkpointing's recompute
    assert liger_calls == {"LigerRMSNormFunction": 2 * 10 + 1, "LigerSiLUMulFunction": 0,  # 10 norms a pass, the
                           "LigerFusedLinearCrossEntropyFunction": 1}                      # final norm once
    assert loss == pytest.approx(reference[0], rel=1e-4)
    assert grads.keys() == reference[1].keys() and len(grads) == 62
    for name, expected in reference[1].items():
        assert (grads[name] - expected).abs().max() <= 2e-3 * expected.abs().max(), name


def test_real_sizes_have_their_published_dimensions():
    nine, big, moe = (e2e.config(size) for size in ("9b", "27b", "35b-a3b"))
    assert (nine.num_hidden_layers, nine.hidden_size, nine.intermediate_size) == (32, 4096, 12288)
    assert (big.num_hidden_layers, big.hidden_size, big.intermediate_size, big.num_attention_heads,
            big.num_key_value_heads, big.linear_num_key_heads, big.linear_num_value_heads) == (64, 5120, 17408, 24, 4,
                                                                                               16, 48)
    assert type(moe).__name__ == "Qwen3_5MoeTextConfig"
    assert (moe.num_hidden_layers, moe.hidden_size, moe.num_experts, moe.num_experts_per_tok,
            moe.moe_intermediate_size) == (40, 2048, 256, 8, 512)
    assert all(c.vocab_size == 248_320 and c.layer_types[3] == "full_attention"
               and c.layer_types[2] == "linear_attention" for c in (nine, big, moe))
    assert e2e.config("9b", layers=4).num_hidden_layers == 4 and e2e.config("h200").num_hidden_layers == 4
    with pytest.raises(ValueError, match="size: expected one of"):
        e2e.config("7b")


def test_rows_of_another_model_size_are_kept_when_the_same_variant_and_T_are_measured(tmp_path):
    path = tmp_path / "end_to_end.csv"
    old = [{"variant": "q35lab", "T": 32768, "size": "h200", "layers": 4, "step_ms": 1.0},
           {"variant": "q35lab", "T": 32768, "size": "9b", "layers": 32, "step_ms": 2.0}]
    e2e.merge_rows(path, old).to_csv(path, index=False)
    merged = e2e.merge_rows(path, [{"variant": "q35lab", "T": 32768, "size": "9b", "layers": 32, "step_ms": 3.0}])
    assert sorted(zip(merged["size"], merged["step_ms"])) == [("9b", 3.0), ("h200", 1.0)]


# ----------------------------------------------------------------------------------------------
# The step's floor and its kernel-category breakdown
# ----------------------------------------------------------------------------------------------
def test_the_floor_of_the_tiny_step_matches_a_hand_count():
    """tiny: H 64, I 128, 2 heads (+ 1 kv head) × 32, GatedDeltaNet 2 key / 4 value heads × 16,
    V 256, layers (GDN, GDN, GDN, attention), LoRA r = 8, T = 16.

    GEMM FLOPs of a linear [k -> n] per token: 6kn + 8r(k + n) = 6kn + 64(k + n); the MLP's down
    projection 4kn + 64(k + n) (its base GEMM is not recomputed: the layer ends there).
    GDN: qkv 64->128 61,440; z 64->64 32,768; b, a 64->4 5,888 each; out 64->64 32,768 = 138,752.
    attention: q 64->128 61,440; k, v 64->32 18,432 each; o 64->64 32,768 = 131,072.
    MLP: gate, up 64->128 61,440 each, down 128->64 45,056 = 167,936.
    3 × (138,752 + 167,936) + 131,072 + 167,936 + LM head 4·64·256 = 1,284,608 per token.

    Streaming elements per token, (forward, backward): every layer 2 norms (128, 192), 2 residual
    adds (384, 384), SwiGLU (384, 640) = (1,024, 1,408); GDN conv over 128 channels (256, 384) and
    gated norm over 64 (192, 320): (1,472, 2,112); attention q/k norm over 96 (192, 288), rotary
    on 3 heads × 8 dims (48, 48), output gate over 64 (192, 320): (1,456, 2,064). Forward twice
    (recompute) but the last residual add's (192): 3 × 4,864 + 4,784 + final norm 320 = 19,696
    elements, 39,392 bytes per token."""
    from q35lab.bench.e2e import floor

    terms = floor.step_floor(e2e.config("tiny"), 16, 8, matmul_tflops=1.0, copy_gbps=1.0, sdpa_ms=2.0, core_ms=3.0)
    assert terms["gemm_tflop"] * 1e12 == pytest.approx(16 * 1_284_608)
    assert terms["streaming_gb"] * 1e9 == pytest.approx(16 * 39_392)
    assert terms["gemm_ms"] == pytest.approx(16 * 1_284_608 / 1e9)  # 1 TFLOP/s
    assert terms["streaming_ms"] == pytest.approx(16 * 39_392 / 1e6)  # 1 GB/s
    assert (terms["attention_ms"], terms["core_ms"]) == (2.0, 9.0)  # 1 attention layer, 3 GatedDeltaNets
    assert terms["total_ms"] == pytest.approx(terms["gemm_ms"] + 2.0 + 9.0 + terms["streaming_ms"])
    unknown = floor.step_floor(e2e.config("tiny"), 16, 8, 1.0, 1.0, sdpa_ms=None, core_ms=3.0)
    assert math.isnan(unknown["attention_ms"]) and math.isnan(unknown["total_ms"]) and unknown["core_ms"] == 9.0


@pytest.mark.parametrize("size, T, rank", [("tiny", 16, 8), ("tiny", 7, 1), ("9b", 32768, 16), ("35b-a3b", 8192, 16)])
def test_the_step_gemms_are_the_work_the_floor_counts(size, T, rank):
    """step_gemms lists the products (m, k, n) that gemms_alone_ms times one by one: their FLOPs
    (2mkn each) are step_gemm_flop's, GEMM by GEMM of linear_flop; on a CPU nothing is timed."""
    from q35lab.bench.e2e import floor

    config = e2e.config(size, layers=4)
    gemms = floor.step_gemms(config, T, rank)
    assert sum(2 * m * k * n * count for (m, k, n), count in gemms.items()) == floor.step_gemm_flop(config, T, rank)
    assert all(count > 0 and min(shape) > 0 for shape, count in gemms.items())
    assert (T, config.hidden_size, config.vocab_size) in gemms  # the LM head's forward
    if not torch.cuda.is_available():
        assert math.isnan(floor.gemms_alone_ms(config, T, rank, "cpu"))
    terms = floor.step_floor(config, T, rank, 1.0, 1.0, 1.0, 1.0, gemms_alone_ms=5.0)
    assert terms["gemm_at_shapes_ms"] == 5.0 and terms["total_ms"] == pytest.approx(
        terms["gemm_ms"] + terms["attention_ms"] + terms["core_ms"] + terms["streaming_ms"])  # beside, not in it


@pytest.mark.parametrize("size", ["tiny", "35b-a3b"])
def test_the_floor_counts_every_linear_layer_of_the_model(size):
    """The config's linear layers are the built model's nn.Linear modules (those PEFT wraps), and
    a MoE layer's routed experts are its expert parameters."""
    from transformers import AutoModelForCausalLM

    from q35lab.bench.e2e import floor

    config = e2e.config(size, layers=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for index, kind in ((0, "linear_attention"), (3, "full_attention")):
        layer = model.model.layers[index]
        built = {name.split(".", 1)[1]: (m.in_features, m.out_features) for name, m in layer.named_modules()
                 if isinstance(m, torch.nn.Linear)}
        counted = {linear.name: (linear.k, linear.n) for linear in floor.decoder_linears(config, kind)}
        adapted = {linear.name for linear in floor.decoder_linears(config, kind) if linear.lora}
        assert {name: counted[name] for name in adapted} == built  # "self_attn.q_proj" is q_proj, and so on
        if size == "35b-a3b":
            experts = layer.mlp.experts
            assert counted["experts.gate_up_proj"] == tuple(experts.gate_up_proj.shape[:0:-1])
            assert counted["experts.down_proj"] == tuple(experts.down_proj.shape[:0:-1])
            assert counted["router"] == tuple(layer.mlp.gate.weight.shape[::-1])


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "GEMM"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)", "GEMM"),
    ("aten::mm", "GEMM"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4, false, false, cutlass::bfloat16_t>>",
     "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "delta rule"),
    ("chunk_fwd_kernel_o", "delta rule"),
    ("recompute_w_u_fwd_kernel", "delta rule"),
    ("void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel<1, c10::BFloat16, int>", "conv"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "conv"),
    ("causal_conv1d_fwd_kernel", "conv"),
    ("_offset_rms_norm_fwd_kernel", "q35lab kernels"),
    ("_gated_rms_norm_bwd_kernel", "q35lab kernels"),
    ("_swiglu_bwd_kernel", "q35lab kernels"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
     "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
     "{lambda(float)#1}>>", "copies/casts"),
    ("Memcpy DtoD (Device -> Device)", "copies/casts"),
    ("aten::_to_copy", "copies/casts"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, "
     "float, float, at::native::binary_internal::MulFunctor<float>>>>", "other elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3>>",
     "other elementwise"),
    ("_rms_norm_forward_kernel", "other elementwise"),  # Liger's
])
def test_kernels_are_categorized_by_their_profiler_names(name, category):
    assert e2e.categorize(name) == category


def _profile_of_a_step():
    """Events shaped as torch.profiler's (CPU events with parents, CUDA kernels), 1 ms of kernels."""
    import itertools
    import types

    from torch.autograd import DeviceType

    clock = itertools.count()

    def cpu(name, parent=None, id=0, seq=-1, thread=1, fwd_thread=0, shapes=()):
        return types.SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, id=id, sequence_nr=seq,
                                     thread=thread, fwd_thread=fwd_thread, stack=[], self_cpu_time_total=0.0,
                                     input_shapes=[list(s) for s in shapes],
                                     time_range=types.SimpleNamespace(start=next(clock)), linked_correlation_id=0)

    def frames(*names):  # outermost first, as the calls were made
        parent = None
        for name in names:
            parent = cpu(name, parent)
        return parent

    def kernel(name, us, id, linked=0):
        return types.SimpleNamespace(name=name, device_type=DeviceType.CUDA, device_time=us, id=id,
                                     linked_correlation_id=linked)

    model = frames("transformers/models/qwen3_5/modeling_qwen3_5.py(545): forward",
                   "peft/tuners/lora/layer.py(1074): forward")
    cumsum = cpu("aten::cumsum",
                 frames("transformers/models/qwen3_5/modeling_qwen3_5.py(286): torch_chunk_gated_delta_rule"),
                 seq=9)
    sdpa = cpu("aten::_flash_attention_forward", frames("transformers/integrations/sdpa_attention.py(96): "
                                                        "sdpa_attention_forward"), id=77)
    node = cpu("autograd::engine::evaluate_function: CumsumBackward0", seq=9, thread=2, fwd_thread=1)
    cast = cpu("aten::copy_", cpu("aten::_to_copy", cpu("autograd::engine::evaluate_function: ToCopyBackward0",
                                                        seq=50, thread=2, fwd_thread=1), shapes=[(4096, 16), ()]),
               shapes=[(4096, 16), (4096, 16)])
    launches = [
        cpu("cudaLaunchKernel", cpu("aten::mm", model, seq=7), id=101),
        cpu("cuLaunchKernel", frames("/site-packages/q35lab/ops/swiglu.py(210): swiglu"), id=102),
        cpu("cuLaunchKernel", frames("axolotl/kernels/swiglu.py(80): swiglu_forward"), id=103),
        cpu("cudaLaunchKernel", cumsum, id=104),
        cpu("cudaLaunchKernel", cpu("aten::flip", node, thread=2), id=105),
        cpu("cudaLaunchKernel", cast, id=106),
    ]
    kernels = [
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 500, 101),
        kernel("_swiglu_fwd_kernel", 100, 102),
        kernel("_swiglu_fwd_kernel", 50, 103),  # axolotl's kernel of the same name
        kernel("void at::native::tensor_kernel_scan_innermost_dim<float, std::plus<float>>", 80, 104),
        kernel("void at::native::elementwise_kernel<128, 2, flip_kernel_impl<float>>", 70, 105),
        kernel("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", 150, 106),
        kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256>>", 40, 900, linked=77),
        kernel("Memset (Device)", 10, 999),  # launched by nothing the profile recorded
    ]
    others = [node, cast.cpu_parent, cast.cpu_parent.cpu_parent, sdpa]
    events = [*launches, *kernels, *others]
    for e in list(events):
        while getattr(e, "cpu_parent", None) is not None and e.cpu_parent not in events:
            events.append(e.cpu_parent)
            e = e.cpu_parent
    return events


def test_the_breakdown_groups_device_time_by_category_and_names_the_launching_code():
    rows = {row["category"]: row for row in e2e.breakdown(_profile_of_a_step())}
    assert list(rows) == list(e2e.CATEGORIES)
    assert {c: round(r["ms"], 6) for c, r in rows.items()} == {
        "GEMM": 0.5, "attention": 0.04, "delta rule": 0.15, "conv": 0.0, "q35lab kernels": 0.1, "copies/casts": 0.15,
        "other elementwise": 0.06}
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0) and rows["GEMM"]["share"] == pytest.approx(0.5)
    sources = {c: json.loads(r["sources"]) for c, r in rows.items()}
    assert sources["GEMM"] == {} and sources["conv"] == {}  # GEMM's are not named; conv took nothing
    # the op it is linked to
    assert sources["attention"] == {"transformers:sdpa_attention.sdpa_attention_forward": 0.04}
    assert sources["delta rule"] == {  # aten kernels of the PyTorch delta rule, its backward named by its forward op
        "transformers:modeling_qwen3_5.torch_chunk_gated_delta_rule": 0.08,
        "backward of transformers:modeling_qwen3_5.torch_chunk_gated_delta_rule": 0.07}
    assert sources["q35lab kernels"] == {"q35lab:swiglu.swiglu": 0.1}
    assert sources["copies/casts"] == {"backward: ToCopyBackward0": 0.15}  # a node whose forward op is unknown
    assert sources["other elementwise"] == {"axolotl:swiglu.swiglu_forward": 0.05, "no Python frame": 0.01}
    # what each kernel was for, by the outermost aten op that queued it and its inputs' shapes; under no aten
    # op, the kernel's own name (cut to 90 characters)
    calls = {c: json.loads(r["aten_calls"]) for c, r in rows.items()}
    assert calls["copies/casts"] == {"aten::_to_copy [[4096, 16]]": 0.15}  # the cast, not the copy_ inside it
    assert calls["delta rule"] == {"aten::cumsum": 0.08, "aten::flip": 0.07}  # no shapes recorded: the name alone
    assert calls["other elementwise"] == {"kernel: _swiglu_fwd_kernel": 0.05, "kernel: Memset (Device)": 0.01}
    assert calls["GEMM"] == {}
    coarse = {r["category"]: json.loads(r["sources"]) for r in e2e.breakdown(_profile_of_a_step(), threshold=0.1)}
    assert coarse["attention"] == {} and len(coarse["delta rule"]) == 2  # 4% is below the threshold, 15% above


def test_breakdown_writes_one_row_per_category_beside_the_floor(tmp_path, monkeypatch):
    """The CLI's --breakdown on the CPU: one more step profiled (aten ops stand in for kernels),
    the floor's rates measured (no ceilings without a GPU), rows beside end_to_end.csv; the step's
    row names the caching allocator's settings the process ran with."""
    out = tmp_path / "end_to_end.csv"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert e2e.main(["--variants", "peft", "--size", "tiny", "--T", "16", "--steps", "1", "--warmup", "0",
                     "--breakdown",
                     "--out", str(out)]) == 0
    import pandas as pd

    steps, categories = pd.read_csv(out), pd.read_csv(tmp_path / "step_breakdown.csv")
    assert {"step_ms", "core_ms", "peak_gib", "device_ms", "floor_ms", "kernels", "busy"} <= set(steps.columns), \
        steps.note.tolist()
    assert steps.kernels[0] == categories.kernels.sum() > 0  # on the CPU, the aten ops that stand in for kernels
    assert steps.busy[0] == pytest.approx(steps.device_ms[0] / steps.step_ms[0], rel=1e-4)
    assert steps.allocator.tolist() == ["expandable_segments:True"]
    assert list(categories.category) == ["GEMM", "attention", "delta rule", "conv", "q35lab kernels", "copies/casts",
                                         "other elementwise"]
    assert (categories[["variant", "T", "size", "layers"]].drop_duplicates().values.tolist()
            == [["peft", 16, "tiny", 4]])
    # (five significant digits in the CSV)
    assert categories.share.sum() == pytest.approx(1.0, rel=1e-4)
    assert categories.ms.sum() == pytest.approx(categories.device_ms[0], rel=1e-4)
    assert (categories.sdpa_layer_ms > 0).all() and (categories.core_layer_ms > 0).all()
    assert (categories.floor_gemm_tflop > 0).all()
    delta = json.loads(categories.set_index("category").loc["delta rule", "sources"])
    assert json.loads(categories.set_index("category").loc["delta rule", "aten_calls"])  # the ops, with shapes
    assert (categories.step_ms == steps.step_ms[0]).all()  # the timed step of the same process, beside its floor
    import transformers

    assert set(steps.transformers) == set(categories.transformers) == {transformers.__version__}
    if torch.cuda.is_available():  # the ceilings measured, fla's kernels (or the PyTorch fallback's) named
        assert (categories.floor_total_ms > 0).all() and delta
    else:  # no ceilings on a CPU; the fallback's aten ops stand in for the kernels
        assert categories.floor_total_ms.isna().all()
        assert "transformers:modeling_qwen3_5.torch_chunk_gated_delta_rule" in delta


def test_the_breakdown_of_a_profile_without_linked_correlation_ids_still_counts_every_category():
    # torch 2.11's profiler events have no linked_correlation_id (the H200 run failed on it): the
    # categories stay whole, and only a kernel that was reachable through that link loses its name
    events = _profile_of_a_step()
    for e in events:
        del e.linked_correlation_id
    rows = {row["category"]: row for row in e2e.breakdown(events)}
    linked = {row["category"]: row for row in e2e.breakdown(_profile_of_a_step())}
    assert {c: r["ms"] for c, r in rows.items()} == {c: r["ms"] for c, r in linked.items()}
    assert json.loads(rows["attention"]["sources"]) == {"no Python frame": 0.04}
    assert json.loads(rows["q35lab kernels"]["sources"]) == {"q35lab:swiglu.swiglu": 0.1}


@pytest.mark.parametrize("patched", [False, True])
def test_the_floor_times_the_delta_rule_with_the_heads_the_layer_passes_it(patched):
    """The core measured alone gets q, k, v shaped as the step hands them (transformers < 5.20
    repeats q and k to the value heads first; newer ones pass the key heads): another head count
    would be another fla autotuning key, tuned afresh (it once ran past a 300 s limit on the H200).
    The recording forward leaves the layer's and the module's functions as they were."""
    from q35lab.bench.e2e.floor import core_call, delta_rule_alone_ms

    model = _model(seed=3)
    if patched:
        q35lab.apply_to_qwen3_5(model)
    gdn = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    module = __import__(type(gdn).__module__, fromlist=["_"])
    before = module.torch_chunk_gated_delta_rule
    passed = []
    real = module.torch_chunk_gated_delta_rule

    def spy(query, key, value, *args, **kwargs):  # what the layer itself hands the module's core
        passed.append([tuple(t.shape[2:4]) for t in (query, key, value)])
        return real(query, key, value, *args, **kwargs)

    module.torch_chunk_gated_delta_rule = spy
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 8), device=device()))
    finally:
        module.torch_chunk_gated_delta_rule = real
    call = core_call(model, tokens=8)
    assert call["heads"] == passed[0]
    assert call["heads"][2] == (gdn.num_v_heads, gdn.head_v_dim) and call["heads"][0][1] == gdn.head_k_dim
    assert call["kwargs"]["use_qk_l2norm_in_kernel"] is True and call["kwargs"]["output_final_state"] is False
    assert module.torch_chunk_gated_delta_rule is before
    assert delta_rule_alone_ms(model, 24) > 0


def test_a_failed_child_replaces_only_its_own_size_rows(tmp_path, monkeypatch):
    """A variant's process that dies leaves a stand-in error row keyed like the rows it would have
    written (size, layers): the same variant's rows at other sizes stay."""
    from q35lab.bench.e2e import cli

    path = tmp_path / "end_to_end.csv"
    kept = [{"variant": "peft+liger", "T": 32768, "size": size, "layers": layers, "status": "ok", "step_ms": ms}
            for size, layers, ms in (("9b", 32, 5162.1), ("27b", 64, 15337.0))]
    pd.DataFrame(kept).to_csv(path, index=False)
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    cli.main(["--variants", "peft+liger", "--size", "35b-a3b", "--T", "32768", "--out", str(path)])
    rows = pd.read_csv(path).set_index("size")
    assert sorted(rows.index) == ["27b", "35b-a3b", "9b"]
    assert rows.loc["9b", "step_ms"] == 5162.1 and rows.loc["27b", "step_ms"] == 15337.0
    failed = rows.loc["35b-a3b"]
    assert failed.status == "error" and failed.layers == 40 and failed.note == "the process failed"


def test_a_recorded_step_failing_with_a_system_error_runs_again_without_the_recompute_early_stop():
    """memory_at_peak's way around pytorch#179536: the step once more with the recompute run to
    each layer's end; a step that works runs once, and other errors are not caught."""
    import weakref

    import torch.utils.checkpoint as checkpointing

    from q35lab.bench.e2e.memory import with_full_recompute_on_system_error

    seen, first_steps_tensor = [], []

    def failing_once():
        seen.append(checkpointing._enable_checkpoint_early_stop)
        if len(seen) == 1:
            held = torch.ones(1000)  # what a failed step's frames hold (its graph, its checkpoints)
            first_steps_tensor.append(weakref.ref(held))
            raise SystemError("<built-in method apply of FunctionMeta object> returned NULL "
                              "without setting an exception")
        assert first_steps_tensor[0]() is None  # the failed step's frames are gone before the retry
        return "snapshot"

    default = checkpointing._enable_checkpoint_early_stop  # None: stop early, torch's default
    assert with_full_recompute_on_system_error(failing_once) == ("snapshot", False)
    assert seen == [default, False] and default is not False
    assert checkpointing._enable_checkpoint_early_stop is default  # restored after
    seen.clear()
    assert with_full_recompute_on_system_error(lambda: seen.append(1) or "ok") == ("ok", True) and seen == [1]

    def out_of_memory():
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        with_full_recompute_on_system_error(out_of_memory)


def test_a_kernel_under_no_aten_op_is_named_by_its_name_cut_to_90_characters():
    from q35lab.bench.e2e import kernels

    long_name = "void at::native::vectorized_elementwise_kernel<4, " + "T" * 200 + ">"
    assert kernels._short(long_name) == long_name[:89] + "…" and len(kernels._short(long_name)) == 90
    assert kernels._short("_gather_rows_kernel") == "_gather_rows_kernel"


def test_merge_leftovers_keeps_the_rows_a_killed_parent_left_in_its_jsonl(tmp_path):
    """A child writes its row to the .jsonl beside --out and the parent merges at the end; a parent
    killed by a time limit in between leaves the row there. --merge-leftovers puts it in the CSV
    (replacing that variant's old row of the same T) and removes the file; with none, nothing changes."""
    import pandas as pd

    out = tmp_path / "end_to_end.csv"
    key = {"T": 32768, "size": "9b", "layers": 32}
    pd.DataFrame([{"variant": "q35lab", **key, "status": "ok", "step_ms": 3700.0},
                  {"variant": "peft", **key, "status": "ok", "step_ms": 5700.0}]).to_csv(out, index=False)
    lines = out.with_suffix(".jsonl")
    lines.write_text(json.dumps({"variant": "q35lab", **key, "status": "ok", "step_ms": 3561.5}) + "\n")
    assert e2e.main(["--merge-leftovers", "--out", str(out)]) == 0
    rows = pd.read_csv(out).set_index("variant")
    assert rows.step_ms.to_dict() == {"peft": 5700.0, "q35lab": 3561.5} and not lines.exists()
    before = out.read_text()
    assert e2e.main(["--merge-leftovers", "--out", str(out)]) == 0 and out.read_text() == before


def test_unsloth_row_says_why_it_did_not_run_without_a_gpu(tmp_path):
    """Unsloth's training path needs a CUDA GPU: on a CPU its row is kept, "skipped", with the reason."""
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the variant itself")
    out = tmp_path / "end_to_end.csv"
    assert e2e.main(["--variants", "unsloth", "--size", "tiny", "--T", "16", "--steps", "1", "--warmup", "0",
                     "--out", str(out)]) == 0
    import pandas as pd

    row = pd.read_csv(out).iloc[0]
    assert (row.variant, row["T"], row["size"], row.status) == ("unsloth", 16, "tiny", "skipped")
    assert "needs a CUDA GPU" in row.note


def test_unsloth_checkpoint_loads_back_as_the_same_model(tmp_path):
    """The checkpoint the Unsloth variant loads holds the seeded weights of the other variants, and
    a tokenizer that transformers' loader accepts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from q35lab.bench.e2e.model import base_model
    write_checkpoint = peers.recipe("unsloth").write_checkpoint  # benchmarks/peers/unsloth.py

    built = base_model("tiny", layers=4, seed=int(torch.randint(0, 2**31, ())))  # fresh weights each run
    folder = write_checkpoint(built, tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert type(loaded) is type(built) and loaded.config.architectures == [type(built).__name__]
    theirs = dict(loaded.named_parameters())
    for name, p in built.named_parameters():
        assert torch.equal(theirs[name], p), name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 0


def test_checkpointing_variants_plan_the_layers_or_turn_checkpointing_off_and_train_a_step():
    """q35lab+ckpt_auto plans for the step's tokens (against an H200's memory off a GPU: nothing checkpointed at
    the tiny size); the +no_ckpt variants train with checkpointing off. Each runs a measured step."""
    def forwards(model):
        calls = []
        for layer in model.get_base_model().model.layers:
            layer.mlp.register_forward_pre_hook(lambda module, args: calls.append(1))
        return calls

    model = _model()
    report = e2e.prepare(model, "q35lab+ckpt_auto", tokens=16)
    assert report.checkpoint_plan.tokens == 16 and report.checkpoint_plan.checkpointed == ()
    assert "0 of 4 decoder layers checkpointed" in report.runs["checkpointing"]
    calls = forwards(model)
    e2e.measure(model, T=16, steps=1, warmup=0)
    assert len(calls) == LAYERS  # each layer's forward once
    for variant in ("q35lab+no_ckpt", "peft+no_ckpt"):
        model = _model()
        report = e2e.prepare(model, variant, tokens=16)
        assert (report is None) == (variant == "peft+no_ckpt")
        assert not any(layer.gradient_checkpointing for layer in model.get_base_model().model.layers)
        calls = forwards(model)
        e2e.measure(model, T=16, steps=1, warmup=0)
        assert len(calls) == LAYERS
    with pytest.raises(ValueError, match="tokens_per_step"):
        e2e.prepare(_model(), "q35lab+ckpt_auto")


def test_expert_lora_variants_train_lora_on_the_routed_experts():
    """"<variant>+expert_lora": PEFT's target_parameters on the experts' fused weights besides every
    linear layer; q35lab routes those wrappers through routed_experts' LoRA terms, the same loss."""
    def model():
        return e2e.build("tiny-moe", 1, rank=4, device=device(), dtype=torch.float32, expert_lora=True)

    ids = e2e.toy_corpus(1, 12, 256, seed=2).to(device())
    peft_model, ours = model(), model()
    assert e2e.prepare(peft_model, "peft+expert_lora") is None
    assert any("experts" in n and "lora_A" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    report = e2e.prepare(ours, "q35lab+expert_lora")
    assert report.replaced["PEFT ParamWrapper (routed experts' LoRA)"] == 1
    torch.testing.assert_close(ours(input_ids=ids, labels=ids).loss, peft_model(input_ids=ids, labels=ids).loss,
                               rtol=1e-4, atol=1e-5)
    assert {"peft+expert_lora", "peft+liger+expert_lora", "q35lab+expert_lora"} <= set(e2e.VARIANTS)
    with pytest.raises(ValueError, match="expert_lora: expected a MoE size"):
        e2e.build("tiny", 1, rank=4, device=device(), dtype=torch.float32, expert_lora=True)


def test_fp8_variant_quantizes_the_base_and_trains_a_step():
    """q35lab+fp8: apply_to_qwen3_5(base_precision="fp8"); a measured step runs (its time and peak on a GPU)."""
    model = _model()
    report = e2e.prepare(model, "q35lab+fp8")
    assert report.replaced["frozen base weight in FP8 e4m3 (nn.Linear)"] > 0 and "base precision" in report.runs
    e2e.measure(model, T=16, steps=1, warmup=0)
