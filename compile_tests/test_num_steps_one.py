"""num_steps = 1 (upstream allows it): no draft-decode step; every builder, the
runner and the EAGLE loop still work (the tree is the root's top-K children)."""

import pytest
import torch

import fa3_spec
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner
from fa3_spec.harness.toy import ToyModel, example_batch, make_step, world_batch
from fa3_spec.harness.worlds import make_world


@pytest.mark.parametrize("p, k", [(1, 1), (2, 4), (16, 8)])
def test_builders_and_runner_with_one_step(p, k):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=1, num_draft_tokens=4, max_bs=8,
                              max_context_len=40)
    assert cfg.num_draft_decode_steps == 0
    w = make_world(cfg, 4, num_padding=1, seed=1)
    assert fa3_spec.build_draft_iteration_metadata(cfg, **w.batch(),
                                                   out_cache_loc=w.out_cache_loc) == ()
    src, dst = fa3_spec.draft_tail_copy_slots(cfg, seq_lens=w.seq_lens, out_cache_loc=w.out_cache_loc)
    assert src.shape == dst.shape == (4 * k * (p - 1) if p > 1 and k > 1 else 0,)
    for mode in ("decode", "target_verify", "draft_extend"):
        fa3_spec.build_metadata(mode, cfg, **w.mode_kwargs(mode, draft_attention="branch"))
        assert int(fa3_spec.error_flags(cfg, mode, **w.mode_kwargs(mode, draft_attention="branch"))) == 0
    with pytest.raises(ValueError, match="no draft-decode step"):
        fa3_spec.build_draft_decode_metadata(cfg, 0, draft_attention="branch", **w.batch(),
                                             out_cache_loc=w.out_cache_loc)
    model = ToyModel.create(layers=1, num_pages=w.num_pages, page_size=p, num_heads=2,
                            num_kv_heads=1, head_dim=8, dtype=torch.float32)
    step = make_step("draft_decode", cfg, model, w.req_to_token, attention_backend="torch")
    runner = CUDAGraphRunner(step, buckets=[2, 4], policy=CompilePolicy.eager(),
                             example=lambda bs: example_batch("draft_decode", cfg, model, bs,
                                                              device="cpu"))
    runner.capture()
    out = runner(**world_batch("draft_decode", w, torch.randn(4, k, model.hidden)))
    assert out.shape == (4, k, 0, model.hidden)


def test_the_eagle_loop_is_exact_with_one_step():
    from test_eagle_loop import check_exact

    mean, _ = check_exact(2, 4, 1, 4, requests=10, max_bs=4)
    assert mean >= 1.0
