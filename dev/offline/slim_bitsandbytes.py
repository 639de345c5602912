"""Repack a bitsandbytes wheel with only the native libraries the H200 machine loads.

The device tool carries at most 64 MiB of ignored paths; bitsandbytes' wheel (43 MB) ships a
library for every CUDA, ROCm and XPU release. axolotl's LoRA kernels import it (for QLoRA
dequantisation, which a bf16 base never calls), so the LoRA and in_proj benches need it. Keeping
the CPU and CUDA 13.0 libraries (torch 2.11+cu130 there: bitsandbytes loads the one of
torch's CUDA) leaves about 5 MB.

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_24_x86_64 bitsandbytes -d /tmp/bnb
    python3 dev/offline/slim_bitsandbytes.py /tmp/bnb/bitsandbytes-*.whl .whl-peers/
"""

import re
import sys
from pathlib import Path

from _wheel import repack

KEEP = re.compile(r"libbitsandbytes_(cpu|cuda130)\.so$")


def slim(wheel: Path, out_dir: Path) -> Path:
    """Copy ``wheel`` to ``out_dir`` without the native libraries KEEP does not match."""
    return repack(wheel, out_dir, lambda name: name.endswith(".so") and not KEEP.search(name))


if __name__ == "__main__":
    path = slim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
