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
    from q35lab import e2e

    parser = e2e._parser()
    assert parser.prog == "python -m q35lab.e2e"
    undocumented = [a.option_strings for a in parser._actions if not a.help]
    assert undocumented == []
    out = _cli("--help", module="q35lab.e2e")
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m q35lab.e2e")
