"""`python -m q35lab …` and `python -m q35lab.e2e --help`: usage errors, clean help, a verdict line."""

import os
import subprocess
import sys

import pytest
import torch

from q35lab import bench, runtime

KNOWN = sorted(bench.discover())


def _cli(*args, module="q35lab"):
    env = {k: v for k, v in os.environ.items() if k not in ("Q35LAB_INTERPRET", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("command", ["check", "bench"])
def test_an_unknown_op_is_a_usage_error_naming_the_known_ops(command):
    out = _cli(command, "bogus")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"usage: python -m q35lab {command}" in out.stderr
    assert "unknown op 'bogus'; known ops: " + ", ".join(KNOWN) in out.stderr


def test_help_is_plain_text_lists_the_ops_and_prints_no_notice():
    out = _cli("--help")
    assert out.returncode == 0
    assert out.stderr == ""  # no warning, no source line
    assert "``" not in out.stdout and "ops: " + ", ".join(KNOWN) in out.stdout
    assert out.stdout.startswith("usage: python -m q35lab")
    sub = _cli("check", "--help")
    assert sub.returncode == 0 and sub.stderr == "" and all(op in sub.stdout for op in KNOWN)


def test_plots_names_a_missing_data_folder(tmp_path):
    missing = tmp_path / "nonexistent"
    out = _cli("plots", "--data", str(missing))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"no such folder: {missing}" in out.stderr


def test_plots_says_when_a_folder_holds_nothing_to_draw(tmp_path):
    out = _cli("plots", "--data", str(tmp_path))
    assert out.returncode == 1
    assert "no results to draw" in out.stderr and str(tmp_path / "bench") in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's smoke sizes")
def test_check_prints_real_bounds_a_verdict_and_the_notice_as_one_plain_line():
    out = _cli("check", "linear_cross_entropy")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = [line for line in lines if line.startswith("linear_cross_entropy")]
    # T=5 × (bf16, fp32) × (loss, dx), ours and the chunked PyTorch baseline (a peer: reported beside)
    assert len(rows) == 8 and all(" ok" in row for row in rows)
    assert sum(" q35lab " in row for row in rows) == 4
    assert "nan" not in out.stdout
    assert lines[-1] == "all 4 checks passed (peers: 4 of 4 within the bound)"
    assert out.stderr.splitlines() == [runtime.NOTICE]


def test_a_failed_check_is_the_verdict_and_the_exit_code(monkeypatch, capsys, tmp_path):
    from q35lab.__main__ import main

    monkeypatch.setenv("Q35LAB_DATA", str(tmp_path))  # on a GPU the rows are written there

    def check(ops):
        return [{"op": ops[0], "impl": "q35lab", "T": 3, "dtype": "bfloat16", "tensor": "y", "kernel_err": 1.0,
                 "bound": 0.1, "ok": False},
                {"op": ops[0], "impl": "q35lab", "T": 3, "dtype": "bfloat16", "tensor": "dx", "kernel_err": 0.0,
                 "bound": 0.1, "ok": True}]

    monkeypatch.setattr(bench, "check", check)
    assert main(["check", "lora"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "1 of 2 checks failed: lora q35lab y (bfloat16, T=3)"


def test_a_peer_outside_the_bound_is_reported_but_does_not_fail_the_check():
    from q35lab.__main__ import verdict

    row = {"op": "lora", "T": 3, "dtype": "bfloat16", "tensor": "y", "kernel_err": 0.0, "bound": 0.1}
    line, passed = verdict([{**row, "impl": "q35lab", "ok": True}, {**row, "impl": "liger", "ok": False}])
    assert passed and line == "all 1 checks passed (peers: 0 of 1 within the bound: outside lora liger y (bfloat16, T=3))"
    assert verdict([]) == ("no checks of q35lab ran", False)


def test_e2e_help_names_its_command_and_every_option_has_a_help_text():
    from q35lab.bench.e2e import cli

    parser = cli._parser()
    assert parser.prog == "python -m q35lab.e2e"
    undocumented = [a.option_strings for a in parser._actions if not a.help]
    assert undocumented == []
    out = _cli("--help", module="q35lab.e2e")
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m q35lab.e2e")


# ---- python -m q35lab plan: the memory model's answer to "how long can I train here?"

GIB = 2**30


def _plan(capsys, *args):
    from q35lab.__main__ import main

    code = main(["plan", *args])
    return code, capsys.readouterr().out


def _reserve(host_gib: float) -> float:
    from q35lab.long_context import HOST_RESERVE_BYTES

    return min(HOST_RESERVE_BYTES, host_gib * GIB / 4)


@pytest.mark.parametrize("size", ["9b", "27b"])
def test_plan_prints_the_longest_planned_step_and_the_call_that_turns_it_on(capsys, size):
    import random

    from q35lab.bench.e2e.model import config
    from q35lab.long_context import longest_planned_step

    gpu, host = round(random.uniform(60, 140), 1), round(random.uniform(0, 200), 1)  # fresh each run
    code, out = _plan(capsys, "--size", size, "--gpu-gib", str(gpu), "--host-gib", str(host))
    expected = longest_planned_step(config(size), gpu_bytes=gpu * GIB, host_bytes=host * GIB,
                                    host_reserve_bytes=_reserve(host))
    assert expected.fits and expected.tokens > 0, (gpu, host)
    assert code == 0, (gpu, host, out)
    assert out.splitlines() == [str(expected), f"turn it on with: q35lab.apply_to_qwen3_5(model, long_context={expected.tokens})"]


def test_plan_for_tokens_is_plan_long_context_and_exits_1_when_it_does_not_fit(capsys):
    from q35lab.bench.e2e.model import config
    from q35lab.long_context import plan_long_context

    code, out = _plan(capsys, "--tokens", "524288", "--gpu-gib", "139", "--host-gib", "128", "--rank", "32")
    expected = plan_long_context(config("9b"), 524288, gpu_bytes=139 * GIB, host_bytes=128 * GIB,
                                 host_reserve_bytes=_reserve(128), lora_rank=32)
    assert code == 0 and out.splitlines()[0] == str(expected)
    code, out = _plan(capsys, "--tokens", "1000000", "--gpu-gib", "20", "--host-gib", "0")
    assert code == 1 and "does not fit even so" in out and "turn it on" not in out


def test_plan_of_a_saved_config_is_the_plan_of_its_size(capsys, tmp_path):
    from q35lab.bench.e2e.model import config

    config("27b").save_pretrained(tmp_path)
    by_size = _plan(capsys, "--size", "27b", "--gpu-gib", "139", "--host-gib", "128")
    by_config = _plan(capsys, "--config", str(tmp_path), "--gpu-gib", "139", "--host-gib", "128")
    assert by_size == by_config and by_size[0] == 0


def test_plan_without_a_gpu_plans_for_an_h200_and_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the plan is for it")
    from q35lab.long_context import H200_USABLE_BYTES

    _, named = _plan(capsys, "--host-gib", "64", "--gpu-gib", str(H200_USABLE_BYTES / GIB))
    _, default = _plan(capsys, "--host-gib", "64")
    assert default.splitlines()[0].startswith("No CUDA GPU here: planning for an H200")
    assert default.splitlines()[1:] == named.splitlines()


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "argument --tokens: expected a whole number of at least 1, got '0'"),
    (["--tokens", "1.5"], "argument --tokens: expected a whole number of at least 1, got '1.5'"),
    (["--rank", "-4"], "argument --rank: expected a whole number of at least 1, got '-4'"),
    (["--gpu-gib", "-1"], "argument --gpu-gib: expected a size in GiB (a finite number, at least 0), got '-1'"),
    (["--host-gib", "nan"], "argument --host-gib: expected a size in GiB (a finite number, at least 0), got 'nan'"),
    (["--gpu-gib", "inf"], "argument --gpu-gib: expected a size in GiB (a finite number, at least 0), got 'inf'"),
    (["--size", "7b"], "argument --size: invalid choice: '7b'"),
    (["--size", "35b-a3b"], "argument --size: invalid choice: '35b-a3b'"),  # the MoE: not in the memory model
    (["--size", "9b", "--config", "x"], "argument --config: not allowed with argument --size"),
])
def test_plan_names_a_bad_argument(capsys, args, message):
    from q35lab.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["plan", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "usage: python -m q35lab plan" in err


def test_plan_names_a_config_that_is_missing_or_not_a_dense_qwen3_5(capsys, tmp_path):
    from transformers import LlamaConfig

    from q35lab.__main__ import main
    from q35lab.bench.e2e.model import config

    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(tmp_path), "--gpu-gib", "80"])  # a folder without config.json
    assert exit_.value.code == 2 and "--config: expected a Qwen3.5 config.json" in capsys.readouterr().err
    LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(tmp_path), "--gpu-gib", "80", "--host-gib", "0"])
    assert exit_.value.code == 2 and "--config: expected a dense Qwen3.5 config" in capsys.readouterr().err
    config("35b-a3b").save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(tmp_path), "--gpu-gib", "80", "--host-gib", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "not the MoE), got Qwen3_5MoeTextConfig" in err
