"""`python -m q35lab …` and `python -m q35lab.e2e --help`: usage errors, clean help, a verdict line."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import patch_everywhere

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
    assert passed and line == ("all 1 checks passed (peers: 0 of 1 within the bound: "
                               "outside lora liger y (bfloat16, T=3))")
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
    assert out.splitlines() == [str(expected),
                                f"turn it on with: q35lab.apply_to_qwen3_5(model, long_context={expected.tokens})"]


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
    by_file = _plan(capsys, "--config", str(tmp_path / "config.json"), "--gpu-gib", "139", "--host-gib", "128")
    assert by_size == by_config == by_file and by_size[0] == 0


def test_plan_without_a_gpu_plans_for_an_h200_and_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the plan is for it")
    from q35lab.long_context import H200_USABLE_BYTES

    _, named = _plan(capsys, "--host-gib", "64", "--gpu-gib", str(H200_USABLE_BYTES / GIB))
    _, default = _plan(capsys, "--host-gib", "64")
    assert default.splitlines()[0].startswith("No CUDA GPU here: planning for an H200")
    assert default.splitlines()[1:] == named.splitlines()


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "argument --tokens: expected at least 1 token, got '0'"),
    (["--tokens=-5k"], "argument --tokens: expected at least 1 token, got '-5k'"),  # (-5k alone reads as an option)
    (["--tokens", "1.5"], "argument --tokens: expected a whole number of tokens, got '1.5' (= 1.5)"),
    (["--tokens", "1e-3"], "argument --tokens: expected a whole number of tokens, got '1e-3' (= 0.001)"),
    (["--tokens", "0.1k"], "argument --tokens: expected a whole number of tokens, got '0.1k' (= 102.4)"),
    (["--tokens", "5_"], "argument --tokens: expected a number of tokens (e.g. 524288, 524_288, 512k, 1M or 1e6)"),
    (["--tokens", "nan"], "argument --tokens: expected a number of tokens (e.g. 524288"),
    (["--tokens", "1G"], "argument --tokens: expected a number of tokens (e.g. 524288"),
    (["--rank", "-4"], "argument --rank: expected a whole number of at least 1, got '-4'"),
    (["--rank", "16.0"], "argument --rank: expected a whole number of at least 1, got '16.0'"),
    (["--gpu-gib", "0"], "argument --gpu-gib: expected a size in GiB (a finite number, above 0), got '0'"),
    (["--gpu-gib", "-1"], "argument --gpu-gib: expected a size in GiB (a finite number, above 0), got '-1'"),
    (["--host-gib", "nan"], "argument --host-gib: expected a size in GiB (a finite number, at least 0), got 'nan'"),
    (["--host-gib", "-0.5"], "argument --host-gib: expected a size in GiB (a finite number, at least 0), got '-0.5'"),
    (["--gpu-gib", "inf"], "argument --gpu-gib: expected a size in GiB (a finite number, above 0), got 'inf'"),
    (["--config", "/nonexistent.json"], "argument --config: no such file or folder: /nonexistent.json"),
    (["--config", "./missing"], "argument --config: no such file or folder: ./missing"),
    (["--config", "a/b/c"], "argument --config: no such file or folder: a/b/c"),
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
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: python -m q35lab plan" in err
    assert f"argument --config: expected a Qwen3.5 config.json, or a folder or hub id holding one: no config.json in " \
           f"the folder {tmp_path}" in err
    (tmp_path / "broken.json").write_text("{ not json")
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(tmp_path / "broken.json"), "--gpu-gib", "80"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: python -m q35lab plan" in err and "broken.json" in err
    assert "argument --config: expected a Qwen3.5 config.json" in err
    LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(tmp_path), "--gpu-gib", "80", "--host-gib", "0"])
    assert exit_.value.code == 2 and "--config: expected a dense Qwen3.5 config" in capsys.readouterr().err
    config("35b-a3b").save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(tmp_path), "--gpu-gib", "80", "--host-gib", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "not the MoE), got Qwen3_5MoeTextConfig" in err


# ---- help and usage errors say nothing else; every option checked for type and range, by name


@pytest.mark.parametrize("command, usage", [(["-m", "q35lab.e2e", "--help"], "python -m q35lab.e2e"),
                                            (["-mq35lab", "plan", "--help"], "python -m q35lab plan")])
def test_help_prints_no_notice_however_python_is_asked_to_run_it(command, usage):
    """``-mq35lab`` (no space) and ``-m q35lab.e2e`` printed the interpreter notice as a warning."""
    env = {k: v for k, v in os.environ.items() if k not in ("Q35LAB_INTERPRET", "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stderr == "" and out.stdout.startswith(f"usage: {usage}")


def test_a_usage_error_prints_the_usage_and_the_error_only():
    out = _cli("plan", "--tokens", "-5")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert lines[0].startswith("usage: python -m q35lab plan")
    assert lines[-1] == "python -m q35lab plan: error: argument --tokens: expected at least 1 token, got '-5'"
    assert all(line.startswith(" ") for line in lines[1:-1])  # the rest is the usage's continuation
    e2e = _cli("--T", "4k", "0", "--out", "x.csv", module="q35lab.e2e")
    assert e2e.returncode == 2 and e2e.stderr.splitlines()[0].startswith("usage: python -m q35lab.e2e")
    assert e2e.stderr.splitlines()[-1] == ("python -m q35lab.e2e: error: argument --T: "
                                           "expected at least 1 token, got '0'")
    assert "Q35labNotice" not in e2e.stderr and "Q35labNotice" not in out.stderr


@pytest.mark.parametrize("argv, module", [
    (["/venv/bin/python", "-m", "q35lab", "--help"], "q35lab"),
    (["python", "-mq35lab.e2e"], "q35lab.e2e"),
    (["python", "-W", "ignore", "-X", "dev", "-m", "q35lab", "plan"], "q35lab"),
    (["python", "-m"], None),
])
def test_the_module_python_m_runs_is_read_from_its_arguments(monkeypatch, argv, module):
    monkeypatch.setattr(sys, "argv", ["-m", *argv[3:]])  # what runpy shows while it locates the module
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert runtime._module_run_by_python_m() == module
    assert runtime._cli_prints_the_notice() == (module in ("q35lab", "q35lab.e2e"))
    monkeypatch.setattr(sys, "argv", ["/path/to/q35lab/__main__.py"])  # located: an import from then on warns
    assert runtime._module_run_by_python_m() is None and not runtime._cli_prints_the_notice()


def test_e2e_prints_the_notice_once_when_it_runs_and_never_in_its_variants_processes(monkeypatch, capsys, tmp_path):
    from q35lab.bench.e2e import cli

    children = []
    monkeypatch.setattr(runtime, "interpreter_notice", lambda: "the notice")
    monkeypatch.setattr(cli.subprocess, "run",
                        lambda command: children.append(command) or subprocess.CompletedProcess(command, 0))
    out = tmp_path / "rows.csv"
    assert cli.main(["--variants", "peft", "q35lab", "--size", "tiny", "--T", "16", "--out", str(out)]) == 0
    assert capsys.readouterr().err == "the notice\n" and len(children) == 2
    assert all("--variant" in child and "-m" in child for child in children)
    assert cli.main(["--merge-leftovers", "--out", str(out)]) == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("written, tokens", [
    ("524288", 524288), ("1e6", 10**6), ("1E6", 10**6), ("512k", 512 * 1024), ("512K", 512 * 1024),
    ("1M", 2**20), ("1m", 2**20), ("1_000_000", 10**6), ("524_288", 524288), ("1.5k", 1536), ("2.5e5", 250000),
    ("+32k", 32768), (" 4096 ", 4096), ("0.5M", 2**19),
])
def test_tokens_are_written_as_people_write_them(written, tokens):
    from q35lab.__main__ import _parser

    parser = _parser(KNOWN)
    assert parser.parse_args(["plan", "--tokens", written]).tokens == tokens
    assert parser.parse_args(["bench", "--T", written, "64"]).T == [tokens, 64]


@pytest.mark.parametrize("args, message", [
    (["bench", "--T", "-5"], "argument --T: expected at least 1 token, got '-5'"),
    (["bench", "--T", "0"], "argument --T: expected at least 1 token, got '0'"),
    (["bench", "--T", "7.5"], "argument --T: expected a whole number of tokens, got '7.5' (= 7.5)"),
    (["bench", "--T"], "argument --T: expected at least one argument"),
    (["bench", "--out", "{file}"], "argument --out: expected a folder to write results into, got the file {file}"),
    (["check", "--quick"], "unrecognized arguments: --quick"),
    (["plots", "--data", "{file}"], "argument --data: no such folder: {file}"),
])
def test_every_command_names_a_bad_option(capsys, tmp_path, args, message):
    from q35lab.__main__ import main

    file = tmp_path / "a_file.csv"
    file.write_text("x\n")
    args = [a.format(file=file) for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    usage = "usage: python -m q35lab" if "unrecognized" in message else f"usage: python -m q35lab {args[0]}"
    assert exit_.value.code == 2 and message.format(file=file) in err and usage in err


@pytest.mark.parametrize("args, message", [
    (["--T", "-5"], "argument --T: expected at least 1 token, got '-5'"),
    (["--T", "1e-1"], "argument --T: expected a whole number of tokens, got '1e-1' (= 0.1)"),
    (["--layers", "0"], "argument --layers: expected a whole number of at least 1, got '0'"),
    (["--size", "9b", "--layers", "33"], "argument --layers: expected at most 32 (9b has that many), got 33"),
    (["--size", "27b", "--layers", "65"], "argument --layers: expected at most 64 (27b has that many), got 65"),
    (["--rank", "0"], "argument --rank: expected a whole number of at least 1, got '0'"),
    (["--steps", "0"], "argument --steps: expected a whole number of at least 1, got '0'"),
    (["--warmup", "-1"], "argument --warmup: expected a whole number of at least 0, got '-1'"),
    (["--warmup", "one"], "argument --warmup: expected a whole number of at least 0, got 'one'"),
    (["--fit-max", "4095"], "argument --fit-max: expected at least 4,096 tokens, got '4095'"),
    (["--fit-from=-4k"], "argument --fit-from: expected at least 0 tokens, got '-4k'"),
    (["--fit-step", "1"], "argument --fit-step: expected a step factor (a finite number, above 1), got '1'"),
    (["--fit-step", "inf"], "argument --fit-step: expected a step factor (a finite number, above 1), got 'inf'"),
    (["--variants", "bogus"], "argument --variants: invalid choice: 'bogus'"),
    (["--what", "block"], "argument --what: invalid choice: 'block'"),
    (["--size", "7b"], "argument --size: invalid choice: '7b'"),
    (["--batch", "ragged"], "argument --batch: invalid choice: 'ragged'"),
    (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
    (["--variant", "bogus"], "argument --variant: invalid choice: 'bogus'"),
    (["--out", "{folder}"], "argument --out: expected a file to write, got the folder {folder}"),
    ([], "the following arguments are required: --out"),
])
def test_e2e_names_a_bad_option(capsys, tmp_path, args, message):
    from q35lab import e2e

    args = [a.format(folder=tmp_path) for a in args]
    if "--out" not in args and message != "the following arguments are required: --out":
        args += ["--out", str(tmp_path / "rows.csv")]
    with pytest.raises(SystemExit) as exit_:
        e2e.main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.format(folder=tmp_path) in err and "usage: python -m q35lab.e2e" in err
    assert not (tmp_path / "rows.csv").exists()


def test_e2e_takes_tokens_as_people_write_them():
    from q35lab.bench.e2e.cli import _parser

    args = _parser().parse_args(["--T", "8k", "32_768", "--fit-max", "1M", "--fit-from", "0", "--out", "x.csv"])
    assert args.T == [8192, 32768] and args.fit_max == 2**20 and args.fit_from == 0


# ---- plan says what it assumed, and where a step does not fit, the longest that does


def test_plan_says_which_host_memory_it_assumed_and_the_longest_step_that_fits(capsys, monkeypatch):
    import random

    from q35lab import long_context
    from q35lab.bench.e2e.model import config

    host = random.uniform(8, 256) * GIB  # this machine's, as the plan reads it: fresh each run
    patch_everywhere(monkeypatch, "host_memory_available", lambda: host)
    gpu = random.uniform(40, 100)
    code, out = _plan(capsys, "--tokens", "1M", "--gpu-gib", f"{gpu}")
    lines = out.splitlines()
    reserve = long_context.default_host_reserve()
    assert code == 1 and lines[0] == (f"Host memory: this machine's, {host / GIB:.1f} GiB available, of which the "
                                      f"offload leaves {reserve / GIB:.1f} GiB free; "
                                      "--host-gib plans for another host.")
    settings = dict(gpu_bytes=gpu * GIB, host_bytes=host, host_reserve_bytes=reserve)
    assert lines[1] == str(long_context.plan_long_context(config("9b"), 2**20, **settings))
    longest = long_context.longest_planned_step(config("9b"), **settings)
    assert longest.fits and longest.tokens < 2**20
    assert not long_context.plan_long_context(config("9b"), longest.tokens + 1024, **settings).fits
    assert lines[2:] == [f"the longest step predicted to fit: {longest.tokens:,} tokens (plan it with --tokens "
                         f"{longest.tokens})"]


def test_plan_without_a_gpu_says_the_host_is_this_machines_while_the_gpu_is_an_h200s(capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the plan is for it")

    patch_everywhere(monkeypatch, "host_memory_available", lambda: 20 * GIB)
    _, out = _plan(capsys, "--size", "27b")
    lines = out.splitlines()
    assert lines[0].startswith("No CUDA GPU here: planning for an H200")
    assert lines[1].startswith("Host memory: this machine's (while the GPU is an H200's), 20.0 GiB available")
    patch_everywhere(monkeypatch, "host_memory_available", lambda: None)
    _, out = _plan(capsys, "--size", "27b", "--gpu-gib", "80")
    assert out.splitlines()[0] == "Host memory: unknown here, so the plan offloads nothing; --host-gib gives it."


def test_plan_says_when_not_even_the_shortest_step_fits(capsys):
    code, out = _plan(capsys, "--tokens", "64k", "--gpu-gib", "1", "--host-gib", "0")
    assert code == 1 and out.splitlines()[-1] == "not even a step of 1,024 tokens fits this GPU"
    code, out = _plan(capsys, "--gpu-gib", "1", "--host-gib", "0")
    assert code == 1 and out.splitlines()[-1] == "not even a step of 1,024 tokens fits this GPU"
