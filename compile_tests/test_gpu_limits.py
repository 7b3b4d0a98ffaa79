"""Limits on the GPU: the captured draft loop at batch 512 / 128K context,
topk 10 with 8 steps, a large batch then a small one then an empty one in the same
bucket, and checked mode captured in a CUDA graph.

Skipped without CUDA sm90 + FA3. Compiled with aot_eager: these tests are about
the metadata, capture and replay at the limits, not about inductor's kernels.
"""

import pytest
import torch

import fa3_spec
from fa3_spec.attention import fa3_available
from gpu_results import rel_err as _rel
from fa3_spec.config import cdiv
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner
from fa3_spec.graphs import capture
from fa3_spec.harness.toy import ToyModel, draft_iteration, example_batch
from fa3_spec.harness.worlds import draft_positions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fa3_available(), reason="needs CUDA sm90 and an FA3 provider"),
]


def shared_prefix_pool(cfg, num_rows):
    """A ``req_to_token`` pool whose rows share one ``max_context_len`` prefix.

    Row ``r`` maps its whole pages before position ``seq_len - seq_len % P`` to
    shared pages (as a radix cache shares a common prefix), and its partial last
    page and draft region to private pages, so every request may be as long as
    the window at a KV pool of ``C + rows * (draft region)`` tokens. Private
    pages start at page index ``seq_len // P``, hence the pool is built per
    batch: returns ``build(seq_lens) -> (req_to_token, num_pages)``.
    """
    p = cfg.page_size
    shared = cdiv(cfg.max_context_len, p)
    private = cdiv(cfg.draft_row_len - cfg.max_context_len + p - 1, p) + 1
    num_pages = 1 + shared + num_rows * private

    def build(seq_lens):
        rows = seq_lens.shape[0]
        pos = torch.arange(cfg.draft_row_len, device=seq_lens.device)
        page_index = (pos // p).unsqueeze(0)  # [1, L]
        first_private = (seq_lens // p).unsqueeze(1)  # [rows, 1]
        own = page_index - first_private
        row_base = 1 + shared + torch.arange(rows, device=seq_lens.device).unsqueeze(1) * private
        page = torch.where(own < 0, 1 + page_index,
                           torch.where(own < private, row_base + own, 0))
        return (page * p + pos % p).to(torch.int32)

    return build, num_pages


def _batch(cfg, r2t, seq_lens, model, seed):
    bs = seq_lens.shape[0]
    rpi = torch.arange(bs, device="cuda")
    positions = draft_positions(cfg, seq_lens, "branch").clamp(max=r2t.shape[1] - 1)
    loc = r2t[rpi.view(-1, 1, 1), positions].to(torch.int64)
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(bs, cfg.topk, model.hidden, device="cuda", generator=g).bfloat16()
    return dict(req_pool_indices=rpi, seq_lens=seq_lens, out_cache_loc=loc, hidden=hidden)




@pytest.mark.parametrize("p", [1, 64])
def test_captured_draft_loop_at_batch_512_and_128k_context(p):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=4, num_steps=3, num_draft_tokens=4, max_bs=512,
                              max_context_len=128 * 1024)
    bs, c = 512, cfg.max_context_len
    build_pool, num_pages = shared_prefix_pool(cfg, bs)
    g = torch.Generator().manual_seed(p)
    seq = torch.randint(1, c + 1, (bs,), generator=g)
    seq[: cfg.num_draft_tokens + 1] = c - torch.arange(cfg.num_draft_tokens + 1)  # C - k, k = 0..N
    seq[-4:] = 0  # padding rows
    seq = seq.cuda()
    r2t = build_pool(seq)
    model = ToyModel.create(layers=1, num_pages=num_pages, page_size=p, num_heads=8,
                            num_kv_heads=2, head_dim=128, device="cuda")

    def step(**b):
        out = draft_iteration(cfg, model, req_to_token=r2t, attention_backend="fa3", **b)
        flags = fa3_spec.error_flags(cfg, "draft_decode", step=cfg.num_steps - 2,
                                     num_pages=num_pages, req_to_token=r2t,
                                     req_pool_indices=b["req_pool_indices"],
                                     seq_lens=b["seq_lens"], out_cache_loc=b["out_cache_loc"])
        return out, flags.expand(b["seq_lens"].shape[0])  # batch-major, as the runner wants

    runner = CUDAGraphRunner(step, buckets=[bs], policy=CompilePolicy(compile_backend="aot_eager"),
                             example=lambda n: example_batch("draft_decode", cfg, model, n,
                                                             device="cuda"))
    runner.capture()
    addresses = [t.data_ptr() for t in runner.static_inputs(bs).values()]
    initial = (model.k_cache.clone(), model.v_cache.clone())

    def restore():
        model.k_cache.copy_(initial[0])
        model.v_cache.copy_(initial[1])

    small = torch.tensor([c, 7, 0], device="cuda")
    for seqs, seed in [(seq, 0), (small, 1), (seq[:0], 2)]:  # large, small, empty: one bucket
        # The engine updates its pool in place (the graph baked in its address).
        r2t.copy_(build_pool(torch.cat([seqs, seq[seqs.numel():]])))
        batch = _batch(cfg, r2t, seqs, model, seed)
        restore()
        got, flags = runner(**batch)
        got = got.clone()
        restore()
        want, _ = step(**batch)
        assert got.shape == want.shape
        if seqs.numel():
            assert torch.isfinite(got).all() and _rel(got, want) <= 1e-2
            assert int(flags[0]) == 0, fa3_spec.describe_errors(flags[0])
    assert [t.data_ptr() for t in runner.static_inputs(bs).values()] == addresses


def test_captured_draft_loop_topk_10_with_8_steps():
    cfg = fa3_spec.SpecConfig(page_size=2, topk=10, num_steps=8, num_draft_tokens=16, max_bs=16,
                              max_context_len=2048)
    build_pool, num_pages = shared_prefix_pool(cfg, 16)
    seq = torch.randint(1, 2049, (16,), generator=torch.Generator().manual_seed(0))
    seq[-1] = 0
    seq = seq.cuda()
    r2t = build_pool(seq)
    model = ToyModel.create(layers=2, num_pages=num_pages, page_size=2, num_heads=8,
                            num_kv_heads=2, head_dim=128, device="cuda")
    batch = _batch(cfg, r2t, seq, model, 0)
    initial = (model.k_cache.clone(), model.v_cache.clone())
    step = torch.compile(lambda **b: draft_iteration(cfg, model, req_to_token=r2t,
                                                     attention_backend="fa3", **b),
                         fullgraph=True, backend="aot_eager")
    graph, out = capture(step, **batch)
    model.k_cache.copy_(initial[0]); model.v_cache.copy_(initial[1])
    graph.replay()
    got = out.clone()
    model.k_cache.copy_(initial[0]); model.v_cache.copy_(initial[1])
    torch_ref = draft_iteration(cfg, model, req_to_token=r2t, attention_backend="torch", **batch)
    assert got.shape == (16, 10, 7, model.hidden)
    assert torch.isfinite(got).all() and _rel(got, torch_ref) <= 1e-2


def test_checked_mode_captured_in_a_cuda_graph():
    """Every planted violation sets its bit when copied into the captured inputs."""
    from test_checks import CFG, _planted

    world, cases = _planted()
    world = world.to("cuda")
    for name, mode, step, over, bit in cases:
        num_pages = over.pop("num_pages", world.num_pages)
        static = {k: v.clone() for k, v in world.mode_kwargs(mode, draft_attention="branch").items()}

        def flags_fn():
            return fa3_spec.error_flags(CFG, mode, step=step, num_pages=num_pages, **static)

        graph, flags = capture(torch.compile(flags_fn, fullgraph=True, backend="aot_eager"))
        graph.replay()
        if not over:  # the pool-size case: the violation is the static num_pages itself
            assert int(flags) & bit, name
            continue
        assert int(flags) == 0, (name, fa3_spec.describe_errors(flags))
        for key, bad in over.items():
            static[key].copy_(bad.to("cuda"))
        graph.replay()
        assert int(flags) & bit, name
        for key, good in world.mode_kwargs(mode, draft_attention="branch").items():
            static[key].copy_(good)
        graph.replay()
        assert int(flags) == 0, name
