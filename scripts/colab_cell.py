"""Write the one install cell every notebook starts with (Colab or a fresh GPU box).

    python scripts/colab_cell.py            # rewrite the first code cell of every notebook
    python scripts/colab_cell.py --check    # exit 1 if a notebook's cell differs (tests run this)
    python scripts/colab_cell.py 01_offset_rmsnorm.ipynb   # only the notebooks named

The cell is tagged ``skip-execution`` (nbmake skips it when the notebooks are tested). It clones the
repository named in ``pyproject.toml`` (``[project.urls] Repository``, written into the cell here:
set the address there and run this script, and a notebook opened from the repository needs no edit)
into ``q35lab-repo`` (Colab puts the working folder on ``sys.path``: a folder named ``q35lab`` there
would shadow the package), installs it without the ``dev`` extra, makes the package importable
without a restart, and says when a restart is needed all the same (a q35lab or Triton already
imported in this runtime). It checks the GPU: one without bf16 units (a T4) runs q35lab through the
Triton interpreter, said in one line; else the free memory against what the notebook needs. Run
again, or from a checkout's notebooks folder, it clones nothing, and it installs nothing that is
installed already.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

#: GPU memory each notebook's GPU sizes need (GiB), the rest 24: every case of 05 needs an H200's
#: memory (transformers' loss at 32k keeps its fp32 logits and their gradients, about 98 GB above the
#: inputs; a smaller GPU runs the other cases and says which did not fit); 06, 08 and 09 train only tiny
#: models on the GPU (their 9B numbers are read from the committed runs). The README states the same needs.
NEEDS_GIB = {"05_fused_linear_cross_entropy.ipynb": 94, "06_qwen3_5_end_to_end.ipynb": 8,
             "08_long_context.ipynb": 8, "09_packed_batches.ipynb": 8}


def repository_url(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """``[project.urls] Repository`` of ``pyproject``: the address every install cell clones."""
    text = pyproject.read_text()
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # Python 3.10: the table's one line, read plainly
        table = re.search(r"^\[project\.urls\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        url = table and re.search(r'^Repository\s*=\s*"([^"]+)"', table.group(1), re.M)
        url = url and url.group(1)
    else:
        url = tomllib.loads(text).get("project", {}).get("urls", {}).get("Repository")
    if not url:
        raise SystemExit(f"{pyproject}: expected the repository's address under [project.urls] as "
                         'Repository = "https://..."; the notebooks\' install cell clones it')
    return url


CELL = '''\
# Run once on Colab or a fresh GPU box (skipped when the notebooks are tested).
REPO_URL = "{url}"  # pyproject.toml's [project.urls] Repository (scripts/colab_cell.py writes it here)
NEEDS_GIB = {needs}  # GPU memory this notebook's GPU sizes need
import importlib.metadata, json, os, pathlib, subprocess, sys

def is_checkout(folder):  # a q35lab repository: its package and its pyproject.toml
    return all(os.path.isfile(os.path.join(folder, *f)) for f in (("pyproject.toml",), ("q35lab", "__init__.py")))


def installed_from(folder):  # whether pip installed q35lab from this folder already (a rerun installs nothing)
    try:
        record = importlib.metadata.distribution("q35lab").read_text("direct_url.json") or "{{}}"
    except importlib.metadata.PackageNotFoundError:
        return False
    return json.loads(record).get("url") == pathlib.Path(folder).as_uri()


here = os.getcwd()  # a checkout already (this cell ran before, or a clone of your own): its root or notebooks/
root = next((folder for folder in (here, os.path.dirname(here)) if is_checkout(folder)), None)
if root is None:
    root = os.path.abspath("q35lab-repo")  # not "q35lab": Colab's working folder is on sys.path
    if not is_checkout(root):
        clone = subprocess.run(["git", "clone", "-q", REPO_URL, root], capture_output=True, text=True)
        if clone.returncode != 0:
            raise SystemExit(f"git clone {{REPO_URL}} failed: {{clone.stderr.strip()}}")
if not installed_from(root):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", root], check=True)  # keeps Colab's torch
if root not in sys.path:
    sys.path.insert(0, root)  # importable now, without a restart
os.chdir(os.path.join(root, "notebooks"))
loaded = sys.modules.get("q35lab")
if (loaded is None and "triton" in sys.modules) or (loaded and not os.path.abspath(loaded.__file__).startswith(root)):
    print("q35lab or Triton was imported before the install: restart the runtime, then run from the next cell.")

import torch

if not torch.cuda.is_available():
    print("No GPU: the kernels run through the Triton interpreter at tiny sizes (correct, not fast).")
elif torch.cuda.get_device_capability() < (8, 0):  # is_bf16_supported() also counts bf16 emulated (a T4's)
    os.environ["Q35LAB_INTERPRET"] = "1"  # read when the next cell imports q35lab
    print(f"{{torch.cuda.get_device_name()}} has no bf16 units: q35lab runs through the Triton interpreter at tiny "
          "sizes here (correct, not fast); to measure, pick an L4, A100 or H100 (Runtime > Change runtime type).")
else:
    free, total = torch.cuda.mem_get_info()
    print(f"{{torch.cuda.get_device_name()}}: {{total / 2**30:.0f}} GiB, {{free / 2**30:.0f}} free; this notebook needs {{NEEDS_GIB}} GiB")
    if free < NEEDS_GIB * 2**30:
        print("Less free memory than this notebook's sizes need: its largest cases will run out of memory.")
'''  # noqa: E501 (the notebooks' first cell as they hold it: rewrapping it here would rewrite every notebook)


def cell_source(notebook: str, url: str | None = None) -> str:
    """The install cell of ``notebook``; ``url``: the repository it clones (default: pyproject's)."""
    return CELL.format(url=url or repository_url(), needs=NEEDS_GIB.get(notebook, 24))


def first_code_cell(nb: dict) -> dict:
    return next(c for c in nb["cells"] if c["cell_type"] == "code")


def main(argv: list[str]) -> int:
    check = "--check" in argv
    named = [a for a in argv if not a.startswith("--")]
    url = repository_url()
    wrong = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        if named and path.name not in named:
            continue
        nb = json.loads(path.read_text())
        cell, want = first_code_cell(nb), cell_source(path.name, url)
        if "".join(cell["source"]) == want and "skip-execution" in cell["metadata"].get("tags", []):
            continue
        wrong.append(path.name)
        if not check:
            cell["source"] = want.splitlines(keepends=True)
            tags = sorted({*cell["metadata"].get("tags", []), "skip-execution"})
            cell["metadata"] = {**cell["metadata"], "tags": tags}
            cell["outputs"], cell["execution_count"] = [], None
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    if check and wrong:
        print("notebooks whose install cell differs (python scripts/colab_cell.py rewrites them):", ", ".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
