"""The harness on a CPU: bytes models, the CSV schema, figures rendered to PNG, the CLI."""

import ast
import inspect
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from q35lab import bench, plots, runtime
from q35lab.bench import core
from q35lab.bench.offset_rms_norm import bytes_model
from q35lab.bench.spec import NotApplicable


def test_ops_are_discovered():
    ops = bench.discover()
    assert "offset_rms_norm" in ops
    spec = ops["offset_rms_norm"]
    assert spec.ours in spec.impls and {"transformers", "torch.compile", "liger"} <= set(spec.impls)


def test_offset_rms_norm_bytes_model():
    T, H = 32768, 4096
    tensor = T * H * 2
    assert bytes_model(T, "fwd") == 2 * tensor  # read x, write y
    assert bytes_model(T, "bwd") == 3 * tensor  # read x, dy, write dx
    assert bytes_model(T, "fwd+bwd") == 5 * tensor
    assert bytes_model(1, "fwd", hidden=5120, elem=4) == 2 * 5120 * 4


def _fake_rows(info):
    ceilings = core.Ceilings(copy_gbps=4000.0, matmul_tflops=700.0)
    rows = []
    for impl, speed in (("transformers", 0.1), ("liger", 0.6), ("q35lab", 0.9)):
        for pass_ in core.PASSES:
            for T in (1024, 2048, 4096):
                case = core.Case("offset_rms_norm", impl, pass_, T, bytes=bytes_model(T, pass_))
                ms = case.bytes / (speed * 4000.0 * 1e6)
                status = "oom" if (impl == "transformers" and T == 4096) else "ok"
                timing = core.Timing(wall_ms=2 * ms, kernel_ms=ms, extra_peak_mb=T / 100, status=status)
                if status == "oom":
                    timing = core.Timing(status="oom", note="out of memory")
                rows.append(core.make_row(case, timing, ceilings, info))
    skipped = core.Case("offset_rms_norm", "fla", "fwd", 1024, bytes=bytes_model(1024, "fwd"))
    rows.append(core.make_row(skipped, core.Timing(status="skipped", note="not installed: fla"), ceilings, info))
    return rows


def test_rows_follow_the_schema_and_round_trip(tmp_path):
    info = dict(gpu="Test GPU", torch="x", triton="y", q35lab="z", commit="abc", date="2026-11-30")
    rows = _fake_rows(info)
    assert all(list(r) == core.SCHEMA for r in rows)
    q = next(r for r in rows if r["impl"] == "q35lab" and r["pass"] == "fwd" and r["T"] == 2048)
    assert math.isclose(q["pct_copy_kernel"], 90.0, rel_tol=1e-9)
    assert math.isclose(q["gbps_wall"], 0.5 * q["gbps_kernel"], rel_tol=1e-9)
    path = core.write_csv(rows, tmp_path / "bench" / core.gpu_slug("Test GPU") / "offset_rms_norm.csv")
    assert path.parent.name == "test-gpu"
    df = core.read_csv(path)
    assert list(df.columns) == core.SCHEMA and len(df) == len(rows)
    assert set(df["status"]) == {"ok", "oom", "skipped"}
    assert math.isnan(df[df.status == "oom"]["wall_ms"].iloc[0])


def test_figures_render_to_png_with_oom_marked(tmp_path):
    info = dict(gpu="Test GPU", torch="x", triton="y", q35lab="z", commit="abc", date="2026-11-30")
    core.write_csv(_fake_rows(info), tmp_path / "bench" / "test-gpu" / "offset_rms_norm.csv")
    written = plots.render(tmp_path)
    assert [p.name for p in written] == ["offset_rms_norm_test-gpu.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and written[0].stat().st_size > 20_000
    df = core.read_csv(tmp_path / "bench" / "test-gpu" / "offset_rms_norm.csv")
    fig = plots.op_figure(df, "Offset RMSNorm", "q35lab")
    memory_axis = fig.axes[3]
    assert any(t.get_text() == "OOM" for t in memory_axis.texts)
    lines = [l.get_label() for l in fig.axes[0].get_lines() if not l.get_label().startswith("_")]
    assert lines[-1] == "q35lab"  # ours drawn last
    assert "Test GPU" in fig._suptitle.get_text()


def test_committed_gpu_results_render(tmp_path):
    committed = sorted((bench.DATA / "bench").glob("*/offset_rms_norm.csv"))
    if not committed:
        pytest.skip("no GPU results committed yet")
    df = core.read_csv(committed[0])
    assert list(df.columns) == core.SCHEMA
    assert {"q35lab", "transformers", "torch.compile", "liger"} <= set(df["impl"])
    fig = plots.op_figure(df, "Offset RMSNorm", "q35lab")
    fig.savefig(tmp_path / "x.png")


def test_run_refuses_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("CPU only")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.run(["offset_rms_norm"])
    with pytest.raises(ValueError, match="ops: unknown"):
        bench.check(["nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the CLI")
def test_cli_bench_without_gpu_runs_the_smoke_checks():
    out = subprocess.run([sys.executable, "-m", "q35lab", "bench", "offset_rms_norm"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Speed needs a GPU" in out.stdout
    assert out.stdout.count(" ok") == 12 and "FAIL" not in out.stdout  # 2 sizes × 2 dtypes × 3 tensors
    assert out.stdout.splitlines()[-1] == "all 12 checks passed"


@pytest.mark.parametrize("op", ["lora", "in_proj"])
def test_every_gemm_implementation_runs_every_variant_on_a_cpu(op):
    """The LoRA sweeps' setups (PEFT peers, ours, autocast and checkpoint variants) at a tiny T."""
    pytest.importorskip("peft")
    spec = bench.discover()[op]
    data = spec.make_inputs(4, torch.device("cpu"))
    for impl, (make, needs) in spec.impls.items():
        if bench._missing(needs):
            continue
        for variant, options in spec.variants.items():
            for pass_ in spec.passes:
                if impl == "peft (no input cast)" and "autocast" not in variant:
                    with pytest.raises(NotApplicable, match="autocast"):  # fp32 adapters meet bf16 x
                        bench._pass_calls(make, [data], pass_, options)
                else:
                    bench._pass_calls(make, [data], pass_, options)[0]()


def test_axolotl_in_proj_peer_is_called_once_per_forward(monkeypatch):
    """The fused peer must run once for all four outputs (a call per output measured it 4×)."""
    pytest.importorskip("peft")
    import types

    calls = []

    def apply_lora_gdn_in_proj(module, x, proj_names):
        calls.append(proj_names)
        return {name: getattr(module, name)(x) for name in proj_names}

    kernels = types.ModuleType("axolotl.kernels.lora")
    kernels.apply_lora_gdn_in_proj = apply_lora_gdn_in_proj
    monkeypatch.setitem(sys.modules, "axolotl", types.ModuleType("axolotl"))
    monkeypatch.setitem(sys.modules, "axolotl.kernels", types.ModuleType("axolotl.kernels"))
    monkeypatch.setitem(sys.modules, "axolotl.kernels.lora", kernels)
    spec = bench.discover()["in_proj"]
    make, _ = spec.impls["axolotl"]
    forward, _, _ = make(spec.make_inputs(4, torch.device("cpu")))
    outputs = forward()
    assert len(calls) == 1 and len(outputs) == len(calls[0]) == 4


def test_figure_names():
    assert plots.figure_name("lora", "", "nvidia-h200") == "lora_nvidia-h200.png"
    assert plots.figure_name("lora", "autocast+checkpoint", "nvidia-h200") == "lora-autocast-checkpoint_nvidia-h200.png"


def test_linear_cross_entropy_setups_run():
    """The loss sweep's setups (every installed implementation, both head variants), small
    vocabulary, on this machine's device (the interpreter's CPU tensors, or the GPU's)."""
    from q35lab.bench import linear_cross_entropy as lce

    spec = bench.discover()["linear_cross_entropy"]
    device = runtime.device()
    data = lce.make_inputs(6, device, vocab=300)
    losses = {}
    for impl, (make, needs) in spec.impls.items():
        gpu_only = impl in ("liger", "cut-cross-entropy")
        if bench._missing(needs) or (gpu_only and device.type == "cpu"):
            continue
        for options in spec.variants.values():
            if impl == "q35lab (dW by vocabulary blocks)" and options.get("frozen"):
                with pytest.raises(NotApplicable, match="frozen head"):
                    make(data, **options)
                continue
            forward, grads, dy = make(data, **options)
            loss = forward()
            assert len(torch.autograd.grad(loss, grads, dy)) == (1 if options.get("frozen") else 2)
            losses[impl] = loss.item()
    assert losses["q35lab"] == pytest.approx(losses["transformers"], rel=1e-2)
    assert losses["q35lab (dW by vocabulary blocks)"] == pytest.approx(losses["transformers"], rel=1e-2)


def test_sizes_given_keep_the_other_rows_of_the_results_file(tmp_path):
    from q35lab.bench import _rows_kept

    rows = [{**{k: "" for k in core.SCHEMA}, "op": "lora", "impl": impl, "T": T}
            for T in (1024, 4096, 16384) for impl in ("a", "b")]
    path = core.write_csv(rows, tmp_path / "lora.csv")
    kept = _rows_kept(path, [4096, 65536])
    assert sorted({int(r["T"]) for r in kept}) == [1024, 16384]
    assert len(kept) == 4 and set(kept[0]) == set(core.SCHEMA)
    assert _rows_kept(tmp_path / "missing.csv", [1024]) == []


def test_input_sets_rotate_enough_bytes_and_no_more():
    from q35lab.bench import _n_input_sets, _tensor_bytes

    data = {"x": torch.empty(1, 1024, 4096, dtype=torch.bfloat16), "dy": (torch.empty(3, 5), torch.empty(2))}
    assert _tensor_bytes(data) == 2 * 1024 * 4096 + 4 * 15 + 4 * 2
    assert _n_input_sets(0) == 16 and _n_input_sets(core.ROTATE_BYTES // 3) == 4
    assert _n_input_sets(core.ROTATE_BYTES) == 1 and _n_input_sets(10 * core.ROTATE_BYTES) == 1


@pytest.mark.parametrize("name", sorted(bench.discover()))
def test_every_bench_sizes_its_input_rotation_from_its_own_passes(name):
    # the sweep of 2026-12-03 stopped at contiguous_rows, measured forward only, asked for "fwd+bwd" bytes
    from q35lab.bench import _footprint

    spec = bench.discover()[name]
    no_inputs = {"x": torch.empty(3, 5)}
    footprint = _footprint(spec, 8192, no_inputs)
    models = [spec.bytes_model(8192, pass_) or 0 for pass_ in spec.passes]
    assert footprint == (max(models) or 4 * 15) and footprint > 0


def test_ablation_waterfall_steps_from_the_baseline_to_the_full_variant():
    import pandas as pd

    at = pd.DataFrame({"outside_core_ms": {"peft": 900.0, "q35lab": 640.0, "q35lab:flce": 700.0,
                                           "q35lab:lora": 850.0, "q35lab:rms_norm": 890.0}})
    fig = plots.ablation_waterfall(at)
    bars = fig.axes[0].patches
    assert [b.get_height() for b in bars] == pytest.approx([900, 200, 50, 10, 0, 640])  # together: 0 here
    assert bars[1].get_y() == pytest.approx(700) and bars[-1].get_y() == 0
    at.loc["q35lab", "outside_core_ms"] = 600.0  # together saves 40 ms more than the parts
    bars = plots.ablation_waterfall(at).axes[0].patches
    assert bars[4].get_height() == pytest.approx(40) and bars[4].get_y() == pytest.approx(600)
    assert plots.ablation_waterfall(at.drop(index="peft")) is None
    assert plots.ablation_waterfall(at.loc[["peft", "q35lab"]]) is None


def _wrong_loss(kind):
    """A q35lab loss that is wrong in its value only, or in its gradient only (by half of dx:
    within the absolute atol of bf16, which a gradient of ~1e-2 entries would not notice)."""
    from q35lab.ops.linear_cross_entropy import linear_cross_entropy_ref

    def loss(x, w, t, **_):
        ref = linear_cross_entropy_ref(x, w, t)
        if kind == "value":
            return ref + 0.01
        return ref + 0.5 * (ref - ref.detach())  # same value, 1.5 × the gradient

    return loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_cross_entropy_check_has_real_bounds(dtype):
    from q35lab.bench import linear_cross_entropy as lce

    rows = lce.check(5, runtime.device(), dtype)
    ours = [r for r in rows if r["impl"] == "q35lab"]
    assert [(r["impl"], r["tensor"]) for r in rows[:2]] == [("q35lab", "loss"), ("q35lab", "dx")] and len(ours) == 2
    for r in ours:  # below 1e-2: the loss is ~7, dx's entries ~1e-2 (bf16's absolute atol alone)
        assert 0 < r["bound"] < 1e-2 and r["kernel_err"] <= r["bound"] and r["ok"] is True
    for r in rows:  # the peers (on a GPU, where their kernels run) are measured by the same rule: reported, not judged
        assert math.isfinite(r["rel_err"]) and math.isfinite(r["kernel_err"]) and r["reference"] == "fp64"
    assert {r["impl"] for r in rows} == {"q35lab", "pytorch-chunked"} or runtime.device().type == "cuda"
    assert all(r["ok"] for r in rows if r["impl"] == "pytorch-chunked")  # transformers' own math, chunked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wrong, failing", [("value", {"loss"}), ("gradient", {"dx"})])
def test_linear_cross_entropy_check_fails_a_wrong_result(monkeypatch, dtype, wrong, failing):
    from q35lab.bench import linear_cross_entropy as lce

    monkeypatch.setattr(lce, "linear_cross_entropy", _wrong_loss(wrong))
    rows = lce.check(5, runtime.device(), dtype)
    assert {r["tensor"] for r in rows if r["impl"] == "q35lab" and not r["ok"]} == failing


def test_data_folder_is_the_argument_then_the_environment_then_the_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("Q35LAB_DATA", raising=False)
    checkout = Path(bench.__file__).resolve().parents[2]
    assert bench.data_dir() == checkout / "data" and (checkout / "pyproject.toml").is_file()
    monkeypatch.setenv("Q35LAB_DATA", str(tmp_path / "env"))
    assert bench.data_dir() == tmp_path / "env"
    assert bench.data_dir(tmp_path / "given") == tmp_path / "given"


def test_an_installed_package_uses_the_current_folder_not_site_packages(tmp_path):
    """A copy of the package with no pyproject.toml beside it, as in site-packages."""
    site = tmp_path / "site-packages"
    shutil.copytree(Path(bench.__file__).resolve().parents[1], site / "q35lab",
                    ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "Q35LAB_DATA"}
    env["PYTHONPATH"] = str(site)
    script = "import q35lab.bench as b; print(b.__file__); print(b.data_dir()); print(b.DATA)"
    out = subprocess.run([sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    module, found, default = out.stdout.splitlines()
    assert module.startswith(str(site)) and found == default == str(work / "data")


def test_plots_exports_every_public_function():
    defined = {name for name, f in inspect.getmembers(plots, inspect.isfunction)
               if f.__module__ == plots.__name__ and not name.startswith("_")}
    assert defined <= set(plots.__all__), sorted(defined - set(plots.__all__))
    assert all(hasattr(plots, name) for name in plots.__all__)


def _root_imports(path: Path) -> list[str]:
    """``import q35lab`` / ``from .. import X`` in a file of q35lab/bench where X is no submodule:
    the package's front door (it imports the patch and every op)."""
    package = path.parents[1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "q35lab"]
        elif isinstance(node, ast.ImportFrom) and (node.level == 2 and not node.module or node.module == "q35lab"):
            found += [a.name for a in node.names
                      if not (package / f"{a.name}.py").is_file() and not (package / a.name).is_dir()]
    return found


def test_the_harness_imports_submodules_not_the_package_front_door():
    files = sorted(Path(bench.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    assert {f.name: _root_imports(f) for f in files if _root_imports(f)} == {}


def test_version_comes_from_metadata_or_the_checkout(monkeypatch, tmp_path):
    import importlib.metadata

    checkout = Path(core.__file__).resolve().parents[2] / "pyproject.toml"
    try:  # installed (pip install -e .), or imported from the checkout as on the GPU machine
        assert core.q35lab_version() == importlib.metadata.version("q35lab")
    except importlib.metadata.PackageNotFoundError:
        assert core.q35lab_version() == core._checkout_version(checkout)

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert core.q35lab_version() == core._checkout_version(checkout) != "unknown"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "q35lab"\nversion = "9.8.7"\n')
    assert core._checkout_version(tmp_path / "pyproject.toml") == "9.8.7"
    assert core._checkout_version(tmp_path / "missing.toml") == "unknown"


def test_plots_draw_the_step_breakdown_of_the_last_recorded_step(tmp_path, monkeypatch):
    committed = bench.DATA / "bench" / "nvidia-h200" / "step_breakdown.csv"
    if not committed.exists():
        pytest.skip("no step breakdown committed")
    earlier = core.read_csv(committed)
    earlier = earlier[earlier["size"].eq("9b")]  # one model's step (the committed file holds each size's)
    later = earlier.assign(commit="later", ms=earlier.ms * 2)  # a second step, recorded after the first
    packed = later.assign(batch="packed", ms=earlier.ms * 3)  # and a packed step of the same commit, before it
    bigger = earlier.assign(size="27b", commit="bigger", ms=earlier.ms * 4)  # another model, recorded last
    folder = tmp_path / "bench" / "test-gpu"
    folder.mkdir(parents=True)
    pd.concat([earlier, packed, later, bigger]).to_csv(folder / "step_breakdown.csv", index=False)
    drawn = []
    original = plots.step_breakdown_figure
    monkeypatch.setattr(plots, "step_breakdown_figure", lambda rows: drawn.append(rows) or original(rows))
    written = plots.render(tmp_path)
    assert len(earlier) and earlier.commit.nunique() == 1
    assert [p.name for p in written] == ["step_breakdown-9b_test-gpu.png", "step_breakdown-27b_test-gpu.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    rows, big = drawn  # each size's last step: the 9B's is not the 27B's recorded after it
    assert set(rows.commit) == {"later"} and len(rows) == len(earlier) and rows.batch.isna().all()
    assert set(big.commit) == {"bigger"} and set(big["size"]) == {"27b"}
    with pytest.raises(ValueError, match="one step"):  # two steps of one commit are not one figure
        plots.step_breakdown_figure(pd.concat([later, packed]))
    earlier.drop(columns="size").to_csv(folder / "step_breakdown.csv", index=False)  # rows from before sizes
    assert [p.name for p in plots.render(tmp_path, ["step_breakdown"])] == ["step_breakdown_test-gpu.png"]


def test_in_proj_benchmark_measures_the_patch_arrangement_with_the_same_outputs():
    """"q35lab (z own buffer)" (the patch's order and buffers) computes what "q35lab" does, its z
    in a buffer of its own, its outputs handed back in the order the other implementations use."""
    pytest.importorskip("peft")
    spec = bench.discover()["in_proj"]
    data = spec.make_inputs(6, torch.device("cpu"))
    one_buffer = spec.impls["q35lab"][0](data)[0]()
    own_z = spec.impls["q35lab (z own buffer)"][0](data)[0]()
    for a, b in zip(one_buffer, own_z):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert own_z[1].is_contiguous() and not one_buffer[1].is_contiguous()  # z: OUT_FEATURES' second


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 64])  # one row; not dividing T; T itself; more than T
def test_the_pytorch_chunked_baseline_is_the_materialising_loss(chunk_rows):
    """Loss, dx and dW of the chunked, checkpointed PyTorch loss against transformers' path, with
    ignored targets, fp32 (nothing but the summation order differs)."""
    from q35lab.bench import linear_cross_entropy as lce
    from q35lab.ops.linear_cross_entropy import linear_cross_entropy_ref

    x = torch.randn(7, 32, dtype=torch.float32, requires_grad=True)
    w = (torch.randn(301, 32) / 32**0.5).requires_grad_()
    target = torch.randint(0, 301, (7,))
    target[[1, 4]] = -100
    ours = lce.torch_chunked_cross_entropy(x, w, target, chunk_rows=chunk_rows)
    ref = linear_cross_entropy_ref(x, w, target)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(ours, [x, w]), torch.autograd.grad(ref, [x, w])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
