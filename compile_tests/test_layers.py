"""The import graph: the library never imports the harness, and nothing imports in a cycle.

Wings: the *library* (everything an engine imports: config, batch, metadata,
builders, expand, tree, checks, modes, attention, graphs, probes, audit,
integrations) and the *harness* (``fa3_spec.harness``: worlds, oracles, the
upstream-style reference, the toy steps, the self-audit, the CLI) plus the
reference EAGLE consumer (``fa3_spec.eagle``). Arrows run from harness and
consumer to the library only. Imports inside functions count too.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fa3_spec"
CONSUMERS = ("fa3_spec.harness", "fa3_spec.eagle")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set:
    """Modules of the package that ``path`` imports (absolute names)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "fa3_spec"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "fa3_spec":
                target = node.module
            else:
                continue
            found.add(target)
            for alias in node.names:  # `from . import x` imports the submodule x
                sub = f"{target}.{alias.name}"
                if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists() or (
                        ROOT.parent / sub.replace(".", "/")).is_dir():
                    found.add(sub)
    return found


GRAPH = {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def _is_consumer(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") for c in CONSUMERS)


def test_the_library_never_imports_the_harness():
    arrows = [(m, t) for m, targets in GRAPH.items() if not _is_consumer(m)
              for t in targets if _is_consumer(t)]
    assert arrows == []


def test_no_import_cycles():
    def parents(module):  # importing a.b.c first imports a and a.b
        parts = module.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    edges = {m: {t for t in ts if t in GRAPH and t != m and t not in parents(m)}
             for m, ts in GRAPH.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_the_checks_see_planted_violations(monkeypatch):
    """Both checks are live: a planted library -> harness arrow and a planted cycle fail."""
    planted = dict(GRAPH)
    planted["fa3_spec.graphs"] = GRAPH["fa3_spec.graphs"] | {"fa3_spec.harness.selfaudit"}
    monkeypatch.setitem(globals(), "GRAPH", planted)
    with pytest.raises(AssertionError):
        test_the_library_never_imports_the_harness()
    planted = dict(GRAPH)
    planted["fa3_spec.probes"] = GRAPH["fa3_spec.probes"] | {"fa3_spec.graphs"}
    monkeypatch.setitem(globals(), "GRAPH", planted)
    with pytest.raises(AssertionError, match="cycle"):
        test_no_import_cycles()
