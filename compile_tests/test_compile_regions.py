"""The layers as nested compile regions or inline, and the engine's choices.

The regions are opt-in (`EagleModels.with_compile_regions`): inductor gave
wrong tokens with them on the H200 and cannot compile them with a symbolic
batch, so an engine compiling with inductor always traces its layers inline.
These tests check, without running inductor, that the switch does what it
says: the regions appear in the traced graph only when on, both give the same
numbers, the engine's inductor iteration runs the layers inline whatever the
models asked for, and it picks the dynamic frame exactly when several buckets
can share it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fa3_spec
from fa3_spec.eagle import EagleEngine, LoopConfig, make_models
from helpers import one_prompt_prefill


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return make_models("tiny", draft="derived", num_layers=2, dtype=torch.float64)


def _prefill_inputs(models, t=9):
    pool, slots, md = one_prompt_prefill(models, t, page_size=2)
    return torch.arange(3, 3 + t), torch.arange(t), slots, md, pool


def _traced(models, regions: bool):
    """The target's forward compiled (fullgraph) through a backend that keeps
    the graph dynamo hands it: (output, graph code)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = models.with_compile_regions(regions)
    tokens, pos, slots, md, pool = _prefill_inputs(m)
    torch._dynamo.reset()
    fn = torch.compile(lambda: m.target_forward(tokens, pos, slots, md, pool.target_kv,
                                                backend="torch"), backend=backend, fullgraph=True)
    out = fn()
    assert len(graphs) == 1
    return out, graphs[0].code


def test_the_layers_are_nested_regions_only_when_asked_and_compute_the_same(models):
    with_regions, code_on = _traced(models, True)
    inline, code_off = _traced(models, False)
    assert "invoke_subgraph" in code_on
    assert "invoke_subgraph" not in code_off
    torch.testing.assert_close(with_regions, inline, rtol=0, atol=0)
    tokens, pos, slots, md, pool = _prefill_inputs(models)
    eager = models.target_forward(tokens, pos, slots, md, pool.target_kv, backend="torch")
    torch.testing.assert_close(inline, eager, rtol=1e-12, atol=1e-12)


def test_with_compile_regions_shares_the_weights_and_leaves_the_models_as_they_were(models):
    assert models.target.compile_regions is False and models.draft.compile_regions is False
    regions = models.with_compile_regions(True)
    assert regions.target.compile_regions is True and regions.draft.compile_regions is True
    assert models.target.compile_regions is False and models.draft.compile_regions is False
    assert regions.target.layers is models.target.layers
    assert regions.draft.layer is models.draft.layer


def _engine(models, buckets, backend, dynamic_batch=None):
    spec = fa3_spec.SpecConfig(page_size=2, topk=4, num_steps=3, num_draft_tokens=6, max_bs=4,
                               max_context_len=64)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(4))
    return EagleEngine(LoopConfig(spec, max_new_tokens=8, backend="torch"), models,
                       buckets=buckets, compile_backend=backend, dynamic_batch=dynamic_batch)


@pytest.mark.parametrize("buckets, backend, dynamic", [
    ([1, 2, 4], "inductor", True),    # two buckets above 1 share the dynamic frame
    ([1, 4], "inductor", False),      # one bucket above 1: static
    ([4], "inductor", False),
    ([4], "aot_eager", True),         # other backends handle the regions dynamically
    ([1, 2, 4], "none", True),
])
def test_the_engine_shares_a_dynamic_frame_when_several_buckets_can(models, buckets, backend,
                                                                   dynamic):
    eng = _engine(models.with_compile_regions(True), buckets, backend)
    assert eng.dynamic_batch is dynamic and eng.runner.dynamic_batch is dynamic
    # Inductor always runs the layers inline; other backends as the models say.
    inline = backend == "inductor"
    assert eng.iteration_models.target.compile_regions is not inline
    assert eng.iteration_models.draft.compile_regions is not inline
    options = eng.runner.compile_counter.options
    # Index propagation is off exactly for inductor with a symbolic batch.
    assert options.get("constant_and_index_propagation", True) is not (
        dynamic and backend == "inductor")


def test_dynamic_batch_can_be_forced_either_way(models):
    assert _engine(models, [1, 2, 4], "inductor", dynamic_batch=False).dynamic_batch is False
    assert _engine(models, [4], "inductor", dynamic_batch=True).dynamic_batch is True


def test_a_static_runner_stays_static_after_the_same_step_ran_at_another_batch():
    """Two one-bucket runners of the same step code (as two engines in one process):
    without ``dynamic=False`` dynamo would compile the second one with a symbolic
    batch (automatic dynamic shapes), which is what inductor cannot do with the
    nested regions."""
    from fa3_spec.graphs import CUDAGraphRunner
    from helpers import symbol_recorder

    record = []

    def runner(bucket, dynamic):
        def step(x):
            return {"y": x * 2}

        return CUDAGraphRunner(step, example=lambda bs: {"x": torch.zeros(bs, 3)},
                               buckets=[bucket], strategy="compile",
                               backend=symbol_recorder(record), dynamic_batch=dynamic)

    torch._dynamo.reset()
    for bucket in (2, 5):
        out = runner(bucket, False)(x=torch.ones(bucket, 3))
        torch.testing.assert_close(out["y"], torch.full((bucket, 3), 2.0))
    assert record == [set(), set()]
    torch._dynamo.reset()
    record.clear()
    for bucket in (2, 5):  # the control: a dynamic runner does get the symbol
        runner(bucket, True)(x=torch.ones(bucket, 3))
    assert any(record), record
