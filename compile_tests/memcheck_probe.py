"""Run under ``compute-sanitizer --tool memcheck``; driven by test_gpu_memcheck.py.

    compute-sanitizer --tool memcheck python3 compile_tests/memcheck_probe.py fixed
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python3 compile_tests/memcheck_probe.py prefix-unchecked

Variants (seed configuration: P = 2, topk = 8, 5 steps):

``fixed``
    The whole draft iteration (fa3_spec metadata, tail copies, KV writes,
    FA3, merge), compiled with inductor and captured in a CUDA graph, replayed
    with valid batches and with garbage in every index tensor (request rows,
    lengths, draft slots over the full int64 range), with ``cfg.num_pages``
    set to the KV pool size. memcheck must report 0 errors: whatever the
    inputs hold, nothing reads or writes out of range.
``fixed-expand-kernel``
    ``fixed`` with the tree's expand calls on the expand kernel
    (`fa3_spec.attention.select_expand_kernel`), under the same garbage.
``prefix-eager``
    `UpstreamStyleBuilder(revert_pr_27360=True)` on CUDA, eager: PyTorch's
    ``scatter_`` checks its indices and trips a device-side assert.
``prefix-unchecked``
    The same pre-fix fill, with the scatter compiled by inductor with
    ``assert_indirect_indexing=False``: a kernel that trusts its indices, as
    graph code did when the bug corrupted memory silently. Run it with
    ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so every tensor is its own
    allocation: the last row's overflow then lands past the end of the
    expand table and memcheck can see it (inside a caching-allocator segment,
    or a CUDA-graph pool, the same write hits a neighbour and goes unseen).

Prints one line ``PROBE <variant> done`` when it finishes.
"""

import dataclasses
import sys

import torch

import fa3_spec
from fa3_spec.graphs import capture
from fa3_spec.harness.toy import ToyModel, draft_iteration
from fa3_spec.harness.worlds import make_world
from fa3_spec.harness.upstream import UpstreamStyleBuilder

CFG = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=16, max_bs=4,
                          max_context_len=512)


def fixed(expand_kernel="fa3"):
    fa3_spec.attention.select_expand_kernel(expand_kernel)  # before the compile reads it
    world = make_world(CFG, 4, num_padding=1, seed=0, device="cuda")
    # The KV pool size lets the builders clamp page ids into the pool. Without
    # it, garbage draft slots became garbage page ids and FA3 read wild
    # addresses (258 memcheck errors on the H200, 2026-11-30).
    cfg = dataclasses.replace(CFG, num_pages=world.num_pages)
    model = ToyModel.create(layers=1, num_pages=world.num_pages, page_size=2, num_heads=8,
                            num_kv_heads=2, head_dim=128, device="cuda")
    static = dict(req_pool_indices=world.req_pool_indices.clone(), seq_lens=world.seq_lens.clone(),
                  out_cache_loc=world.out_cache_loc.view(4, CFG.topk, CFG.num_steps).clone(),
                  hidden=torch.randn(4, CFG.topk, model.hidden, device="cuda").bfloat16())
    step = torch.compile(
        lambda **b: draft_iteration(cfg, model, req_to_token=world.req_to_token,
                                    attention_backend="fa3", **b),
        fullgraph=True, backend="inductor")
    graph, out = capture(step, **static)
    for seed in range(4):
        g = torch.Generator(device="cuda").manual_seed(seed)
        if seed:  # garbage over the full int64 range in every index tensor
            for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
                info = torch.iinfo(torch.int64)
                static[name].copy_(torch.randint(info.min, info.max, static[name].shape,
                                                 device="cuda", generator=g))
            if seed == 3:  # and in the engine's own pool
                info = torch.iinfo(torch.int32)
                world.req_to_token.copy_(torch.randint(info.min, info.max, world.req_to_token.shape,
                                                       device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        print(f"replay {seed}: finite={bool(torch.isfinite(out).all())}", flush=True)


def _pre_fix(scatter=None):
    world = make_world(CFG, CFG.max_bs, seed=0, device="cuda")  # full batch: last row is last
    builder = UpstreamStyleBuilder(CFG, "cuda", revert_pr_27360=True, scatter=scatter)
    builder.draft_decode(0, **world.mode_kwargs("draft_decode", draft_attention="branch"))
    torch.cuda.synchronize()


def prefix_unchecked():
    import torch._inductor.config as inductor_config

    inductor_config.assert_indirect_indexing = False
    scatter = torch.compile(lambda t, dim, index, src: t.scatter_(dim, index, src),
                            fullgraph=True, backend="inductor")
    _pre_fix(scatter)


VARIANTS = {"fixed": fixed, "fixed-expand-kernel": lambda: fixed("triton"),
            "prefix-eager": _pre_fix, "prefix-unchecked": prefix_unchecked}

if __name__ == "__main__":
    variant = sys.argv[1]
    VARIANTS[variant]()
    print(f"PROBE {variant} done", flush=True)
