"""RESULTS.md and the README's results table are what the committed CSVs give (q35lab.bench.record)."""

import random
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from q35lab.bench import record

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"


def test_results_md_is_what_the_csvs_give():
    # Regenerate with `python -m q35lab.bench.record` after committing new rows (or editing the generator).
    assert (ROOT / "RESULTS.md").read_text() == record.render(DATA)


def test_the_readme_shows_the_headline_table_as_the_csvs_give_it():
    table = "\n".join(record.headline(DATA))
    assert table in (ROOT / "README.md").read_text()


def test_the_readme_names_at_most_two_commits():
    readme = (ROOT / "README.md").read_text()
    commits = set(re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7}\b", readme))
    assert len(commits) <= 2, commits  # the record holds the provenance; the README stays a front door


# --- the rules, on CSVs made up here ------------------------------------------------------------

COLUMNS = ["variant", "T", "size", "layers", "rank", "status", "note", "report", "step_ms", "peak_gib", "loss_first",
           "gpu", "torch", "triton", "transformers", "commit", "date", "batch", "floor_ms"]


def _row(variant, commit, date, rng, T=32768, status="ok", **extra):
    ok = status == "ok"
    return {"variant": variant, "T": T, "size": "9b", "layers": 32, "rank": 16, "status": status,
            "note": "" if ok else "out of memory in backward", "report": "", "gpu": "NVIDIA H200",
            "step_ms": round(rng.uniform(1000, 9000), 1) if ok else None,
            "peak_gib": round(rng.uniform(10, 130), 3) if ok else None, "loss_first": round(rng.uniform(12, 14), 3),
            "torch": "2.11.0+cu130", "triton": "3.7.1", "transformers": "5.17.0", "commit": commit, "date": date,
            "batch": "", "floor_ms": None, **extra}


def _write(data: Path, rows: list[dict]) -> None:
    folder = data / "bench" / "nvidia-h200"
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=COLUMNS).to_csv(folder / "end_to_end.csv", index=False)


def test_the_headline_is_the_newest_call_that_ran_every_variant_and_prints_its_numbers(tmp_path):
    rng = random.Random()
    full = [_row(v, "aaaaaa1", "2026-01-02", rng) for v in record.HEADLINE]
    full[-1]["floor_ms"] = round(rng.uniform(500, 900), 1)
    newer_but_partial = [_row(v, "bbbbbb2", "2026-01-05", rng) for v in ("peft+liger", "q35lab")]
    other_size = [{**_row(v, "cccccc3", "2026-01-06", rng), "size": "27b", "layers": 64} for v in record.HEADLINE]
    other_length = [_row(v, "dddddd4", "2026-01-07", rng, T=8192) for v in record.HEADLINE]
    _write(tmp_path, full + newer_but_partial + other_size + other_length)

    table = record.headline(tmp_path)
    ours = full[-1]
    assert len(table) == 2 + len(record.HEADLINE) + 1  # header, rule, a row a variant, the floor
    for line, row in zip(table[2:], full):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == f"{row['step_ms'] / 1e3:.2f} s"
        assert cells[2] == f"{32768 / row['step_ms'] * 1e3:,.0f}"
        assert cells[3] == f"{row['peak_gib']:.1f} GiB"
        assert cells[4] == ("" if row is ours else f"{row['step_ms'] / ours['step_ms']:.2f}×")
    assert f"| {ours['floor_ms'] / 1e3:.2f} s |" in table[-1]
    assert "commit aaaaaa1, 2026-01-02" in record.headline_source(tmp_path)

    newest_full = [_row(v, "eeeeee5", "2026-01-09", rng) for v in record.HEADLINE]
    _write(tmp_path, full + newer_but_partial + newest_full)
    assert "commit eeeeee5, 2026-01-09" in record.headline_source(tmp_path)
    assert not record.headline(tmp_path)[-1].startswith("| the step's floor")  # that call profiled no floor


def test_a_call_on_the_same_day_is_newer_when_its_rows_come_later(tmp_path):
    rng = random.Random()
    _write(tmp_path, [_row(v, c, "2026-01-02", rng) for c in ("aaaaaa1", "bbbbbb2") for v in record.HEADLINE])
    assert "commit bbbbbb2" in record.headline_source(tmp_path)


def test_missing_data_is_an_error_that_says_what_is_missing(tmp_path):
    with pytest.raises(record.RecordError, match=r"end_to_end\.csv: not found"):
        record.headline(tmp_path)
    rng = random.Random()
    _write(tmp_path, [_row(v, "aaaaaa1", "2026-01-02", rng) for v in ("peft", "q35lab")])
    with pytest.raises(record.RecordError, match=r"no call ran all of peft, peft\+liger, peft\+liger\+axolotl, q35lab"):
        record.headline(tmp_path)


def test_the_longest_step_table_pairs_each_fit_with_the_next_length_out_of_memory(tmp_path):
    rng = random.Random()
    rows = [_row("peft+liger", "aaaaaa1", "2026-01-02", rng, T=T) for T in (8192, 65536)]
    rows += [_row("peft+liger", "bbbbbb2", "2026-01-03", rng, T=T, status="oom") for T in (32768 * 9, 4096 * 53)]
    rows += [_row("q35lab+long", "cccccc3", "2026-01-04", rng, T=524288)]
    _write(tmp_path, rows)
    lines = record._longest_section(tmp_path)
    liger = next(line for line in lines if line.startswith("| PEFT + Liger |"))
    assert "| 65,536 |" in liger and "| 217,088 | bbbbbb2, 2026-01-03 |" in liger  # the shorter of the two
    assert "not reached" in next(line for line in lines if line.startswith("| q35lab + all three options |"))
    assert f"is {524288 / 217088:.2f}× the length at which PEFT + Liger ran out of memory" in "\n".join(lines)


def test_the_command_writes_the_record_and_check_catches_a_stale_one(tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(DATA / "bench", data / "bench")
    out = tmp_path / "RESULTS.md"
    assert record.main(["--data", str(data), "--out", str(out)]) == 0
    assert record.main(["--check", "--data", str(data), "--out", str(out)]) == 0
    e2e = data / "bench" / "nvidia-h200" / "end_to_end.csv"
    frame = pd.read_csv(e2e)
    frame["step_ms"] *= 1.01  # every step measured again, a little slower
    frame.to_csv(e2e, index=False)
    assert record.main(["--check", "--data", str(data), "--out", str(out)]) == 1
    assert "differs from what" in capsys.readouterr().err
