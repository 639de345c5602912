"""The package's shape (DESIGN.md, "Layout"): layers that import one way, no cycle, modules of a readable
size, and code that holds its reasons, not its history."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "q35lab"

#: Each layer imports only layers below it (lower number); a module not listed is a door (``__init__``,
#: ``__main__`` and the aliases that keep moved names working), which may import anything.
LAYERS = {
    "runtime": 0, "shapes": 0,
    "ops": 1,
    "hf": 2, "numerics": 2,
    "long_context": 3, "patch": 4,
    "bench": 5, "plots": 5, "demo": 5, "exercises": 5,
}
SOFT_LINES, HARD_LINES = 900, 1200  # a kernel module (ops) may pass the first


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(("q35lab", *path.relative_to(PACKAGE).with_suffix("").parts))
        yield name.removesuffix(".__init__"), path


def _imports(name: str, path: Path):
    """Every q35lab module this one imports, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("q35lab"):
                yield target
                for alias in node.names:  # "from . import patch" names a module
                    yield f"{target}.{alias.name}"
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("q35lab"))


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


MODULES = dict(_modules())
GRAPH = {name: {t for t in _imports(name, path) if t in MODULES and t != name} for name, path in MODULES.items()}


def test_every_import_goes_down_or_sideways_within_its_own_package():
    upward = [(a, b) for a, targets in GRAPH.items() for b in targets
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert not upward, f"imports from a lower layer to a higher one: {upward}"


def test_long_context_and_patch_import_nothing_private_of_each_other():
    offending = []
    for name, path in MODULES.items():
        if _layer(name) not in (LAYERS["long_context"], LAYERS["patch"]):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and re.search(r"\b(patch|long_context)\b", node.module):
                offending += [f"{name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not offending


def test_no_import_cycle():
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for target in GRAPH[node]:
            if not (target in MODULES and MODULES[target].name == "__init__.py" and node.startswith(target + ".")):
                visit(target)  # a module's own package __init__ is not an edge back
        stack.pop()

    for module in GRAPH:
        visit(module)
    assert not cycles, cycles[:3]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= HARD_LINES, f"{name}: {lines} lines"
    if name.split(".")[1:2] != ["ops"]:
        assert lines <= SOFT_LINES, f"{name}: {lines} lines"


def test_no_commit_hashes_or_dates_in_the_package():
    """History lives in data/, RESULTS.md and git log: a hex run that reads as a commit, or a date."""
    pattern = re.compile(r"(?<![\w/])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/])"
                         r"|\b20\d\d-[01]\d-[0-3]\d\b")
    found = [f"{path.relative_to(PACKAGE)}:{i}: {m.group(0)}" for path in PACKAGE.rglob("*.py")
             for i, line in enumerate(path.read_text().splitlines(), 1) for m in pattern.finditer(line)]
    assert not found, found[:10]
