"""The device harness's pure parts (dev/), on the CPU: the wheel slimming for an offline machine, the
join of a call's rows; and the conv tuning's choice (python -m q35lab tune)."""

import importlib.util
import json
import random
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(path: str):
    """The script at ``path`` (from the repository's root, without ``.py``), as a module."""
    script = ROOT / f"{path}.py"
    sys.path.insert(0, str(script.parent))  # as when the script runs: its folder first (for _wheel)
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_wheel(path: Path, files: list[str]) -> Path:
    """A zip with ``files`` (each holding its own name) and a RECORD listing them all."""
    with zipfile.ZipFile(path, "w") as z:
        for name in files:
            z.writestr(name, name)
        z.writestr("transformers-0.0.dist-info/RECORD", "".join(f"{n},sha256=x,1\n" for n in files))
    return path


def test_slim_transformers_keeps_the_named_model_folders_and_everything_outside_the_models(tmp_path):
    slim = _load("dev/offline/slim_transformers")
    folders = random.sample(["qwen3_5", "llama", "bert", "gemma", "bloom", "auto", "t5"], 5)
    keep = set(folders[:2])
    files = ["transformers/__init__.py", "transformers/utils/import_utils.py", "transformers/models/__init__.py",
             *[f"transformers/models/{f}/modeling_{f}.py" for f in folders],
             *[f"transformers/models/{f}/__init__.py" for f in folders]]
    out = slim.slim(_fake_wheel(tmp_path / "transformers-0.0-py3-none-any.whl", files), tmp_path / "out", keep)
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        record = {line.split(",")[0] for line in z.read("transformers-0.0.dist-info/RECORD").decode().splitlines()}
        assert all(z.read(n).decode() == n for n in names if not n.endswith("RECORD"))  # contents unchanged
    expected = {n for n in files if slim._model_folder(n) in (None, *keep)}
    assert names == expected | {"transformers-0.0.dist-info/RECORD"}
    assert record == expected  # pip checks that every file RECORD lists exists
    assert {"transformers/models/__init__.py", "transformers/utils/import_utils.py"} <= names


@pytest.mark.parametrize("name, folder", [("transformers/models/qwen3_5/modeling_qwen3_5.py", "qwen3_5"),
                                          ("transformers/models/__init__.py", None),
                                          ("transformers/modeling_utils.py", None),
                                          ("transformers-5.24.0.dist-info/RECORD", None)])
def test_a_file_belongs_to_the_model_folder_it_sits_in(name, folder):
    assert _load("dev/offline/slim_transformers")._model_folder(name) == folder


def test_slim_unsloth_drops_the_studio_app_and_cli_only(tmp_path):
    slim = _load("dev/offline/slim_unsloth")
    files = ["unsloth/__init__.py", "unsloth/kernels/fast_lora.py", "studio/frontend/app.js", "studio/backend/main.py",
             "unsloth_cli/commands/train.py", "unsloth-0.0.dist-info/METADATA"]
    out = slim.slim(_fake_wheel(tmp_path / "unsloth-0.0-py3-none-any.whl", files), tmp_path / "out")
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        record = z.read("transformers-0.0.dist-info/RECORD").decode()
    assert names - {"transformers-0.0.dist-info/RECORD"} == {"unsloth/__init__.py", "unsloth/kernels/fast_lora.py",
                                                             "unsloth-0.0.dist-info/METADATA"}
    assert "studio/" not in record and "unsloth_cli/" not in record and "unsloth/__init__.py" in record


def test_slim_bitsandbytes_keeps_the_cpu_and_cuda_13_libraries_only(tmp_path):
    slim = _load("dev/offline/slim_bitsandbytes")
    libraries = [f"bitsandbytes/libbitsandbytes_{v}.so" for v in ("cpu", "cuda130", "cuda131", "cuda128", "rocm62")]
    files = ["bitsandbytes/__init__.py", *libraries]
    out = slim.slim(_fake_wheel(tmp_path / "bitsandbytes-0.0-py3-none-any.whl", files), tmp_path / "out")
    with zipfile.ZipFile(out) as z:
        kept = {n for n in z.namelist() if n.endswith(".so")}
        assert "bitsandbytes/__init__.py" in z.namelist()
    assert kept == {f"bitsandbytes/libbitsandbytes_{v}.so" for v in ("cpu", "cuda130")}


def test_the_conv_tuning_keeps_the_fastest_tiles_of_the_fine_tune_and_their_best_split():
    """python -m q35lab tune causal_conv1d: each pass's fastest configuration is saved, the trainable
    conv's backward (dW) with tiles of its own, whatever the dx-only backward chose."""
    from q35lab.bench.tune import causal_conv1d as module

    def row(pass_, ms, **fields):
        return dict(pass_=pass_, ms=ms, config=str(fields), **fields)

    rows = pd.DataFrame([
        row("fwd", 2.0, block_t=32, block_c=128, num_warps=4),
        row("fwd", 1.5, block_t=64, block_c=64, num_warps=8),
        row("bwd_dx", 3.0, bwd_block_t=32, bwd_block_c=64, bwd_warps=4),
        row("bwd_dx", 2.5, bwd_block_t=16, bwd_block_c=128, bwd_warps=2),
        row("bwd_dw", 1.0, dw_block_t=32, dw_block_c=64, dw_warps=4, dw_programs_per_sm=16),
        row("bwd_dw", 4.0, dw_block_t=16, dw_block_c=128, dw_warps=2, dw_programs_per_sm=16),
        row("bwd_dw", 3.5, dw_block_t=16, dw_block_c=128, dw_warps=2, dw_programs_per_sm=4),
    ])
    assert module.best_fields(rows) == dict(block_t=64, block_c=64, num_warps=8, bwd_block_t=16, bwd_block_c=128,
                                            bwd_warps=2, dw_block_t=32, dw_block_c=64, dw_warps=4,
                                            dw_programs_per_sm=16)
    assert all(set(c) <= {f for f in module.op.LaunchConfig.__dataclass_fields__}
               for options in module.CANDIDATES.values() for c in options)


# dev/join_calls.py: one device call's rows joined to the rows of every earlier call
def test_a_call_keeps_the_other_calls_baselines_and_replaces_its_own_rows():
    kept = pd.DataFrame({"variant": ["q35lab", "q35lab+offload", "q35lab", "q35lab+tiled"],
                         "commit": ["aaa", "aaa", "bbb", "bbb"], "step_ms": [1.0, 2.0, 3.0, 4.0]})
    call = pd.DataFrame({"variant": ["q35lab", "q35lab+tiled"], "commit": ["bbb", "bbb"], "step_ms": [5.0, 6.0]})
    joined = _load("dev/join_calls").join(call, kept)
    by_key = joined.set_index(["variant", "commit"]).step_ms
    assert len(joined) == 4 and by_key["q35lab", "aaa"] == 1.0 and by_key["q35lab+offload", "aaa"] == 2.0
    assert by_key["q35lab", "bbb"] == 5.0 and by_key["q35lab+tiled", "bbb"] == 6.0


def test_a_new_commit_adds_rows_beside_the_same_variants_of_older_calls():
    kept = pd.DataFrame({"variant": ["q35lab"], "commit": ["aaa"], "step_ms": [1.0]})
    call = pd.DataFrame({"variant": ["q35lab"], "commit": ["ccc"], "step_ms": [2.0]})
    joined = _load("dev/join_calls").join(call, kept)
    assert list(zip(joined.variant, joined.commit)) == [("q35lab", "aaa"), ("q35lab", "ccc")]


def test_a_packed_and_a_padded_row_of_one_variant_and_call_both_stay():
    kept = pd.DataFrame({"variant": ["q35lab"], "batch": ["packed"], "commit": ["aaa"], "step_ms": [1.0]})
    call = pd.DataFrame({"variant": ["q35lab", "q35lab"], "batch": ["padded", "packed"], "commit": ["aaa", "aaa"],
                         "step_ms": [4.0, 2.0]})
    joined = _load("dev/join_calls").join(call, kept).set_index(["batch"]).step_ms
    assert len(joined) == 2 and joined["padded"] == 4.0 and joined["packed"] == 2.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a CUDA GPU")
@pytest.mark.parametrize("op", ["causal_conv1d", "gated_rms_norm", "linear_cross_entropy", "offset_rms_norm"])
def test_tune_without_a_gpu_is_a_usage_error_that_says_why(op, capsys, tmp_path):
    from q35lab.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["tune", op, "--out", str(tmp_path / "tuning.csv")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: python -m q35lab tune {op}" in err and "it needs a CUDA GPU" in err
    assert not (tmp_path / "tuning.csv").exists()


def test_tune_names_the_ops_it_tunes(capsys):
    from q35lab import bench
    from q35lab.__main__ import main
    from q35lab.bench import tune

    with pytest.raises(SystemExit) as exit_:
        main(["tune", "swiglu"])
    assert exit_.value.code == 2
    assert "unknown op 'swiglu'; known ops: " + ", ".join(tune.TUNABLE) in capsys.readouterr().err
    assert set(tune.TUNABLE) <= set(bench.discover())  # each one an op of the harness
    with pytest.raises(ValueError, match="op: expected one of causal_conv1d"):
        tune.main("swiglu", [])


@pytest.mark.parametrize("shipped", [False, True])
def test_tune_records_in_the_user_file_or_with_shipped_the_package_file_and_says_where(
        tuned_tables, shipped, capsys, tmp_path):
    """python -m q35lab tune OP [--shipped]: the options every tuning takes, and where its result goes."""
    from q35lab.bench import tune
    from q35lab.bench.tune import gated_rms_norm as module

    package, user, gpu = tuned_tables
    before = package.read_text()
    argv = ["--out", str(tmp_path / "tuning.csv")] + ["--shipped"] * shipped
    args = tune.parse(tune.parser("gated_rms_norm", module.__doc__), argv, "gated_rms_norm")
    fields = {"fwd_block_rows": random.choice([8, 16, 32, 64]), "fwd_warps": random.choice([1, 2, 4, 8])}
    tune.record(args, "gated_rms_norm", 128, fields)
    written = package if shipped else user
    assert json.loads(written.read_text())[gpu] == {"gated_rms_norm": {"128": fields}}
    assert not user.exists() if shipped else package.read_text() == before
    assert f"saved {fields} in {written}" in capsys.readouterr().out


def test_the_gpu_harness_tunes_into_the_shipped_file_it_packs():
    """dev/gpu_run.sh packs q35lab/ops/tuned.json: its tune step must write that file."""
    script = (ROOT / "dev" / "gpu_run.sh").read_text()
    tunes = [line for line in script.splitlines() if "-m q35lab tune" in line]
    assert "q35lab/ops/tuned.json" in script and tunes
    assert all("--shipped" in line for line in tunes), tunes
