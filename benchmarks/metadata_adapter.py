"""The sglang adapter as a drop-in for a draft iteration's replay-time
metadata, against sglang 0.5.23's own code.

sglang prepares the metadata of a whole topk > 1 draft iteration on the host
before each replay: ``FlashAttentionMultiStepBackend`` calls
``_apply_cuda_graph_metadata`` of each of the ``num_steps - 1`` step backends.
The adapter fills the same buffers with
`fa3_spec.integrations.sglang.draft_iteration`, compiled once and captured as
one CUDA graph; a replay is the input copy plus ``graph.replay()``. Both run
here, in one process, on the same batches, sglang's from its own code
(`fa3_spec.harness.sglang_upstream`; ``FA3_SPEC_SGLANG_SRC`` offline), and
every buffer is compared bitwise before anything is timed. Per batch size:
host time per iteration (the Python call, no sync) and wall time (call +
synchronize), medians, and their ratios. ``--smoke``: CPU, tiny, every code
path, no timing value. Exit 2 when sglang's code cannot be had, 1 when
parity fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

from fa3_spec.graphs import compile_fullgraph
from fa3_spec.harness.sglang_upstream import (
    SGLANG_VERSION, load_upstream_or_reason, make_req_to_token, sglang_batch,
)
from fa3_spec.integrations import sglang as sgl

import runs
import timing

PROG = "metadata.py adapter"
HELP = "the sglang adapter's graph against sglang's own replay-time metadata functions"


def _host_wall_us(fn, iters, sync):
    host, wall = timing.samples(fn, iters, sync)
    return timing.median_us(host), timing.median_us(wall)


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        sorted(a[k]) == sorted(b[k]) and all(torch.equal(a[k][n], b[k][n]) for n in a[k])
        for k in a)


def run_row(upstream, cfg, bs, iters, device, smoke):
    """Parity of the two fills at batch ``bs``, then their host and wall µs per iteration."""
    g = torch.Generator().manual_seed(bs)
    r2t = make_req_to_token(cfg, bs + 2, g, device=device)
    batches = [sglang_batch(cfg, r2t, bs, bs, g) for _ in range(2)]
    kws = [b.inputs("draft_decode") for b in batches]
    steps = range(cfg.num_steps - 1)

    backends = upstream.draft_backends(cfg, r2t)
    mine = [sgl.allocate_buffers(cfg, step=s, device=device) for s in steps]

    def upstream_iteration(kw):
        for b in backends:
            b.draft_decode(**kw)

    # The adapter's graph reads static inputs; a replay copies the batch in
    # (as sglang's runner copies into its own buffers), then replays.
    static = {k: v.clone() for k, v in kws[0].items()}

    def adapter_iteration():
        sgl.draft_iteration(cfg, mine, req_to_token=r2t, **static)

    # smoke: tracing only, as the other smoke runs; the aot_eager compile of the same fill
    # (bitwise against eager) is test_sglang_adapter.py's compile test.
    compiled = compile_fullgraph(adapter_iteration,
                                 compile_backend="eager" if smoke else "inductor")
    if device.type == "cuda":
        from fa3_spec.graphs import capture

        graph, _ = capture(compiled)
        run_adapter = graph.replay
    else:
        run_adapter = compiled

    def adapter_replay(kw):
        for k, v in kw.items():
            static[k].copy_(v)
        run_adapter()

    # Parity first: same inputs, same starting buffers, every buffer bitwise.
    parity = True
    for kw in kws:
        for up, buf in zip(backends, mine):
            for key, group in up.buffers.items():
                for name, t in group.items():
                    buf[key][name].copy_(t)
        upstream_iteration(kw)
        adapter_replay(kw)
        parity &= all(_equal(buf, up.buffers) for up, buf in zip(backends, mine))

    sync = timing.synchronizer(device)
    up_host, up_wall = _host_wall_us(lambda: upstream_iteration(kws[1]), iters, sync)
    ad_host, ad_wall = _host_wall_us(lambda: adapter_replay(kws[1]), iters, sync)
    return dict(
        bs=bs, page_size=cfg.page_size, topk=cfg.topk, num_steps=cfg.num_steps,
        context_len=cfg.context_len, parity=bool(parity), iters=iters,
        upstream_host_us=up_host, upstream_wall_us=up_wall,
        adapter_host_us=ad_host, adapter_wall_us=ad_wall,
        host_ratio=up_host / ad_host, wall_ratio=up_wall / ad_wall,
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny, no meaningful timing")
    ap.add_argument("--bs", type=int, nargs="*", default=[1, 8, 32, 64])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--context-len", type=int, default=4096)
    ap.add_argument("--json", help="write the rows here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.bs, args.iters, args.context_len = [1, 3], 2, 64
    upstream, why = load_upstream_or_reason(device=device, compile_expand=not args.smoke)
    if upstream is None:
        print(f"sglang {SGLANG_VERSION}'s code unavailable: {why}", file=sys.stderr)
        return 2
    cfg = sgl.SglangConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=6,
                           max_bs=max(args.bs), context_len=args.context_len)
    meta = dict(device=runs.device_name(device.type), torch=torch.__version__,
                sglang=SGLANG_VERSION, smoke=args.smoke, command=runs.command_line(PROG, argv))
    rows = []
    for bs in args.bs:
        row = run_row(upstream, cfg, bs, args.iters, device, args.smoke)
        rows.append(row)
        print(f"bs {bs:4d}  parity {row['parity']}  upstream host {row['upstream_host_us']:8.1f} us"
              f"  wall {row['upstream_wall_us']:8.1f} us | adapter graph host "
              f"{row['adapter_host_us']:7.1f} us  wall {row['adapter_wall_us']:7.1f} us | "
              f"ratio host {row['host_ratio']:5.1f}x  wall {row['wall_ratio']:5.1f}x", flush=True)
        if args.json:
            runs.write_json(args.json, dict(meta=meta, rows=rows))
    return 0 if all(r["parity"] for r in rows) else 1
