"""Peers' training recipes (axolotl's loader, Unsloth's), found in a checkout of the repository.

They rebuild other projects' training paths to measure q35lab against them, so they live in the
repository's ``benchmarks/peers/`` and not in the wheel: the harness loads them from there, by
path, when a variant asks for one. Nothing here imports a peer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

#: The variants that run a peer's recipe, and the file of ``benchmarks/peers/`` that holds it.
RECIPES = {"peft+axolotl": "axolotl", "peft+liger+axolotl": "axolotl", "unsloth": "unsloth"}


class RecipeNotFound(RuntimeError):
    """A peer's recipe was asked for where no checkout's ``benchmarks/peers/`` is found."""


def benchmarks_folder() -> Path | None:
    """The checkout's ``benchmarks/`` folder: the one beside this q35lab package (run from a
    checkout, or installed editable), else the current directory's (a wheel run from a checkout);
    None where neither holds ``peers/``."""
    candidates = [Path(__file__).resolve().parents[3] / "benchmarks", Path.cwd() / "benchmarks"]
    return next((folder for folder in candidates if (folder / "peers").is_dir()), None)


def recipe(name: str):
    """The module ``benchmarks/peers/<name>.py``, loaded once (as ``q35lab_peers.<name>``): the
    same module for every caller, so that what a test replaces in it is what the harness calls."""
    module_name = f"q35lab_peers.{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder = benchmarks_folder()
    path = folder / "peers" / f"{name}.py" if folder else None
    if path is None or not path.is_file():
        raise RecipeNotFound(f"{name}: run from a checkout of the repository: peers' recipes live in "
                             "benchmarks/peers/, not in the wheel")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def missing(variants) -> list[str]:
    """Those of ``variants`` whose peer recipe this machine cannot find (none from a checkout)."""
    wanted = [v for v in variants if v in RECIPES]
    if not wanted:
        return []
    folder = benchmarks_folder()
    return [v for v in wanted if folder is None or not (folder / "peers" / f"{RECIPES[v]}.py").is_file()]
