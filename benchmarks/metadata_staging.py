"""Host cost of `CUDAGraphRunner.__call__` beyond the replay itself ("staging").

Per batch size, in one process: the runner call ``runner(**batch)`` against
the replay alone (``runner.graph(bucket).replay()``), host wall time (no sync
inside the timed region, the device drained between samples) and device time
(CUDA events); staging is the difference of the host medians. The zero-copy
path (``runner.replay(bucket, bs)`` after the engine writes
``runner.static_inputs(bucket)``) is timed too, and so are the parts of
staging outside the runner: the signature lookup and three ways to copy the
live rows. The step is the toy 1-layer draft iteration (FA3, 32/8 heads,
D = 128). ``--smoke`` (CPU) uses the "eager" strategy with a no-op step, so
the call time is the runner's own host work.
"""

from __future__ import annotations

import argparse
import json

import torch

import fa3_spec
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner

import runs
import timing

PROG = "metadata.py staging"
HELP = "host cost of a runner call beyond its replay, and its parts"

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _device_us(fn, iters):
    return timing.median_us(timing.event_samples(fn, iters)[1])


def draft_setup(cfg, bs, device):
    """(runner, batch) of the toy 1-layer draft iteration at batch ``bs`` (one bucket)."""
    from fa3_spec.harness.toy import ToyModel, example_batch, make_step, world_batch
    from fa3_spec.harness.worlds import make_world

    world = make_world(cfg, bs, seed=1, device=device)
    heads = (HEADS, KV_HEADS, HEAD_DIM) if device == "cuda" else (4, 2, 16)
    model = ToyModel.create(layers=1, num_pages=world.num_pages, page_size=cfg.page_size,
                            num_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
                            dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(bs, cfg.topk, model.hidden, device=device, generator=g).bfloat16()
    step = make_step("draft_decode", cfg, model, world.req_to_token,
                     attention_backend="fa3" if device == "cuda" else "torch")
    policy = CompilePolicy() if device == "cuda" else CompilePolicy.eager()
    runner = CUDAGraphRunner(step, buckets=[bs], policy=policy,
                             example=lambda n: example_batch("draft_decode", cfg, model, n,
                                                             device=device))
    runner.capture()
    return runner, world_batch("draft_decode", world, hidden)


def staging_row(runner, batch, bs, iters, device):
    """Host medians of the runner call, the replay alone and the zero-copy path."""
    bucket = runner.bucket_for(bs)
    if device == "cuda":
        sync, replay_only = torch.cuda.synchronize, runner.graph(bucket).replay
    else:  # eager strategy: the "replay" is the step itself on the static buffers
        static = runner.static_inputs(bucket)
        sync, replay_only = timing.no_sync, (lambda: runner.compiled_step(**static))
    row = dict(batch=bs, bucket=bucket)
    row["call_host_us"] = timing.host_us(lambda: runner(**batch), iters, sync)
    row["replay_host_us"] = timing.host_us(replay_only, iters, sync)
    row["runner_staging_us"] = round(row["call_host_us"] - row["replay_host_us"], 2)
    if hasattr(runner, "replay"):  # zero-copy: the engine writes the static inputs itself
        row["zero_copy_host_us"] = timing.host_us(lambda: runner.replay(bucket, bs), iters, sync)
        row["zero_copy_staging_us"] = round(row["zero_copy_host_us"] - row["replay_host_us"], 2)
    if device == "cuda":
        row["call_device_us"] = _device_us(lambda: runner(**batch), iters)
        row["replay_device_us"] = _device_us(replay_only, iters)
    row.update(staging_parts(runner, batch, bucket, bs, iters, sync))
    return row


def staging_parts(runner, batch, bucket, bs, iters, sync):
    """Host medians of the pieces of staging, outside the runner: the
    signature lookup, and three ways to copy the live rows (one
    ``_foreach_copy_`` over the mixed-dtype list, one per dtype as the
    runner does, one ``copy_`` per tensor)."""
    static = runner.static_inputs(bucket)
    names = list(static)
    dst = [static[n][:bs] for n in names]
    src = [batch[n] for n in names]
    groups = runner.copy_groups(bucket, bs)  # the runner's own per-dtype groups

    def per_dtype():
        for group in groups:
            torch._foreach_copy_(group.views, [batch[n] for n in group.names])

    def per_tensor():
        for d, x in zip(dst, src):
            d.copy_(x)

    dst_bytes = [d.view(torch.uint8) for d in dst]

    def as_bytes():  # one launch: every pair viewed as uint8 (contiguous sources)
        torch._foreach_copy_(dst_bytes, [x.view(torch.uint8) for x in src])

    return dict(
        inputs=len(names), input_dtypes=len(groups),
        copy_bytes_foreach_us=timing.host_us(as_bytes, iters, sync),
        route_lookup_us=timing.host_us(lambda: runner.route(batch), iters, sync),
        copy_mixed_foreach_us=timing.host_us(lambda: torch._foreach_copy_(dst, src), iters, sync),
        copy_per_dtype_foreach_us=timing.host_us(per_dtype, iters, sync),
        copy_per_tensor_us=timing.host_us(per_tensor, iters, sync))


def smoke_setup(bs, k=4, s=5, hidden=64):
    """(runner, batch): the draft step's input shapes, a no-op step, eager strategy."""
    def example(n):
        return dict(req_pool_indices=torch.zeros(n, dtype=torch.int64),
                    seq_lens=torch.zeros(n, dtype=torch.int64),
                    out_cache_loc=torch.zeros(n, k, s, dtype=torch.int64),
                    hidden=torch.zeros(n, k, hidden, dtype=torch.bfloat16))

    runner = CUDAGraphRunner(lambda **b: b["seq_lens"], example=example, buckets=[bs],
                             policy=CompilePolicy.eager())
    runner.capture()
    batch = {name: torch.ones_like(t) for name, t in example(bs).items()}
    return runner, batch


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="CPU, no-op step, eager strategy")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    rows = []
    for bs in args.batches:
        if args.smoke:
            runner, batch = smoke_setup(bs)
        else:
            cfg = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=16,
                                      max_bs=bs, max_context_len=4096)
            runner, batch = draft_setup(cfg, bs, device)
        row = dict(kind="runner_staging", device=device, **staging_row(runner, batch, bs,
                                                                       args.iters, device))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            runs.write_json(args.json, dict(torch=torch.__version__,
                                            command=runs.command_line(PROG, argv), rows=rows))
    return 0
