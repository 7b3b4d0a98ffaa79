"""The runner's host staging: checks once per signature, padding kept zero by a
high-water mark, one grouped copy, the zero-copy path, and the compile cache;
the inputs it refuses and the outputs it returns."""

import pathlib
import sys

import pytest
import torch

import children
import fa3_spec
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner, load_compile_cache
from fa3_spec.harness.toy import ToyModel, make_step, world_batch
from fa3_spec.harness.worlds import make_world

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = fa3_spec.SpecConfig(page_size=4, topk=3, num_steps=4, num_draft_tokens=5, max_bs=8,
                          max_context_len=40)


def _example(bs):  # non-zero: the first call must zero-fill what capture left
    return dict(req_pool_indices=torch.ones(bs, dtype=torch.int64),
                out_cache_loc=torch.ones(bs, 3, 2, dtype=torch.int64),
                hidden=torch.ones(bs, 3, 5, dtype=torch.bfloat16))


def _batch(bs, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(1, 100, v.shape, generator=g).to(v.dtype)
            for k, v in _example(bs).items()}


def _step(req_pool_indices, out_cache_loc, hidden):
    # Reads every row of every input: a stale padding row would show.
    return req_pool_indices + out_cache_loc.sum((1, 2)), hidden.float().sum(1)


def _runner(buckets=(4, 8)):
    runner = CUDAGraphRunner(_step, example=_example, buckets=list(buckets),
                             policy=CompilePolicy.eager())
    runner.capture()
    return runner


def _padded(batch, bucket):
    return {k: torch.cat([v, v.new_zeros((bucket - v.shape[0],) + v.shape[1:])])
            for k, v in batch.items()}


def test_padding_rows_stay_zero_across_batch_sizes():
    runner = _runner()
    for i, bs in enumerate([3, 8, 7, 5, 5, 0, 6, 1, 4, 3, 2]):
        batch = _batch(bs, i)
        bucket = runner.bucket_for(bs)
        got = runner(**batch)
        want = _step(**_padded(batch, bucket))
        for name, buf in runner.static_inputs(bucket).items():
            assert torch.equal(buf[:bs], batch[name]) and not buf[bs:].any(), (bs, name)
        assert all(torch.equal(g, w[:bs]) for g, w in zip(got, want))


def test_checks_run_once_per_signature_and_still_refuse(monkeypatch):
    runner = _runner()
    calls = []
    check = runner._check_batch
    monkeypatch.setattr(runner, "_check_batch", lambda *a: calls.append(1) or check(*a))
    good = _batch(3, 0)
    for i in range(3):
        runner(**_batch(3, i))
    assert len(calls) == 1  # same keys, types, dtypes, shapes, devices: checked once
    runner(**_batch(6, 0))
    assert len(calls) == 2  # a new shape is a new signature
    with pytest.raises(TypeError, match="out_cache_loc"):
        runner(**{**good, "out_cache_loc": good["out_cache_loc"].int()})
    with pytest.raises(ValueError, match="out_cache_loc"):
        runner(**{**good, "out_cache_loc": good["out_cache_loc"][:, :1]})
    with pytest.raises(TypeError, match="hidden"):
        runner(**{**good, "hidden": good["hidden"].tolist()})
    with pytest.raises(ValueError, match="keys"):
        runner(**{k: v for k, v in good.items() if k != "hidden"})
    runner(**good)  # the good signature still passes after the refusals
    assert len(calls) == 6


def test_strided_sources_take_the_per_dtype_copy_and_give_the_same_rows():
    runner, ref = _runner(), _runner()
    batch = _batch(3, 7)
    wide = torch.zeros(3, 3, 4, dtype=torch.int64)
    wide[:, :, ::2] = batch["out_cache_loc"]
    strided = {**batch, "out_cache_loc": wide[:, :, ::2]}  # last-dimension stride 2: no byte view
    assert not strided["out_cache_loc"].is_contiguous()
    got, want = runner(**strided), ref(**batch)  # ref: contiguous, one byte-view copy
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len(runner._routes) == len(ref._routes) == 1
    copy_strided = next(iter(runner._routes.values())).copy
    copy_bytes = next(iter(ref._routes.values())).copy
    assert copy_strided.__code__ is not copy_bytes.__code__  # the two copy paths


def test_a_buffer_without_a_byte_view_takes_the_per_dtype_copy():
    # capture() clones the example: a transposed example keeps a strided last dimension.
    def example(bs):
        return dict(a=torch.zeros(bs, 5, 3).transpose(1, 2))

    runner = CUDAGraphRunner(lambda a: a.sum((1, 2)), example=example, buckets=[4],
                             policy=CompilePolicy.eager())
    runner.capture()
    a = torch.randn(3, 3, 5)
    assert torch.allclose(runner(a=a), a.sum((1, 2)))  # summation order follows the layout
    assert torch.equal(runner.static_inputs(4)["a"][:3], a)


def test_neg_bit_views_after_a_plain_call_still_copy():
    runner, ref = _runner(), _runner()
    batch = _batch(3, 1)
    runner(**batch)  # caches the byte-view route for this signature
    neg = {**batch, "hidden": torch._neg_view(batch["hidden"])}  # same signature, no byte view
    got, want = runner(**neg), ref(**{**batch, "hidden": -batch["hidden"]})
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_zero_copy_replay_matches_the_call():
    runner, ref = _runner(), _runner()
    for i, bs in enumerate([2, 8, 7, 6, 0]):
        batch = _batch(bs, i)
        bucket = runner.bucket_for(bs)
        for name, buf in runner.static_inputs(bucket).items():
            buf[:bs].copy_(batch[name])  # the engine writes its rows in place
        got, want = runner.replay(bucket, bs), ref(**batch)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert all(not buf[bs:].any() for buf in runner.static_inputs(bucket).values())
    with pytest.raises(ValueError, match="bucket"):
        runner.replay(5, 2)
    with pytest.raises(ValueError, match="bs"):
        runner.replay(4, 5)


@pytest.mark.parametrize("mode, tree", [("draft_decode", False), ("target_verify", True),
                                        ("draft_extend", False)])
def test_library_steps_do_not_write_their_inputs(mode, tree):
    """The zero-fill skip assumes the step leaves its batch inputs unchanged."""
    cfg = fa3_spec.SpecConfig(page_size=2, topk=2, num_steps=3, num_draft_tokens=4, max_bs=4,
                              max_context_len=24)
    world = make_world(cfg, 4, seed=3)
    model = ToyModel.create(layers=1, num_pages=world.num_pages, page_size=2, num_heads=2,
                            num_kv_heads=1, head_dim=8, dtype=torch.float32)
    step = make_step(mode, cfg, model, world.req_to_token, attention_backend="torch", tree=tree)
    rows = cfg.topk if mode == "draft_decode" else cfg.num_draft_tokens
    batch = world_batch(mode, world, torch.randn(4, rows, model.hidden), tree=tree)
    before = {k: v.clone() for k, v in batch.items()}
    step(**batch)
    assert all(torch.equal(batch[k], before[k]) for k in batch)


def test_missing_compile_cache_is_not_an_error(tmp_path):
    assert load_compile_cache(str(tmp_path / "absent.bin")) is False
    assert load_compile_cache(str(tmp_path)) is False  # a directory is no cache file
    runner = CUDAGraphRunner(_step, example=_example, buckets=[4], policy=CompilePolicy.eager(),
                             cache_path=str(tmp_path / "cache.bin"))
    runner.capture()  # eager compiles nothing: no file
    assert not (tmp_path / "cache.bin").exists()


def test_a_garbage_compile_cache_is_reported_as_not_loaded(tmp_path):
    path = tmp_path / "garbage.bin"
    path.write_bytes(b"not a cache file")
    assert load_compile_cache(str(path)) is False  # was True: "loaded"


def _flaky_step(fail):
    def step(req_pool_indices, out_cache_loc, hidden):
        if fail:  # a Python switch, as a step that raises during warm-up or tracing
            raise RuntimeError("the step failed during capture")
        return _step(req_pool_indices, out_cache_loc, hidden)
    return step


def test_a_failed_capture_leaves_the_runner_as_it_was():
    fail = [True]
    runner = CUDAGraphRunner(_flaky_step(fail), example=_example, buckets=[4, 8],
                             policy=CompilePolicy.eager())
    with pytest.raises(RuntimeError, match="failed during capture"):
        runner.capture()
    assert runner.capture_seconds == {}  # no half-filled bucket
    with pytest.raises(RuntimeError, match="failed during capture"):  # the real error again
        runner(**_batch(3, 0))
    fail.clear()
    batch = _batch(3, 1)  # the next call captures, then runs
    got = runner(**batch)
    want = _step(**_padded(batch, 4))
    assert all(torch.equal(g, w[:3]) for g, w in zip(got, want))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_manual_capture_without_cuda_says_so_every_time():
    runner = CUDAGraphRunner(_step, example=_example, buckets=[4, 8])  # graphs, the default
    for attempt in (runner.capture, lambda: runner(**_batch(3, 0))):
        with pytest.raises(RuntimeError, match="graphs=True captures CUDA graphs and needs CUDA"):
            attempt()  # was an internal error, then KeyError: 4
    assert runner.capture_seconds == {} and runner.output_buffers(4) is None


_COMPILE = """
import sys, torch
from torch._dynamo.utils import counters
from fa3_spec.graphs import load_compile_cache, save_compile_cache
loaded = load_compile_cache(sys.argv[1])
torch.compile(lambda x: (x * 2 + 1).relu(), fullgraph=True, backend="inductor")(torch.randn(8))
torch.compile(lambda x: x.sin().sum(), fullgraph=True, backend="inductor")(torch.randn(8))
saved = False if loaded else save_compile_cache(sys.argv[1])  # once, after both
print(loaded, saved, counters["inductor"]["fxgraph_cache_hit"])
"""


def _compile_twice(tmp):
    """The cold process, then the warm one, each with its own empty inductor cache dir."""
    def run(cache_dir):
        out = children.run([sys.executable, "-c", _COMPILE, str(tmp / "c.bin")], timeout=300,
                           env_extra=dict(PYTHONPATH=str(ROOT),
                                          TORCHINDUCTOR_CACHE_DIR=str(cache_dir))).stdout
        return out.split()[-3:]

    return run(tmp / "cold"), run(tmp / "warm")


@pytest.mark.slow
@pytest.mark.children(job=_compile_twice, heavy=True)
def test_compile_cache_round_trip_across_processes(child):
    """A second process with an empty inductor cache dir hits the saved
    artifacts of both compiles the one save followed."""
    cold, warm = child.result()
    assert cold == ["False", "True", "0"]
    assert warm == ["True", "False", "2"]


# What the runner refuses, and outputs that are not one row per request
def _eager_runner(step, example, buckets=(2, 4)):
    runner = CUDAGraphRunner(step, example=example, buckets=list(buckets),
                             policy=CompilePolicy.eager())
    runner.capture()
    return runner


def _draft_example(cfg):
    def example(bs):
        return dict(req_pool_indices=torch.zeros(bs, dtype=torch.int64),
                    seq_lens=torch.zeros(bs, dtype=torch.int64),
                    out_cache_loc=torch.zeros(bs, cfg.topk, cfg.num_steps, dtype=torch.int64))
    return example


def test_runner_refuses_a_broadcastable_out_cache_loc_and_float_seq_lens():
    world = make_world(CFG, 3, seed=1)

    def step(req_pool_indices, seq_lens, out_cache_loc):
        return fa3_spec.build_draft_decode_metadata(
            CFG, 1, draft_attention="branch", req_to_token=world.req_to_token, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, out_cache_loc=out_cache_loc).expand.cache_seqlens

    runner = _eager_runner(step, _draft_example(CFG))
    loc = world.out_cache_loc.view(3, CFG.topk, CFG.num_steps)
    good = dict(req_pool_indices=world.req_pool_indices, seq_lens=world.seq_lens, out_cache_loc=loc)
    assert torch.equal(runner(**good), step(**good))
    with pytest.raises(ValueError, match="out_cache_loc"):
        runner(**{**good, "out_cache_loc": loc[:, :1]})  # [B, 1, S] would broadcast over K
    with pytest.raises(TypeError, match="seq_lens"):
        runner(**{**good, "seq_lens": world.seq_lens.double()})
    with pytest.raises(ValueError, match="seq_lens"):
        runner(**{**good, "seq_lens": world.seq_lens[:2]})


def test_runner_returns_expand_rows_and_cu_seqlens_whole():
    world = make_world(CFG, 3, seed=2)

    def step(req_pool_indices, seq_lens, out_cache_loc):
        md = fa3_spec.build_draft_decode_metadata(
            CFG, 2, draft_attention="branch", req_to_token=world.req_to_token, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, out_cache_loc=out_cache_loc)
        return md.expand.page_table, md.expand.cu_seqlens_q, md.prefix.cu_seqlens_k, md.prefix.page_table

    runner = _eager_runner(step, _draft_example(CFG))
    batch = dict(req_pool_indices=world.req_pool_indices, seq_lens=world.seq_lens,
                 out_cache_loc=world.out_cache_loc.view(3, CFG.topk, CFG.num_steps))
    got, want = runner(**batch), step(**batch)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    assert got[0].shape[0] == 3 * CFG.topk and got[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_runner_refuses_outputs_with_the_batch_in_another_dimension():
    def step(x):
        return x.t()  # [D, B]

    with pytest.raises(ValueError, match="batch-major"):
        _eager_runner(step, lambda bs: dict(x=torch.zeros(bs, 3)))


def test_runner_never_returns_a_negative_slice():
    def step(x):
        return (x[1:] - x[:-1],)  # B - 1 rows

    runner = _eager_runner(step, lambda bs: dict(x=torch.zeros(bs)), buckets=(4, 8))
    assert runner(x=torch.zeros(0))[0].shape == (0,)
    assert runner(x=torch.arange(3.0))[0].tolist() == [1.0, 1.0]

