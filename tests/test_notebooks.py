"""The notebooks' install cell (scripts/colab_cell.py): one cell, in every notebook, that fails loudly."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("colab_cell", ROOT / "scripts" / "colab_cell.py")
colab_cell = importlib.util.module_from_spec(spec)
spec.loader.exec_module(colab_cell)


def test_every_notebook_starts_with_the_install_cell_skipped_when_tested():
    assert colab_cell.main(["--check"]) == 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cell = colab_cell.first_code_cell(json.loads(path.read_text()))
        assert "skip-execution" in cell["metadata"]["tags"], path.name
        compile("".join(cell["source"]), path.name, "exec")  # valid Python (no IPython magics)


def test_the_install_cell_stops_with_a_message_until_the_repository_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="Set REPO_URL"):
        exec(colab_cell.cell_source("01_offset_rmsnorm.ipynb"), {})
    assert not any(tmp_path.iterdir())  # nothing cloned, nothing installed


def test_a_failed_clone_is_an_error_naming_the_address(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = colab_cell.cell_source("06_qwen3_5_end_to_end.ipynb").replace(
        'REPO_URL = ""', f'REPO_URL = "{tmp_path / "no-such-repository"}"')
    with pytest.raises(SystemExit, match="git clone .*no-such-repository failed"):
        exec(source, {})
    assert f"NEEDS_GIB = {colab_cell.NEEDS_GIB['06_qwen3_5_end_to_end.ipynb']}" in source  # its own need, not the default


def test_run_again_inside_the_clone_it_clones_nothing_and_installs_that_checkout(tmp_path, monkeypatch):
    import subprocess
    import sys

    checkout = tmp_path / "q35lab-repo"
    (checkout / "q35lab").mkdir(parents=True)
    (checkout / "q35lab" / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text("")
    (checkout / "notebooks").mkdir()
    (tmp_path / "notebooks" / "q35lab").mkdir(parents=True)  # a look-alike: no package, no pyproject
    monkeypatch.chdir(checkout / "notebooks")  # where the first run left the notebook
    monkeypatch.setattr(sys, "path", list(sys.path))
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kwargs: calls.append(args))
    exec(colab_cell.cell_source("01_offset_rmsnorm.ipynb"), {})  # REPO_URL unset: not needed here
    assert [args[:3] for args in calls] == [[sys.executable, "-m", "pip"]]
    assert calls[0][-1] == str(checkout) and sys.path[0] == str(checkout)
    assert Path.cwd() == checkout / "notebooks"
    calls.clear()
    monkeypatch.chdir(tmp_path / "notebooks")  # not a checkout: it wants the address before anything
    with pytest.raises(SystemExit, match="Set REPO_URL"):
        exec(colab_cell.cell_source("01_offset_rmsnorm.ipynb"), {})
    assert calls == []


@pytest.mark.parametrize("capability, free_gib, warned", [
    ((7, 5), 14, ["no bf16 units", "run out of memory"]),  # a T4: bf16 only emulated (is_bf16_supported says True)
    ((8, 0), 39, []),  # an A100 40 GB: room for 01's sizes
    ((9, 0), 79, ["run out of memory"]),  # an H100 under 05's need
])
def test_the_install_cell_checks_the_gpu_for_bf16_units_and_memory(tmp_path, monkeypatch, capsys,
                                                                   capability, free_gib, warned):
    import subprocess
    import sys

    import torch

    checkout = tmp_path / "q35lab-repo"
    (checkout / "q35lab").mkdir(parents=True)
    (checkout / "q35lab" / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text("")
    (checkout / "notebooks").mkdir()
    monkeypatch.chdir(checkout / "notebooks")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(subprocess, "run", lambda args, **kwargs: None)  # no install
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (free_gib * 2**30, 80 * 2**30))
    notebook = "05_fused_linear_cross_entropy.ipynb" if capability == (9, 0) else "01_offset_rmsnorm.ipynb"
    exec(colab_cell.cell_source(notebook), {})
    out = capsys.readouterr().out
    assert f"a GPU: 80 GiB, {free_gib} free; this notebook needs {colab_cell.NEEDS_GIB.get(notebook, 24)} GiB" in out
    for message in ("no bf16 units", "run out of memory"):
        assert (message in out) == (message in warned), message
