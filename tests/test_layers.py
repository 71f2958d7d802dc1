"""The import-layer contract: every import points down the layers below, and no modules import each
other in a loop.

import-linter cannot check this project (grimp walks a package's own directory, and
``radixcache.integrations`` lives in ``integrations/`` by the package-dir mapping), so the graph is
read here from the source: every ``import`` and ``from ... import`` of a ``radixcache`` module,
top-level or inside a function (a lazy import is an arrow too), except those under
``if TYPE_CHECKING:`` (annotations only).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top down: a module may import its own layer's modules and any lower layer's, never a higher one's.
# The package face ``radixcache`` (``wrap`` and the public names) sits between the server and the
# transformers adapter it re-exports.
LAYERS = [
    ["radixcache.app"],
    ["radixcache.integrations.serve"],
    ["radixcache"],
    ["radixcache.integrations.hf"],
    ["radixcache.integrations.redis_store"],
    ["radixcache.engine"],
    ["radixcache.lifecycle", "radixcache.attention", "radixcache.kv_events"],
    ["radixcache.kv"],
    ["radixcache.store", "radixcache.tree"],
    ["radixcache.blocks", "radixcache.tokens", "radixcache.models", "radixcache.quantize", "radixcache.compute_threads",
     "radixcache.args", "radixcache.table"],
    ["radixcache.errors"],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "integrations":
        parts = ["radixcache"] + parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict:
    return {module_name(p): p for d in ("radixcache", "integrations") for p in (ROOT / d).rglob("*.py")}


def imports(path: Path, known) -> set:
    """The ``radixcache`` modules ``path`` imports (outside ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import submodule`` depends on the submodule; other names on the module
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def layer_of(module: str) -> int:
    best, index = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    assert index is not None, f"{module} is in no layer: add it to LAYERS"
    return index


def graph() -> dict:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_every_import_points_down_the_layers():
    wrong = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
             for m, targets in graph().items() for t in sorted(targets) if layer_of(t) < layer_of(m)]
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def test_no_modules_import_each_other_in_a_loop():
    edges = graph()
    index, low, on_stack, stack, loops = {}, {}, set(), [], []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not loops, "modules that import each other in a loop:\n" + "\n".join(" <-> ".join(c) for c in loops)


def test_the_contract_fails_on_an_import_that_points_up(tmp_path, monkeypatch):
    """The check can fail: a tree module importing the engine is reported."""
    bad = ROOT / "radixcache" / "tree" / "body.py"
    edges = graph()
    edges[module_name(bad)] = edges[module_name(bad)] | {"radixcache.engine.engine"}
    wrong = [m for m, targets in edges.items() for t in targets if layer_of(t) < layer_of(m)]
    assert wrong == ["radixcache.tree.body"]
