"""Launch configurations measured best on a given GPU, committed beside the kernels.

``tuned.json`` maps a GPU (its slug, e.g. ``nvidia-h200``) to an op to a shape key (a row width,
or e.g. ``"248320x4096"``) to fields of that op's ``LaunchConfig``. It is written by the op's
tuning on that GPU (``python -m q35lab tune OP``) and read at the first launch; GPUs it does not
list get the op's heuristic defaults.

Every op chooses its launch the same way: ``launch_config(shape key)`` is
``tuned_config(op, key, heuristic default)``, and its host functions take ``config=`` (None: that).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TypeVar

import torch

Config = TypeVar("Config")

TUNED_FILE = Path(__file__).with_name("tuned.json")


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' → 'nvidia-h200'."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


@functools.cache
def _table() -> dict:
    return json.loads(TUNED_FILE.read_text()) if TUNED_FILE.exists() else {}


@functools.cache
def tuned_fields(op: str, n_cols: int | str) -> dict | None:
    """The committed configuration of ``op`` at width ``n_cols`` (or another shape key, e.g.
    ``"248320x4096"``) on this GPU, if there is one."""
    if not torch.cuda.is_available():
        return None
    entry = _table().get(gpu_slug(torch.cuda.get_device_name()), {}).get(op, {})
    return entry.get(str(n_cols))


def tuned_config(op: str, key: int | str, default: Config) -> Config:
    """``default`` (a frozen ``LaunchConfig``) with this GPU's tuned fields for ``op`` at ``key``.

    An entry may name only some fields (an older tuning script's): the others keep the default.
    A name the dataclass does not have raises: a misspelt entry would otherwise be ignored.
    """
    fields = tuned_fields(op, key)
    if not fields:
        return default
    unknown = set(fields) - {f.name for f in dataclasses.fields(default)}
    if unknown:
        raise ValueError(f"{TUNED_FILE.name}: {op} at {key}: unknown fields {sorted(unknown)} "
                         f"for {type(default).__name__}")
    return dataclasses.replace(default, **fields)


def save(op: str, n_cols: int | str, fields: dict, gpu: str) -> None:
    """Record ``fields`` as the configuration of ``op`` at ``n_cols`` on ``gpu`` (tuning scripts)."""
    table = json.loads(TUNED_FILE.read_text()) if TUNED_FILE.exists() else {}
    table.setdefault(gpu_slug(gpu), {}).setdefault(op, {})[str(n_cols)] = fields
    TUNED_FILE.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    _table.cache_clear()
    tuned_fields.cache_clear()
