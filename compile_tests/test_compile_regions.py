"""The layers as compiled regions (`fa3_spec.eagle.regions`) or inline, and the engine's choices.

A region is a ``fa3_spec_eagle`` layer custom op (``decoder_layer_first``
for a forward's first layer, ``decoder_layer`` after) running a
``torch.compile`` of one layer (while an enclosing function is compiled;
eagerly, the layer itself). These tests check, with ``aot_eager``/
``eager`` regions (inductor's own output is checked on the GPU,
``test_gpu_eagle.py``), that the switch does what it says: one op per layer
appears in the traced graph only when asked, the numbers and the cache
writes are those of the inline layers bit for bit, one compile of a program
serves every layer and every batch, and the engine picks
regions only when asked (with its own backend) and the dynamic frame exactly
when several buckets can share it.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import children
import fa3_spec
from fa3_spec.graphs import CompilePolicy
from fa3_spec.eagle import EagleEngine, LoopConfig, greedy_generate, make_models, regions
from helpers import model_pool, one_prompt_prefill


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return make_models("tiny", draft="derived", num_layers=3, dtype=torch.float64)


def _prefill_inputs(models, t=9, bound=None):
    pool, slots, md = one_prompt_prefill(models, t, page_size=2, bound=bound)
    return torch.arange(3, 3 + t), torch.arange(t), slots, md, pool


def _traced(models, region_backend, t=9):
    """The target's forward compiled (fullgraph) through a backend that keeps
    the graph dynamo hands it: (output, graph code, the pool it wrote)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = models.with_compile_regions(region_backend)
    tokens, pos, slots, md, pool = _prefill_inputs(m, t)
    torch._dynamo.reset()
    fn = torch.compile(lambda: m.target_forward(tokens, pos, slots, md, pool.target_kv,
                                                attention_backend="torch"), backend=backend, fullgraph=True)
    out = fn()
    assert len(graphs) == 1
    return out, graphs[0].code, pool


def test_the_layers_are_region_ops_only_when_asked_and_compute_the_same(models):
    """Eager regions (aot_eager's are checked against eager in the no-recompile
    test below)."""
    with_regions, code_on, pool_on = _traced(models, "eager")
    inline, code_off, pool_off = _traced(models, None)
    first = code_on.count("fa3_spec_eagle.decoder_layer_first")
    later = code_on.count("fa3_spec_eagle.decoder_layer(") + code_on.count(
        "fa3_spec_eagle.decoder_layer.default")
    assert (first, later) == (1, models.num_target_layers - 1), (first, later)
    assert "fa3_spec_eagle.decoder_layer" not in code_off
    torch.testing.assert_close(with_regions, inline, rtol=0, atol=0)
    torch.testing.assert_close(pool_on.target_kv.k, pool_off.target_kv.k, rtol=0, atol=0)
    torch.testing.assert_close(pool_on.target_kv.v, pool_off.target_kv.v, rtol=0, atol=0)
    assert pool_on.target_kv.k.abs().sum() > 0  # the forward did write its K/V
    tokens, pos, slots, md, pool = _prefill_inputs(models)
    eager = models.target_forward(tokens, pos, slots, md, pool.target_kv, attention_backend="torch")
    torch.testing.assert_close(inline, eager, rtol=1e-12, atol=1e-12)


def _decode_inputs(models, batch, context=6):
    """A decode step of ``batch`` requests of ``context`` keys each: its metadata's
    statics do not depend on the batch. ``(tokens, positions, slots, md, pool)``."""
    spec = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=2, num_draft_tokens=2, max_bs=4,
                               max_context_len=16)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(4, "branch"))
    pool = model_pool(models, spec, 4)
    rows = torch.tensor([pool.allocate(context, 4) for _ in range(batch)])
    md = fa3_spec.build_decode_metadata(spec, req_to_token=pool.req_to_token,
                                        req_pool_indices=rows,
                                        seq_lens=torch.full((batch,), context))
    slots = pool.req_to_token[rows, context - 1].to(torch.int64)
    return (torch.arange(3, 3 + batch), torch.full((batch,), context - 1), slots, md, pool)


def test_one_program_serves_the_later_layers_and_every_batch(models):
    """Layer 0 (no deltas to add) and layers 1.. are two programs; the same step
    at other batch sizes reuses them (the token and row dimensions are marked
    dynamic): 2 graphs for 3 layers and 2 batch sizes. Each batch is its own
    enclosing compile (static), so only the programs are shared."""
    m = models.with_compile_regions("aot_eager")
    before = regions.compiled_programs()
    stats = torch._dynamo.utils.counters["stats"]
    graphs = stats["unique_graphs"]
    outer = 0
    for batch in (2, 4):
        tokens, pos, slots, md, pool = _decode_inputs(m, batch)
        fn = torch.compile(lambda kv: m.target_forward(tokens, pos, slots, md, kv,
                                                       attention_backend="torch"),
                           backend="eager", fullgraph=True, dynamic=False)
        out = fn(pool.target_kv)
        outer += 1
        tokens, pos, slots, md, ref_pool = _decode_inputs(models, batch)
        inline = models.target_forward(tokens, pos, slots, md, ref_pool.target_kv,
                                       attention_backend="torch")
        torch.testing.assert_close(out, inline, rtol=0, atol=0)
        torch.testing.assert_close(pool.target_kv.k, ref_pool.target_kv.k, rtol=0, atol=0)
    assert regions.compiled_programs() - before == 2
    assert stats["unique_graphs"] - graphs == outer + 2


def test_called_eagerly_a_region_is_a_plain_call_and_compiles_nothing(models):
    """An eager forward of region models (a prefill of any prompt length) runs
    the layer inline: no program, the inline numbers."""
    m = models.with_compile_regions("inductor")
    before = regions.compiled_programs()
    for t in (5, 9):
        tokens, pos, slots, md, pool = _prefill_inputs(m, t)
        out = m.target_forward(tokens, pos, slots, md, pool.target_kv, attention_backend="torch")
        tokens, pos, slots, md, pool = _prefill_inputs(models, t)
        inline = models.target_forward(tokens, pos, slots, md, pool.target_kv,
                                       attention_backend="torch")
        torch.testing.assert_close(out, inline, rtol=0, atol=0)
    assert regions.compiled_programs() == before


def test_the_metadata_crosses_the_op_whole(models):
    """Every `FA3Metadata` field attention reads crosses the op (the only one
    dropped is a draft prefix's ``draft_attention`` label), and a cascade comes
    back as the same calls; what is not metadata is refused by name."""
    fields = [f.name for f in dataclasses.fields(fa3_spec.FA3Metadata)]
    assert sorted(regions._MD_TENSORS + regions._MD_STATICS) == sorted(fields)
    extra = {f.name for f in dataclasses.fields(fa3_spec.DraftPrefixMetadata)} - set(fields)
    assert extra == {"draft_attention"}
    *_, md, _ = _prefill_inputs(models)
    casc = fa3_spec.CascadeMetadata(md, dataclasses.replace(md, causal=False, window_left=3))
    for original in (md, casc, fa3_spec.CascadeMetadata(md, None)):
        back = regions._decode_metadata(*regions._encode_metadata(original))
        assert type(back) is type(original)
        for a, b in zip(original.calls, back.calls):
            for f in fields:
                x, y = getattr(a, f), getattr(b, f)
                assert (x is y) if isinstance(x, torch.Tensor) else (x == y), f
    with pytest.raises(TypeError, match="metadata must be an FA3Metadata or a CascadeMetadata"):
        regions._encode_metadata({"page_table": md.page_table})


def test_on_fa3_the_draft_steps_key_one_program(models):
    """The draft steps' cascades differ only in the expand call's key bound
    (one more draft token a step): on FA3 that is the same kernel call
    (`fa3_equivalent_key_bound`), so they encode to one program key; on the
    torch reference, which reads the bound, each step keeps its own. A
    window keeps its bound on FA3 too."""
    *_, md, _ = _prefill_inputs(models)
    steps = [fa3_spec.CascadeMetadata(md, dataclasses.replace(md, max_seqlen_k=j, causal=False))
             for j in (1, 2, 3, 4)]
    keys = {fa3: {tuple(regions._encode_metadata(c, fa3=fa3)[1]) for c in steps}
            for fa3 in (False, True)}
    assert len(keys[False]) == 4 and len(keys[True]) == 1
    windowed = [dataclasses.replace(c, expand=dataclasses.replace(c.expand, window_left=8))
                for c in steps]
    assert len({tuple(regions._encode_metadata(c, fa3=True)[1]) for c in windowed}) == 4


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_caller_runs_its_regions_again_without_any_recompile(models, backend):
    """The second call of a compiled forward with regions compiles nothing: the
    op marks no dynamic dimension on its caller's tensors (that would fail the
    caller's own guards), and its programs see one dispatch state whether the
    op runs from a compiled graph or eagerly (under inductor, without the
    op's fixed dispatch state, the programs compiled again on the second call).
    One layer: one program, the least for inductor to compile on CPU."""
    m = make_models("tiny", draft="derived", num_layers=1,
                    dtype=torch.float64).with_compile_regions(backend)
    tokens, pos, slots, md, pool_a = _prefill_inputs(m, 11)
    *_, pool_b = _prefill_inputs(m, 11)
    fn = torch.compile(lambda kv: m.target_forward(tokens, pos, slots, md, kv,
                                                   attention_backend="torch"),
                       backend=backend, fullgraph=True)
    stats = torch._dynamo.utils.counters["stats"]
    torch._dynamo.reset()
    first = fn(pool_a.target_kv)
    settled = stats["unique_graphs"]
    second = fn(pool_b.target_kv)
    eager = m.target_forward(tokens, pos, slots, md, pool_b.target_kv, attention_backend="torch")
    assert stats["unique_graphs"] == settled
    for t in (tokens, pos, slots, md.page_table, md.cache_seqlens, md.cu_seqlens_q):
        assert not hasattr(t, "_dynamo_weak_dynamic_indices")
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    if backend == "aot_eager":
        torch.testing.assert_close(second, eager, rtol=0, atol=0)
    else:  # inductor's fused reductions round differently from eager
        torch.testing.assert_close(second, eager, rtol=1e-9, atol=1e-9)
    assert stats["unique_graphs"] == settled  # the eager call ran the layers inline


#: Inductor's device test patched to the GPU's answer, in a child process
#: (the patch is in no cache key: a fresh cache, nothing read or left, and
#: nothing compiled under it reaches the test process's caches or programs).
ADDMM_CHILD = r"""
import json, sys
sys.path.insert(0, {tests!r})
import torch
import torch._inductor.fx_passes.post_grad as post_grad
import torch._inductor.utils as inductor_utils
from fa3_spec.eagle import make_models
from helpers import one_prompt_prefill

post_grad.is_gpu = lambda device: True
fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
m = make_models("tiny", draft="derived", num_layers=2,
                dtype=torch.bfloat16).with_compile_regions("inductor")
pool, slots, md = one_prompt_prefill(m, 11, page_size=2)
tokens, pos = torch.arange(3, 14), torch.arange(11)
fn = torch.compile(lambda kv: m.target_forward(tokens, pos, slots, md, kv,
                                               attention_backend="torch"),
                   backend="inductor", fullgraph=True)
with fresh():
    _, codes = inductor_utils.run_and_get_code(fn, pool.target_kv)
print(json.dumps(dict(programs=len(codes),
                      addmm=sum(c.count("extern_kernels.addmm") for c in codes),
                      mm=sum(c.count("extern_kernels.mm(") for c in codes))))
"""


def _addmm_counts(tmp):
    import json
    import pathlib
    import sys

    code = ADDMM_CHILD.format(tests=str(pathlib.Path(__file__).resolve().parent))
    done = children.run([sys.executable, "-c", code])
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.children(job=_addmm_counts, heavy=True)
def test_no_region_program_adds_a_residual_to_a_matmul_in_an_addmm(child):
    """Inductor makes ``x + a @ w`` one ``addmm`` when the sum leaves the graph
    (on a GPU: on CPU always), and cuBLAS's addmm first copies ``x`` into
    its output: one device-to-device copy per layer on the H200 while the
    regions returned ``(x + attn @ wo, mlp_out)``. They return the stream's
    parts unsummed now. Checked under the GPU's rule on CPU (inductor's
    device test patched: it is the rule's only device dependence); fails on
    the old return (2 addmm, one per program: layer 0, and the later layers)."""
    counts = child.result()
    assert counts["programs"] == 3  # the frame, 2 programs (layer 0, the later layers)
    assert counts["addmm"] == 0
    assert counts["mm"] == 8  # QKV, O, gate/up, down


def test_with_compile_regions_shares_the_weights_and_leaves_the_models_as_they_were(models):
    assert models.target.compile_regions is None and models.draft.compile_regions is None
    on = models.with_compile_regions("inductor")
    assert on.target.compile_regions == "inductor" and on.draft.compile_regions == "inductor"
    assert models.target.compile_regions is None and models.draft.compile_regions is None
    assert on.target.layers is models.target.layers
    assert on.draft.layer is models.draft.layer
    with pytest.raises(ValueError, match="compile_backend must be None or one of"):
        models.with_compile_regions("cudagraphs")
    with pytest.raises(ValueError, match="compile_backend must be None or one of"):
        models.with_compile_regions(True)


def test_a_region_refuses_an_unknown_compiler(models):
    tokens, pos, slots, md, pool = _prefill_inputs(models)
    w, shape = models.target.layers[0], models.target.shape
    x = models.target.embed[tokens]
    cos, sin = models.target.rope.at(pos)
    with pytest.raises(ValueError, match="compile_backend must be one of"):
        regions.decoder_layer_region(shape, w, x, (), None, cos, sin, slots.to(torch.int64),
                                     md, pool.target_kv.k[0], pool.target_kv.v[0], "torch",
                                     None, "cudagraphs")


def _engine(models, buckets, backend, max_new=8, topk=4, num_steps=3, num_draft_tokens=6,
            policy=None):
    spec = fa3_spec.SpecConfig(page_size=2, topk=topk, num_steps=num_steps,
                               num_draft_tokens=num_draft_tokens, max_bs=4, max_context_len=64)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(4, "ancestors"))
    kw = dict(policy=policy) if policy is not None else dict(compile_backend=backend)
    return EagleEngine(LoopConfig(spec, max_new_tokens=max_new, attention_backend="torch"), models,
                       buckets=buckets, **kw)


@pytest.mark.parametrize("buckets, backend, dynamic", [
    ([1, 2, 4], "inductor", True),    # two buckets above 1 share the dynamic frame
    ([1, 4], "inductor", False),      # one bucket above 1: static
    ([4], "inductor", False),
    ([4], "aot_eager", True),         # other backends handle a dynamic batch anyway
    ([1, 2, 4], "none", True),
])
def test_the_engine_shares_a_dynamic_frame_when_several_buckets_can(models, buckets, backend,
                                                                   dynamic):
    eng = _engine(models, buckets, backend)
    assert eng.policy.dynamic_batch is dynamic and eng.runner.dynamic_batch is dynamic
    # Bucket 1 joins the frame (no 0/1 specialisation) where the batch is symbolic,
    # except under inductor (its own frame there).
    assert eng.policy.size_oblivious is (dynamic and backend in ("aot_eager", "eager"))
    # The layers are regions under inductor, inline otherwise.
    regions_on = backend == "inductor"
    assert eng.policy.regions is regions_on
    assert eng.iteration_models.target.compile_regions == ("inductor" if regions_on else None)
    assert eng.iteration_models.draft.compile_regions == ("inductor" if regions_on else None)
    assert models.target.compile_regions is None  # the caller's models are left as they were
    options = eng.runner.compile_counter.options
    # Index propagation is off exactly for inductor with a symbolic batch, and
    # combo kernels too when the layers are regions there.
    assert options.get("constant_and_index_propagation", True) is not (
        dynamic and backend == "inductor")
    assert options.get("combo_kernels", False) is not (dynamic and regions_on)


def test_models_without_regions_run_inline_under_inductor(models):
    class Plain:  # a SpecModel without with_compile_regions
        def __getattr__(self, name):
            if name == "with_compile_regions":
                raise AttributeError(name)
            return getattr(models, name)

    eng = _engine(Plain(), [4], "inductor")
    assert eng.policy.regions is False and isinstance(eng.iteration_models, Plain)
    with pytest.raises(ValueError, match="policy.regions needs models with with_compile_regions"):
        _engine(Plain(), [4], None, policy=CompilePolicy(compile_backend="eager", graphs=False,
                                                         regions=True))
    with pytest.raises(ValueError, match="policy.graphs needs a CUDA device"):
        _engine(models, [4], None, policy=CompilePolicy())
    with pytest.raises(ValueError, match="not both"):
        EagleEngine(_engine(models, [4], "none").lc, models, compile_backend="eager",
                    policy=CompilePolicy.eager())


def test_the_compile_policy_refuses_what_cannot_be():
    with pytest.raises(ValueError, match="compile_backend must be one of"):
        CompilePolicy.for_loop(device="cpu", compile_backend="inductr", buckets=[4],
                               regions_available=True)
    with pytest.raises(ValueError, match="graphs=True needs a CUDA device"):
        CompilePolicy.for_loop(device="cpu", graphs=True, buckets=[4], regions_available=True)
    with pytest.raises(TypeError, match="graphs must be a bool or None"):
        CompilePolicy.for_loop(device="cpu", graphs="yes", buckets=[4], regions_available=True)
    with pytest.raises(ValueError, match="regions=True compiles each layer"):
        CompilePolicy(compile_backend=None, regions=True)
    with pytest.raises(TypeError, match="dynamic_batch must be a bool"):
        CompilePolicy(dynamic_batch="no")


def _assert_alone_then_three_match_greedy(eng, models):
    """One request alone (bucket 1), then three at once (bucket 4), 4 new
    tokens each: the engine's tokens are greedy decoding's."""
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6], [8]]
    first = eng.submit(prompts[0], 4)
    got = eng.run()
    rids = [first] + [eng.submit(p, 4) for p in prompts]
    got.update(eng.run())
    want = greedy_generate(models, prompts[:1] + prompts, [4] * 4, page_size=2,
                           attention_backend="torch")
    assert [got[r] for r in rids] == want


def test_an_engine_with_regions_under_a_dynamic_frame_is_exact_to_greedy(models):
    """An eager-backend iteration with eager regions (dynamo traces both),
    buckets 1, 2 and 4 sharing one frame (the batch dimension symbolic in the
    enclosing frame, bucket 1 included): the same tokens as greedy, and
    dynamo compiled the frame and each program once."""
    regions.clear_programs()
    assert regions.compiled_programs() == 0
    stats = torch._dynamo.utils.counters["stats"]
    graphs = stats["unique_graphs"]
    # A small tree (topk 2, 2 steps): the cost is dynamo tracing the symbolic frame.
    policy = CompilePolicy(compile_backend="eager", graphs=False, size_oblivious=True,
                           regions=True)
    eng = _engine(models, [1, 2, 4], None, max_new=4, topk=2, num_steps=2, num_draft_tokens=3,
                  policy=policy)
    _assert_alone_then_three_match_greedy(eng, models)
    assert eng.runner.compile_counter.frame_count == 1
    assert regions.compiled_programs() >= 2
    assert stats["unique_graphs"] - graphs == 1 + regions.compiled_programs()


#: The engine checks run in a child (their aot_eager traces are the longest of
#: these tests: they run on the other core, children.py). ``{engine}`` builds
#: ``eng``, whose tokens must be greedy's; the child prints the frames its
#: runner compiled.
ENGINE_FRAMES_CHILD = r"""
import json, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from fa3_spec.eagle import make_models
from fa3_spec.graphs import CompilePolicy
from fa3_spec.eagle import regions
from test_compile_regions import _assert_alone_then_three_match_greedy, _engine

torch.manual_seed(0)
models = make_models("tiny", draft="derived", num_layers=3, dtype=torch.float64)  # the fixture's
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
{engine}
_assert_alone_then_three_match_greedy(eng, models)
assert eng.runner.compile_counter.data_dependent == [], eng.runner.compile_counter.data_dependent
print(json.dumps([eng.runner.compile_counter.frame_count, regions.compiled_programs(),
                  torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs]))
"""

CHAIN = """eng = _engine(models, [1, 2, 4], "aot_eager", max_new=4, topk=1, num_steps=2,
              num_draft_tokens=3)
assert eng.lc.draft_attention == "ancestors" and eng.policy.size_oblivious"""
#: A small tree (topk 2, 2 steps), the batch unbacked, the layers as regions
#: traced size-oblivious.
TREE_UNBACKED = """eng = _engine(models, [1, 2, 4], None, max_new=4, topk=2, num_steps=2,
              num_draft_tokens=3, policy=CompilePolicy(
    compile_backend="eager", graphs=False, unbacked_batch=True, size_oblivious=True,
    regions=True))
assert eng.lc.spec.topk == 2 and eng.lc.draft_attention == 'ancestors'"""


def _frames(tmp, engine):
    import json
    import pathlib
    import sys

    code = ENGINE_FRAMES_CHILD.format(tests=str(pathlib.Path(__file__).resolve().parent),
                                      engine=engine)
    return json.loads(children.run([sys.executable, "-c", code]).stdout.strip().splitlines()[-1])


@pytest.mark.children(job=functools.partial(_frames, engine=CHAIN), heavy=True)
def test_a_chain_engine_shares_one_frame_with_bucket_one_under_aot_eager(child):
    """A chain (topk 1) under aot_eager, buckets 1, 2 and 4 (the requests run
    in buckets 1 and 4), ``ancestors``
    (the loop's default; ``branch`` was checked once by hand, not here: each
    case costs about 40 s of the CPU suite): one frame, the same tokens as
    greedy (asserted in the child). With one leaf per request the per-leaf
    tensors are ``[B]``, and a reshape or a copy of such a view guarded the
    batch against 1 in its layout check (the draft steps' slots and parents,
    the layer's head split, the reference attention's LSE): bucket 1 compiled
    a frame of its own."""
    assert child.result()[0] == 1


@pytest.mark.children(job=functools.partial(_frames, engine=TREE_UNBACKED), heavy=True)
def test_a_tree_engine_with_an_unbacked_batch_compiles_nothing_for_bucket_one(child):
    """A tree (topk 2) with ``unbacked_batch`` and ``size_oblivious``, the
    layers as regions, dynamo tracing the frame and the programs (eager
    backend), buckets 1, 2 and 4 (the requests run in buckets 1 and 4): the
    same tokens as greedy (asserted in the child), one frame, no
    data-dependent node, and each layer program compiled once, bucket 1's
    one-row calls and the first draft step's one-column page table included.
    The iteration never asks for the batch's value (a step that did would
    fail to trace with the batch unbacked)."""
    frames, programs, graphs = child.result()
    assert frames == 1 and programs >= 3
    assert graphs == frames + programs


def test_a_static_runner_stays_static_after_the_same_step_ran_at_another_batch():
    """Two one-bucket runners of the same step code (as two engines in one process):
    without ``dynamic=False`` dynamo would compile the second one with a symbolic
    batch (automatic dynamic shapes)."""
    from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner
    from helpers import symbol_recorder

    record = []

    def runner(bucket, dynamic):
        def step(x):
            return {"y": x * 2}

        return CUDAGraphRunner(step, example=lambda bs: {"x": torch.zeros(bs, 3)},
                               buckets=[bucket],
                               policy=CompilePolicy.compiled(symbol_recorder(record),
                                                             dynamic_batch=dynamic))

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


def test_a_size_oblivious_runner_compiles_bucket_one_into_the_shared_frame():
    """With ``size_oblivious`` a batch of 1 keeps the batch symbol: one frame
    serves buckets 1, 2 and 4, and its results are those of the step. The
    control, without it: bucket 1 is a frame of its own (dynamo's 0/1
    specialisation)."""
    from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner
    from helpers import symbol_recorder

    def step(x, n):
        return {"y": x.sum(-1, keepdim=True) * n + torch.arange(x.shape[0]).unsqueeze(-1)}

    def example(bs):
        return {"x": torch.zeros(bs, 3), "n": torch.zeros(bs, 1, dtype=torch.int64)}

    for oblivious, frames in ((True, 1), (False, 2)):
        torch._dynamo.reset()
        record = []
        policy = CompilePolicy(compile_backend=symbol_recorder(record), graphs=False,
                               size_oblivious=oblivious)
        runner = CUDAGraphRunner(step, example=example, buckets=[1, 2, 4], policy=policy)
        for bs in (4, 1, 2, 1):
            x = torch.arange(bs * 3, dtype=torch.float32).view(bs, 3)
            n = torch.arange(1, bs + 1).view(bs, 1)
            torch.testing.assert_close(runner(x=x, n=n)["y"], step(x, n)["y"])
        assert len(record) == frames and record[0], record  # the first frame: symbolic
        if not oblivious:
            assert record[1] == set(), record  # bucket 1's own frame: a constant batch


UNBACKED_CHILD = r"""
import json
import torch
torch.set_num_threads(1)
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner


def step(x):  # a view of a non-contiguous, batch-leading layout, as attention's einsums make
    return {"y": torch.einsum("bij,bjk->bik", x.transpose(1, 2), x)}


frames = {}
for name in ("size_oblivious", "unbacked_batch"):
    torch._dynamo.reset()
    policy = CompilePolicy(compile_backend="inductor", graphs=False, **{name: True})
    runner = CUDAGraphRunner(step, example=lambda bs: {"x": torch.zeros(bs, 3, 4)},
                             buckets=[1, 2, 4], policy=policy)
    for bs in (4, 1, 2, 3):
        x = torch.randn(bs, 3, 4)
        torch.testing.assert_close(runner(x=x)["y"], x.transpose(1, 2) @ x)
    frames[name] = runner.compile_counter.frame_count
    assert runner.compile_counter.data_dependent == [], runner.compile_counter.data_dependent
print(json.dumps(frames))
"""


def _inductor_frames(tmp):
    import json
    import sys

    return json.loads(children.run([sys.executable, "-c", UNBACKED_CHILD]).stdout.splitlines()[-1])


@pytest.mark.children(job=_inductor_frames)
def test_an_unbacked_batch_compiles_bucket_one_into_the_shared_frame_under_inductor(child):
    """Inductor lowers a view of a non-contiguous, batch-leading layout with
    backed-size reasoning, so under ``size_oblivious`` bucket 1 still compiles a
    frame of its own (the control); with ``unbacked_batch`` one frame serves
    buckets 1, 2 and 4, and batches 1 to 4 get the step's results (asserted in
    the child)."""
    assert child.result() == {"size_oblivious": 2, "unbacked_batch": 1}


def test_an_unbacked_batch_is_one_symbol_bounded_by_the_largest_bucket():
    """The compiler sees one unbacked batch symbol for every input, in
    ``[1, largest bucket]``: inductor reads that range for its index widths
    and size-oblivious reasoning, and it holds on releases whose
    ``mark_unbacked`` takes no bounds."""
    from torch._guards import detect_fake_mode

    from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner

    ranges = []

    def backend(gm, example_inputs):
        env = detect_fake_mode(example_inputs).shape_env
        unbacked = {s: r for s, r in env.var_to_range.items() if str(s).startswith("u")}
        ranges.append(({str(env.replace(s)) for s in unbacked},  # one per input, unified
                       {(int(r.lower), int(r.upper)) for r in unbacked.values()}))
        return gm.forward

    torch._dynamo.reset()
    policy = CompilePolicy(compile_backend=backend, graphs=False, unbacked_batch=True)
    runner = CUDAGraphRunner(lambda x, n: {"y": x * n}, buckets=[1, 2, 8], policy=policy,
                             example=lambda bs: {"x": torch.zeros(bs, 3),
                                                 "n": torch.zeros(bs, 1)})
    for bs in (3, 1):
        x, n = torch.randn(bs, 3), torch.randn(bs, 1)
        torch.testing.assert_close(runner(x=x, n=n)["y"], x * n)
    assert ranges == [({"u0"}, {(1, 8)})], ranges


def test_runners_of_one_step_with_their_own_largest_bucket_keep_their_own_bound():
    """Two runners of one step code, the batch unbacked, largest buckets 8 and
    2 (an engine's shapes, each over its own buckets): each frame bounds the
    batch by its own largest bucket, so a step that checks the batch against
    a constant (the builders' ``bs > max_bs``) traces in both. Had the two
    shared one wrapper code, the second compile would have made the bound a
    symbol and that check data-dependent."""
    from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner

    def step(x):
        if x.shape[0] > 8:
            raise ValueError("batch above max_bs")
        return {"y": x * 2}

    torch._dynamo.reset()
    policy = CompilePolicy(compile_backend="eager", graphs=False, unbacked_batch=True)
    for buckets in ([4, 8], [1, 2]):
        runner = CUDAGraphRunner(step, buckets=buckets, policy=policy,
                                 example=lambda bs: {"x": torch.zeros(bs, 3)})
        for bs in buckets:
            x = torch.randn(bs, 3)
            torch.testing.assert_close(runner(x=x)["y"], x * 2)


def test_unbacked_batch_needs_a_dynamic_compiled_step_and_batch_leading_inputs():
    from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner

    for kwargs in (dict(dynamic_batch=False, compile_backend="eager"),
                   dict(compile_backend=None, graphs=False)):
        with pytest.raises(ValueError, match="unbacked_batch=True needs dynamic_batch=True"):
            CompilePolicy(unbacked_batch=True, **kwargs)
    with pytest.raises(TypeError, match="unbacked_batch must be a bool, got 1"):
        CompilePolicy(compile_backend="eager", unbacked_batch=1)
    policy = CompilePolicy(compile_backend="eager", graphs=False, unbacked_batch=True)
    runner = CUDAGraphRunner(lambda x, table: {"y": x}, buckets=[1, 2], policy=policy,
                             example=lambda bs: {"x": torch.zeros(bs), "table": torch.zeros(8)})
    with pytest.raises(ValueError, match=r"lead with the batch: 'table' has shape \(8,\) in bucket 2"):
        runner.capture()
    assert not runner.captured


def test_the_loop_policy_with_an_unbacked_batch_is_dynamic_for_any_buckets(monkeypatch):
    """``for_loop(unbacked_batch=True)``: one dynamic frame even where the
    default keeps static frames (one bucket above 1), the layer programs
    traced size-oblivious, inductor's options for a symbolic batch."""
    from fa3_spec.graphs import CompilePolicy, policy as policy_module

    for buckets in ([1, 4], [1, 2, 4], [4]):
        for backend, available in (("inductor", True), ("inductor", False), ("aot_eager", True)):
            got = CompilePolicy.for_loop(device="cpu", compile_backend=backend, buckets=buckets,
                                         regions_available=available, unbacked_batch=True)
            assert got.dynamic_batch and got.unbacked_batch and got.size_oblivious
            assert got.regions is (backend == "inductor" and available)
            if backend == "inductor":
                assert got.options["constant_and_index_propagation"] is False
                assert got.options["combo_kernels"] is False
    static = CompilePolicy.for_loop(device="cpu", compile_backend="inductor", buckets=[1, 4],
                                    regions_available=True)
    assert not static.dynamic_batch and not static.unbacked_batch  # the control: the default
    backed = CompilePolicy.for_loop(device="cpu", compile_backend="inductor", buckets=[1, 2, 4],
                                    regions_available=False)
    assert backed.options["combo_kernels"] is True  # a backed batch, inline: it compiles them
    with pytest.raises(ValueError, match="unbacked_batch=True needs a compile backend"):
        CompilePolicy.for_loop(device="cpu", compile_backend=None, buckets=[1, 4],
                               regions_available=False, unbacked_batch=True)
    with pytest.raises(TypeError, match="unbacked_batch must be a bool, got 'yes'"):
        CompilePolicy.for_loop(device="cpu", compile_backend="inductor", buckets=[1, 4],
                               regions_available=False, unbacked_batch="yes")
    # A torch whose mark_unbacked cannot share the symbol or hint it is refused by name.
    monkeypatch.setattr(policy_module, "_UNBACKED_OPTIONS", frozenset({"t", "index", "shape_id"}))
    with pytest.raises(RuntimeError, match="lacks hint_override"):
        CompilePolicy(compile_backend="eager", unbacked_batch=True)


def test_size_oblivious_needs_a_dynamic_compiled_step():
    from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner

    for kwargs in (dict(dynamic_batch=False, compile_backend="eager"),
                   dict(compile_backend=None), dict(compile_backend=None, graphs=False)):
        with pytest.raises(ValueError, match="size_oblivious=True needs dynamic_batch=True"):
            CompilePolicy(size_oblivious=True, **kwargs)
    with pytest.raises(TypeError, match="size_oblivious must be a bool, got 'no'"):
        CompilePolicy(compile_backend="eager", size_oblivious="no")
    with pytest.raises(TypeError, match="policy must be a CompilePolicy"):
        CUDAGraphRunner(lambda x: {"y": x}, example=lambda bs: {"x": torch.zeros(bs)},
                        buckets=[1], policy="compile")
