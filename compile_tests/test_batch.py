"""SpecBatch: a batch validated once, outside any compiled region, keeps the
builders' error types; inside a compiled caller the same errors reach it wrapped
by dynamo."""

import pytest
import torch

import fa3_spec
from fa3_spec import SpecBatch
from fa3_spec.harness.worlds import make_world

CFG = fa3_spec.SpecConfig(page_size=4, topk=3, num_steps=4, num_draft_tokens=5, max_bs=8,
                          max_context_len=40)


def test_compiled_callers_see_dynamo_wrapping_and_specbatch_keeps_the_type():
    world = make_world(CFG, 2, seed=9)
    bad_seq = world.seq_lens.float()

    def fn(seq_lens):
        return fa3_spec.build_decode_metadata(CFG, req_to_token=world.req_to_token,
                                              req_pool_indices=world.req_pool_indices,
                                              seq_lens=seq_lens)

    with pytest.raises(torch._dynamo.exc.Unsupported, match="seq_lens must have dtype"):
        torch.compile(fn, fullgraph=True, backend="eager")(bad_seq)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match="seq_lens"):  # validated outside the compiled region
        SpecBatch.create(CFG, req_to_token=world.req_to_token,
                         req_pool_indices=world.req_pool_indices, seq_lens=bad_seq)
    batch = SpecBatch.create(CFG, req_to_token=world.req_to_token,
                             req_pool_indices=world.req_pool_indices, seq_lens=world.seq_lens)
    compiled = torch.compile(lambda b: fa3_spec.build_metadata("decode", b), fullgraph=True,
                             backend="eager")
    assert torch.equal(compiled(batch).page_table, fn(world.seq_lens).page_table)
