"""``python -m q35lab demo``: the README's first command trains the tiny model both ways and says
whether the curves agree, in a short summary."""

import math

import pytest
import torch

from q35lab import demo
from q35lab.__main__ import main


def test_demo_trains_both_ways_and_prints_a_short_summary_that_says_they_agree(capsys):
    assert main(["demo", "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    # a summary, not a log: the report, the curves and (on a GPU) the 9B-sized step's four lines
    assert len(out) <= 30, "\n".join(out)
    assert any("× Qwen3_5RMSNorm" in line for line in out)  # the patch's report
    rows = [line.split() for line in out if line[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2]
    unpatched, patched = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
    assert unpatched != patched  # two runs, not one printed twice: the kernels round elsewhere
    assert patched == pytest.approx(unpatched, rel=demo.LOSS_RTOL)
    assert patched[1] < patched[0] and unpatched[1] < unpatched[0]  # it learns the batch: real steps
    assert any(line.startswith("the curves agree") for line in out)


def test_curves_that_do_not_agree_are_said_so_and_fail_the_command(monkeypatch, capsys):
    def diverging(steps, seq=32, seed=0):
        unpatched = [5.5, 5.1][:steps]
        patched = [5.5, 5.1 * (1 + 3 * demo.LOSS_RTOL)][:steps]
        return {"unpatched": unpatched, "patched": patched, "unpatched_s": 1.0, "patched_s": 2.0, "report": "a report",
                "max_rel_difference": 3 * demo.LOSS_RTOL, "agree": False}

    monkeypatch.setattr(demo, "compare", diverging)
    assert main(["demo", "--steps", "2"]) == 1
    assert "the curves DO NOT agree: largest relative difference 6.0e-02" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--tokens", "-5"], ["--steps", "two"]])
def test_a_bad_option_is_a_usage_error_naming_it(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["demo", *argv])
    assert stop.value.code == 2
    assert f"argument {argv[0]}: expected a whole number of at least 1" in capsys.readouterr().err


def test_the_real_size_step_times_peft_and_q35lab_from_the_same_weights():
    # The GPU branch's code at the tiny size, on this machine: both variants train one measured step.
    rows = demo.real_size_step("tiny", tokens=16)
    assert list(rows) == ["PEFT", "PEFT + q35lab"]
    for row in rows.values():
        assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(16 / row["step_ms"] * 1e3)
    assert rows["PEFT + q35lab"]["loss"] == pytest.approx(rows["PEFT"]["loss"], rel=demo.LOSS_RTOL)
    assert all(math.isfinite(row["loss"]) for row in rows.values())


def test_a_variant_out_of_memory_is_reported_and_the_other_still_runs(monkeypatch):
    from q35lab.bench import e2e

    def measure(model, tokens, **_):
        if not any(type(m).__module__.startswith("q35lab") for m in model.modules()):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return {"step_ms": 4.0, "peak_gib": 1.5, "loss_first": 5.5}

    monkeypatch.setattr(e2e, "measure", measure)
    rows = demo.real_size_step("tiny", tokens=16)
    assert rows["PEFT"] == {"error": "out of memory"}
    assert rows["PEFT + q35lab"]["step_ms"] == 4.0

    monkeypatch.setattr(e2e, "measure", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):  # anything else is not a result: it propagates
        demo.real_size_step("tiny", tokens=16)
