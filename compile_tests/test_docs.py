"""Every python block of docs/ runs as written (docs/engines.md's are sketches in
an engine's names), and every docstring example in fa3_spec runs."""

import doctest
import importlib
import pathlib

import pytest
import torch

import fa3_spec
from test_readme import fenced_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fa3_spec"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: Pages whose python blocks are sketches (names an engine has), not programs.
SKETCHES = {"engines.md"}


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _python_blocks():
    out = []
    for page in DOCS:
        if page.name in SKETCHES:
            continue
        for lang, body, line in fenced_blocks(page.read_text()):
            if lang == "python":
                out.append(pytest.param(page, body, line, id=f"{_rel(page)}:{line}"))
    return out


DOC_BLOCKS = _python_blocks()


def _modules_with_examples():
    """Dotted names of the fa3_spec modules whose source holds a ``>>>`` example."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text():
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_the_api_tour_is_kept():
    blocks = [b for lang, b, _ in fenced_blocks((ROOT / "docs" / "metadata.md").read_text())
              if lang == "python" and "fa3_spec.draft_positions(cfg, seq_lens)" in b]
    assert blocks, "docs/metadata.md lost its API tour"
    assert "make_world" not in blocks[0], "the tour starts from engine-owned tensors, not the harness"


def test_doc_blocks_are_found():
    pages = {p.values[0].name for p in DOC_BLOCKS}
    assert {"metadata.md", "attention.md", "graphs.md", "eagle.md", "audit.md"} <= pages


@pytest.mark.parametrize("page,body,line", DOC_BLOCKS)
def test_doc_python_block_runs(page, body, line, one_thread):
    # Padded so that a traceback's line numbers are the page's.
    exec(compile("\n" * (line - 1) + body, str(page), "exec"), {"__name__": "__main__"})


def test_examples_are_found_in_the_modules_that_have_them():
    assert {"fa3_spec", "fa3_spec.config", "fa3_spec.batch", "fa3_spec.expand",
            "fa3_spec.builders.decode", "fa3_spec.builders.prefill"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"torch": torch, "fa3_spec": fa3_spec,
                                                  "SpecConfig": fa3_spec.SpecConfig})
    assert result.attempted > 0, f"{name}: every example is skipped"
    assert result.failed == 0
