"""`fa3_spec.audit.audit_callable` on sglang 0.5.23's own draft-decode metadata code,
next to fa3_spec's rows for the same job.

Upstream rows run sglang's code from its wheel (``fa3_spec.harness.sglang_upstream``;
nothing of sglang is committed): the module-level
``draft_decode_set_expand_metadata`` (called as the backend calls it, without
its ``torch.compile`` decorator: the audit compiles it), and the replay-time
metadata path (``_apply_cuda_graph_metadata`` of one draft step, and of the
whole draft iteration's step backends). fa3_spec rows: the sglang adapter
filling the same buffers (`fa3_spec.integrations.sglang.draft_decode` and
``draft_iteration``) and `fa3_spec.build_draft_iteration_metadata`.
Configuration: page size 2, topk 8, 5 steps (the #27360 case).

Each row audits the example batch and one variant (another batch of the same
shapes): graph breaks, data-dependent ops, recompiles, writes to inputs that
are not output buffers and parity, and on CUDA host syncs and capture +
replay, each finding with its file and line (sglang's lines are those of
its wheel's ``flashattention_backend.py``).

    python3 benchmarks/audit_upstream.py --device cuda --json audit_upstream.json   # GPU
    TRITON_INTERPRET=1 python3 benchmarks/audit_upstream.py --device cpu           # CPU: no syncs/capture

Exits 2 when sglang's code cannot be had (the reason is printed), else 0: the
rows are a report, whatever they say.
"""

from __future__ import annotations

import argparse
import sys

import torch

import runs


def _subjects(upstream, cfg, device, bs: int):
    """``[(name, fn, example, variant, writable, restore)]``: upstream rows, then fa3_spec's.

    ``restore`` puts every buffer a row fills back to its initial values (the
    fills write live entries only, as sglang's do)."""
    import types

    import fa3_spec
    from fa3_spec.harness.sglang_upstream import DECODE, make_req_to_token, sglang_batch
    from fa3_spec.integrations import sglang as sgl

    g = torch.Generator().manual_seed(0)
    r2t = make_req_to_token(cfg, bs + 2, g, device=device)
    batches = [sglang_batch(cfg, r2t, bs, bs, g) for _ in range(2)]
    kws = [b.inputs("draft_decode") for b in batches]
    step = cfg.num_steps - 2  # the last draft step: the widest expand table
    decode_length = step + 1
    p, k = cfg.page_size, cfg.topk

    def expand_kwargs(kw):  # what _apply_cuda_graph_metadata passes (flashattention_backend.py)
        return dict(
            cache_seqlens_int32=torch.zeros(bs * k, dtype=torch.int32, device=device),
            page_table=torch.zeros(bs * k, decode_length + 1, dtype=torch.int32, device=device),
            last_page_lens=kw["seq_lens"] % p, decode_length=decode_length,
            cache_loc=kw["out_cache_loc"].view(-1, cfg.num_steps)[:, :decode_length],
            topk=k, page_size=p)

    def restorer(groups):
        """In-place reset of every tensor of ``groups`` (dicts of dicts of tensors)."""
        flat = [t for g in groups for d in g.values() for t in d.values()]
        initial = [t.clone() for t in flat]

        def restore():
            for t, v in zip(flat, initial):
                t.copy_(v)
        return restore

    subjects = [("sglang draft_decode_set_expand_metadata",
                 upstream.draft_decode_set_expand_metadata,
                 expand_kwargs(kws[0]), expand_kwargs(kws[1]), ["cache_seqlens_int32", "page_table"],
                 lambda: None)]

    # The draft spec_info the replay path reads, made outside the audited code
    # (it stands for sglang's EagleDraftInput; making it is not sglang's metadata code).
    draft_info = types.SimpleNamespace(is_draft_input=lambda: True)
    one = upstream.compile_backend(cfg, r2t, step=step)

    def sglang_replay_metadata_step(req_pool_indices, seq_lens, out_cache_loc):
        one._apply(DECODE, bs, req_pool_indices, seq_lens, draft_info, out_cache_loc)
        return one.buffers

    every = upstream.draft_backends(cfg, r2t)

    def sglang_replay_metadata_iteration(req_pool_indices, seq_lens, out_cache_loc):
        for b in every:
            b._apply(DECODE, bs, req_pool_indices, seq_lens, draft_info, out_cache_loc)
        return [b.buffers for b in every]

    mine_one = sgl.allocate_buffers(cfg, step=step, device=device)

    def fa3_spec_sglang_draft_decode(req_pool_indices, seq_lens, out_cache_loc):
        sgl.draft_decode(cfg, mine_one, step, req_to_token=r2t, req_pool_indices=req_pool_indices,
                         seq_lens=seq_lens, out_cache_loc=out_cache_loc)
        return mine_one

    mine = [sgl.allocate_buffers(cfg, step=s, device=device) for s in range(cfg.num_steps - 1)]

    def fa3_spec_sglang_draft_iteration(req_pool_indices, seq_lens, out_cache_loc):
        sgl.draft_iteration(cfg, mine, req_to_token=r2t, req_pool_indices=req_pool_indices,
                            seq_lens=seq_lens, out_cache_loc=out_cache_loc)
        return mine

    spec = cfg.spec_config()

    def fa3_spec_build_draft_iteration_metadata(req_pool_indices, seq_lens, out_cache_loc):
        return fa3_spec.build_draft_iteration_metadata(
            spec, req_to_token=r2t, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
            out_cache_loc=out_cache_loc)

    for name, fn, restore in [
            ("sglang replay metadata, draft step", sglang_replay_metadata_step,
             restorer([one.buffers])),
            ("sglang replay metadata, iteration", sglang_replay_metadata_iteration,
             restorer([b.buffers for b in every])),
            ("fa3_spec sglang.draft_decode step", fa3_spec_sglang_draft_decode,
             restorer([mine_one])),
            ("fa3_spec sglang.draft_iteration", fa3_spec_sglang_draft_iteration, restorer(mine)),
            ("fa3_spec build_draft_iteration_metadata", fa3_spec_build_draft_iteration_metadata,
             lambda: None)]:
        subjects.append((name, fn, dict(kws[0]), dict(kws[1]), [], restore))
    return subjects


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--compile-backend", default="aot_eager", help="torch.compile backend")
    parser.add_argument("--bs", type=int, default=4)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--only", nargs="*", help="run only rows whose name contains one of these")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    # First: on CPU this fixes Triton's interpreter mode before anything imports Triton.
    from fa3_spec.harness.sglang_upstream import SGLANG_VERSION, load_upstream_or_reason

    upstream, why = load_upstream_or_reason(device=device)
    if upstream is None:
        print(f"sglang {SGLANG_VERSION}'s code unavailable: {why}", file=sys.stderr)
        return 2
    from fa3_spec.audit import audit_callable, format_table
    from fa3_spec.integrations.sglang import SglangConfig

    cfg = SglangConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=6, max_bs=args.bs,
                       context_len=args.context_len)
    rows = []
    for name, fn, example, variant, writable, restore in _subjects(upstream, cfg, torch.device(device),
                                                          args.bs):
        if args.only and not any(o in name for o in args.only):
            continue
        print(f"auditing {name} ...", flush=True)
        rows.append(audit_callable(fn, example, variants=[variant],
                                   compile_backend=args.compile_backend,
                                   device=device, writable=writable, restore=restore,
                                   name=name))
    print(format_table(rows))
    if device == "cpu":
        print("host syncs and CUDA-graph capture: not measured on CPU")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    torch=torch.__version__, sglang=SGLANG_VERSION, compile_backend=args.compile_backend,
                    config=dict(page_size=2, topk=8, num_steps=5, bs=args.bs,
                                context_len=args.context_len),
                    command=runs.command_line("audit_upstream.py", argv))
        runs.write_json(args.json, dict(meta=meta, rows=[r.to_json() for r in rows]))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
