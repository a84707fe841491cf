"""The package layering of docs/architecture.md, checked on the source.

Each module gets the level of its layer; a module may import only from its own level or below
(`TYPE_CHECKING` blocks are ignored: they never run). No package may import another in a cycle,
and the torch-free layers (`plan/`, `hardware/`, the config) never import torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "llmscale"

# Lowest first. A module matches the longest prefix listed.
LAYERS: list[tuple[str, ...]] = [
    (
        "llmscale.errors",
        "llmscale.ui",
        "llmscale.paths",
        "llmscale.config",
        "llmscale.model.config",
    ),
    ("llmscale.hardware",),
    ("llmscale.stack",),
    ("llmscale.plan",),
    ("llmscale.validation", "llmscale.report"),
    ("llmscale.tensors", "llmscale.torch_internals", "llmscale.instrument"),
    ("llmscale.model",),
    ("llmscale.data",),
    ("llmscale.parallel",),
    ("llmscale.offload",),
    ("llmscale.hf",),
    ("llmscale.train",),
    ("llmscale.inference",),
    ("llmscale.bench",),
    ("llmscale.cli", "llmscale.__main__", "llmscale"),
]
TORCH_FREE = (
    "llmscale.errors",
    "llmscale.ui",
    "llmscale.paths",
    "llmscale.config",
    "llmscale.model.config",
    "llmscale.hardware",
    "llmscale.stack",
    "llmscale.plan",
    "llmscale.validation",
    "llmscale.report",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _match(name: str, prefixes: tuple[str, ...]) -> str | None:
    best = None
    for p in prefixes:
        if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best)):
            best = p
    return best


def level(name: str) -> int:
    """The layer of a module: the one whose longest listed prefix matches it."""
    found = [(len(m), i) for i, layer in enumerate(LAYERS) if (m := _match(name, layer))]
    assert found, f"{name} is in no layer of LAYERS"
    return max(found)[1]


def package(name: str) -> str:
    """The unit a cycle is checked between: `llmscale.X` (model.config on its own)."""
    if name.startswith("llmscale.model.config"):
        return "llmscale.model.config"
    return ".".join(name.split(".")[:2])


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import that runs, at any depth."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = module.split(".")[: -node.level]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.append((name, node.lineno))
            # `from llmscale.plan import memory` imports the submodule llmscale.plan.memory
            out.extend((f"{name}.{a.name}", node.lineno) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _graph() -> dict[str, list[tuple[str, int]]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        edges = []
        for imported, line in _imports(ast.parse(path.read_text()), name):
            root = imported.split(".")[0]
            if (root == "llmscale" and imported in modules) or root == "torch":
                edges.append((imported, line))
        graph[name] = edges
    return graph


GRAPH = _graph()


def test_every_module_has_a_layer() -> None:
    for name in GRAPH:
        level(name)


def test_no_upward_import() -> None:
    bad = [
        f"{name}:{line} imports {imp} (layer {level(imp)} above {level(name)})"
        for name, edges in GRAPH.items()
        for imp, line in edges
        if imp.startswith("llmscale") and level(imp) > level(name)
    ]
    assert not bad, "\n".join(bad)


def test_torch_free_layers() -> None:
    bad = [
        f"{name}:{line} imports {imp}"
        for name, edges in GRAPH.items()
        if _match(name, TORCH_FREE) and name != "llmscale"
        for imp, line in edges
        if imp.split(".")[0] == "torch"
    ]
    assert not bad, "\n".join(bad)


def test_no_package_cycle() -> None:
    deps: dict[str, set[str]] = {}
    for name, edges in GRAPH.items():
        for imp, _ in edges:
            if imp.startswith("llmscale") and package(imp) != package(name):
                deps.setdefault(package(name), set()).add(package(imp))
    # Depth-first search for a back edge.
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(deps.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(deps):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize(
    ("low", "high"),
    [
        ("llmscale.plan.memory", "llmscale.train.trainer"),
        ("llmscale.tensors", "llmscale.model.transformer"),
    ],
)
def test_levels_are_ordered(low: str, high: str) -> None:
    """The checker itself: a known-lower module ranks below a known-higher one."""
    assert level(low) < level(high)


def test_dtype_bytes_match_torch() -> None:
    """The torch-free byte table agrees with torch's own element sizes."""
    from llmscale.config import DTYPE_BYTES
    from llmscale.tensors import DTYPES

    assert set(DTYPE_BYTES) == set(DTYPES)
    for name, nbytes in DTYPE_BYTES.items():
        assert DTYPES[name].itemsize == nbytes
