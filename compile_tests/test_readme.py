"""README.md is the front door: its Quickstart opens with the two commands, and
every python block runs on CPU as written, each on its own (a reader pastes one
block, not the page)."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```\s*$", flags=re.S | re.M)


def fenced_blocks(text: str):
    """``(language, body, first body line)`` of every fenced block, in order."""
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start(2)) + 1)
            for m in _FENCE.finditer(text)]


def section(text: str, title: str) -> str:
    """The text of the ``## title`` section, up to the next ``## `` heading."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


TEXT = README.read_text()
PYTHON = [(body, line) for lang, body, line in fenced_blocks(TEXT) if lang == "python"]


def test_the_readme_is_short_and_keeps_its_examples():
    assert len(TEXT.splitlines()) <= MAX_LINES
    assert len(PYTHON) >= 2, "README.md needs its engine example and its EAGLE example"
    assert any("cascade_attention" in body and "build_" in body for body, _ in PYTHON)
    assert any("EagleEngine" in body for body, _ in PYTHON)


def test_every_python_block_imports_what_it_uses():
    """Each block stands alone: it imports fa3_spec (and torch) itself."""
    for body, line in PYTHON:
        for name in ("fa3_spec", "torch"):
            if re.search(rf"\b{name}\.", body):
                assert re.search(rf"^(import|from) [\w, .]*\b{name}\b", body, flags=re.M), \
                    f"README.md:{line}: the block uses {name} without importing it"


def _quickstart():
    """.ci/quickstart.py, which CI runs: it reads the two commands from this README."""
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / ".ci" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_opens_with_the_two_commands():
    quick = section(TEXT, "Quickstart")
    blocks = fenced_blocks(quick)
    assert blocks, "the Quickstart has no code block"
    lang, body, _ = blocks[0]
    assert quick.lstrip().startswith("```bash"), "the Quickstart opens with its commands"
    commands = [ln.strip() for ln in body.splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]
    assert lang == "bash" and len(commands) == 2, commands
    main_job, tests = commands
    assert "fa3-spec" in main_job and "pytest" in tests
    # CI runs the test command on the pinned CPU build, then both commands as the
    # README writes them, in a fresh clone and virtual environment (.ci/quickstart.py).
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci and "python3 .ci/quickstart.py" in ci
    assert _quickstart().quickstart_commands(TEXT) == commands
    # The CPU note comes after the two commands.
    cpu = [i for i, (_, b, _) in enumerate(blocks) if "whl/cpu" in b]
    assert cpu and cpu[0] > 0


def test_results_name_their_source():
    results = section(TEXT, "Results")
    assert "benchmarks/RESULTS.md" in results
    assert re.search(r"`[0-9a-f]{7,}`", results), "the results table names its commit"


@pytest.mark.parametrize("body,line", PYTHON, ids=[f"README.md:{line}" for _, line in PYTHON])
def test_python_block_runs(body, line, one_thread):
    # Padded so that a traceback's line numbers are README.md's.
    code = compile("\n" * (line - 1) + body, str(README), "exec")
    exec(code, {"__name__": "__main__"})
