"""How bench/ and tools/ get what they import (issue #39 point 1): nothing there edits ``sys.path`` or
loads a file by location (``importlib.util.spec_from_file_location``) -- a ComfyUI tree, or this
repository, comes in through ``PYTHONPATH`` that the command line or a small wrapper sets (.ci/run for
the tests, bench/device_setup.sh on the GPU box); and bench/'s modules import each other without a
circle (an import inside a function counts: it is a circle all the same once both functions run).

The scan reads the source with ``ast`` (a docstring naming ``sys.path`` is no edit)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("bench", "tools")
#: list methods that change sys.path in place
_MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "reverse", "sort",
             "__setitem__", "__delitem__", "__iadd__"}
_LOADERS = {"spec_from_file_location", "SourceFileLoader", "addsitedir"}


def _py_files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def _sys_aliases(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names ``sys`` is bound to, names ``sys.path`` is bound to by ``from sys import path``)."""
    mods, paths = {"sys"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.asname or a.name for a in node.names if a.name == "sys"}
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and not node.level:
            paths |= {a.asname or a.name for a in node.names if a.name == "path"}
    return mods, paths


def path_edits(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    """(line, what) for each edit of ``sys.path`` and each load of a file by location in ``source``."""
    tree = ast.parse(source, filename)
    mods, paths = _sys_aliases(tree)
    hits = []

    def is_sys_path(n):
        if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name):
            return n.value.id in mods
        return isinstance(n, ast.Name) and n.id in paths

    def target_hits(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            return any(target_hits(e) for e in t.elts)
        if isinstance(t, ast.Starred):
            return target_hits(t.value)
        return is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in _MUTATORS and is_sys_path(f.value):
                hits.append((node.lineno, f"sys.path.{f.attr}(...)"))
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _LOADERS:
                hits.append((node.lineno, f"{name}(...)"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(target_hits(t) for t in targets):
                hits.append((node.lineno, f"sys.path {type(node).__name__.lower()}"))
        elif isinstance(node, ast.ImportFrom) and any(a.name in _LOADERS for a in node.names):
            hits.append((node.lineno, "imports " + ", ".join(a.name for a in node.names if a.name in _LOADERS)))
    return sorted(set(hits))


# ---------------------------------------------------------------- bench/'s import graph
def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def bench_modules() -> dict[str, Path]:
    return {module_name(p): p for p in _py_files("bench")}


def imported_modules(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere in ``source`` (function bodies
    included): ``import bench.x``, ``from bench import x``, ``from bench.x import y``, relative imports.
    ``from P import x`` is an edge to P.x where that is a module, else to P."""
    pkg = name if is_package else name.rpartition(".")[0]
    out = set()

    def longest_known(mod: str) -> str | None:
        while mod:
            if mod in known:
                return mod
            mod = mod.rpartition(".")[0]
        return None

    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            for a in node.names:
                hit = longest_known(a.name)
                if hit:
                    out.add(hit)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                hit = longest_known(mod if a.name == "*" else f"{mod}.{a.name}")
                if hit:
                    out.add(hit)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = bench_modules()
    return {m: imported_modules(p.read_text(encoding="utf-8"), m, p.name == "__init__.py", set(mods))
            for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# ---------------------------------------------------------------- the scans
def test_bench_and_tools_edit_no_sys_path_and_load_no_file_by_location():
    files = [f for d in SCANNED for f in _py_files(d)]
    assert len(files) > 30, "the scan reads the files"
    hits = [f"{f.relative_to(ROOT)}:{line}: {what}" for f in files
            for line, what in path_edits(f.read_text(encoding="utf-8"), str(f))]
    assert not hits, ("bench/ and tools/ take ComfyUI and this repository from PYTHONPATH "
                      "(set by the command line or its wrapper), they do not edit sys.path:\n" + "\n".join(hits))


def test_bench_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 20 and sum(map(len, graph.values())) > 20, "the graph has bench/'s modules and their imports"
    found = cycles(graph)
    assert not found, "import circles in bench/: " + "; ".join(" <-> ".join(c) for c in found)


# ---------------------------------------------------------------- the scanners themselves
def test_the_scan_sees_each_kind_of_edit():
    src = '''
"""Docs may name sys.path.insert(0, x) and spec_from_file_location freely."""
import sys
import sys as _s
import importlib.util
from sys import path as P
from importlib.util import spec_from_file_location
sys.path.insert(0, "a")
_s.path.append("b")
sys.path[:0] = ["c"]
sys.path = ["d"]
sys.path += ["e"]
P.extend(["f"])
del sys.path[0]
importlib.util.spec_from_file_location("m", "/x/m.py")
ok = "a" in sys.path and sys.path[0] and list(sys.path)
'''
    got = [line for line, _ in path_edits(src)]
    assert got == [7, 8, 9, 10, 11, 12, 13, 14, 15], path_edits(src)


def test_the_graph_sees_every_import_form_and_finds_a_circle():
    known = {"bench", "bench.a", "bench.b", "bench.c", "bench.d", "bench.repro", "bench.repro.w"}
    src = '''
import bench.a
from bench import b
from bench.c import thing
def f():
    from . import d
    from .repro import w
import torch
'''
    assert imported_modules(src, "bench.x", False, known) == {"bench.a", "bench.b", "bench.c", "bench.d",
                                                              "bench.repro.w"}
    assert imported_modules("from .. import a\nfrom ..c import z\n", "bench.repro.w", False, known) == {"bench.a", "bench.c"}
    assert imported_modules("from . import w\n", "bench.repro", True, known) == {"bench.repro.w"}
    g = {"bench.a": {"bench.b"}, "bench.b": {"bench.c"}, "bench.c": {"bench.a"}, "bench.d": {"bench.a"}}
    assert cycles(g) == [["bench.a", "bench.b", "bench.c"]]
    assert cycles({"bench.a": {"bench.b"}, "bench.b": set()}) == []
