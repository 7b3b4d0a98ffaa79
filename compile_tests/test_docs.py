"""The docs hold up: every python block of docs/ runs as written (docs/engines.md's
are sketches in an engine's names), every relative link and section citation of
README.md, CONTRIBUTING.md and docs/ resolves, the docs describe the product and
not how it was made, and every docstring example in fa3_spec runs."""

import doctest
import importlib
import pathlib
import re
import tomllib
import unicodedata

import pytest
import torch

import fa3_spec
from helpers import MAKING_WORDS
from test_readme import fenced_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fa3_spec"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"] + DOCS
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


def _prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```\s*$", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def _headings(path: pathlib.Path):
    return [m.group(1) for m in re.finditer(r"^#{1,6} (.+?)\s*$", _prose(path.read_text()), re.M)]


def test_the_api_tour_is_kept():
    blocks = [b for lang, b, _ in fenced_blocks((ROOT / "docs" / "metadata.md").read_text())
              if lang == "python" and 'fa3_spec.draft_positions(cfg, seq_lens, "branch")' in b]
    assert blocks, "docs/metadata.md lost its API tour"
    assert "make_world" not in blocks[0], "the tour starts from engine-owned tensors, not the harness"


def test_doc_blocks_are_found():
    pages = {p.values[0].name for p in DOC_BLOCKS}
    assert {"metadata.md", "attention.md", "graphs.md", "eagle.md", "audit.md"} <= pages


@pytest.mark.parametrize("page,body,line", DOC_BLOCKS)
def test_doc_python_block_runs(page, body, line, one_thread):
    # Padded so that a traceback's line numbers are the page's.
    exec(compile("\n" * (line - 1) + body, str(page), "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    """Every relative link points at a file that exists, and an anchor into a
    Markdown page at one of its headings."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in map(_slug, _headings(dest)):
            bad.append(f"{target}: no such heading")
    assert not bad, f"{_rel(page)}: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_semantics_citations_name_real_sections(page):
    """``semantics.md, "Heading"`` names a heading of docs/semantics.md (or its start)."""
    headings = [h.replace("`", "").lower() for h in _headings(ROOT / "docs" / "semantics.md")]
    cited = [" ".join(c.split()) for c in re.findall(r'semantics\.md, "([^"]+)"', page.read_text())]
    missing = [c for c in cited if not any(h.startswith(c.lower()) for h in headings)]
    assert not missing, f"{_rel(page)} cites no such section: {missing}"


def _resolve(dotted: str):
    """The object a dotted ``fa3_spec...`` name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for attr in parts[i:]:
        obj = getattr(obj, attr)
    return obj


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "migration.md"], ids=_rel)
def test_named_api_exists(page):
    """Every ``fa3_spec.x.y`` a page names is importable (migration.md names the removed ones)."""
    missing = []
    for name in sorted(set(re.findall(r"(?<![\w.:])fa3_spec(?:\.[A-Za-z_]\w*)+", page.read_text()))):
        try:
            _resolve(name)
        except AttributeError:
            missing.append(name)
    assert not missing, f"{_rel(page)} names what fa3_spec does not have: {missing}"


def _cli_main():
    """The ``fa3-spec`` entry point that pyproject.toml names."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["fa3-spec"].partition(":")
    return getattr(importlib.import_module(module), func)


def _cli_commands():
    """``(page, subcommand, flags)`` of every ``fa3-spec`` command in a bash block."""
    out = []
    for page in PAGES:
        for lang, body, line in fenced_blocks(page.read_text()):
            if lang != "bash":
                continue
            for command in body.replace("\\\n", " ").splitlines():
                m = re.match(r"\s*fa3-spec ([\w-]+)(.*)", command.split("#")[0])
                if m:
                    out.append((page, m.group(1), re.findall(r"--[\w-]+", m.group(2))))
    return out


def test_cli_commands_use_real_flags(capsys):
    commands = _cli_commands()
    assert {sub for _, sub, _ in commands} >= {"audit", "eagle"}
    main, helps, bad = _cli_main(), {}, []
    for page, sub, flags in commands:
        if sub not in helps:
            with pytest.raises(SystemExit):
                main([sub, "--help"])
            helps[sub] = capsys.readouterr().out
        bad += [f"{_rel(page)}: fa3-spec {sub} {f}" for f in flags
                if not re.search(rf"{re.escape(f)}\b", helps[sub])]
    assert not bad, bad




@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_pages_describe_the_product_not_its_making(page):
    text = page.read_text()
    found = [m.group(0) for pattern in MAKING_WORDS for m in re.finditer(pattern, text, re.I)]
    assert not found, f"{_rel(page)}: {found}"


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
