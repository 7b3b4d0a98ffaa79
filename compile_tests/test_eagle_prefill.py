"""build_prefill_metadata: arbitrary new-token counts per request."""

import pytest
import torch

import fa3_spec
from fa3_spec.probes import RecordingBackend
from fa3_spec.harness.oracle import key_slots_read, metadata_mismatches
from fa3_spec.harness.worlds import make_world


def _world(p=2, bs=5):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=1, num_steps=2, num_draft_tokens=3, max_bs=8,
                              max_context_len=40)
    return make_world(cfg, bs, seq_lens=[17, 1, 0, 32, 8][:bs], seed=p)


@pytest.mark.parametrize("p", [1, 2, 16])
def test_each_query_reads_its_prefix_and_itself(p):
    world = _world(p)
    ext = torch.tensor([17, 1, 5, 3, 9])  # 17: a whole prompt; 9 > seq_len 8 is clamped to 8
    md = fa3_spec.build_prefill_metadata(world.cfg, **world.batch(), extend_seq_lens=ext,
                                         max_seqlen_q=20)
    total = 5 * 20
    read = key_slots_read(md, total)
    r2t = world.req_to_token
    want = []
    for b, (row, s) in enumerate(zip(world.req_pool_indices.tolist(), world.seq_lens.tolist())):
        e = min(int(ext[b]), s)  # padding row (s = 0): no queries
        want += [r2t[row, : s - e + i + 1].tolist() for i in range(e)]
    assert read[: len(want)] == want
    assert all(r == [] for r in read[len(want):])
    assert md.cu_seqlens_q.tolist() == [0, 17, 18, 18, 21, 29]
    row, pos, owned = fa3_spec.extend_query_positions(md, world.seq_lens, total)
    assert owned.sum() == 29
    assert pos[:18].tolist() == list(range(17)) + [0]
    assert pos[18:21].tolist() == [29, 30, 31] and row[18:21].tolist() == [3, 3, 3]


def test_equals_draft_extend_when_lengths_fit():
    world = _world(2)
    cfg, ext = world.cfg, torch.tensor([3, 1, 2, 3, 1])
    got = fa3_spec.build_prefill_metadata(cfg, **world.batch(), extend_seq_lens=ext,
                                          max_seqlen_q=cfg.num_draft_tokens)
    want = fa3_spec.build_draft_extend_metadata(cfg, **world.batch(), extend_seq_lens=ext)
    assert metadata_mismatches(got, want) == []


def test_compiles_fullgraph_without_recompiles():
    world = _world(2)
    backend = RecordingBackend("aot_eager")

    def fn(r2t, rpi, seq, ext):
        return fa3_spec.build_prefill_metadata(world.cfg, req_to_token=r2t, req_pool_indices=rpi,
                                               seq_lens=seq, extend_seq_lens=ext, max_seqlen_q=16)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for ext in (torch.tensor([5, 1, 0, 16, 2]), torch.tensor([1, 1, 1, 1, 1])):
        args = (world.req_to_token, world.req_pool_indices, world.seq_lens, ext)
        assert metadata_mismatches(compiled(*args), fn(*args)) == []
    assert backend.frame_count == 1 and backend.data_dependent == []


def test_boundary_errors_name_the_argument():
    world = _world(2)
    kw = dict(world.batch(), extend_seq_lens=torch.ones(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="max_seqlen_q"):
        fa3_spec.build_prefill_metadata(world.cfg, **kw, max_seqlen_q=2.0)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fa3_spec.build_prefill_metadata(world.cfg, **kw, max_seqlen_q=0)
    kw["extend_seq_lens"] = torch.ones(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="extend_seq_lens"):
        fa3_spec.build_prefill_metadata(world.cfg, **kw, max_seqlen_q=4)


def test_extend_query_positions_checks_its_arguments():
    cfg = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=2, num_draft_tokens=2, max_bs=4,
                              max_context_len=16)
    w = make_world(cfg, 3, seed=1)
    md = fa3_spec.build_prefill_metadata(cfg, **w.batch(), extend_seq_lens=w.seq_lens,
                                         max_seqlen_q=16)
    with pytest.raises(ValueError, match="seq_lens"):
        fa3_spec.extend_query_positions(md, w.seq_lens[:2], 48)
    with pytest.raises(TypeError, match="metadata"):
        fa3_spec.extend_query_positions(fa3_spec.CascadeMetadata(md, None), w.seq_lens, 48)

