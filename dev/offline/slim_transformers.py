"""Repack a transformers wheel with only the model folders a Qwen3.5 step imports.

The H200 image has transformers 5.17, whose GatedDeltaNet repeats q and k to the value heads
before it calls fla (the profile's largest copy); the current release does not. Its wheel
(about 13 MB) does not fit beside the slim Triton in the 64 MiB a device call carries. Models
live in folders of their own under ``transformers/models/``, and transformers registers what is
there when it is imported, so a wheel without the other folders still imports and builds
Qwen3.5. The folders kept are ``KEEP`` and those the installed Liger names (``liger_folders``);
``--check`` installs the result aside and trains a tiny Qwen3.5 step through PEFT, Liger's import
and q35lab with it. The rest of the package stays whole (3.1 MB for 5.24.0 with Liger 0.8.5).

    python3 -m pip download --no-deps transformers==5.24.0 -d /tmp/tf
    python3 dev/offline/slim_transformers.py /tmp/tf/transformers-*.whl .whl-tf/ --check
    python3 -m pip download --no-deps "huggingface-hub>=1.31,<2" -d .whl-tf/

transformers 5.24 checks at import for huggingface-hub >= 1.31, newer than the image's (made for
5.17), so its wheel travels in the same folder (1.x: 2.x needs httpx2, which the image lacks).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _wheel import repack

#: The model folders kept whatever else is installed: Qwen3.5 (dense and MoE), the auto classes
#: and what they import (encoder_decoder), and what PEFT 0.21 imports (bloom, mixtral).
KEEP = {"auto", "qwen3_5", "qwen3_5_moe", "encoder_decoder", "bloom", "mixtral"}


def liger_folders() -> set[str]:
    """The model folders the installed Liger names: its monkey_patch imports their modules when
    it is imported (about 40 folders for Liger 0.8.5)."""
    import importlib.util

    spec = importlib.util.find_spec("liger_kernel")
    if spec is None:
        raise SystemExit("liger-kernel is not installed here: its model folders cannot be listed")
    root = Path(spec.submodule_search_locations[0])
    return {m for f in root.rglob("*.py") for m in re.findall(r"transformers\.models\.([a-z0-9_]+)", f.read_text())}


def _model_folder(name: str) -> str | None:
    """``transformers/models/<folder>/...`` -> folder; None for a file outside the models."""
    parts = name.split("/")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def slim(wheel: Path, out_dir: Path, keep: set[str] = KEEP) -> Path:
    """Copy ``wheel`` into ``out_dir`` without the model folders ``keep`` does not name."""
    return repack(wheel, out_dir, lambda name: _model_folder(name) not in (None, *keep))


#: What a run imports and does with transformers: the harness's tiny Qwen3.5 (dense and MoE),
#: patched by q35lab, and Liger's Qwen3.5 entry points.
CHECK = """
import transformers, peft, torch
from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5, apply_liger_kernel_to_qwen3_5_moe
import q35lab
from q35lab import e2e
assert transformers.__file__.startswith(TARGET), transformers.__file__
model = e2e.build("tiny", layers=4, rank=8, device=torch.device("cpu"), dtype=torch.float32)
q35lab.apply_to_qwen3_5(model)
ids = torch.randint(0, 256, (1, 16))
model(input_ids=ids, labels=ids).loss.backward()
print("transformers", transformers.__version__, "from", transformers.__file__, ": tiny Qwen3.5 trained one step")
"""


def check(wheel: Path) -> None:
    """Install ``wheel`` into a scratch folder ahead of everything else on the path and run CHECK."""
    with tempfile.TemporaryDirectory() as target:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", target,
                        str(wheel)], check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([target, os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-c", f"TARGET = {target!r}\n" + CHECK], check=True, env=env)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--check", action="store_true", help="install the slimmed wheel aside and train a tiny step")
    args = parser.parse_args()
    path = slim(args.wheel, args.out_dir, KEEP | liger_folders())
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    if args.check:
        check(path)
