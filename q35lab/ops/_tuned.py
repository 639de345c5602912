"""Launch configurations measured best on a given GPU, committed beside the kernels.

``tuned.json`` maps a GPU (its slug, e.g. ``nvidia-h200``) to an op to a row width to the fields
of that op's ``LaunchConfig``. It is written by the op's tuning script on that GPU and read at
the first launch; GPUs it does not list get the op's heuristic defaults.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

TUNED_FILE = Path(__file__).with_name("tuned.json")


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' → 'nvidia-h200'."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    return json.loads(TUNED_FILE.read_text()) if TUNED_FILE.exists() else {}


@functools.lru_cache(maxsize=None)
def tuned_fields(op: str, n_cols: int | str) -> dict | None:
    """The committed configuration of ``op`` at width ``n_cols`` (or another shape key, e.g.
    ``"248320x4096"``) on this GPU, if there is one."""
    if not torch.cuda.is_available():
        return None
    entry = _table().get(gpu_slug(torch.cuda.get_device_name()), {}).get(op, {})
    return entry.get(str(n_cols))


def save(op: str, n_cols: int | str, fields: dict, gpu: str) -> None:
    """Record ``fields`` as the configuration of ``op`` at ``n_cols`` on ``gpu`` (tuning scripts)."""
    table = json.loads(TUNED_FILE.read_text()) if TUNED_FILE.exists() else {}
    table.setdefault(gpu_slug(gpu), {}).setdefault(op, {})[str(n_cols)] = fields
    TUNED_FILE.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    _table.cache_clear()
    tuned_fields.cache_clear()
