"""q35lab's patch under PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): two CPU processes
over gloo train the tiny Qwen3.5 + PEFT LoRA model, patched and then sharded (each decoder layer and
the root), for two SGD steps.

Each rank trains on an input of its own; FSDP averages the two ranks' gradients. The references are
computed on each rank too, without sharding, as DDP would (each rank's gradients all-reduced and
averaged before the step): the single-process patched model (a), the unpatched model in fp32 and
in fp64 (b). The parent process compares them:

* (a) FSDP changes nothing but where the weights live: the same kernels see the same numbers, and
  the average of two gradients has the same bits whether halved before or after the sum (halving is
  exact in binary floating point), so the sharded model's losses and gradients are held to the
  single-process patched model's within a few fp32 ulps (they come out bit for bit equal here);
* (b) against the unpatched model, the numerics rule (``q35lab.numerics``): at most twice the fp32
  unpatched model's distance from its fp64 twin, plus fp32's absolute slack, for the losses of both
  steps and the first step's gradients, each of those also within 1e-2 of fp64 norm-wise.

The order is patch, then shard: ``apply_to_qwen3_5`` replaces the norms by modules that hold the
original Parameter objects, which ``fully_shard`` then shards like any other, and every other
patched forward reads its weights from the modules at call time, where FSDP has put the gathered
ones. The other order cannot work: FSDP records the (module, name) of each parameter when it
shards, so a module put in afterwards keeps the sharded DTensor and is never given the gathered
weight. ``test_patching_after_fully_shard_is_refused_with_a_clear_error`` asks for a clear refusal.

The workers write their results to files; a failing rank's traceback (and each rank's log) is in
the failure message. ``Q35LAB_FSDP_SEED`` replays a seed that a failure printed.
"""

import datetime
import faulthandler
import os
import random
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)
if not dist.is_gloo_available():
    pytest.skip("the gloo backend is not available in this torch build", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2, torch >= 2.6)
    from torch.distributed.tensor import DTensor
except ImportError as exc:  # pragma: no cover - older torch
    pytest.skip(f"FSDP2 (torch.distributed.fsdp.fully_shard) is not available: {exc}", allow_module_level=True)

from q35lab.long_context import enable_checkpointing
from q35lab.numerics import assert_close_by_rule

WORLD = 2
#: apply_to_qwen3_5's flags: every optimization; without the in_proj packing/fusion and the fused loss
#: (flce), their unfused paths together (one config: each spawned config costs CI seconds). Every other
#: flag stays at its default (on).
CONFIGS = {"everything": {}, "in_proj=False, flce=False": {"in_proj": False, "flce": False},
           "long context": {"tiled_mlp": 4, "tiled_gdn": 4},
           "checkpointing auto": {"checkpointing": "auto", "tokens_per_step": 18, "memory_budget": 2**50}}
#: The config that also offloads every decoder layer's checkpoint input to host memory (min_bytes=0:
#: the tiny layers' inputs are below the offload's default threshold), before sharding
LONG = "long context"
#: The config whose plan (a budget for everything, steps of SHAPE's 18 tokens) runs every decoder layer once a step
AUTO = "checkpointing auto"
LR = 1.0  # SGD on the LoRA weights: large enough that the second step's loss moves visibly
SHAPE = (2, 9)  # a batch per rank: 2 sequences of 9 tokens
DEADLINE_S = 300  # both ranks together take ~20 s; a loaded CI box, several times that
#: (a): gradients of the same fp32 computations, reduced the same way: a few ulps (see the docstring)
SAME_RTOL, SAME_ATOL = 1e-6, 1e-8


# ----------------------------------------------------------------------------------------------
# What each rank runs (in a process of its own, started by torch.multiprocessing.spawn)
# ----------------------------------------------------------------------------------------------
def _model(seed: int, dtype=torch.float32):
    """The tiny Qwen3.5 with LoRA on every linear layer (lora_B random: LoRA starts at B = 0, which
    would hide a wrong adapter gradient) and gradient checkpointing, as the e2e benchmark trains it."""
    from tiny_models import lora_causal_lm

    model = lora_causal_lm(seed)
    enable_checkpointing(model)
    return model.to(dtype).train()


def _shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)


def _inputs(seed: int) -> torch.Tensor:
    """Every rank's token ids, [WORLD, *SHAPE]; each rank takes its own row."""
    return torch.randint(0, 128, (WORLD, *SHAPE), generator=torch.Generator().manual_seed(seed + 1))


def _step(model, ids, fused_calls: list) -> dict:
    """Forward with labels, backward. Gradients: FSDP's reduced ones gathered whole (``full_tensor``,
    a collective), or, for an unsharded model, all-reduced and averaged in place (DDP), so that the
    optimizer step that follows is the same on every side."""
    model.zero_grad(set_to_none=True)
    calls_before = len(fused_calls)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads, sharded = {}, []
    for name, p in model.named_parameters():  # the same order on every rank: collectives match
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            sharded.append(name)
            grads[name] = p.grad.full_tensor().detach().clone()
        else:
            dist.all_reduce(p.grad)
            p.grad.div_(WORLD)
            grads[name] = p.grad.detach().clone()
    return {"loss": out.loss.detach().clone(), "grads": grads, "sharded_grads": sharded,
            "logits": out.logits is not None, "fused_calls": len(fused_calls) - calls_before}


def _two_steps(model, ids, fused_calls) -> list[dict]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    steps = [_step(model, ids, fused_calls)]
    optimizer.step()
    steps.append(_step(model, ids, fused_calls))
    return steps


def _lora_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _shard_then_patch(seed, ids, fused_calls) -> dict:
    """The other order: what apply_to_qwen3_5 does to a model fully_shard has sharded already, and
    what revert does to a model patched, then sharded."""
    import q35lab

    outcome = {}
    patched = _model(seed)
    q35lab.apply_to_qwen3_5(patched)
    _shard(patched)
    try:
        q35lab.revert(patched)
        outcome["revert"] = "reverted"
    except Exception as exc:
        outcome["revert_raised"] = f"{type(exc).__name__}: {exc}"
    model = _model(seed)
    _shard(model)
    try:
        q35lab.apply_to_qwen3_5(model)
    except Exception as exc:
        return {**outcome, "raised": f"{type(exc).__name__}: {exc}"}
    try:
        return {**outcome, "steps": _two_steps(model, ids, fused_calls)}
    except Exception as exc:  # the same on both ranks (the first norm's forward): no collective is left waiting
        return {**outcome, "step_error": f"{type(exc).__name__}: {exc}"}


def _rank_results(rank: int, seed: int) -> dict:
    import q35lab
    from q35lab.long_context import offload_decoder_layers
    from q35lab.ops.fused_projections import FusedLoRAProjectionsFunction

    fused_calls = []  # one entry a call of the fused projections' autograd node (in_proj, gate/up)
    forward = FusedLoRAProjectionsFunction.forward
    FusedLoRAProjectionsFunction.forward = staticmethod(lambda ctx, *a: fused_calls.append(1) or forward(ctx, *a))

    ids = _inputs(seed)[rank]
    results = {"unpatched": _two_steps(_model(seed), ids, fused_calls),
               "unpatched64": _two_steps(_model(seed, torch.float64), ids, fused_calls),
               "lora_names": _lora_names(_model(seed)), "configs": {},
               "device": (str(q35lab.runtime.device()), torch.cuda.is_available())}
    for name, flags in CONFIGS.items():
        single = _model(seed)
        q35lab.apply_to_qwen3_5(single, **flags)
        sharded = _model(seed)
        report = q35lab.apply_to_qwen3_5(sharded, **flags)  # patch first, then shard
        offloaders = [offload_decoder_layers(m, 1.0, min_bytes=0) for m in (single, sharded)] if name == LONG else []
        _shard(sharded)
        results["configs"][name] = {"single": _two_steps(single, ids, fused_calls),
                                    "fsdp": _two_steps(sharded, ids, fused_calls),
                                    "offloaded": [o.stats["offloaded"] for o in offloaders],
                                    "replaced": dict(report.replaced), "report": str(report)}
    results["shard_first"] = _shard_then_patch(seed, ids, fused_calls)  # last: it may leave a step half done
    return results


def _worker(rank: int, store: str, out_dir: str, seed: int) -> None:
    out = Path(out_dir)
    log = open(out / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)  # this rank's prints, warnings and a stuck rank's stacks: in its log
    os.dup2(log.fileno(), 2)
    # a rank stuck (a collective its peer never joins) writes every thread's stack, then exits
    faulthandler.dump_traceback_later(DEADLINE_S - 20, exit=True, file=log)
    warnings.simplefilter("ignore")
    # The ranks run on the CPU, where fla's kernels cannot run (their autotuner asks for a GPU
    # driver: "0 active drivers" on the H200 machine, whose fla is on the path). Before anything
    # imports transformers, fla is made absent, so transformers takes its PyTorch delta rule here
    # as on a machine without fla (importlib's find_spec answers None for a None module entry).
    sys.modules["fla"] = None
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ and any(
            name == "lo" for _, name in socket.if_nameindex()):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # ranks of one host: loopback, whatever the hostname resolves to
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=DEADLINE_S))
    try:
        results = _rank_results(rank, seed)
        torch.save(results, out / f"rank{rank}.pt")
    except BaseException:
        traceback.print_exc()  # in the log too: the spawn error carries it to the parent as well
        raise
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The parent: run both ranks once for the module, then compare
# ----------------------------------------------------------------------------------------------
def _logs(out: Path) -> str:
    parts = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.log"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        parts.append(f"--- rank {rank} log (last 4000 characters) ---\n{text[-4000:]}")
    return "\n".join(parts)


#: What the ranks' environment sets: no GPU, and the Triton interpreter (a GPU machine runs this
#: file's CPU test like any other; its GPU path is measured by benchmarks/fsdp2_step.py)
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "Q35LAB_INTERPRET": "1"}


def _spawn_on_the_cpu(worker, args):
    """``mp.spawn`` of the ranks with ``CPU_ONLY`` in their environment (a spawned process reads
    it when it starts, before it imports torch or q35lab); this process's own is left as it was."""
    import torch.multiprocessing as mp

    saved = {name: os.environ.get(name) for name in CPU_ONLY}
    os.environ.update(CPU_ONLY)
    try:
        return mp.spawn(worker, args=args, nprocs=WORLD, join=False)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    import torch.multiprocessing as mp  # (its exceptions, below)

    seed = int(os.environ.get("Q35LAB_FSDP_SEED", random.randrange(2**31)))
    out = tmp_path_factory.mktemp("fsdp2")
    store = out / "store"  # a FileStore: no TCP port to pick, none to collide with another worker's
    context = _spawn_on_the_cpu(_worker, (str(store), str(out), seed))
    deadline, failure = time.monotonic() + DEADLINE_S, None
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for process in context.processes:  # the ranks this fixture started
                    if process.is_alive():
                        process.kill()
                        process.join(10)
                failure = f"the {WORLD} FSDP2 ranks did not finish in {DEADLINE_S} s"
                break
    except mp.ProcessRaisedException as exc:  # join has stopped the other rank; exc holds the traceback
        failure = f"an FSDP2 rank failed:\n{exc}"
    except mp.ProcessExitedException as exc:  # killed, or stuck and ended by its faulthandler (stacks in its log)
        failure = f"an FSDP2 rank died: {exc}"
    if failure:
        pytest.fail(f"{failure}\n(seed {seed}; Q35LAB_FSDP_SEED={seed} replays it)\n{_logs(out)}", pytrace=False)
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
    return seed, ranks


def _averaged(ranks, key, config=None):
    """Per step: (each rank's loss, the rank-averaged gradients) of one side, for every rank."""
    def side(r):
        return r["configs"][config][key] if config else r[key]

    steps = []
    for i in range(2):
        losses = [side(r)[i]["loss"] for r in ranks]
        # every rank holds the same averaged gradients (all-reduced, or gathered by full_tensor)
        grads = side(ranks[0])[i]["grads"]
        for r in ranks[1:]:
            other = side(r)[i]["grads"]
            assert other.keys() == grads.keys()
            for name in grads:
                assert torch.equal(other[name], grads[name]), f"{key} step {i + 1}: ranks differ in {name}"
        steps.append((losses, grads))
    return steps


@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp2_loss_and_every_lora_gradient_match_the_single_process_patched_model(fsdp_results, config):
    seed, ranks = fsdp_results
    lora = set(ranks[0]["lora_names"])
    for i, ((loss, grads), (loss_ref, grads_ref)) in enumerate(zip(_averaged(ranks, "fsdp", config),
                                                                   _averaged(ranks, "single", config))):
        where = f"{config}, step {i + 1}, seed {seed}"
        assert set(grads) == set(grads_ref) == lora, where  # every LoRA weight, and nothing else, has a gradient
        for rank, (a, b) in enumerate(zip(loss, loss_ref)):
            torch.testing.assert_close(a, b, rtol=SAME_RTOL, atol=SAME_ATOL, msg=f"loss of rank {rank} ({where})")
        for name in grads:
            assert grads_ref[name].abs().max() > 0, f"{name}: zero gradient ({where})"
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=SAME_RTOL, atol=SAME_ATOL,
                                       msg=f"{name} ({where})")
    first, second = (ranks[0]["configs"][config]["fsdp"][i]["loss"] for i in range(2))
    assert abs(first - second) > 1e-3, f"the SGD step did not move the loss ({config}, seed {seed})"


@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp2_loss_and_every_lora_gradient_follow_the_unpatched_model_by_the_numerics_rule(fsdp_results, config):
    """The rule for the losses of both steps, and for the first step's gradients: there all three
    sides start from the same weights. (After a step they differ by each side's rounding of the
    update, which the rule, made for one computation of the same inputs, does not bound; (a) holds
    the second step's gradients to the single-process patched model's instead.)"""
    seed, ranks = fsdp_results
    sides = zip(_averaged(ranks, "fsdp", config), _averaged(ranks, "unpatched"), _averaged(ranks, "unpatched64"))
    for i, ((loss, grads), (loss32, grads32), (loss64, grads64)) in enumerate(sides):
        where = f"{config}, step {i + 1}, seed {seed}"
        assert set(grads) == set(grads32) == set(grads64), where
        for rank in range(WORLD):
            assert_close_by_rule(f"loss of rank {rank} ({where})", loss[rank], loss32[rank], loss64[rank])
        if i > 0:
            continue
        for name in grads:
            assert_close_by_rule(f"{name} ({where})", grads[name], grads32[name], grads64[name])
            # fp32's absolute slack (1e-5) is as large as the smallest gradients (in_proj_a's, max |g| ~1e-5):
            # the rule alone would pass a zero one. Norm-wise the patched model usually comes within ~1e-4
            # of fp64, and on rare seeds (cancellation in the smallest, summed in tiles) a few 1e-3; a wrong
            # gradient is ~1 off.
            exact = grads64[name]
            rel = ((grads[name].double() - exact).norm() / exact.norm()).item()
            assert rel <= 1e-2, f"{name} ({where}): ||out - ref64|| / ||ref64|| = {rel:.2e} > 1e-2"


@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp2_shards_the_lora_gradients_and_runs_the_fused_paths(fsdp_results, config):
    seed, ranks = fsdp_results
    flags = CONFIGS[config]
    for rank, r in enumerate(ranks):
        assert r["device"] == ("cpu", False), f"rank {rank} saw {r['device']}: CPU_ONLY did not reach it"
        result = r["configs"][config]
        replaced = result["replaced"]
        assert ("Qwen3_5GatedDeltaNet in_proj (4 projections, 1 node)" in replaced) == flags.get("in_proj", True), \
            result["report"]
        assert ("Qwen3_5ForCausalLM loss (fused linear cross entropy)" in replaced) == flags.get("flce", True), \
            result["report"]
        for fsdp, single in zip(result["fsdp"], result["single"]):
            assert set(fsdp["sharded_grads"]) == set(r["lora_names"]) and not single["sharded_grads"]
            # the fused loss makes no logits: under FSDP too it ran, not the model's own loss
            assert fsdp["logits"] == single["logits"] == (not flags.get("flce", True))
            # one fused node per GatedDeltaNet in_proj (if fused) and per MLP's gate/up, forward and
            # checkpointing's recompute: FSDP's gathered weights did not send them back to PEFT's path
            per_forward = (1 if flags.get("in_proj", True) else 0) + 2
            calls = fsdp["fused_calls"]
            runs = 1 if config == AUTO else 2  # the plan's layers: no recompute
            assert calls == single["fused_calls"] and (config == LONG or calls == runs * per_forward), \
                f"rank {rank}, seed {seed}"
        if config == LONG:  # tiles (in the forward, and again in the backward) and every layer's input offloaded
            assert calls > 2 * per_forward and any("tiled" in k for k in replaced), result["report"]
            layers = 2  # the tiny model's decoder layers: one checkpoint input each, per step (x 2 steps)
            assert result["offloaded"] == [2 * layers, 2 * layers], (result["offloaded"], seed)


def test_patching_after_fully_shard_is_refused_with_a_clear_error(fsdp_results):
    """fully_shard, then apply_to_qwen3_5 (or revert of a model patched, then sharded): refused,
    saying to patch before sharding (a norm put in after fully_shard would keep the sharded
    DTensor weight for good, and its kernel would fail on it)."""
    seed, ranks = fsdp_results
    for o in (r["shard_first"] for r in ranks):
        for key in ("raised", "revert_raised"):
            assert key in o, f"{key[:-7] or 'apply'}: not refused ({o.keys()}, seed {seed})"
            assert "fully_shard" in o[key] and "before" in o[key], o[key]
