"""specfleet's import graph, from the source alone (ast; nothing is imported), checked against the layers.

    python tools/import_graph.py              # package-level edges, cycles and imports against the layers
    python tools/import_graph.py --files      # file-level edges too

An import counts wherever it stands (module level or inside a function), because a deferred import
still ties the two modules together. Cycles are reported as strongly connected components of the
file graph and of the package graph (a package is specfleet's first-level subpackage or module).

Layers, highest first; a package may import only packages of lower layers:

    cli                                        the command line
    cluster, server, distill                   replicas behind a router, the HTTP server, draft distillation
    bench                                      the benchmark suite
    llm                                        the offline API
    engine                                     requests, scheduler, executor, pipelined and async drivers
    strategies                                 vote, select, fleet, adaptive length, the spec grammar
    drafting                                   draft sources: models, n-grams, lookup, suffix, remote
    runtime                                    device code: models, kernels, KV memory, loading
                                               (inside it, runtime.model imports no backend: ROOM_RULES)
    core, registry                             shared types (tree, proposer protocol, verifier), the model registry
    config, outputs, extras, sampling_params   plain settings and results
    errors

`__main__` modules are entry points (`python -m specfleet.server` runs the CLI's serve) and are
left out of the package graph. Exit status 1 on a cycle or an import against the layers (the test
suite runs this check: tests/test_layering.py).
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specfleet"
LAYERS = [["cli"], ["cluster", "server", "distill"], ["bench"], ["llm"], ["engine"], ["strategies"], ["drafting"], ["runtime"],
          ["core", "registry"], ["config", "outputs", "extras", "sampling_params"], ["errors"]]
RANK = {f"{PACKAGE}.{name}": len(LAYERS) - i for i, layer in enumerate(LAYERS) for name in layer}
# Rooms inside a layer that must not reach into others (docs/layout.md): the model is modules only and
# computes through the routes runtime/backends/bind.py hands it, so it imports no backend, no loader,
# no step plumbing, no sampling and no weight format.
ROOM_RULES = {f"{PACKAGE}.runtime.model": tuple(f"{PACKAGE}.runtime.{room}" for room in
                                                ("backends", "step", "loading", "sample", "formats"))}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """specfleet modules `path` imports, resolved to the deepest known module name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own = module_name(path)
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = own.split(".") if is_pkg else own.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name.startswith(PACKAGE) and name != own:
                found.add(name)
                break
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components with more than one node (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def build() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    known = {module_name(f) for f in files}
    file_graph = {module_name(f): imported_modules(f, known) for f in files}
    pkg_graph: dict[str, set[str]] = defaultdict(set)
    for src, dsts in file_graph.items():
        if src.endswith(".__main__"):
            continue  # an entry point, not a layer
        for dst in dsts:
            a, b = package_of(src), package_of(dst)
            if a != b and a != PACKAGE:  # the top-level __init__ re-exports; it is no layer
                pkg_graph[a].add(b)
    return file_graph, dict(pkg_graph)


def layer_violations(file_graph: dict[str, set[str]]) -> list[str]:
    """File imports that go up or sideways across the layers (or touch a package with no layer)."""
    out = []
    for src in sorted(file_graph):
        if src.endswith(".__main__") or src == PACKAGE:
            continue
        for dst in sorted(file_graph[src]):
            a, b = package_of(src), package_of(dst)
            if a == b:
                continue
            if a not in RANK or b not in RANK:
                out.append(f"{src} -> {dst}: {a if a not in RANK else b} has no layer (add it to LAYERS)")
            elif RANK[a] <= RANK[b]:
                out.append(f"{src} -> {dst}: {a} may not import {b}")
    for src in sorted(file_graph):
        for room, barred in ROOM_RULES.items():
            if src == room or src.startswith(room + "."):
                for dst in sorted(file_graph[src]):
                    hit = next((b for b in barred if dst == b or dst.startswith(b + ".")), None)
                    if hit:
                        out.append(f"{src} -> {dst}: {room} may not import {hit}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", action="store_true", help="print file-level edges too")
    args = ap.parse_args()
    file_graph, pkg_graph = build()
    print("package imports (A -> B: some file of A imports B):")
    for a in sorted(pkg_graph):
        print(f"  {a} -> {', '.join(sorted(pkg_graph[a]))}")
    if args.files:
        print("\nfile imports:")
        for a in sorted(file_graph):
            if file_graph[a]:
                print(f"  {a} -> {', '.join(sorted(file_graph[a]))}")
    file_cycles = strongly_connected(file_graph)
    pkg_cycles = strongly_connected(pkg_graph)
    print(f"\nfile-level cycles: {len(file_cycles)}")
    for c in file_cycles:
        print("  " + " <-> ".join(c))
    print(f"package-level cycles: {len(pkg_cycles)}")
    for c in pkg_cycles:
        print("  " + " <-> ".join(c))
    bad = layer_violations(file_graph)
    print(f"imports against the layers: {len(bad)}")
    for line in bad:
        print("  " + line)
    return 1 if file_cycles or pkg_cycles or bad else 0


if __name__ == "__main__":
    sys.exit(main())
