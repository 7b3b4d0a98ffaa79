"""The full CPU grid: every config exact to greedy (opt-in: FA3_SPEC_EAGLE_SWEEP=1, not in CI).

page_size {1, 2, 16} x topk {1, 4, 8} x num_steps {2, 5} x num_draft_tokens
{4, 8}, each with the derived (high-acceptance) and the random draft, and
each under both draft semantics (``draft_attention`` "branch" and
"ancestors"), 14 requests of 1-40 prompt tokens and 32-40 new tokens each
through 8 batch rows (so 6 requests join mid-run). A topk = 1 tree is a chain of at most
``num_steps`` drafts, so N is lowered to ``num_steps + 1`` where the grid asks
for more (the loop rejects impossible trees). Run with

    FA3_SPEC_EAGLE_SWEEP=1 python3 -m pytest -q compile_tests/test_eagle_sweep.py -s

It prints each config's mean accept length (tokens per iteration). CI runs
a small subset of each semantics in ``test_eagle_loop.py``.
"""

import os

import pytest

from test_eagle_loop import check_exact

pytestmark = pytest.mark.skipif(os.environ.get("FA3_SPEC_EAGLE_SWEEP") != "1",
                                reason="set FA3_SPEC_EAGLE_SWEEP=1 for the full grid")


def _grid():
    seen = []
    for p in (1, 2, 16):
        for k in (1, 4, 8):
            for s in (2, 5):
                for n in (4, 8):
                    n_eff = min(n, 1 + k + (s - 1) * k * k)
                    if (p, k, s, n_eff) not in seen:
                        seen.append((p, k, s, n_eff))
    return seen


GRID = _grid()


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.mark.parametrize("draft_attention", ["branch", "ancestors"])
@pytest.mark.parametrize("draft", ["derived", "random"])
@pytest.mark.parametrize("p, k, s, n", GRID, ids=[f"P{p}K{k}S{s}N{n}" for p, k, s, n in GRID])
def test_grid_exact_to_greedy(p, k, s, n, draft, draft_attention):
    mean, eng = check_exact(p, k, s, n, draft=draft, draft_attention=draft_attention)
    print(f"\nEAGLE-SWEEP P={p} topk={k} steps={s} N={n} draft={draft} "
          f"draft_attention={draft_attention}: "
          f"mean accept length {mean:.2f} over {eng.stats.iterations} iterations")
    if draft == "random":
        assert mean < 1.5
    elif min(n - 1, s) + 1 >= 4:  # a path of 3+ drafts is possible
        assert mean >= 2.5
