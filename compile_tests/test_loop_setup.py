"""benchmarks/workload.py: the loop configuration, engine, kernels and prompts
the benchmarks share; and the entry points' refusals of bad invocations."""

import dataclasses
import pathlib
import sys

import pytest

import fa3_spec
from fa3_spec.eagle import DEFAULT_SCRIPT, LoopConfig, make_models
from fa3_spec.eagle.kernels import Kernels

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import workload  # noqa: E402


@pytest.mark.parametrize("mode", fa3_spec.DRAFT_ATTENTION)
def test_loop_config_sizes_context_and_pool_for_the_config(mode):
    lc = workload.loop_config((2, 8, 5, 16), batch=4, context=100, max_new=30, pool_rows=8,
                              draft_attention=mode)
    s = lc.spec
    assert (s.page_size, s.topk, s.num_steps, s.num_draft_tokens, s.max_bs) == (2, 8, 5, 16, 4)
    assert s.max_context_len == 100 + 30 + 16
    assert s.num_pages == s.pool_pages(8, mode)
    assert lc.draft_attention == mode and lc.max_new_tokens == 30


def test_loop_config_defaults_to_the_loops_semantics_and_batch_rows():
    lc = workload.loop_config((16, 1, 5, 6), batch=3, context=64, max_new=8)
    assert lc.draft_attention == LoopConfig.draft_attention
    assert lc.spec.num_pages == lc.spec.pool_pages(3, LoopConfig.draft_attention)
    longer = workload.loop_config((16, 1, 5, 6), batch=3, context=64, max_new=8,
                                  max_context_len=200)
    assert longer.spec.max_context_len == 200


def test_the_engine_scripts_acceptance_and_can_keep_the_layers_inline():
    models = make_models("tiny", draft="random")
    lc = workload.loop_config((2, 4, 3, 6), batch=2, context=8, max_new=16)
    plain = workload.engine(lc, models, buckets=[2], compile_backend="inductor")
    scripted = workload.engine(lc, models, scripted=True, buckets=[2],
                               compile_backend="inductor", regions=False)
    assert plain.acceptance is None and scripted.acceptance.script == DEFAULT_SCRIPT
    assert plain.policy.regions and not scripted.policy.regions
    assert workload.compiled_as(scripted) == dict(compile="inductor", compile_regions=False)
    assert workload.SCRIPTED == "scripted:" + ",".join(map(str, DEFAULT_SCRIPT))
    with pytest.raises(ValueError, match="buckets"):
        workload.engine(lc, models, regions=False)


def test_the_engine_can_take_an_unbacked_batch_keeping_the_rest_of_its_policy():
    models = make_models("tiny", draft="random")
    lc = workload.loop_config((2, 4, 3, 6), batch=4, context=8, max_new=16)
    for backend in ("inductor", "aot_eager"):
        default = workload.engine(lc, models, buckets=[1, 2, 4], compile_backend=backend)
        unbacked = workload.engine(lc, models, buckets=[1, 2, 4], compile_backend=backend,
                                   unbacked_batch=True)
        assert unbacked.policy.unbacked_batch and unbacked.policy.size_oblivious
        assert dataclasses.replace(unbacked.policy, unbacked_batch=False,
                                   size_oblivious=default.policy.size_oblivious) == default.policy
    with pytest.raises(ValueError, match="buckets"):
        workload.engine(lc, models, unbacked_batch=True)


def test_kernels_come_from_name_value_pairs():
    assert workload.kernels([]) == Kernels()
    assert workload.kernels(["gemm=cublas", "pdl=off"]) == Kernels(gemm="cublas", pdl=False)
    for bad in (["gemm"], ["pdl=maybe"], ["nope=1"], ["rope_kv=other"]):
        with pytest.raises(ValueError):
            workload.kernels(bad)


def test_random_prompts_are_seeded_and_in_the_vocabulary():
    a = workload.random_prompts(3, 50, 17, seed=5)
    assert a == workload.random_prompts(3, 50, 17, seed=5) != workload.random_prompts(3, 50, 17, seed=6)
    assert len(a) == 3 and all(len(p) == 50 and all(0 <= t < 17 for t in p) for p in a)


def test_configs_need_four_values_and_pools_need_rows():
    assert workload.parse_config("2,8,5,16") == (2, 8, 5, 16)
    for bad in ("2,8,5", "2,x,5,16"):
        with pytest.raises(ValueError):
            workload.parse_config(bad)
    with pytest.raises(ValueError, match="config must be"):
        workload.loop_config((2, 8, 5), batch=1, context=8, max_new=4)
    with pytest.raises(ValueError, match="max_reqs"):
        workload.loop_config((2, 8, 5, 16), batch=1, context=8, max_new=4, pool_rows=0)


@pytest.mark.parametrize("argv, says", [
    (["compile.py", "regions", "--restart"], "--restart needs --what iteration"),
    (["compile.py", "regions", "--layers", "0"], "must be >= 1"),
    (["compile.py"], "a subcommand is needed"),
    (["loop.py", "compare", "--kernels", "gemm=fast"], "--kernels"),
    (["loop.py", "sampling", "--config", "2,4,3"], "--config"),
])
def test_an_entry_point_refuses_a_bad_invocation_with_exit_2(argv, says, capsys):
    import importlib

    entry = importlib.import_module(argv[0][:-3])
    assert entry.main(argv[1:]) == 2
    assert says in capsys.readouterr().err
