"""One FA3 scheduler plan per call of a forward, shared by its layers
(`fa3_spec.attention.fa3_plans`): traced on CPU through the ops' fakes (FA3
itself runs in `test_gpu_attention.py`)."""

import dataclasses

import pytest
import torch

import fa3_spec
from fa3_spec.attention import cascade_attention, fa3_plans, plan_entries
from fa3_spec.eagle import make_models
from helpers import one_prompt_prefill, trace_only_backend

PLAN, FA3 = "fa3_spec.fa3_scheduler_plan", "fa3_spec.fa3_paged_attention"
#: A forward's first layer region, and the later ones (`fa3_spec.eagle.regions`).
FIRST_LAYER, LAYER = "fa3_spec_eagle.decoder_layer_first", "fa3_spec_eagle.decoder_layer"


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return make_models("tiny", draft="derived", num_layers=3, dtype=torch.bfloat16)


def test_plan_entries_restate_fa3s_layout():
    def entries(rows, causal, nq=16, nk=1024, d=128, window=(-1, -1)):
        return plan_entries(rows, causal=causal, max_seqlen_q=nq, max_seqlen_k=nk, head_dim=d,
                            window_left=window[0], window_right=window[1])

    # A tile counter, then 3 per-row vectors (4 when causal) padded to 4 rows:
    # what the H200 measured at head_dim 128 without a window.
    assert [entries(b, False) for b in (1, 2, 4, 5, 8, 64)] == [13, 13, 13, 25, 25, 193]
    assert [entries(b, True) for b in (1, 4, 5, 64)] == [17, 17, 33, 257]
    assert entries(3, True, nq=1) == 17  # one query, head_dim 128: FA3 keeps causal
    # FA3's own reading of the flags (from its source): one query without a
    # window is not causal outside 64 < head_dim <= 128; a window makes the
    # call local (no batch sort, a head swizzle); a window as long as the call
    # is no window.
    assert entries(3, True, nq=1, d=64) == entries(3, True, nq=1, d=256) == 13
    assert entries(3, True, nq=16, d=64) == 17
    assert entries(3, True, window=(100, -1)) == 13 and entries(3, False, window=(100, -1)) == 13
    assert entries(3, True, window=(1023, -1)) == 17 and entries(3, False, window=(-1, 15)) == 13
    assert entries(3, False, window=(-1, 0)) == 17  # a right window of 0 is causal


def _graph(fn):
    """``fn`` traced whole by dynamo, never run (the FA3 ops have fakes only here)."""
    graphs = []
    torch._dynamo.reset()
    torch.compile(fn, backend=trace_only_backend(graphs), fullgraph=True)()
    (gm,) = graphs
    return gm.graph


def _nodes(graph, op):
    """The graph's calls of the custom op named ``op`` (dynamo records an op or
    its packet)."""
    return [n for n in graph.nodes
            if n.op == "call_function" and str(n.target).split(".default")[0] == op]


@pytest.fixture
def plans_on(monkeypatch):
    """A provider that plans (no FA3 here: the graphs are traced, never run)."""
    from fa3_spec.eagle import models

    monkeypatch.setattr(models, "provider_plans", lambda: True)


@pytest.mark.parametrize("regions", [None, "eager"])
@pytest.mark.parametrize("cascade", [False, True])
def test_the_target_makes_one_plan_per_call_and_every_layer_reads_it(models, regions, cascade,
                                                                     plans_on):
    m = models.with_compile_regions(regions)
    pool, slots, md = one_prompt_prefill(m, 9, page_size=2)
    if cascade:
        md = fa3_spec.CascadeMetadata(md, dataclasses.replace(md, causal=False))
    tokens, pos = torch.arange(3, 12), torch.arange(9)
    graph = _graph(lambda: m.target_forward(tokens, pos, slots, md, pool.target_kv,
                                            attention_backend="fa3"))
    plans = _nodes(graph, PLAN)
    assert len(plans) == len(md.calls)
    if regions is None:
        calls = _nodes(graph, FA3)
        assert len(calls) == 3 * len(md.calls)  # every layer's calls
        for i, call in enumerate(calls):
            plan = plans[i % len(md.calls)]
            assert call.args[16] is plan
            # The plan is the call's: rows, query bound, causality, split count.
            assert plan.args[0] is call.args[4] and plan.args[1] is call.args[5]
            assert plan.args[2] == call.args[6] and plan.args[10] == call.args[8]
            assert plan.args[11] == call.args[9]
            # ... softcap and window (plan: has_softcap, left, right; call: softcap, left, right).
            assert plan.args[12] == (call.args[10] > 0)
            assert tuple(plan.args[13:15]) == tuple(call.args[11:13])
            assert plan.args[3] == md.calls[i % len(md.calls)].page_table.shape[1] * 2
    else:
        layers = _nodes(graph, FIRST_LAYER) + _nodes(graph, LAYER)
        assert [str(n.target).split(".default")[0] for n in layers] == [FIRST_LAYER] + 2 * [LAYER]
        assert not _nodes(graph, FA3)
        for layer in layers:
            op = getattr(layer.target, "default", layer.target)  # a packet or its overload
            names = [a.name for a in op._schema.arguments]
            assert list(layer.args[names.index("plans")]) == plans


def test_without_plans_each_call_plans_for_itself(models, monkeypatch):
    """A provider without ``get_scheduler_metadata``: no plan op, every FA3 call plans itself."""
    from fa3_spec.eagle import models as models_module

    monkeypatch.setattr(models_module, "provider_plans", lambda: False)
    target = models.target
    pool, slots, md = one_prompt_prefill(models, 9, page_size=2)
    graph = _graph(lambda: target.forward(torch.arange(3, 12), torch.arange(9), slots, md,
                                          pool.target_kv, attention_backend="fa3"))
    assert not _nodes(graph, PLAN) and len(_nodes(graph, FA3)) == 3


def test_one_layer_plans_inside_its_call_and_the_torch_backend_plans_nothing(models, plans_on):
    one = dataclasses.replace(models.target, layers=models.target.layers[:1])
    pool, slots, md = one_prompt_prefill(models, 9, page_size=2)
    tokens, pos = torch.arange(3, 12), torch.arange(9)
    graph = _graph(lambda: one.forward(tokens, pos, slots, md, pool.target_kv,
                                       attention_backend="fa3"))
    assert not _nodes(graph, PLAN)
    (call,) = _nodes(graph, FA3)
    assert len(call.args) < 17 or call.args[16] is None
    graph = _graph(lambda: models.target.forward(tokens, pos, slots, md, pool.target_kv,
                                                 attention_backend="torch"))
    assert not _nodes(graph, PLAN) and not _nodes(graph, FA3)


def test_a_dynamic_batch_keeps_one_frame_with_a_symbolic_plan():
    graphs = []
    k = torch.zeros(40, 2, 2, 64, dtype=torch.bfloat16)

    def call(cache_seqlens, cu_seqlens_q, page_table):
        md = fa3_spec.FA3Metadata(page_table, cache_seqlens, cu_seqlens_q, cu_seqlens_q, 1, 64,
                                  2, True)
        (plan,) = fa3_plans(md, num_heads=8, head_dim=64, k_cache=k, v_cache=k)
        return plan

    torch._dynamo.reset()
    compiled = torch.compile(call, backend=trace_only_backend(graphs), fullgraph=True)
    for bs in (3, 9, 40):
        t = [torch.ones(bs, dtype=torch.int32), torch.arange(bs + 1, dtype=torch.int32),
             torch.zeros(bs, 32, dtype=torch.int32)]
        for x in t:
            torch._dynamo.mark_dynamic(x, 0)
        compiled(*t)
    assert len(graphs) == 1
    (plan,) = _nodes(graphs[0].graph, PLAN)
    (size,) = plan.meta["example_value"].shape
    assert isinstance(size, torch.SymInt)  # 1 + 4 * round_up(batch, 4), from the batch


def test_bad_plans_are_refused_by_name(models):
    pool, slots, md = one_prompt_prefill(models, 9, page_size=2)
    q = torch.randn(9, models.target.shape.num_heads, models.head_dim, dtype=torch.bfloat16)
    k, v = pool.target_kv.k[0], pool.target_kv.v[0]
    with pytest.raises(ValueError, match="plans must be a tuple of 1 plans"):
        cascade_attention(q, k, v, md, attention_backend="torch", plans=())
    with pytest.raises(TypeError, match="plans: the single call's plan must be a 1-D int32"):
        cascade_attention(q, k, v, md, attention_backend="torch", plans=(torch.zeros(13),))
    plan13 = torch.zeros(13, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"plans cannot be used with window_size=\(4, 0\)"):
        cascade_attention(q, k, v, md, attention_backend="torch", plans=(plan13,), window_size=(4,
                                                                                                0))
    # The torch backend ignores a well-formed plan: the same output.
    plan = torch.zeros(17, dtype=torch.int32)
    assert torch.equal(cascade_attention(q, k, v, md, attention_backend="torch", plans=(plan,)),
                       cascade_attention(q, k, v, md, attention_backend="torch"))
