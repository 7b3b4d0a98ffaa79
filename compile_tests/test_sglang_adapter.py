"""The sglang adapter writes what sglang 0.5.23's own code writes: bitwise, whole buffers.

sglang's code is obtained at test time (``fa3_spec.harness.sglang_upstream``:
the wheel from PyPI, cached; Triton's interpreter on CPU) and the test skips
when it cannot be had. Both sides start from the same buffers, pre-filled
with garbage so that an element one side writes and the other does not shows
up, then replay a sequence of batches (shrinking, growing, padded to buckets)
and compare every buffer tensor after each replay.

``FA3_SPEC_SGLANG_WORLDS`` (default 50, in CI; 200 or more for a long run)
random worlds per mode; each world is a random configuration (page size 1-64,
topk 1-8) with two replays. On CUDA (the H200) the same tests run sglang's
Triton kernels natively.
"""

import os
import random
import zlib

import pytest
import torch

from fa3_spec.probes import RecordingBackend
from fa3_spec.harness.sglang_upstream import (
    make_req_to_token, sglang_batch,
)
from fa3_spec.integrations import sglang as sgl

WORLDS = int(os.environ.get("FA3_SPEC_SGLANG_WORLDS", "50"))
from conftest import SGLANG_DEVICE as DEVICE  # noqa: E402
SEED_CFG = dict(page_size=2, topk=8, num_steps=5, num_draft_tokens=6)  # the seed's (PR #27360)
UNTOUCHED = ("strided_indices",)  # index constants sglang reads as inputs: never garbage them



def _config(rng: random.Random, *, topk, world: int, **fixed) -> sgl.SglangConfig:
    if world == 0:  # the seed's configuration first (P = 2, topk = 8), with sglang's padding
        fixed = {**SEED_CFG, **fixed, "topk": 1 if topk(rng) == 1 else SEED_CFG["topk"]}
    p = fixed.get("page_size", rng.choice([1, 2, 4, 8, 16, 64]))
    return sgl.SglangConfig(
        page_size=p, topk=fixed.get("topk", topk(rng)),
        num_steps=fixed.get("num_steps", rng.randint(2, 5)),
        num_draft_tokens=fixed.get("num_draft_tokens", rng.randint(1, 8)),
        max_bs=6, context_len=rng.randint(1, 3 * max(p, 8)))


def _garbage_like(buffers, g):
    for group in buffers.values():
        for name, t in group.items():
            if name not in UNTOUCHED:
                t.copy_(torch.randint(-999, 999, t.shape, generator=g, dtype=t.dtype))


def _copy_buffers(src, dst):
    for key, group in src.items():
        for name, t in group.items():
            dst[key][name].copy_(t)


def _mismatches(got: dict, want: dict) -> list:
    """Every buffer tensor compared whole: names, dtypes, shapes, values."""
    if sorted(got) != sorted(want):
        return [f"buffer sets {sorted(got)} != {sorted(want)}"]
    out = []
    for key in want:
        if sorted(got[key]) != sorted(want[key]):
            out.append(f"{key}: {sorted(got[key])} != {sorted(want[key])}")
            continue
        for name, w in want[key].items():
            gt = got[key][name]
            if gt.dtype != w.dtype or gt.shape != w.shape or not torch.equal(gt, w):
                diff = (gt != w).nonzero()[:3].tolist() if gt.shape == w.shape else "shape"
                out.append(f"{key}[{name}] differs ({gt.dtype}{tuple(gt.shape)} vs "
                           f"{w.dtype}{tuple(w.shape)}; first at {diff})")
    return out


def _replays(rng, cfg):
    """Two (raw_bs, bucket) pairs: sizes change between replays, padding included."""
    out = []
    for _ in range(2):
        raw = rng.randint(1, cfg.max_bs)
        out.append((raw, rng.randint(raw, cfg.max_bs)))
    return out


def _setup(upstream, cfg, g, steps):
    r2t = make_req_to_token(cfg, cfg.max_bs + 2, g, device=DEVICE)
    ups = [upstream.backend(cfg, r2t, step=s) for s in steps]
    mine = [sgl.allocate_buffers(cfg, step=s, device=DEVICE) for s in steps]
    for up, buf in zip(ups, mine):
        assert _mismatches(buf, up.buffers) == []  # allocated like init_cuda_graph_state
        _garbage_like(buf, g)
        _copy_buffers(buf, up.buffers)
    return r2t, ups, mine


def _world_rng(name, world):
    return random.Random(f"{name}-{world}"), torch.Generator().manual_seed(
        zlib.crc32(f"{name}-{world}".encode()))


# ---------------------------------------------------------------- bitwise
@pytest.mark.parametrize("topk", ["chain", "tree"])
def test_draft_decode_every_step_bitwise(upstream, topk):
    """Draft decode, all num_steps - 1 steps: per-step adapter and whole-iteration
    adapter both equal sglang's per-step ``_apply_cuda_graph_metadata``."""
    pick = (lambda r: 1) if topk == "chain" else (lambda r: r.randint(2, 8))
    for world in range(WORLDS):
        rng, g = _world_rng(f"draft-{topk}", world)
        # Chain: each step is one interpreted Triton launch on CPU; keep S <= 4 but world 0.
        fixed = {"num_steps": rng.randint(2, 4)} if topk == "chain" and world else {}
        cfg = _config(rng, topk=pick, world=world, **fixed)
        steps = range(cfg.num_steps - 1)
        r2t, ups, mine = _setup(upstream, cfg, g, steps)
        fused = [sgl.allocate_buffers(cfg, step=s, device=DEVICE) for s in steps]
        for src, dst in zip(mine, fused):
            _copy_buffers(src, dst)
        for raw, bucket in _replays(rng, cfg):
            batch = sglang_batch(cfg, r2t, raw, bucket, g, random_slots=rng.random() < 0.25)
            kw = batch.inputs("draft_decode")
            for step, up, buf in zip(steps, ups, mine):
                up.draft_decode(**kw)
                sgl.draft_decode(cfg, buf, step, req_to_token=r2t, **kw)
            sgl.draft_iteration(cfg, fused, req_to_token=r2t, **kw)
            for step, up, buf, fb in zip(steps, ups, mine, fused):
                where = f"world {world} {cfg} raw {raw} bucket {bucket} step {step}"
                assert _mismatches(buf, up.buffers) == [], where
                assert _mismatches(fb, up.buffers) == [], where + " (draft_iteration)"


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_target_verify_bitwise(upstream, shape):
    """Target verify, chain (topk = 1) and tree (topk > 1, sglang's flat custom_mask)."""
    pick = (lambda r: 1) if shape == "chain" else (lambda r: r.randint(2, 8))
    for world in range(WORLDS):
        rng, g = _world_rng(f"verify-{shape}", world)
        cfg = _config(rng, topk=pick, world=world)
        r2t, (up,), (buf,) = _setup(upstream, cfg, g, [0])
        for raw, bucket in _replays(rng, cfg):
            batch = sglang_batch(cfg, r2t, raw, bucket, g)
            kw = batch.inputs("target_verify")
            up.target_verify(num_real_rows=batch.num_real_rows, **kw)
            sgl.target_verify(cfg, buf, req_to_token=r2t, **kw)
            assert _mismatches(buf, up.buffers) == [], f"world {world} {cfg} raw {raw} bucket {bucket}"


def test_draft_extend_bitwise(upstream):
    """Draft extend: sglang's replay is its out-of-graph metadata, then the kernel
    its graph records (``draft_extend_set_metadata``); the adapter equals the
    state after both."""
    for world in range(WORLDS):
        rng, g = _world_rng("extend", world)
        cfg = _config(rng, topk=lambda r: r.choice([1, 4, 8]), world=world)
        r2t, (up,), (buf,) = _setup(upstream, cfg, g, [0])
        for raw, bucket in _replays(rng, cfg):
            batch = sglang_batch(cfg, r2t, raw, bucket, g)
            kw = batch.inputs("draft_extend")
            up.draft_extend(**kw)
            up.draft_extend_in_graph(**kw)
            sgl.draft_extend(cfg, buf, req_to_token=r2t, **kw)
            where = f"world {world} {cfg} raw {raw} bucket {bucket}"
            assert _mismatches(buf, up.buffers) == [], where


def test_whole_buffer_comparison_is_not_vacuous(upstream):
    """The comparison sees what FA3 never reads: after a long batch then a short one,
    sglang's tables hold stale, non-sentinel pages past cache_seqlens, and the
    builder's own (sentinel) table would not match them."""
    cfg = sgl.SglangConfig(**SEED_CFG, max_bs=8, context_len=64)
    g = torch.Generator().manual_seed(5)
    r2t = make_req_to_token(cfg, cfg.max_bs + 2, g, device=DEVICE)
    up = upstream.backend(cfg, r2t)
    long = sglang_batch(cfg, r2t, 4, 4, g, seq_lens=[60] * 4)
    up.target_verify(num_real_rows=4, **long.inputs("target_verify"))
    short = sglang_batch(cfg, r2t, 4, 4, g, seq_lens=[3] * 4)
    up.target_verify(num_real_rows=4, **short.inputs("target_verify"))
    table = up.buffers[sgl.TARGET_VERIFY_TOPK_NORMAL]["page_table"][:4]
    assert (table[:, 2:32] != 0).any()  # stale pages of the long batch
    expand = up.buffers[sgl.TARGET_VERIFY_TOPK_EXPAND]
    csl = expand["cache_seqlens"][:4 * cfg.num_draft_tokens]
    assert (csl < cfg.num_draft_tokens).any()  # unattended slots written past cache_seqlens


# --------------------------------------------------------------- compile
def _fill_fn(cfg, mode, step, names):
    def fill(buffers, *tensors):
        kw = dict(zip(names, tensors))
        if mode == "draft_decode":
            sgl.draft_decode(cfg, buffers, step, **kw)
        elif mode == "draft_iteration":
            sgl.draft_iteration(cfg, buffers, **kw)
        else:
            getattr(sgl, mode)(cfg, buffers, **kw)
        return buffers
    return fill


COMPILE_CASES = [("draft_decode", 8), ("draft_decode", 1), ("draft_iteration", 8),
                 ("draft_iteration", 1), ("target_verify", 8), ("target_verify", 1),
                 ("draft_extend", 8)]


@pytest.mark.parametrize("mode,topk", COMPILE_CASES)
def test_adapter_compiles_fullgraph_without_data_dependent_ops(mode, topk):
    """Each fill traces with fullgraph (0 breaks), one frame for new values of the
    same bucket (no recompile), no data-dependent node, and equals eager."""
    cfg = sgl.SglangConfig(**{**SEED_CFG, "topk": topk}, max_bs=8, context_len=48)
    g = torch.Generator().manual_seed(1)
    r2t = make_req_to_token(cfg, cfg.max_bs + 2, g)
    batches = [sglang_batch(cfg, r2t, raw, 6, g) for raw in (6, 3)]
    total = max(b.custom_mask.numel() for b in batches) + 8  # one static mask length
    for b in batches:
        b.custom_mask = torch.cat([b.custom_mask, torch.zeros(total - b.custom_mask.numel(),
                                                              dtype=torch.bool)])
    base = "draft_decode" if mode == "draft_iteration" else mode
    names = ["req_to_token"] + list(batches[0].inputs(base))
    step = cfg.num_steps - 2

    def make_buffers():
        if mode == "draft_iteration":
            return [sgl.allocate_buffers(cfg, step=s) for s in range(cfg.num_steps - 1)]
        return sgl.allocate_buffers(cfg, step=step)

    fill = _fill_fn(cfg, mode, step, names)
    args = lambda b: [r2t] + list(b.inputs(base).values())  # noqa: E731
    # fullgraph=True fails on any graph break (test_compile.py's negative controls), and
    # the recorder flags data-dependent ops that it accepts: no separate explain pass.
    recorder = RecordingBackend("aot_eager")
    compiled = torch.compile(fill, fullgraph=True, backend=recorder)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in batches:
            want, got = make_buffers(), make_buffers()
            fill(want, *args(b))
            compiled(got, *args(b))
            for w, o in (zip(want, got) if mode == "draft_iteration" else [(want, got)]):
                assert _mismatches(o, w) == []
    assert recorder.frame_count == 1
    assert recorder.data_dependent == []


# ------------------------------------------------------------- padding
def test_pad_batch_follows_sglang_and_error_flags_exempt_padding():
    """pad_batch pads as sglang's runners do; the adapter's error_flags ignores those
    rows (fa3_spec.error_flags alone flags their zero draft slots) but still flags
    a bad live row."""
    cfg = sgl.SglangConfig(**SEED_CFG, max_bs=8, context_len=48)
    g = torch.Generator().manual_seed(3)
    r2t = make_req_to_token(cfg, cfg.max_bs + 2, g)
    batch = sglang_batch(cfg, r2t, 3, 8, g)
    assert batch.seq_lens[3:].tolist() == [1] * 5 and batch.req_pool_indices[3:].tolist() == [0] * 5
    assert batch.extend_seq_lens[3:].tolist() == [cfg.num_draft_tokens] * 5
    assert sgl.real_rows(cfg, batch.req_pool_indices).tolist() == [True] * 3 + [False] * 5
    for step in range(cfg.num_steps - 1):
        kw = dict(req_to_token=r2t, step=step, **batch.inputs("draft_decode"))
        assert int(sgl.error_flags(cfg, "draft_decode", **kw)) == 0
    raw = fa3_spec_error_flags(cfg, "draft_decode", step=1, req_to_token=r2t,
                               **batch.inputs("draft_decode"))
    assert raw != 0  # without the exemption, sglang's padding rows are flagged
    for mode in ("target_verify", "draft_extend"):
        assert int(sgl.error_flags(cfg, mode, req_to_token=r2t, **batch.inputs(mode))) == 0
    bad = batch.out_cache_loc.clone()
    bad[: cfg.num_steps] = 0  # a live branch whose slots span the wrong pages
    kw = dict(batch.inputs("draft_decode"), out_cache_loc=bad)
    assert int(sgl.error_flags(cfg, "draft_decode", req_to_token=r2t, step=2, **kw)) != 0
    other = sgl.SglangConfig(**SEED_CFG, max_bs=8, context_len=48, pad_req_pool_index=7)
    assert sgl.real_rows(other, torch.tensor([7, 0, 3])).tolist() == [False, True, True]


def fa3_spec_error_flags(cfg, mode, **kw):
    import fa3_spec

    return int(fa3_spec.error_flags(cfg.spec_config(), mode, **kw))
