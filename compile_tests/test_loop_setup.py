"""benchmarks/loop_setup.py: the loop configuration and prompts the benchmarks share."""

import pathlib
import sys

import pytest

import fa3_spec
from fa3_spec.eagle import LoopConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import loop_setup  # noqa: E402


@pytest.mark.parametrize("mode", fa3_spec.DRAFT_ATTENTION)
def test_loop_config_sizes_context_and_pool_for_the_config(mode):
    lc = loop_setup.loop_config((2, 8, 5, 16), batch=4, context=100, max_new=30, pool_rows=8,
                                draft_attention=mode, scripted=[3, 4])
    s = lc.spec
    assert (s.page_size, s.topk, s.num_steps, s.num_draft_tokens, s.max_bs) == (2, 8, 5, 16, 4)
    assert s.max_context_len == 100 + 30 + 16
    assert s.num_pages == s.pool_pages(8, mode)
    assert lc.draft_attention == mode and lc.max_new_tokens == 30 and list(lc.scripted) == [3, 4]


def test_loop_config_defaults_to_the_loops_semantics_and_batch_rows():
    lc = loop_setup.loop_config((16, 1, 5, 6), batch=3, context=64, max_new=8)
    assert lc.draft_attention == LoopConfig.draft_attention
    assert lc.spec.num_pages == lc.spec.pool_pages(3, LoopConfig.draft_attention)


def test_random_prompts_are_seeded_and_in_the_vocabulary():
    a = loop_setup.random_prompts(3, 50, 17, seed=5)
    assert a == loop_setup.random_prompts(3, 50, 17, seed=5) != loop_setup.random_prompts(3, 50, 17, seed=6)
    assert len(a) == 3 and all(len(p) == 50 and all(0 <= t < 17 for t in p) for p in a)


def test_loop_config_refuses_a_config_without_four_values_and_zero_pool_rows():
    with pytest.raises(ValueError, match="config must be"):
        loop_setup.loop_config((2, 8, 5), batch=1, context=8, max_new=4)
    with pytest.raises(ValueError, match="max_reqs"):
        loop_setup.loop_config((2, 8, 5, 16), batch=1, context=8, max_new=4, pool_rows=0)


@pytest.mark.parametrize("argv, says", [
    (["--what", "iteration", "--config", "2,4,3"], "config must be (P, topk, steps, N)"),
    (["--what", "iteration", "--config", "2,x,3,6"], "invalid literal"),
    (["--what", "iteration", "--config", "0,4,3,6"], "page_size must be >= 1"),
    (["--restart"], "--restart needs --what iteration"),
])
def test_region_compile_refuses_a_bad_invocation_with_exit_2(argv, says, capsys):
    import region_compile

    assert region_compile.main(argv) == 2
    assert says in capsys.readouterr().err
