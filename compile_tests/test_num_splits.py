"""FA3's default split count: the same numbers as the branchy heuristic it
replaced, and no guard on a dynamic batch (one compiled frame across the
thresholds where the count changes)."""

import torch

from fa3_spec.attention.fa3_op import default_num_splits, fa3_paged_attention
from helpers import trace_only_backend


def branchy(rows, kv_heads, keys, sms=132):
    items = max(1, rows * kv_heads)
    if items >= sms:
        return 1
    return max(1, min(16, sms // items, keys // 128))


def test_default_num_splits_matches_the_branchy_heuristic():
    for rows in range(0, 400, 7):
        for kv_heads in (1, 2, 8, 32):
            for keys in (1, 127, 128, 511, 512, 4096, 9000, 131072):
                got = default_num_splits(rows, kv_heads, keys)
                assert got == branchy(rows, kv_heads, keys) and isinstance(got, int)


def test_a_dynamic_batch_compiles_one_frame_with_a_symbolic_split_count():
    graphs = []  # traced only: FA3 is not run (no GPU here)

    def call(q, k, v, page_table, cache_seqlens, cu_seqlens_q):
        splits = default_num_splits(q.shape[0], k.shape[2], 4096)
        return list(fa3_paged_attention(q, k, v, page_table, cache_seqlens, cu_seqlens_q,
                                        1, 0.125, True, splits))

    torch._dynamo.reset()
    compiled = torch.compile(call, backend=trace_only_backend(graphs), fullgraph=True)
    k = torch.randn(10, 16, 2, 64)
    for bs in (3, 9, 40, 100):  # 2 KV heads: the count is 16, 7, 1, 1
        q = torch.randn(bs, 8, 64)
        tensors = [torch.zeros(bs, 5, dtype=torch.int32), torch.ones(bs, dtype=torch.int32),
                   torch.arange(bs + 1, dtype=torch.int32)]
        for t in (q, *tensors):
            torch._dynamo.mark_dynamic(t, 0)
        compiled(q, k, k, *tensors)
    assert len(graphs) == 1
    (op,) = [n for n in graphs[0].graph.nodes if "fa3_paged_attention" in str(n.target)]
    assert isinstance(op.args[9], torch.fx.Node)  # computed from the batch, not a constant


_QK = (torch.randn(4, 4, 8), torch.randn(6, 2, 2, 8))  # one q and cache for every call


def _fa3_call_args(monkeypatch, md, window_size=(-1, -1), num_splits=None):
    """What `attention_call` on the ``"fa3"`` backend hands the FA3 op for ``md``
    (the op replaced by a recorder: no GPU here)."""
    from fa3_spec.attention import cascade

    calls = []

    def record(q, *args):
        calls.append(args)
        return (q.new_zeros(q.shape), torch.zeros(q.shape[1], q.shape[0]))

    monkeypatch.setattr(cascade, "fa3_paged_attention", record)
    q, k = _QK
    cascade.attention_call(q, k, k, md, softmax_scale=0.5, attention_backend="fa3",
                           num_splits=num_splits, window_size=window_size)
    (args,) = calls
    return [(a.data_ptr(), a.shape, a.stride()) if isinstance(a, torch.Tensor) else a
            for a in args]


def test_every_key_bound_of_one_class_makes_the_same_fa3_call(monkeypatch):
    """`fa3_equivalent_key_bound` may stand for ``max_seqlen_k`` in a compiled
    program's key only because FA3 gets the very same arguments with either:
    checked across split-block edges, with and without a fixed split count,
    and left alone where a window reads the bound."""
    import dataclasses

    from fa3_spec import FA3Metadata
    from fa3_spec.attention import fa3_equivalent_key_bound

    i32 = dict(dtype=torch.int32)
    md = FA3Metadata(torch.zeros(2, 3, **i32), torch.tensor([3, 1], **i32),
                     torch.tensor([0, 2, 4], **i32), torch.tensor([0, 3, 4], **i32),
                     max_seqlen_q=2, max_seqlen_k=1, page_size=2, causal=False)
    for bound in (1, 2, 5, 126, 127, 128, 129, 255, 256, 1000, 1023, 1024, 4097):
        same = fa3_equivalent_key_bound(dataclasses.replace(md, max_seqlen_k=bound))
        assert same >= bound and same // 128 == bound // 128
        for splits in (None, 3):
            want = _fa3_call_args(monkeypatch, dataclasses.replace(md, max_seqlen_k=bound),
                                  num_splits=splits)
            assert _fa3_call_args(monkeypatch, dataclasses.replace(md, max_seqlen_k=same),
                                  num_splits=splits) == want
    assert fa3_equivalent_key_bound(md) == 127
    assert fa3_equivalent_key_bound(md, window_size=(4, 0)) == 1
    assert fa3_equivalent_key_bound(dataclasses.replace(md, window_left=4)) == 1
    # Where a window reads the bound, another bound is another call.
    wide = dataclasses.replace(md, max_seqlen_k=300)
    assert (_fa3_call_args(monkeypatch, dataclasses.replace(md, max_seqlen_k=8), window_size=(8, -1))
            != _fa3_call_args(monkeypatch, wide, window_size=(8, -1)))
