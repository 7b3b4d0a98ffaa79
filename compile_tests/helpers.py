"""Hypothesis strategies and assertions shared by the property and parity tests."""

import dataclasses
import os
from typing import Optional

import torch
from hypothesis import strategies as st

import fa3_spec
from fa3_spec import build_metadata as build
from fa3_spec.harness.oracle import (
    dead_columns_clean,
    expected_key_slots,
    key_slots_read,
    metadata_mismatches,
    num_queries,
)
from fa3_spec.harness.worlds import make_world
from fa3_spec.harness.upstream import UpstreamStyleBuilder

#: Examples per fuzz property (test_fuzz.py; a quarter of it, at least 50, in
#: test_iteration_metadata.py). The default keeps the CI suite short; set
#: FA3_SPEC_FUZZ_EXAMPLES=1000 or more for a long run.
FUZZ_EXAMPLES = int(os.environ.get("FA3_SPEC_FUZZ_EXAMPLES", "250"))

NARROW = dict(page_sizes=st.sampled_from([1, 2, 3, 4, 7, 16, 64, 128]), max_topk=10, max_steps=8,
              max_n=12, max_bs=32, max_ctx=160)
WIDE = dict(page_sizes=st.integers(1, 128), max_topk=16, max_steps=10, max_n=64, max_bs=64,
            max_ctx=300)


@st.composite
def configs(draw, page_sizes, max_topk, max_steps, max_n, max_bs, max_ctx):
    return fa3_spec.SpecConfig(
        page_size=draw(page_sizes),
        topk=draw(st.integers(1, max_topk)),
        num_steps=draw(st.integers(2, max_steps)),
        num_draft_tokens=draw(st.integers(1, max_n)),
        max_bs=max_bs,
        max_context_len=draw(st.integers(1, max_ctx)),
    )


@st.composite
def worlds(draw, **ranges):
    """A random `World`: configuration, batch of 0..max_bs, lengths 0..C (0 = padding)."""
    cfg = draw(configs(**ranges))
    bs = draw(st.integers(0, ranges["max_bs"]))
    seqs = draw(st.lists(st.integers(0, cfg.max_context_len), min_size=bs, max_size=bs))
    return make_world(cfg, bs, seq_lens=seqs, seed=draw(st.integers(0, 2**20)), extra_rows=2)


def assert_builder_matches(world, mode, step, tree=True, *, spec_slots=True):
    """The builder of ``mode`` equals the upstream-style reference in every value
    FA3 reads, keeps dead columns at the sentinel, and (``spec_slots``) makes
    each query read exactly the key slots of docs/semantics.md. Returns the metadata."""
    cfg = world.cfg
    kwargs = world.mode_kwargs(mode, tree=tree, draft_attention="branch")
    got = build(mode, cfg, step=step, **kwargs)
    want = UpstreamStyleBuilder(cfg).build(mode, step=step, **kwargs)
    assert metadata_mismatches(got, want) == []
    assert dead_columns_clean(got)
    if spec_slots:
        read = key_slots_read(got, num_queries(world, mode))
        expected = expected_key_slots(world, mode, step=step, tree=tree, draft_attention="branch")
        assert read == expected + [[]] * (len(read) - len(expected))
    return got


def garbage_inputs(cfg, bs, mode, seed, *, pool_rows=3, r2t_dtype=torch.int32):
    """Builder keywords of ``mode`` whose index tensors hold garbage over their
    dtype's whole range (``tree_mask``: random bits)."""
    g = torch.Generator().manual_seed(seed)

    def garbage(shape, dtype=torch.int64):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, dtype=dtype, generator=g)

    kwargs = dict(req_to_token=garbage((pool_rows, cfg.min_row_len), r2t_dtype),
                  req_pool_indices=garbage((bs,)), seq_lens=garbage((bs,)))
    n = cfg.num_draft_tokens
    if mode == "draft_decode":
        kwargs["out_cache_loc"] = garbage((bs * cfg.topk * cfg.num_steps,))
    elif mode == "target_verify":
        kwargs["tree_mask"] = torch.randint(0, 2, (bs, n, n), generator=g).bool()
    elif mode == "draft_extend":
        kwargs["extend_seq_lens"] = garbage((bs,))
    return kwargs


def symbol_recorder(record: list, delegate="eager"):
    """A ``torch.compile`` backend that appends, per compiled graph, the sources
    of the symbols left in its inputs' sizes (after dynamo's replacements: a
    symbol pinned to a constant by a guard is no symbol), then runs ``delegate``."""
    def backend(gm, example_inputs):
        env = torch._guards.TracingContext.try_get().fake_mode.shape_env
        found = set()
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            sizes = (list(value.shape) if isinstance(value, torch.Tensor)
                     else [value] if isinstance(value, torch.SymInt) else [])
            for size in sizes:
                if isinstance(size, torch.SymInt):
                    for sym in env.replace(size.node.expr).free_symbols:
                        found |= {src.name for src in env.var_to_sources.get(sym, [])}
        record.append(found)
        return torch._dynamo.lookup_backend(delegate)(gm, example_inputs)
    return backend


def model_pool(models, spec, max_reqs: int):
    """A CPU `KVPool` of ``spec`` for ``models``' shapes, one draft layer."""
    from fa3_spec.eagle import KVPool

    return KVPool(spec, max_reqs=max_reqs, target_layers=models.num_target_layers,
                  draft_layers=1, num_kv_heads=models.num_kv_heads, head_dim=models.head_dim,
                  dtype=models.dtype, device="cpu", draft_attention="branch")


def one_prompt_prefill(models, t: int, page_size: int = 1, bound: Optional[int] = None):
    """One request of ``t`` prompt tokens in a fresh pool of ``models``' shapes:
    ``(pool, slots [t] int64, prefill metadata)``, for a forward over the prompt.
    ``bound`` (default ``t``): the metadata's static query bound, so prompts of
    different lengths up to it share their static metadata."""
    bound = t if bound is None else bound
    spec = fa3_spec.SpecConfig(page_size=page_size, topk=1, num_steps=2, num_draft_tokens=2,
                               max_bs=1, max_context_len=bound + 4)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(1, "branch"))
    pool = model_pool(models, spec, 1)
    row = pool.allocate(t, 1)
    lens = torch.tensor([t])
    md = fa3_spec.build_prefill_metadata(spec, req_to_token=pool.req_to_token,
                                         req_pool_indices=torch.tensor([row]), seq_lens=lens,
                                         extend_seq_lens=lens, max_seqlen_q=bound)
    return pool, pool.req_to_token[row, :t].to(torch.int64), md


def trace_only_backend(graphs: list):
    """A ``torch.compile`` backend that appends each FX graph dynamo hands it to
    ``graphs`` and never runs it: its compiled function returns one empty
    tensor per graph output (for steps whose custom ops have fakes only here,
    such as FA3 on a CPU)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        outputs = len(gm.graph.output_node().args[0])
        return lambda *args: [torch.empty(0)] * outputs

    return backend


def cuda_kernel_names(fn) -> list:
    """The names of the CUDA kernels ``fn()`` launches, in order (the profiler's view)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


#: Words about how the project was made, which no page or report carries.
MAKING_WORDS = [r"\bsessions?\b", r"machine start", r"device tool", r"DEVICE\.md", r"SPEC §",
                r"(?<!sglang )\bissue #?\d+", r"\bCI run of\b", r"\(before\)"]
