"""The notebooks' install cell (scripts/colab_cell.py): one cell, in every notebook, that fails loudly."""

import importlib.util
import json
import os
import random
import re
import sys
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


URL = colab_cell.repository_url()


def test_the_install_cell_clones_the_address_pyproject_names(tmp_path, monkeypatch):
    assert f'REPO_URL = "{URL}"' in colab_cell.cell_source("01_offset_rmsnorm.ipynb")
    fork = "https://example.org/a-fork/q35lab-" + str(random.randrange(10**6))
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(f'[project]\nname = "q35lab"\n\n[project.urls]\nHomepage = "https://example.org"\n'
                         f'Repository = "{fork}"\n\n[tool.pytest.ini_options]\nRepository = "not this one"\n')
    assert colab_cell.repository_url(pyproject) == fork
    monkeypatch.setitem(sys.modules, "tomllib", None)  # Python 3.10 has no tomllib: the plain reading
    assert colab_cell.repository_url(pyproject) == fork
    pyproject.write_text('[project]\nname = "q35lab"\n')
    with pytest.raises(SystemExit, match=r"pyproject.toml: expected the repository's address under \[project.urls\]"):
        colab_cell.repository_url(pyproject)


def test_a_failed_clone_is_an_error_naming_the_address(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = colab_cell.cell_source("06_qwen3_5_end_to_end.ipynb", url=str(tmp_path / "no-such-repository"))
    with pytest.raises(SystemExit, match="git clone .*no-such-repository failed"):
        exec(source, {})
    assert f"NEEDS_GIB = {colab_cell.NEEDS_GIB['06_qwen3_5_end_to_end.ipynb']}" in source  # its own, not the default


def _checkout(tmp_path):
    checkout = tmp_path / "q35lab-repo"
    (checkout / "q35lab").mkdir(parents=True)
    (checkout / "q35lab" / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text("")
    (checkout / "notebooks").mkdir()
    return checkout


class _Installed:
    """What importlib.metadata finds for a q35lab pip-installed (editable) from ``folder``."""

    def __init__(self, folder):
        self.folder = folder

    def read_text(self, name):
        if name != "direct_url.json":
            return None
        return json.dumps({"url": Path(self.folder).as_uri(), "dir_info": {"editable": True}})


def test_run_again_inside_the_clone_it_clones_nothing_and_installs_nothing(tmp_path, monkeypatch):
    import importlib.metadata
    import subprocess

    checkout = _checkout(tmp_path)
    (tmp_path / "notebooks" / "q35lab").mkdir(parents=True)  # a look-alike: no package, no pyproject
    monkeypatch.chdir(checkout / "notebooks")  # where the first run left the notebook
    monkeypatch.setattr(sys, "path", list(sys.path))
    calls, installed = [], {}

    def distribution(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    def run(args, **kwargs):
        calls.append(args)
        installed["q35lab"] = _Installed(args[-1])

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(subprocess, "run", run)
    exec(colab_cell.cell_source("01_offset_rmsnorm.ipynb"), {})  # a checkout's notebooks/: no clone
    assert [args[:3] for args in calls] == [[sys.executable, "-m", "pip"]]
    assert calls[0][-1] == str(checkout) and sys.path[0] == str(checkout)
    assert Path.cwd() == checkout / "notebooks"
    exec(colab_cell.cell_source("01_offset_rmsnorm.ipynb"), {})  # the rerun: installed from here already
    assert len(calls) == 1 and sys.path.count(str(checkout)) == 1
    installed["q35lab"] = _Installed(tmp_path / "another-checkout")  # installed, but from elsewhere: install this one
    exec(colab_cell.cell_source("01_offset_rmsnorm.ipynb"), {})
    assert len(calls) == 2 and calls[1][-1] == str(checkout)


@pytest.mark.parametrize("capability, free_gib, warned", [
    ((7, 5), 14, ["no bf16 units"]),  # a T4: bf16 only emulated (is_bf16_supported says True): the interpreter
    ((8, 0), 39, []),  # an A100 40 GB: room for 01's sizes
    ((9, 0), 79, ["run out of memory"]),  # an H100 under 05's need
])
def test_the_install_cell_checks_the_gpu_for_bf16_units_and_memory(tmp_path, monkeypatch, capsys,
                                                                   capability, free_gib, warned):
    import subprocess

    import torch

    checkout = _checkout(tmp_path)
    monkeypatch.chdir(checkout / "notebooks")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("Q35LAB_INTERPRET", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda args, **kwargs: None)  # no install
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (free_gib * 2**30, 80 * 2**30))
    notebook = "05_fused_linear_cross_entropy.ipynb" if capability == (9, 0) else "01_offset_rmsnorm.ipynb"
    exec(colab_cell.cell_source(notebook), {})
    out = capsys.readouterr().out
    no_bf16 = "no bf16 units" in warned
    assert ("Q35LAB_INTERPRET" in os.environ) == no_bf16  # the next cell's import picks the interpreter
    if no_bf16:
        said = [line for line in out.splitlines() if "bf16" in line]  # one line says what happens and what to pick
        assert len(said) == 1 and "runs through the Triton interpreter" in said[0] and "L4, A100 or H100" in said[0]
    else:
        need = colab_cell.NEEDS_GIB.get(notebook, 24)
        assert f"a GPU: 80 GiB, {free_gib} free; this notebook needs {need} GiB" in out
    for message in ("no bf16 units", "run out of memory"):
        assert (message in out) == (message in warned), message


def test_the_readme_states_the_memory_each_notebook_needs():
    readme = (ROOT / "README.md").read_text()
    assert "24 GiB for most" in readme
    for notebook, gib in colab_cell.NEEDS_GIB.items():  # "8 GiB for 06, 08 and 09" names each of them
        number = notebook[:2]
        assert re.search(rf"{gib} GiB for (every case of )?(\d\d, )*(\d\d and )?{number}\b", readme), number
