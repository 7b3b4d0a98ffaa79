"""FA3's default split count: the same numbers as the branchy heuristic it
replaced, and no guard on a dynamic batch (one compiled frame across the
thresholds where the count changes)."""

import torch

from fa3_spec.attention.fa3_op import default_num_splits, fa3_paged_attention


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
    graphs = []

    def record(gm, example_inputs):  # trace only: FA3 is not run (no GPU here)
        graphs.append(gm)
        return lambda *args: [torch.empty(0), torch.empty(0)]

    def call(q, k, v, page_table, cache_seqlens, cu_seqlens_q):
        splits = default_num_splits(q.shape[0], k.shape[2], 4096)
        return list(fa3_paged_attention(q, k, v, page_table, cache_seqlens, cu_seqlens_q,
                                        1, 0.125, True, splits))

    torch._dynamo.reset()
    compiled = torch.compile(call, backend=record, fullgraph=True)
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
