"""The layering of the package, read from the source: which folder may import which, and no import circle.

reference/ is the contract and imports no engine; kernels/ never import the engine above them (their tests take the
torch forms from fast/ or reference/); the product (reference, fast, kernels, qualify, serve, cli) never imports the
lab, and reaches the benchmarks only from inside `iquest bench`'s functions; no module-level import circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("reference", "fast", "kernels", "qualify", "serve", "cli")
FORBIDDEN = {  # folder -> packages it must not import at all
    "reference": {"fast", "kernels", "qualify", "serve", "cli", "bench", "lab"},
    "kernels": {"fast", "qualify", "serve", "cli", "bench", "lab"},
    "fast": {"qualify", "serve", "cli", "bench", "lab"},
    "qualify": {"serve", "cli", "bench", "lab"},
    "serve": {"qualify", "cli", "bench", "lab"},
    "cli": {"lab"},
}


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported iquest module, at module level?) for every import in `path`, relative ones resolved."""
    package = ["iquest", *path.relative_to(ROOT).parent.parts]
    tree = ast.parse(path.read_text(), str(path))
    top: set[int] = set()

    def mark(node: ast.AST) -> None:  # what runs at import: everything outside function bodies
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        top.add(id(node))
        for child in ast.iter_child_nodes(node):
            mark(child)
    mark(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name] + [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            if n == "iquest" or n.startswith("iquest."):
                out.append((n, id(node) in top))
    return out


def modules() -> dict[str, Path]:
    found = {}
    for folder in PRODUCT + ("bench", "lab"):
        for path in sorted((ROOT / folder).glob("*.py")):
            name = f"iquest.{folder}" + ("" if path.stem == "__init__" else f".{path.stem}")
            found[name] = path
    return found


MODULES = modules()


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_folder_imports_what_sits_above_it(folder):
    bad = [(name, imported) for name, path in MODULES.items() if _folder(name) == folder
           for imported, _ in imports(path) if _folder(imported) in FORBIDDEN[folder]]
    assert not bad, f"{folder}/ imports what it must not: {bad}"


def test_the_cli_reaches_the_benchmarks_only_inside_functions():
    bad = [(name, imported) for name, path in MODULES.items() if _folder(name) == "cli"
           for imported, top in imports(path) if top and _folder(imported) == "bench"]
    assert not bad, f"module-level imports of bench/ from the CLI: {bad}"


def test_no_import_circle_at_module_level():
    graph = {name: {i for i, top in imports(path) if top and i in MODULES and i != name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return trail + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, trail + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [])
            assert cycle is None, "import circle: " + " -> ".join(cycle[cycle.index(cycle[-1]):])


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The scanner is not blind: a kernel module importing the engine, relatively and inside a function, is found."""
    fake = ROOT / "kernels" / "_layering_probe.py"
    fake.write_text("def f():\n    from ..fast import sampler\n")
    try:
        assert ("iquest.fast.sampler", False) in imports(fake)
    finally:
        fake.unlink()
