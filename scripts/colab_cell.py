"""Write the one install cell every notebook starts with (Colab or a fresh GPU box).

    python scripts/colab_cell.py            # rewrite the first code cell of every notebook
    python scripts/colab_cell.py --check    # exit 1 if a notebook's cell differs (tests run this)
    python scripts/colab_cell.py 01_offset_rmsnorm.ipynb   # only the notebooks named

The cell is tagged ``skip-execution`` (nbmake skips it when the notebooks are tested). It takes the
repository's address as a parameter and stops with a message while it is unset, clones into
``q35lab-repo`` (Colab puts the working folder on ``sys.path``: a folder named ``q35lab`` there
would shadow the package), checks that the clone worked, installs without the ``dev`` extra, makes
the package importable without a restart, says when a restart is needed all the same (a q35lab or
Triton already imported in this runtime), and checks the GPU against what the notebook needs. Run
again, or from a checkout's notebooks folder, it clones nothing and installs that checkout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

#: GPU memory each notebook's GPU sizes need (GiB), the rest 24: 05 times transformers' loss at 32k
#: (its fp32 logits and their gradients, 98 GB above its inputs on the H200: a smaller GPU runs the
#: rest and says which cases did not fit); 06, 08 and 09 run only tiny models on the GPU (their 9B
#: numbers are read from the committed runs).
NEEDS_GIB = {"05_fused_linear_cross_entropy.ipynb": 100, "06_qwen3_5_end_to_end.ipynb": 8,
             "08_long_context.ipynb": 8, "09_packed_batches.ipynb": 8}

CELL = '''\
# Run once on Colab or a fresh GPU box (skipped when the notebooks are tested).
REPO_URL = ""  # the address of the q35lab repository this notebook came from, e.g. "https://github.com/<you>/q35lab"
NEEDS_GIB = {needs}  # GPU memory this notebook's GPU sizes need
import os, subprocess, sys

def is_checkout(folder):  # a q35lab repository: its package and its pyproject.toml
    return all(os.path.isfile(os.path.join(folder, *f)) for f in (("pyproject.toml",), ("q35lab", "__init__.py")))


here = os.getcwd()  # a checkout already (this cell ran before, or a clone of your own): its root or notebooks/
root = next((folder for folder in (here, os.path.dirname(here)) if is_checkout(folder)), None)
if root is None:
    root = os.path.abspath("q35lab-repo")  # not "q35lab": Colab's working folder is on sys.path
    if not is_checkout(root):
        if not REPO_URL:
            raise SystemExit("Set REPO_URL (first line of this cell) to the q35lab repository's address, "
                             "then run the cell again.")
        clone = subprocess.run(["git", "clone", "-q", REPO_URL, root], capture_output=True, text=True)
        if clone.returncode != 0:
            raise SystemExit(f"git clone {{REPO_URL}} failed: {{clone.stderr.strip()}}")
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", root], check=True)  # keeps Colab's torch
sys.path.insert(0, root)  # importable now, without a restart
os.chdir(os.path.join(root, "notebooks"))
loaded = sys.modules.get("q35lab")
if (loaded is None and "triton" in sys.modules) or (loaded and not os.path.abspath(loaded.__file__).startswith(root)):
    print("q35lab or Triton was imported before the install: restart the runtime, then run from the next cell.")

import torch

if not torch.cuda.is_available():
    print("No GPU: the kernels run through the Triton interpreter at tiny sizes (correct, not fast).")
else:
    free, total = torch.cuda.mem_get_info()
    print(f"{{torch.cuda.get_device_name()}}: {{total / 2**30:.0f}} GiB, {{free / 2**30:.0f}} free; this notebook needs {{NEEDS_GIB}} GiB")
    if torch.cuda.get_device_capability() < (8, 0):  # is_bf16_supported() also counts bf16 emulated (a T4's)
        print("This GPU has no bf16 units (a T4 or older): the Triton kernels' bf16 cells will fail; "
              "use an L4, A100 or H100/H200.")
    if free < NEEDS_GIB * 2**30:
        print("Less free memory than this notebook's sizes need: its largest cases will run out of memory.")
'''


def cell_source(notebook: str) -> str:
    return CELL.format(needs=NEEDS_GIB.get(notebook, 24))


def first_code_cell(nb: dict) -> dict:
    return next(c for c in nb["cells"] if c["cell_type"] == "code")


def main(argv: list[str]) -> int:
    check = "--check" in argv
    named = [a for a in argv if not a.startswith("--")]
    wrong = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        if named and path.name not in named:
            continue
        nb = json.loads(path.read_text())
        cell, want = first_code_cell(nb), cell_source(path.name)
        if "".join(cell["source"]) == want and "skip-execution" in cell["metadata"].get("tags", []):
            continue
        wrong.append(path.name)
        if not check:
            cell["source"] = want.splitlines(keepends=True)
            cell["metadata"] = {**cell["metadata"], "tags": sorted({*cell["metadata"].get("tags", []), "skip-execution"})}
            cell["outputs"], cell["execution_count"] = [], None
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    if check and wrong:
        print("notebooks whose install cell differs (python scripts/colab_cell.py rewrites them):", ", ".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
