"""The floor plan holds: imports run one way between the layers, and no module imports itself
back through others.

Every import counts, those inside functions and under TYPE_CHECKING too: a lazy import still
makes the importer know the imported. The layers, lowest first, and what each may import:
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("specpipe", "models", "workers", "app")

ENGINE = (
    "specpipe.core",
    "specpipe.prompts",
    "specpipe.settings",
    "specpipe.transformer",
    "specpipe.drafting",
    "specpipe.decoding",
    "specpipe.proofs",
    "specpipe.swarm",
    "specpipe.ops",
)
# layer -> the layers it may import (besides itself)
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "specpipe.core": (),
    "specpipe.prompts": (),
    "specpipe.settings": ("specpipe.core",),
    "specpipe.transformer": ("specpipe.core", "specpipe.settings"),
    "specpipe.drafting": (
        "specpipe.core",
        "specpipe.settings",
        "specpipe.prompts",
        "specpipe.transformer",
    ),
    "specpipe.decoding": (
        "specpipe.core",
        "specpipe.settings",
        "specpipe.transformer",
        "specpipe.drafting",
    ),
    "specpipe.proofs": (
        "specpipe.core",
        "specpipe.settings",
        "specpipe.prompts",
        "specpipe.transformer",
        "specpipe.drafting",
        "specpipe.decoding",
    ),
    "specpipe.swarm": (
        "specpipe.core",
        "specpipe.settings",
        "specpipe.transformer",
        "specpipe.drafting",
        "specpipe.decoding",
    ),
    "specpipe.ops": ENGINE[:-1],
    "models": ENGINE,
    "workers": (*ENGINE, "models"),
    "app": (*ENGINE, "models", "workers"),
    # The top floor: the benchmarks and the CLI compose everything; only the CLI imports the
    # benchmarks, and nothing imports the CLI.
    "specpipe.bench": (*ENGINE, "models", "workers", "app"),
    "specpipe.cli": (*ENGINE, "models", "workers", "app", "specpipe.bench"),
}
# The package's root holds its version only: anyone may read it, and it imports nothing.
ROOT_MODULE = "specpipe"
# `python -m specpipe` is the CLI's entry point.
ALIASES = {"specpipe.__main__": "specpipe.cli"}


def modules() -> dict[str, Path]:
    found = {}
    for top in TOP_PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports, lazily or not."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            wanted.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                wanted.add(full if full in known else base)
    found = set()
    for target in wanted:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def layer_of(module: str) -> str | None:
    module = ALIASES.get(module, module)
    best = None
    for layer in MAY_IMPORT:
        if module == layer or module.startswith(layer + "."):
            if best is None or len(layer) > len(best):
                best = layer
    return best


KNOWN = modules()
GRAPH = {name: imports_of(name, path, KNOWN) for name, path in KNOWN.items()}


def test_every_module_has_a_layer():
    assert [m for m in KNOWN if m != ROOT_MODULE and layer_of(m) is None] == []


def test_the_root_imports_nothing():
    assert GRAPH[ROOT_MODULE] == set()


def forbidden_arrows() -> list[str]:
    bad = []
    for module, targets in sorted(GRAPH.items()):
        here = layer_of(module)
        for target in sorted(targets - {ROOT_MODULE}):
            there = layer_of(target)
            if there != here and there not in MAY_IMPORT[here]:
                bad.append(f"{module} -> {target}")
    return bad


def test_imports_run_one_way_between_layers():
    assert forbidden_arrows() == []


def cycles() -> list[list[str]]:
    """Each import circle once, as the path that closes it (depth-first search)."""
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path)
        path.pop()
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [])
    return found


def test_no_import_circles():
    assert [" -> ".join(c) for c in cycles()] == []


@pytest.mark.parametrize(
    "module, target",
    [
        ("specpipe.swarm.wire", "models.jobs"),
        ("specpipe.transformer.layer_range", "specpipe.swarm.streams"),
    ],
)
def test_the_check_sees_a_forbidden_arrow(module, target, monkeypatch):
    monkeypatch.setitem(GRAPH, module, GRAPH[module] | {target})
    assert f"{module} -> {target}" in forbidden_arrows()


def test_the_check_sees_a_circle(monkeypatch):
    monkeypatch.setitem(GRAPH, "specpipe.core.sampling", {"specpipe.core.coupling"})
    assert any("specpipe.core.sampling" in c for c in cycles())
