"""List import cycles among polymask's modules (top-level and function-level imports).

    python tools/import_cycles.py        # exit 1 when a cycle exists

Edges are relative imports inside ``src/polymask``; ``from . import x`` depends
on ``x``, not on the package's ``__init__``.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (ROOT / "polymask").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: pathlib.Path, mods) -> set[str]:
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.level > 0):
            continue
        base = ".".join(pkg[:len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
        cands = [f"{base}.{a.name}" for a in node.names]
        if node.module:
            cands.append(base)
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


def main() -> int:
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    # The package __init__ re-exports the API; modules never import it back.
    graph.pop("polymask", None)
    for deps in graph.values():
        deps.discard("polymask")
    cycles = find_cycles(graph)
    for c in cycles:
        print("cycle:", " <-> ".join(c))
    print(f"{len(graph)} modules, {len(cycles)} import cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
