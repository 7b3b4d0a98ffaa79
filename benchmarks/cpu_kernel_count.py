"""Inductor kernels and compile time of one draft iteration's metadata, on CPU.

    python3 benchmarks/cpu_kernel_count.py

Compares the per-step builders (prefix once, then `build_draft_decode_metadata`
for each step) with `build_draft_iteration_metadata`, both compiled with
inductor (``fullgraph=True``) and returning every step's metadata. A CPU proxy
only: Triton fuses differently; the H200 figures are in RESULTS.md.
"""

import time

import torch
from torch._inductor import metrics

import fa3_spec
from fa3_spec import builders
from fa3_spec.harness.worlds import make_world

CFG = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=16, max_bs=8,
                          max_context_len=4096)


def per_step(**kw):
    batch = {k: kw[k] for k in ("req_to_token", "req_pool_indices", "seq_lens")}
    prefix = builders.build_draft_prefix_metadata(CFG, **batch)
    return [builders.build_draft_decode_metadata(CFG, s, **kw, prefix=prefix)
            for s in range(CFG.num_steps - 1)]


def together(**kw):
    return builders.build_draft_iteration_metadata(CFG, **kw)


def main():
    kwargs = make_world(CFG, 8, seed=0).mode_kwargs("draft_decode")
    for name, fn in (("per-step builders", per_step), ("build_draft_iteration_metadata", together)):
        torch._dynamo.reset()
        metrics.reset()
        start = time.perf_counter()
        torch.compile(fn, fullgraph=True, backend="inductor")(**kwargs)
        print(f"{name:32s} kernels {metrics.generated_kernel_count:3d}   "
              f"compile {time.perf_counter() - start:5.1f} s")


if __name__ == "__main__":
    main()
