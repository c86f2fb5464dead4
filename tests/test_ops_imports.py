"""The ``cute_kv.ops`` modules import no cycle: every import counts, at the top or inside a function (a late import
hides a cycle from Python, not from a reader), so an op's dispatch goes one way: entry, backends, shared helpers."""

from __future__ import annotations

import ast
from pathlib import Path

OPS = Path(__file__).resolve().parent.parent / "cute_kv" / "ops"
PACKAGE = "cute_kv.ops"


def import_graph(ops: Path = OPS) -> dict[str, set[str]]:
    """Module -> the ``ops`` modules it imports anywhere in its source (the package ``__init__`` left out: it imports
    the entry points to register their custom ops)."""
    modules = {p.stem for p in ops.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((ops / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name[len(PACKAGE) + 1:].split(".")[0] for a in node.names
                          if a.name.startswith(PACKAGE + ".")}
            elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
                found.add(node.module[len(PACKAGE) + 1:].split(".")[0])
        graph[name] = found & modules
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``[]``."""
    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[name] = "done"
        return []

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name)
            if cycle:
                return cycle
    return []


def test_find_cycle_finds_a_late_import_cycle(tmp_path):
    """The check itself: a cycle closed by an import inside a function is found, an acyclic chain is not."""
    (tmp_path / "a.py").write_text("from cute_kv.ops import b\n")
    (tmp_path / "b.py").write_text("import cute_kv.ops.c\n")
    (tmp_path / "c.py").write_text("def f():\n    from cute_kv.ops.a import g\n")
    assert find_cycle(import_graph(tmp_path)) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import torch\n")
    assert find_cycle(import_graph(tmp_path)) == []


def test_ops_modules_import_no_cycle():
    graph = import_graph()
    assert {"paged_attention", "splits", "paths"} <= set(graph)  # the parse sees the modules
    assert "splits" in graph["paged_attention_sm90"]  # and their imports
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


def test_attention_backends_import_only_shared_helpers():
    """Each kernel family's module is reached from its op entry and calls down: no op entry, no other family."""
    from cute_kv.ops import paged_attention

    families = {b.launcher.__module__.rsplit(".", 1)[1] for b in paged_attention.BACKENDS.values()}
    assert families == {"paged_attention_sm90", "paged_attention_sm100", "mla_decode", "mla_decode_sm100"}
    graph = import_graph()
    entries = {"paged_attention", "sparse_mla_attention", "mla_prefill", "explain"}
    for name in families:
        assert not graph[name] & (entries | families), (name, graph[name] & (entries | families))
