"""Repack an Unsloth wheel without its Studio app, for a device call's carry.

Unsloth 2026.10.9's wheel is 28.6 MB, 24.4 MB of it ``studio/`` (a web frontend and backend)
beside ``unsloth_cli/``; ``unsloth/`` imports neither. Without them the wheel is about 2.5 MB,
and with unsloth_zoo (2.9 MB) the pair fits beside ``.whl`` in the 64 MiB a call carries.
What Unsloth needs beyond the device image (trl, datasets, dill, multiprocess, and bitsandbytes,
which its ``get_peft_model`` asks for even without 4-bit weights) travels beside it in
``.whl-unsloth`` (dev/offline/device_wheels.sh).

    python3 -m pip download --no-deps unsloth unsloth_zoo -d /tmp/unsloth
    python3 dev/offline/slim_unsloth.py /tmp/unsloth/unsloth-*.whl .whl-unsloth/
    cp /tmp/unsloth/unsloth_zoo-*.whl .whl-unsloth/
"""

import sys
from pathlib import Path

from _wheel import repack

DROP = ("studio/", "unsloth_cli/")


def slim(wheel: Path, out_dir: Path) -> Path:
    """Copy ``wheel`` to ``out_dir`` without the top-level folders DROP names."""
    return repack(wheel, out_dir, lambda name: name.startswith(DROP))


if __name__ == "__main__":
    path = slim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
