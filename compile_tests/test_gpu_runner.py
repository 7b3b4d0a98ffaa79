"""The CUDA-graph runner on real FA3: whole steps replayed with fresh batches.

Skipped without CUDA sm90 + FA3. Most cases compile with aot_eager to keep
the device run short; ``benchmarks/compile.py runner`` covers inductor.
"""

import pytest
import torch

import fa3_spec
from fa3_spec.attention import fa3_available
from gpu_results import rel_err as _rel
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner
from fa3_spec.harness.toy import STEP_VARIANTS, ToyModel, example_batch, make_step, world_batch
from fa3_spec.harness.worlds import make_world, rebase_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fa3_available(), reason="needs CUDA sm90 and an FA3 provider"),
]


def _setup(mode, p, k, compile_backend="aot_eager", buckets=(1, 2, 4, 8), tree=True):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=5,
                              num_draft_tokens=8 if k > 1 else 4, max_bs=8, max_context_len=700)
    base = make_world(cfg, 8, seed=0, device="cuda")
    model = ToyModel.create(layers=2, num_pages=base.num_pages, page_size=p, num_heads=8,
                            num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cuda")
    tree = tree and k > 1
    step = make_step(mode, cfg, model, base.req_to_token, attention_backend="fa3", tree=tree)
    runner = CUDAGraphRunner(step, buckets=list(buckets),
                             policy=CompilePolicy(compile_backend=compile_backend),
                             example=lambda bs: example_batch(mode, cfg, model, bs, device="cuda",
                                                              tree=tree))
    return cfg, base, model, step, runner


def _batch(mode, cfg, base, model, bs, seed, tree=True):
    world = rebase_world(make_world(cfg, bs, seed=seed, num_padding=1 if bs > 2 else 0,
                                    device="cuda"), base.req_to_token)
    rows = cfg.topk if mode == "draft_decode" else cfg.num_draft_tokens
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(bs, rows, model.hidden, device="cuda", generator=g).bfloat16()
    return world_batch(mode, world, hidden, tree=tree and cfg.topk > 1)




@pytest.mark.parametrize("p, k", [(2, 8), (16, 1), (1, 4)])
@pytest.mark.parametrize("mode, tree", STEP_VARIANTS)
def test_runner_replays_fresh_batches(mode, tree, p, k):
    cfg, base, model, step, runner = _setup(mode, p, k, tree=tree)
    runner.capture()
    addresses = {b: [t.data_ptr() for t in runner.static_inputs(b).values()] for b in runner.buckets}
    out_address = {b: runner.output_buffers(b).data_ptr() for b in runner.buckets}
    initial = (model.k_cache.clone(), model.v_cache.clone())

    def restore():
        model.k_cache.copy_(initial[0])
        model.v_cache.copy_(initial[1])

    # A full bucket, then a smaller batch in the same bucket, then others.
    for bs, seed in [(8, 1), (5, 2), (1, 3), (3, 4), (8, 5)]:
        batch = _batch(mode, cfg, base, model, bs, seed, tree=tree)
        restore()
        got = runner(**batch).clone()
        k_after = model.k_cache.clone()
        restore()
        want = step(**batch)
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert _rel(got, want) <= 1e-2, (bs, _rel(got, want))
        # Same KV writes outside page 0 (the dummy page every padding row
        # writes, racing): a stale row of the previous batch would write
        # O(1) values into real slots the eager step leaves alone.
        diff = (k_after[:, 1:].float() - model.k_cache[:, 1:].float()).abs().max()
        assert float(diff) < 0.25
    for b in runner.buckets:
        assert [t.data_ptr() for t in runner.static_inputs(b).values()] == addresses[b]
        assert runner.output_buffers(b).data_ptr() == out_address[b]
    assert runner.compile_counter.data_dependent == []


def test_one_compile_serves_all_buckets_above_one():
    cfg, base, model, step, runner = _setup("draft_decode", 2, 8, buckets=(1, 2, 3, 4, 6, 8))
    runner.capture()
    # Bucket 1 is specialised by dynamo (sizes 0/1 always are); the rest share one graph.
    assert runner.compile_counter.frame_count <= 2


def test_inductor_draft_iteration_capture():
    cfg, base, model, step, runner = _setup("draft_decode", 2, 8, compile_backend="inductor",
                                            buckets=(4,))
    runner.capture()
    initial = (model.k_cache.clone(), model.v_cache.clone())
    batch = _batch("draft_decode", cfg, base, model, 3, 9)
    got = runner(**batch).clone()
    model.k_cache.copy_(initial[0]); model.v_cache.copy_(initial[1])
    assert _rel(got, step(**batch)) <= 1e-2


def test_sync_counter_sees_a_real_host_sync():
    """The audit's host-sync count is live: .item() is counted on every call."""
    from fa3_spec.probes import count_host_syncs

    x = torch.ones(4, device="cuda")
    count, messages = count_host_syncs(lambda t: t.sum().item(), x, calls=2)
    assert count >= 2, messages
    assert count_host_syncs(lambda t: t * 2, x)[0] == 0
