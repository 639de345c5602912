"""Launch configurations measured best on a given GPU: the shipped table and the user's own.

A table maps a GPU (its slug, e.g. ``nvidia-h200``) to an op to a shape key (a row width, or
e.g. ``"248320x4096"``) to fields of that op's ``LaunchConfig``. Two are read, merged at the
first launch: ``TUNED_FILE`` (``q35lab/ops/tuned.json``), shipped with the package (what the
project measured; ``python -m q35lab tune OP --shipped`` writes it, for a commit), and the
user's file (``user_file()``: ``$Q35LAB_TUNED_FILE``, else ``$XDG_CACHE_HOME/q35lab/tuned.json``,
else ``~/.cache/q35lab/tuned.json``), written by ``python -m q35lab tune OP``, so that tuning
never writes into an installed package. The user's entry wins at the same (GPU, op, key): it
was measured on the machine that reads it. GPUs neither lists get the op's heuristic defaults.

Every op chooses its launch the same way: ``launch_config(shape key)`` is
``tuned_config(op, key, heuristic default)``, and its host functions take ``config=`` (None: that).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import TypeVar

import torch

Config = TypeVar("Config")

#: The shipped table: what the project measured and committed.
TUNED_FILE = Path(__file__).with_name("tuned.json")


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' → 'nvidia-h200'."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def user_file() -> Path:
    """The user's table: ``$Q35LAB_TUNED_FILE``, else ``$XDG_CACHE_HOME/q35lab/tuned.json`` (an
    absolute ``XDG_CACHE_HOME`` only, as the XDG spec says), else ``~/.cache/q35lab/tuned.json``."""
    if os.environ.get("Q35LAB_TUNED_FILE"):
        return Path(os.environ["Q35LAB_TUNED_FILE"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(cache) if os.path.isabs(cache) else Path.home() / ".cache") / "q35lab" / "tuned.json"


def _read(path: Path) -> dict:
    """The table in ``path`` ({} where there is no file); an unreadable one raises, naming it."""
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # ValueError: not JSON, or not UTF-8
        raise ValueError(f"{path}: expected a JSON table of tuned launch configurations, could not read it "
                         f"({error}); fix or delete it") from error
    if not _nested(table, 4):
        raise ValueError(f"{path}: expected JSON objects {{gpu: {{op: {{shape key: {{field: value}}}}}}}}; "
                         f"fix or delete it")
    return table


def _nested(value, depth: int) -> bool:
    """Whether ``value`` is ``depth`` levels of JSON objects."""
    return isinstance(value, dict) and (depth == 1 or all(_nested(v, depth - 1) for v in value.values()))


@functools.cache
def _table() -> dict:
    """The shipped table with the user's entries over it."""
    table = _read(TUNED_FILE)
    for gpu, ops in _read(user_file()).items():
        for op, entries in ops.items():
            table.setdefault(gpu, {}).setdefault(op, {}).update(entries)
    return table


@functools.cache
def tuned_fields(op: str, n_cols: int | str) -> dict | None:
    """The tuned configuration of ``op`` at width ``n_cols`` (or another shape key, e.g.
    ``"248320x4096"``) on this GPU, if either table has one."""
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
        raise ValueError(f"{op} at {key}: unknown fields {sorted(unknown)} for {type(default).__name__} "
                         f"(a tuned entry of {user_file()} or {TUNED_FILE})")
    return dataclasses.replace(default, **fields)


def save(op: str, n_cols: int | str, fields: dict, gpu: str, shipped: bool = False) -> Path:
    """Record ``fields`` as the configuration of ``op`` at ``n_cols`` on ``gpu`` (tuning scripts)
    in the user's file, or with ``shipped`` in the package's; returns the file written."""
    path = TUNED_FILE if shipped else user_file()
    table = _read(path)
    table.setdefault(gpu_slug(gpu), {}).setdefault(op, {})[str(n_cols)] = fields
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    _table.cache_clear()
    tuned_fields.cache_clear()
    return path
