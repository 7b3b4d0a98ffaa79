"""The import graph: the library never imports the harness, nothing imports in a
cycle, and no consumer imports a private module.

Wings: the *library* (everything an engine imports: config, batch, metadata,
builders, expand, tree, checks, modes, attention, graphs, probes, audit,
integrations) and the *harness* (``fa3_spec.harness``: worlds, oracles, the
upstream-style reference, the toy steps, the self-audit), the reference EAGLE
consumer (``fa3_spec.eagle``), the draft-head trainer built on it
(``fa3_spec.train``) and the ``fa3-spec`` command (``fa3_spec.cli``). Arrows run from harness and
consumer to the library only. Imports inside functions count too.

Private modules (a ``_`` name, such as ``fa3_spec._validate``) belong to the
library *core*: ``fa3_spec/*.py``, ``builders/``, ``attention/`` and ``graphs/``. Everything
else (``eagle/``, ``train/``, ``integrations/``, ``harness/``, ``cli/``, ``benchmarks/``,
``notebooks/``) reaches the library through its public modules only.
"""

import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fa3_spec"
CONSUMERS = ("fa3_spec.harness", "fa3_spec.eagle", "fa3_spec.train", "fa3_spec.cli")
CORE_PACKAGES = ("builders", "attention", "graphs")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    path = ROOT.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def _imports(path: pathlib.Path, source: str = None, package: str = "") -> set:
    """Modules of the package that ``path`` (or ``source``, code outside the
    package) imports (absolute names)."""
    if source is None:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        source = path.read_text()
    found = set()
    for node in ast.walk(ast.parse(source)):
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
                if _is_module(sub):
                    found.add(sub)
        elif isinstance(node, ast.Attribute):  # fa3_spec._private.x after `import fa3_spec`
            parts = []
            while isinstance(node, ast.Attribute):
                parts.insert(0, node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id == "fa3_spec":
                found |= {".".join(["fa3_spec"] + parts[:i]) for i in range(1, len(parts) + 1)
                          if _is_module(".".join(["fa3_spec"] + parts[:i]))}
    return found


GRAPH = {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def _code_cells(notebook: pathlib.Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    lines = [line for c in cells if c["cell_type"] == "code"
             for line in "".join(c["source"]).splitlines() if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


def _is_core(module: str) -> bool:
    """``fa3_spec/*.py``, ``builders/``, ``attention/``: the modules private ones serve."""
    parts = module.split(".")
    return (len(parts) == 1 or parts[1] in CORE_PACKAGES
            or (len(parts) == 2 and (ROOT / f"{parts[1]}.py").exists()))


#: Every consumer (package module or outside file) and the fa3_spec modules it imports.
CONSUMER_IMPORTS = {
    **{m: targets for m, targets in GRAPH.items() if not _is_core(m)},
    **{f"benchmarks/{p.name}": _imports(p, p.read_text()) for p in (ROOT.parent / "benchmarks").glob("*.py")},
    **{f"notebooks/{p.name}": _imports(p, _code_cells(p)) for p in (ROOT.parent / "notebooks").glob("*.ipynb")},
}


def _private(module: str) -> bool:
    return any(part.startswith("_") and part != "__init__" for part in module.split(".")[1:])


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


def test_consumers_import_no_private_module():
    arrows = sorted((m, t) for m, targets in CONSUMER_IMPORTS.items() for t in targets if _private(t))
    assert arrows == []


def test_the_consumer_list_covers_every_wing():
    wings = {m.split("/")[0] if "/" in m else ".".join(m.split(".")[:2]) for m in CONSUMER_IMPORTS}
    assert wings == {"fa3_spec.eagle", "fa3_spec.train", "fa3_spec.integrations", "fa3_spec.harness",
                     "fa3_spec.cli",
                     "benchmarks", "notebooks"}
    assert not any(_is_core(m) for m in CONSUMER_IMPORTS if m.startswith("fa3_spec"))
    assert {"fa3_spec.config", "fa3_spec.builders.draft", "fa3_spec.attention.cascade"} <= {
        m for m in GRAPH if _is_core(m)}


def test_the_checks_see_planted_violations(monkeypatch):
    """Every check is live: a planted library -> harness arrow, a planted cycle and
    planted private imports (relative, absolute, by attribute, in a notebook) fail."""
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
    planted = dict(CONSUMER_IMPORTS)
    pkg = "fa3_spec.integrations"
    for module, source in [("fa3_spec.integrations.sglang", "from .._validate import int_in_range"),
                           ("benchmarks/perf.py", "from fa3_spec import _validate"),
                           ("benchmarks/perf.py", "import fa3_spec\nfa3_spec._validate.tensor"),
                           ("notebooks/01.ipynb", "from fa3_spec.builders._common import slot_call")]:
        planted[module] = CONSUMER_IMPORTS.get(module, set()) | _imports(None, source, pkg)
        monkeypatch.setitem(globals(), "CONSUMER_IMPORTS", planted)
        with pytest.raises(AssertionError):
            test_consumers_import_no_private_module()
        planted[module] = CONSUMER_IMPORTS.get(module, set())


def _private_members(path: pathlib.Path, classes: set) -> set:
    """``_name`` methods and attributes defined in ``classes`` of ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef):
                    name = sub.name
                elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                      and sub.value.id == "self"):
                    name = sub.attr
                else:
                    name = None
                if name and name.startswith("_") and not name.startswith("__"):
                    names.add(name)
    return names


ENGINE_AND_RUNNER_PRIVATES = (_private_members(ROOT / "eagle" / "engine.py", {"EagleEngine"})
                              | _private_members(ROOT / "graphs" / "runner.py", {"CUDAGraphRunner"}))


def _private_calls(source: str) -> set:
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_AND_RUNNER_PRIVATES
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")}


def test_benchmarks_use_no_private_member_of_the_engine_or_the_runner():
    found = {path.name: _private_calls(path.read_text())
             for path in sorted((ROOT.parent / "benchmarks").glob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_notebooks_use_no_private_member_of_the_engine_or_the_runner():
    found = {path.name: _private_calls(_code_cells(path))
             for path in sorted((ROOT.parent / "notebooks").glob("*.ipynb"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_private_member_check_sees_a_planted_call():
    assert {"_admit", "_plan", "_route"} <= ENGINE_AND_RUNNER_PRIVATES
    assert _private_calls("eng._admit()\nrunner._route(batch)\nself._admit()") == {"_admit", "_route"}
