"""The EAGLE loop on the H200: FA3, bf16, CUDA graphs per bucket, zero host syncs.

Skipped without CUDA sm90 + FA3. Exactness in bf16 cannot be bitwise: the
speculative path (tree cascade, commit copies) and plain greedy decoding
(one causal decode call per token) round differently, so a divergence is
accepted only where its first diverging token is a near tie in the
reference's logits, as `fa3_spec.eagle.greedy_check` (and ``fa3-spec eagle
--check-greedy``) judge it: ``|logit(greedy's token) - logit(the loop's
token)| <= NEAR_TIE * max(1, |top-1 logit|)`` (2 % of the logit, i.e. a few
bf16 ulps of it). Every divergence that is not such a tie fails the test.
Each test prints one ``EAGLE-GPU {json}`` line with the counts.

Run on the H200 (FA3 wheel on PYTHONPATH)::

    python3 -m pytest -q -s compile_tests/test_gpu_eagle.py
"""

import dataclasses
import json

import pytest
import torch

import fa3_spec
from fa3_spec.attention import fa3_available
from fa3_spec.eagle import EagleEngine, LoopConfig, greedy_generate, make_models, regions
from fa3_spec.eagle.cli import workload
from fa3_spec.eagle.greedy_check import compare_with_greedy
from fa3_spec.eagle.sync_probe import HostSyncProbe
from fa3_spec.graphs import CompilePolicy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fa3_available(), reason="needs CUDA sm90 and an FA3 provider"),
]


def _engine(models, p, k, s, n, *, batch, max_new, prompt_len, buckets, compile_backend,
            graphs=True, draft_attention=LoopConfig.draft_attention, compile_regions=None,
            unbacked_batch=False):
    """``compile_regions``: None, the engine's own policy; False, a policy resolved as
    for models without regions; True, one with them (inductor only). ``unbacked_batch``:
    that policy's (needs ``compile_regions``)."""
    spec = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=n,
                               max_bs=batch, max_context_len=prompt_len + max_new + n)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(2 * batch, draft_attention))
    lc = LoopConfig(spec, max_new_tokens=max_new, attention_backend="fa3",
                    draft_attention=draft_attention)
    if compile_regions is None:
        return EagleEngine(lc, models, max_reqs=2 * batch, buckets=buckets, graphs=graphs,
                           compile_backend=compile_backend, device="cuda")
    policy = CompilePolicy.for_loop(device="cuda", compile_backend=compile_backend,
                                    graphs=graphs, buckets=buckets,
                                    regions_available=compile_regions,
                                    unbacked_batch=unbacked_batch)
    assert policy.regions is compile_regions
    return EagleEngine(lc, models, max_reqs=2 * batch, buckets=buckets, policy=policy,
                       device="cuda")


def check(preset, p, k, s, n, *, batch=4, requests=8, max_new=32, prompt_len=48,
          buckets=None, compile_backend=None, num_layers=None, label="",
          draft_attention=LoopConfig.draft_attention, compile_regions=None,
          unbacked_batch=False):
    torch.manual_seed(0)
    models = make_models(preset, draft="derived", device="cuda", num_layers=num_layers)
    prompts, news = workload(requests, page_size=p, max_prompt=prompt_len, max_new=max_new,
                             vocab=models.vocab_size, seed=0)
    eng = _engine(models, p, k, s, n, batch=batch, max_new=max_new, prompt_len=prompt_len,
                  buckets=buckets or [batch], compile_backend=compile_backend,
                  draft_attention=draft_attention, compile_regions=compile_regions,
                  unbacked_batch=unbacked_batch)
    regions.clear_programs()  # each test counts the programs its engine compiles
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eng.capture()
    for prompt, m in zip(prompts, news):
        eng.submit(prompt, m)
    with HostSyncProbe(eng) as probe:
        out = eng.run()
    logits = []
    ref = greedy_generate(models, prompts, news, page_size=p, attention_backend="fa3",
                          device="cuda",
                          logits_out=logits)
    found = compare_with_greedy([out[i] for i in range(requests)], ref, logits)
    exact, ties = requests - len(found), sum(d.near_tie for d in found)
    gaps = [round(d.gap, 4) for d in found if d.gap is not None]
    unexplained = [dict(request=d.request, position=d.position, gap=d.gap, bound=d.bound)
                   for d in found if not d.near_tie]
    report = dict(test=label, draft_attention=draft_attention, preset=preset, layers=models.num_target_layers, page_size=p,
                  topk=k, num_steps=s, num_draft_tokens=n, batch=batch, requests=requests,
                  exact_requests=exact, near_tie_divergences=ties,
                  unexplained_divergences=len(unexplained), divergence_gaps=gaps,
                  mean_accept_len=round(eng.stats.mean_accept_len, 3), iterations=eng.stats.iterations,
                  host_syncs_per_iteration=probe.worst,
                  compile=compile_backend, buckets=eng.buckets,
                  dynamic_batch=eng.policy.dynamic_batch,
                  unbacked_batch=eng.policy.unbacked_batch,
                  frames=eng.runner.compile_counter.frame_count,
                  data_dependent=eng.runner.compile_counter.data_dependent,
                  compile_regions=eng.policy.regions,
                  region_programs=regions.compiled_programs(),
                  graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs)
    print("EAGLE-GPU " + json.dumps(report))
    assert not unexplained, unexplained
    assert report["host_syncs_per_iteration"] == 0
    return report


def _check_programs(report, compile_regions, compiles_per_program=1, one_column_extra=True):
    """The regions ran exactly when asked, and compiled four programs: the
    target's layer 0 and the rest, the draft's extend, and one for every
    draft step (their FA3 calls are the same: `fa3_equivalent_key_bound`).
    Dynamo compiled each frame once and each program ``compiles_per_program``
    times (2 where bucket 1 is a static frame of its own: its size-1 rows
    recompile each program once), and under ``ancestors`` the draft-step
    program once more per frame: its first step's expand page table is one
    column wide, a size 1 that dynamo specialises (the CPU reproduces these
    counts with FA3's program keys), unless the programs are traced
    size-oblivious (``one_column_extra=False``)."""
    assert report["compile_regions"] is compile_regions
    extra = 0
    if compile_regions:
        assert report["region_programs"] == 4, report
        if one_column_extra and report["draft_attention"] == "ancestors":
            extra = compiles_per_program
    else:
        assert report["region_programs"] == 0
    assert report["graphs"] == (report["frames"] + extra
                                + compiles_per_program * report["region_programs"]), report


@pytest.mark.parametrize("draft_attention", ["ancestors", "branch"])
@pytest.mark.parametrize("p, k, s, n", [(16, 1, 5, 6), (16, 4, 5, 8), (2, 8, 5, 16), (1, 4, 2, 4)])
def test_tiny_bf16_matches_greedy_up_to_near_ties(p, k, s, n, draft_attention):
    check("tiny", p, k, s, n, batch=4, requests=10, buckets=[1, 2, 4],
          compile_backend="aot_eager", label=f"tiny-{draft_attention}",
          draft_attention=draft_attention)


@pytest.mark.parametrize("p, k, s, n", [(16, 4, 5, 8), (2, 8, 5, 16)])
def test_llama3_8b_shapes_match_greedy_up_to_near_ties(p, k, s, n):
    # 32 layers, random weights made on the device; eager iteration captured
    # (no compile) to keep the device time short.
    check("llama3-8b", p, k, s, n, batch=4, requests=6, max_new=24, prompt_len=200,
          buckets=[4], compile_backend=None, label="llama3-8b")


@pytest.mark.parametrize("compile_regions", [False, True])
def test_llama3_8b_shapes_compiled_by_default_match_greedy_up_to_near_ties(compile_regions):
    """The default on CUDA: inductor (a single bucket: one static frame), the
    layers as compiled regions (default) or inline."""
    report = check("llama3-8b", 2, 8, 5, 16, batch=4, requests=6, max_new=24, prompt_len=200,
                   buckets=[4], compile_backend="auto", compile_regions=compile_regions,
                   label=f"llama3-8b-inductor-regions-{compile_regions}")
    _check_programs(report, compile_regions)


@pytest.mark.parametrize("compile_regions", [True, False])
@pytest.mark.parametrize("draft_attention", ["ancestors", "branch"])
def test_inductor_with_a_dynamic_batch_matches_greedy_up_to_near_ties(draft_attention,
                                                                      compile_regions):
    """The default for several buckets: inductor, one dynamic frame for buckets 2
    and 4 (index propagation off; combo kernels off around the regions), one
    static frame for bucket 1; the layers as compiled regions (the default)
    or inline."""
    report = check("tiny", 2, 8, 5, 16, batch=4, requests=10, buckets=[1, 2, 4],
                   compile_backend="auto", compile_regions=compile_regions,
                   label=f"tiny-inductor-dynamic-{draft_attention}-regions-{compile_regions}",
                   draft_attention=draft_attention)
    assert report["dynamic_batch"] and report["frames"] == 2
    _check_programs(report, compile_regions, compiles_per_program=2)


@pytest.mark.parametrize("compile_regions", [True, False])
def test_inductor_with_an_unbacked_batch_shares_bucket_one_and_matches_greedy(compile_regions):
    """Inductor with the batch unbacked and the layer programs traced
    size-oblivious (`CompilePolicy`'s ``unbacked_batch`` and
    ``size_oblivious``): one frame for buckets 1, 2 and 4, captured per
    bucket, each layer program compiled once, the same tokens up to near
    ties."""
    report = check("tiny", 2, 8, 5, 16, batch=4, requests=10, buckets=[1, 2, 4],
                   compile_backend="inductor", compile_regions=compile_regions,
                   unbacked_batch=True, label=f"tiny-inductor-unbacked-regions-{compile_regions}")
    assert report["unbacked_batch"] and report["frames"] == 1
    assert report["data_dependent"] == [], report
    _check_programs(report, compile_regions, one_column_extra=False)


@pytest.mark.parametrize("compile_regions", [False, True])
@pytest.mark.parametrize("draft_attention", ["branch", "ancestors"])
def test_tiny_compiled_by_default_in_one_static_frame_matches_greedy_up_to_near_ties(
        draft_attention, compile_regions):
    """The CUDA default for one bucket: inductor, one static frame; the layers
    as compiled regions (the default, `fa3_spec.eagle.regions`) or inline.
    With the layers as *nested* compile regions (an earlier default) this
    emitted wrong tokens in both semantics."""
    report = check("tiny", 2, 8, 5, 16, batch=4, requests=10, buckets=[4],
                   compile_backend="auto", compile_regions=compile_regions,
                   label=f"tiny-inductor-static-{draft_attention}-regions-{compile_regions}",
                   draft_attention=draft_attention)
    _check_programs(report, compile_regions)


def test_eager_iteration_has_zero_host_syncs():
    """The iteration itself (not only its graph) never synchronizes with the host."""
    models = make_models("tiny", device="cuda")
    eng = _engine(models, 2, 8, 5, 16, batch=4, max_new=24, prompt_len=40, buckets=[4],
                  compile_backend=None, graphs=False)
    prompts, news = workload(6, page_size=2, max_prompt=40, max_new=24,
                             vocab=models.vocab_size, seed=1)
    for prompt, m in zip(prompts, news):
        eng.submit(prompt, m)
    with HostSyncProbe(eng) as probe:
        eng.run()
    syncs = probe.counts
    print("EAGLE-GPU " + json.dumps(dict(test="eager-syncs", iterations=len(syncs),
                                         host_syncs_total=sum(syncs))))
    assert syncs and sum(syncs) == 0
