"""Import cycles and upward imports among polymask's modules and layers.

    python tools/import_cycles.py        # exit 1 on a cycle or an upward import

Edges are relative imports inside ``src/polymask``, top-level and
function-level alike; ``from . import x`` depends on ``x``, not on the
package's ``__init__``. Each module belongs to a *layer*: the top-level
package it lives in (``polymask.tracing.cases.tree`` -> ``tracing``), or the
root-level module itself (``testing``); ``""`` is the root ``__init__``. A
module may import its own layer and the layers before it in ``LAYERS``, never
one after it (docs/CONTRIBUTING.md, "Architecture in one screen").
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src"


# The data flow, lowest layer first: a layer imports only the layers before it.
LAYERS = (
    "_jax_compat",  # every private JAX API; behaviour that differs by JAX version
    "core",         # errors, specs, dim vars, shapes, masks, Masked, plans, buckets
    "tracing",      # symbolic trace, case splits, rule table, prologue, interpreter, mask()
    "rules",        # masking rules, one module per family (fill tracing's rule table)
    "ops",          # data-dependent-size ops built on rules' primitives
    "packing",      # the packed layout: segments, packed interpreter and rules, cost model
    "inspection",   # shape_formula, explain
    "runners",      # polymask.jit, ragged_map, program cache, compiles, host I/O
    "models",       # example models (BERT encoder) and their loader
    "serving",      # the dynamic batcher and the HTTP server (polymask serve)
    "cli",          # the command line
    "testing",      # the oracle (public module)
    "",             # polymask/__init__.py: the public API
)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (ROOT / "polymask").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: pathlib.Path, mods) -> set[str]:
    """The polymask modules ``name`` imports: relative imports and absolute
    ones (``from polymask.runners import polyjit``, ``import polymask.x``),
    at any level of the file (function-level imports included)."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            groups = [[a.name] for a in node.names if a.name.split(".")[0] == "polymask"]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            base = ".".join(pkg[:len(pkg) - (node.level - 1)]
                            + ([node.module] if node.module else []))
            groups = [[f"{base}.{a.name}" for a in node.names] + ([base] if node.module else [])]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "polymask":
            groups = [[f"{node.module}.{a.name}" for a in node.names] + [node.module]]
        else:
            continue
        for cands in groups:
            for c in cands:
                if c in mods and c != name:
                    deps.add(c)
                    break
    return deps


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def strongconnect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return out


def module_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, mods) for m, p in mods.items()}


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph contracted to layers (edges between distinct layers)."""
    out: dict[str, set[str]] = {layer_of(m): set() for m in graph}
    for m, deps in graph.items():
        out[layer_of(m)].update(layer_of(d) for d in deps if layer_of(d) != layer_of(m))
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` pairs whose imported layer comes after the importer's
    in ``LAYERS``; a layer missing from ``LAYERS`` counts as upward."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    out = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            a, b = layer_of(m), layer_of(d)
            if a != b and rank.get(b, len(LAYERS)) > rank.get(a, -1):
                out.append((m, d))
    return out


def main() -> int:
    graph = module_graph()
    up = upward_imports(graph)
    layers = layer_graph(graph)
    # The package __init__ re-exports the API; modules never import it back.
    graph.pop("polymask", None)
    for deps in graph.values():
        deps.discard("polymask")
    cycles = find_cycles(graph)
    layer_cycles = find_cycles(layers)
    for c in cycles:
        print("cycle:", " <-> ".join(c))
    for c in layer_cycles:
        print("layer cycle:", " <-> ".join(c))
    for m, d in up:
        print(f"upward import: {m} ({layer_of(m) or 'polymask'}) imports {d} ({layer_of(d)})")
    print(f"{len(graph)} modules, {len(cycles)} import cycles, {len(layers)} layers, "
          f"{len(layer_cycles)} layer cycles, {len(up)} upward imports")
    return 1 if cycles or layer_cycles or up else 0


if __name__ == "__main__":
    sys.exit(main())
