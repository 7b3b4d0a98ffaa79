"""Whole steps on CPU: dense-oracle parity, runner padding, one compiled graph."""

import pytest
import torch

import fa3_spec
from fa3_spec.probes import RecordingBackend
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner
from fa3_spec.harness.toy import (
    STEP_VARIANTS,
    ToyModel,
    draft_iteration,
    example_batch,
    make_step,
    world_batch,
)
from fa3_spec.harness.oracle import dense_attention, expected_key_slots
from fa3_spec.harness.worlds import make_world
from helpers import symbol_recorder

CFGS = [(2, 4), (1, 1), (3, 3), (16, 1)]


def _model(world, p, seed=0):
    return ToyModel.create(layers=2, num_pages=world.num_pages, page_size=p, num_heads=4,
                           num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=seed)


def _clone(model):
    return ToyModel(*(t.clone() for t in (model.wq, model.wk, model.wv, model.wo,
                                          model.k_cache, model.v_cache)))


@pytest.mark.parametrize("p, k", CFGS, ids=[f"P{p}K{k}" for p, k in CFGS])
def test_draft_iteration_matches_dense_oracle(p, k):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=4, num_draft_tokens=5, max_bs=8,
                              max_context_len=40)
    world = make_world(cfg, 4, num_padding=1, seed=p + k)
    model = _model(world, p)
    oracle = _clone(model)
    hidden = torch.randn(4, k, model.hidden, generator=torch.Generator().manual_seed(1))
    loc = world.out_cache_loc.view(4, k, cfg.num_steps)
    got = draft_iteration(cfg, model, **world.batch(), out_cache_loc=loc, hidden=hidden,
                          attention_backend="torch")
    # Oracle: the same layers, attention over docs/semantics.md's key slots per query.
    oracle.copy_slots(*fa3_spec.draft_tail_copy_slots(cfg, seq_lens=world.seq_lens, out_cache_loc=loc))
    x, outs = hidden.reshape(4 * k, -1), []
    for step in range(cfg.num_steps - 1):
        slots = expected_key_slots(world, "draft_decode", step=step, draft_attention="branch")
        x = oracle.forward(x, loc.reshape(4 * k, -1)[:, step],
                           lambda q, kc, vc: dense_attention(q, kc, vc, slots))
        outs.append(x)
    torch.testing.assert_close(got, torch.stack(outs, 1).view_as(got), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.k_cache, oracle.k_cache)


@pytest.mark.parametrize("mode, tree", [("target_verify", True), ("target_verify", False),
                                        ("draft_extend", False)])
def test_verify_and_extend_match_dense_oracle(mode, tree):
    cfg = fa3_spec.SpecConfig(page_size=2, topk=4, num_steps=4, num_draft_tokens=5, max_bs=8,
                              max_context_len=40)
    world = make_world(cfg, 4, num_padding=1, seed=3)
    model = _model(world, 2)
    oracle = _clone(model)
    hidden = torch.randn(4, 5, model.hidden, generator=torch.Generator().manual_seed(2))
    step = make_step(mode, cfg, model, world.req_to_token, attention_backend="torch", tree=tree)
    got = step(**world_batch(mode, world, hidden, tree=tree))
    slots = expected_key_slots(world, mode, tree=tree, draft_attention="branch")
    r2t, x = world.req_to_token, hidden.reshape(20, -1)
    if mode == "draft_extend":  # packed tokens: request b's last e_b accepted tokens
        write = [int(r2t[row, s - e + i]) for row, s, e in zip(world.req_pool_indices.tolist(),
                 world.seq_lens.tolist(), world.extend_seq_lens.tolist()) for i in range(e)]
    else:
        write = [int(r2t[row, s + c]) if s > 0 else 0 for row, s in
                 zip(world.req_pool_indices.tolist(), world.seq_lens.tolist()) for c in range(5)]
    write = torch.tensor(write + [0] * (20 - len(write)))
    want = oracle.forward(x, write, lambda q, kc, vc: dense_attention(q, kc, vc, slots))
    rows = len(slots)  # queries past the real ones are unattended; compare the real ones
    torch.testing.assert_close(got.reshape(20, -1)[:rows], want[:rows], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode, tree", STEP_VARIANTS)
def test_runner_padding_leaves_real_rows_unchanged(mode, tree):
    cfg = fa3_spec.SpecConfig(page_size=2, topk=4, num_steps=4, num_draft_tokens=5, max_bs=8,
                              max_context_len=40)
    world = make_world(cfg, 8, seed=1)
    model = _model(world, 2)
    step = make_step(mode, cfg, model, world.req_to_token, attention_backend="torch", tree=tree)
    runner = CUDAGraphRunner(step, buckets=[2, 4, 8], policy=CompilePolicy.eager(),
                             example=lambda bs: example_batch(mode, cfg, model, bs, device="cpu",
                                                              tree=tree))
    runner.capture()
    rows = 4 if mode == "draft_decode" else 5
    full = world_batch(mode, world, torch.randn(8, rows, model.hidden), tree=tree)
    initial = (model.k_cache.clone(), model.v_cache.clone())
    for bs in (8, 3, 5, 0):  # a full bucket, then smaller batches in it, then none
        batch = {k: v[:bs] for k, v in full.items()}
        model.k_cache.copy_(initial[0]); model.v_cache.copy_(initial[1])
        got = runner(**batch)
        model.k_cache.copy_(initial[0]); model.v_cache.copy_(initial[1])
        assert torch.equal(got, step(**batch))
    with pytest.raises(ValueError, match="largest bucket"):
        runner(**{k: torch.cat([v, v[:1]]) for k, v in full.items()})


def test_whole_draft_iteration_is_one_graph():
    cfg = fa3_spec.SpecConfig(page_size=2, topk=4, num_steps=3, num_draft_tokens=4, max_bs=4,
                              max_context_len=24)
    world = make_world(cfg, 3, seed=4)
    model = ToyModel.create(layers=1, num_pages=world.num_pages, page_size=2, num_heads=2,
                            num_kv_heads=1, head_dim=8, dtype=torch.float32)
    step = make_step("draft_decode", cfg, model, world.req_to_token, attention_backend="torch")
    batch = world_batch("draft_decode", world, torch.randn(3, 4, model.hidden))
    recorder = RecordingBackend("aot_eager")
    initial = model.k_cache.clone()
    got = torch.compile(step, fullgraph=True, backend=recorder)(**batch)
    model.k_cache.copy_(initial)
    torch.testing.assert_close(got, step(**batch))
    assert recorder.frame_count == 1 and recorder.data_dependent == []


def test_two_configs_share_one_process_through_the_runner():
    """Found on the H200: a second config compiled through the runner (toy
    draft_iteration, same code, another closed-over config) failed to trace once
    dynamo made the config's ints symbolic. Each runner's compiled step (its
    manual capture needs CUDA, so the compiled step is called directly) now
    builds with static config ints; only the batch dimension is symbolic."""
    base = make_world(fa3_spec.SpecConfig(page_size=2, topk=2, num_steps=3, num_draft_tokens=3,
                                          max_bs=4, max_context_len=16), 3, seed=2)
    model = ToyModel.create(layers=1, num_pages=base.num_pages, page_size=2, num_heads=2,
                            num_kv_heads=1, head_dim=8, dtype=torch.float32)
    record = []
    for steps in (3, 2):
        cfg = fa3_spec.SpecConfig(page_size=2, topk=2, num_steps=steps, num_draft_tokens=3,
                                  max_bs=4, max_context_len=16)
        step = make_step("draft_decode", cfg, model, base.req_to_token, attention_backend="torch")
        runner = CUDAGraphRunner(step, buckets=[2, 4],
                                 policy=CompilePolicy(compile_backend=symbol_recorder(record)),
                                 example=lambda bs: example_batch("draft_decode", cfg, model, bs,
                                                                  device="cpu"))
        rows = base.req_pool_indices.view(-1, 1, 1)
        batch = dict(req_pool_indices=base.req_pool_indices, seq_lens=base.seq_lens,
                     out_cache_loc=base.req_to_token[rows, fa3_spec.draft_positions(cfg, base.seq_lens, "branch")].long(),
                     hidden=torch.randn(3, 2, model.hidden, generator=torch.Generator().manual_seed(steps)))
        for t in batch.values():
            torch._dynamo.maybe_mark_dynamic(t, 0)  # as the runner's capture does
        initial = model.k_cache.clone()
        got = runner.compiled_step(**batch)
        model.k_cache.copy_(initial)
        torch.testing.assert_close(got, step(**batch))
        model.k_cache.copy_(initial)
    assert len(record) == 2
    assert all(len(found) == 1 and next(iter(found)).endswith(".size()[0]") for found in record), record
