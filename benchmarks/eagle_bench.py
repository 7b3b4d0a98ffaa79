"""End-to-end EAGLE loop: metadata in the graph vs host-built metadata vs no speculation.

For each config (page size, topk, num_steps, num_draft_tokens) and batch, in
one process, over the same prefilled requests (``--context`` prompt tokens):

  a  this loop: the whole iteration (draft steps, tree, verify, accept,
     commit, draft extend, output) is one CUDA graph, its metadata built
     inside by fa3_spec builders (`fa3_spec.eagle.eagle_iteration`).
  b  the same loop with every step's metadata filled on the host before each
     replay: the iteration is three graphs (draft phase, verify + accept +
     commit, extend + output) because verify needs the drafted tree and
     extend the accepted lengths. ``--upstream`` picks the filler; every row
     says which in ``b_metadata_source``:
       "sglang-0.5.23 replay functions" (``sglang``; ``auto`` when it loads):
         sglang's own ``FlashAttentionBackend._apply_cuda_graph_metadata``
         (one backend per draft step, one target, one draft extend; run via
         `fa3_spec.harness.sglang_upstream`, its Triton kernels native on
         CUDA) fills sglang's own buffers, and the captured phases read
         `fa3_spec.integrations.sglang.metadata_views` of those buffers, as
         sglang's FA3 calls do; the flat tree-verify ``custom_mask`` is built
         on the device, sized from host ``seq_lens`` (one sync);
       "fa3_spec upstream-style model" (``model``; ``auto`` otherwise, with
         ``b_metadata_note`` saying why): `UpstreamStyleBuilder`, the
         project's model of upstream (``.item()`` syncs, in-place buffers,
         the flat custom mask), its metadata copied into static buffers.
  c  plain greedy decoding without speculation: one decode step (metadata +
     target + argmax) per graph replay.

Random weights accept almost nothing, so by default acceptance is SCRIPTED:
each iteration emits a fixed sequence of token counts (3, 4, 2, 5, 3, 4; mean
3.5) whatever the models say. Every row says so (``acceptance``); its tokens
are not the model's. ``--real-acceptance`` uses greedy acceptance instead.

Per row: tokens/s, ms per iteration (wall, synced), host CPU time per
iteration (``time.process_time``), host syncs per iteration
(``torch.cuda.set_sync_debug_mode``), GPU idle share inside an iteration
(profiler: 1 - union of GPU activity / span from first to last GPU activity).

    python3 benchmarks/eagle_bench.py --json benchmarks/results/eagle_h200.json
    python3 benchmarks/eagle_bench.py --configs 2,8,5,16 --append --json ...   # one config more
    python3 benchmarks/eagle_bench.py --smoke --json /tmp/eagle_smoke.json   # CPU, tiny

``--smoke`` runs every code path on CPU with the tiny preset (eager calls
instead of graphs; timings meaningless; sglang's kernels in Triton's
interpreter) and checks that (a) and (b) produce the same tokens and the
same whole loop state, and that (b)'s metadata read, query by query, the
keys fa3_spec's builders read (``b_metadata_mismatches``).

Offline (the H200): ``FA3_SPEC_SGLANG_SRC=$PWD/.sglang_src`` names sglang's
extracted sources (see `fa3_spec.harness.sglang_upstream.SOURCE_FILES`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from functools import partial

import torch
import torch.utils._pytree as pytree

import fa3_spec
from fa3_spec.eagle import Eagle3Draft, EagleEngine, LoopConfig, make_models
from fa3_spec.eagle.decode import decode_step
from fa3_spec.eagle.vocab import vocab_argmax
from fa3_spec.eagle.engine import COMPILE_BACKENDS
from fa3_spec.eagle.iteration import (
    DEFAULT_SCRIPT, draft_phase, draft_slots, extend_phase, verify_phase,
)
from fa3_spec import SpecBatch
from fa3_spec.graphs import capture, compile_fullgraph
from fa3_spec.probes import recording_host_syncs
from fa3_spec.harness.upstream import UpstreamStyleBuilder
from fa3_spec.harness.sglang_upstream import SGLANG_VERSION, load_upstream_or_reason
from fa3_spec.integrations import sglang

import timing
from loop_setup import loop_config, random_prompts

#: (page_size, topk, num_steps, num_draft_tokens): a chain, a small tree, and the
#: #27360 shape (P = 2, topk = 8, 5 steps, 16 draft tokens).
CONFIGS = [(16, 1, 5, 6), (16, 4, 5, 8), (2, 8, 5, 16)]
BATCHES = [1, 8, 32, 64]
SGLANG_SOURCE = f"sglang-{SGLANG_VERSION} replay functions"
MODEL_SOURCE = "fa3_spec upstream-style model"


def compiled(fn, backend: str):
    """``fn`` compiled as the engine compiles (a) (``"none"``: as is), so that
    (a), (b) and (c) run the same compiled model."""
    if backend == "none":
        return fn
    return compile_fullgraph(fn, backend=backend, dynamic=False)


class Segment:
    """``fn()`` captured as a CUDA graph (replay), or called directly on CPU.

    ``out`` holds the outputs at fixed addresses after each run."""

    def __init__(self, fn, graphs: bool, pool=None, backend: str = "none"):
        fn = compiled(fn, backend)
        self.fn, self.graphs = fn, graphs
        if graphs:
            self.graph, self.out = capture(fn, pool=pool)
        else:
            self.out = fn()

    def run(self):
        if self.graphs:
            self.graph.replay()
        else:
            fresh = self.fn()
            pytree.tree_map(lambda d, s: d.copy_(s), self.out, fresh)


def _static_clone(md):
    return pytree.tree_map(lambda t: t.clone(), md)


def flat_custom_mask(tree_mask: torch.Tensor, seq_lens_host: list) -> torch.Tensor:
    """Upstream's flat verify mask built on the device (sizes from host seq_lens)."""
    n = tree_mask.shape[-1]
    dev = tree_mask.device
    seq = torch.tensor(seq_lens_host, dtype=torch.int64, device=dev)
    row_len = seq + n
    sizes = n * row_len
    total = int(sum(n * (s + n) for s in seq_lens_host))
    b = torch.repeat_interleave(torch.arange(len(seq_lens_host), device=dev), sizes,
                                output_size=total)
    start = torch.cumsum(sizes, 0) - sizes
    off = torch.arange(total, device=dev) - start[b]
    j, col = off // row_len[b], off % row_len[b]
    draft = tree_mask[b, j, (col - seq[b]).clamp(min=0, max=n - 1)]
    return torch.where(col < seq[b], True, draft)


class HostMetadataLoop:
    """Variant (b): three captured phases reading static metadata the host refills
    before each replay. This class: the upstream-style model's metadata copied into
    static clones (`SglangMetadataLoop`: sglang's own functions filling its buffers)."""

    source = MODEL_SOURCE

    def __init__(self, engine: EagleEngine, bucket: int, graphs: bool):
        self.eng, self.bucket = engine, bucket
        lc, pool = engine.lc, engine.pool
        self.lc, self.spec = lc, lc.spec
        self.view = engine.bucket_state(bucket)
        be = engine.compile_backend
        st, m, r2t = self.view, engine.iteration_models, pool.req_to_token
        n = lc.spec.num_draft_tokens
        tree_mask = torch.tril(torch.ones(bucket, n, n, dtype=torch.bool, device=engine.device))
        # Static metadata (values refilled before each replay), valid for the capture.
        self.md_draft, self.md_verify, self.md_extend = self._static_metadata(
            self._batch(), self._draft_slots(), tree_mask)
        saved = {k: v.clone() for k, v in st.items()}
        st["seq_lens"].zero_()  # capture on padding rows: nothing real is written
        gpool = torch.cuda.graph_pool_handle() if graphs else None
        self.a = Segment(lambda: draft_phase(lc, m, pool.draft_kv, r2t, st, self.md_draft),
                         graphs, gpool, be)
        self.b = Segment(lambda: verify_phase(lc, m, pool.target_kv, r2t, st, self.a.out,
                                              self.md_verify), graphs, gpool, be)

        def extend_and_store():
            new = extend_phase(lc, m, pool.draft_kv, r2t, st, self.a.out, self.b.out,
                               self.md_extend)
            for k, buf in st.items():
                buf.copy_(new[k])
            return {}

        self.c = Segment(extend_and_store, graphs, gpool, be)
        for k, v in st.items():
            v.copy_(saved[k])

    def _batch(self) -> dict:
        st = self.view
        return dict(req_to_token=self.eng.pool.req_to_token,
                    req_pool_indices=st["req_pool_indices"], seq_lens=st["seq_lens"])

    def _draft_slots(self) -> torch.Tensor:
        return draft_slots(self.lc, SpecBatch.create(self.spec, **self._batch()).view())

    def _static_metadata(self, batch, loc, tree_mask):
        spec = self.spec
        self.ref = UpstreamStyleBuilder(spec, self.eng.device)
        st = self.view
        return (_static_clone(fa3_spec.build_draft_iteration_metadata(spec, **batch, out_cache_loc=loc)),
                _static_clone(fa3_spec.build_target_verify_metadata(
                    spec, **batch, tree_mask=None if spec.topk == 1 else tree_mask)),
                _static_clone(fa3_spec.build_draft_extend_metadata(
                    spec, **batch, extend_seq_lens=torch.ones_like(st["seq_lens"]))))

    def fill_draft(self, batch, loc):
        fresh = [self.ref.draft_decode(i, **batch, out_cache_loc=loc)
                 for i in range(self.spec.num_steps - 1)]
        timing.copy_leaves(self.md_draft, tuple(fresh))

    def fill_verify(self, batch, tree_mask):
        if self.spec.topk == 1:
            verify = self.ref.target_verify(**batch)
        else:
            seq_host = batch["seq_lens"].tolist()  # host sync, as upstream engines hold seq_lens on the CPU
            verify = self.ref.target_verify(**batch, custom_mask=flat_custom_mask(tree_mask, seq_host))
        timing.copy_leaves(self.md_verify, verify)

    def fill_extend(self, batch, new_seq_lens, extend_seq_lens):
        ext = self.ref.draft_extend(req_to_token=batch["req_to_token"],
                                    req_pool_indices=batch["req_pool_indices"],
                                    seq_lens=new_seq_lens, extend_seq_lens=extend_seq_lens)
        timing.copy_leaves(self.md_extend, ext)

    def iteration(self):
        batch = self._batch()
        self.fill_draft(batch, self._draft_slots())
        self.a.run()
        self.fill_verify(batch, self.a.out["tree_mask"])
        self.b.run()
        self.fill_extend(batch, self.b.out["new_seq_lens"], self.b.out["extend_seq_lens"])
        self.c.run()


class SglangMetadataLoop(HostMetadataLoop):
    """Variant (b) on sglang 0.5.23's own replay functions.

    One ``FlashAttentionBackend`` per draft step (sglang's multi-step draft
    backend), one for the target, one for draft extend, each with the buffers
    of its ``init_cuda_graph_state``. Before each phase's replay the host calls
    that backend's ``_apply_cuda_graph_metadata`` (`fa3_spec.harness.
    sglang_upstream`; the sync-free path, ``seq_lens_cpu=None``), which fills
    its buffers in place; the captured phases read `metadata_views` of those
    buffers, as sglang's FA3 calls do: no copy sglang would not make.

    Padding rows: the loop's are ``seq_len = 0`` (finished requests, anywhere
    in the bucket); sglang never pads with 0, so they reach its functions with
    its padding ``seq_len = 1`` (``SglangConfig.pad_seq_len``) and their
    request index unchanged: they read one key of a pool row and write nothing
    (the loop writes by its own state, where they stay at 0). The flat
    tree-verify mask is built over those same lengths, every row counted real
    (``num_real_rows = bucket``). Not reproduced: sglang re-runs the draft-extend
    metadata kernel inside its graph (equal values); (b) only fills out of graph.
    """

    def __init__(self, engine: EagleEngine, bucket: int, graphs: bool, upstream):
        self.upstream = upstream
        super().__init__(engine, bucket, graphs)

    @property
    def source(self):
        return SGLANG_SOURCE

    def _sglang_lens(self, seq_lens):
        return torch.where(seq_lens > 0, seq_lens, self.cfg.pad_seq_len)

    def _static_metadata(self, batch, loc, tree_mask):
        spec, up, r2t = self.spec, self.upstream, batch["req_to_token"]
        self.cfg = sglang.SglangConfig(
            page_size=spec.page_size, topk=spec.topk, num_steps=spec.num_steps,
            num_draft_tokens=spec.num_draft_tokens, max_bs=self.bucket,
            context_len=spec.max_context_len)
        self.draft = [up.backend(self.cfg, r2t, step=i) for i in range(spec.num_steps - 1)]
        self.target = up.backend(self.cfg, r2t, is_draft_runner=False)
        self.extend = up.backend(self.cfg, r2t)
        # Fill once on the live state (valid values while capturing), as sglang does.
        self.fill_draft(batch, loc)
        self.fill_verify(batch, tree_mask)
        self.fill_extend(batch, batch["seq_lens"], torch.ones_like(batch["seq_lens"]))
        views = partial(sglang.metadata_views, self.cfg, bs=self.bucket)
        return (tuple(views(be.buffers, "draft_decode", step=i) for i, be in enumerate(self.draft)),
                views(self.target.buffers, "target_verify"),
                views(self.extend.buffers, "draft_extend"))

    def fill_draft(self, batch, loc):
        seq = self._sglang_lens(batch["seq_lens"])
        for be in self.draft:
            be.draft_decode(req_pool_indices=batch["req_pool_indices"], seq_lens=seq,
                            out_cache_loc=loc.reshape(-1))

    def fill_verify(self, batch, tree_mask):
        seq = self._sglang_lens(batch["seq_lens"])
        mask = None
        if self.spec.topk > 1:  # sglang's flat custom mask; its size needs host seq_lens (a sync)
            mask = flat_custom_mask(tree_mask, seq.tolist())
        self.target.target_verify(req_pool_indices=batch["req_pool_indices"], seq_lens=seq,
                                  custom_mask=mask, num_real_rows=self.bucket)

    def fill_extend(self, batch, new_seq_lens, extend_seq_lens):
        self.extend.draft_extend(req_pool_indices=batch["req_pool_indices"],
                                 seq_lens=self._sglang_lens(new_seq_lens),
                                 extend_seq_lens=extend_seq_lens)


def metadata_reads_as_builders(host: HostMetadataLoop) -> list:
    """Smoke check: refill (b)'s metadata on the current state; the modes whose
    static metadata read other keys (per query) than fa3_spec's builders' ([] if none).
    The tiny models' tokens barely depend on the draft's attention; this does."""
    from fa3_spec.harness.oracle import key_slots_read

    spec, batch, loc = host.spec, host._batch(), host._draft_slots()
    tree = host.a.out["tree_mask"]
    ones = torch.ones_like(batch["seq_lens"])
    host.fill_draft(batch, loc)
    host.fill_verify(batch, tree)
    host.fill_extend(batch, batch["seq_lens"], ones)
    want = dict(
        draft=fa3_spec.build_draft_iteration_metadata(spec, **batch, out_cache_loc=loc),
        verify=fa3_spec.build_target_verify_metadata(
            spec, **batch, tree_mask=None if spec.topk == 1 else tree),
        extend=fa3_spec.build_draft_extend_metadata(spec, **batch, extend_seq_lens=ones))
    got = dict(draft=host.md_draft, verify=host.md_verify, extend=host.md_extend)
    q = dict(draft=host.bucket * spec.topk, verify=host.bucket * spec.num_draft_tokens,
             extend=host.bucket)
    bad = []
    for mode in want:
        w = want[mode] if mode == "draft" else (want[mode],)
        g = got[mode] if mode == "draft" else (got[mode],)
        if any(key_slots_read(a, q[mode]) != key_slots_read(b, q[mode]) for a, b in zip(g, w)):
            bad.append(mode)
    return bad


def greedy_segment(engine: EagleEngine, bucket: int, graphs: bool):
    """Variant (c): one plain decode step (`fa3_spec.eagle.decode.decode_step`)
    of the target over the same requests, compiled as (a) is."""
    m, pool, spec = engine.iteration_models, engine.pool, engine.spec
    st = engine.bucket_state(bucket)
    tok = st["root"].clone()
    seq = st["seq_lens"].clone()
    rpi = st["req_pool_indices"].clone()

    def step():
        logits = decode_step(m, spec, pool.target_kv, pool.req_to_token, rpi, seq, tok,
                             backend=engine.lc.backend, num_splits=engine.lc.num_splits)
        tok.copy_(vocab_argmax(logits))
        seq.copy_(torch.where(seq > 0, seq + 1, 0))
        return {}

    saved = seq.clone()
    seq.zero_()
    seg = Segment(step, graphs, backend=engine.compile_backend)
    seq.copy_(saved)
    return seg, seq


def _count_syncs(fn, cuda: bool):
    if not cuda:
        fn()
        return None
    with recording_host_syncs() as syncs:
        fn()
    return len(syncs)


def _gpu_idle(fn, cuda: bool, reps: int = 3):
    """Median over ``reps`` runs of 1 - busy / span of GPU activity in one
    ``fn()`` (`idle_breakdown.breakdown` of its profile)."""
    if not cuda:
        return None
    from idle_breakdown import breakdown, profile_events

    shares = []
    for _ in range(reps):
        r = breakdown(profile_events(fn, 1, cpu=False))
        if r["ops"]:
            shares.append(1 - r["busy_us"] / r["span_us"] if r["span_us"] > 0 else 0.0)
    return round(sorted(shares)[len(shares) // 2], 4) if shares else None


def _measure(fn, tokens_fn, iters: int, cuda: bool) -> dict:
    """Time ``iters`` calls of ``fn`` (one iteration each)."""
    for _ in range(2):
        fn()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = tokens_fn()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    sync()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    tokens = tokens_fn() - t0
    return dict(ms_per_iteration=round(1e3 * wall / iters, 4),
                host_cpu_ms_per_iteration=round(1e3 * cpu / iters, 4),
                tokens_per_s=round(tokens / wall, 2), tokens=int(tokens),
                host_syncs_per_iteration=_count_syncs(fn, cuda), gpu_idle_share=_gpu_idle(fn, cuda))


def _fields(w) -> list:
    """A weights dataclass's fields, the tensors themselves (``dataclasses.astuple``
    would deep-copy them: gigabytes on the device)."""
    return [getattr(w, f.name) for f in dataclasses.fields(w)]


def forward_bytes(models, batch: int, context: int) -> dict:
    """Bytes one forward must read: ``target`` (every layer's matrices, the
    final norm and the lm_head, plus its K/V at ``context`` for ``batch``
    requests) and ``draft`` (the draft layer, ``fc``, norm and the lm_head,
    read again by every draft forward, plus one layer's K/V)."""
    t, d = models.target, models.draft
    size = lambda ts: sum(x.numel() * x.element_size() for x in ts if x is not None)  # noqa: E731
    layer = lambda w: size(_fields(w))  # noqa: E731
    kv_layer = 2 * batch * context * models.num_kv_heads * models.head_dim * t.embed.element_size()
    target = sum(layer(w) for w in t.layers) + size([t.norm, t.lm_head]) + t.shape.num_layers * kv_layer
    draft = layer(d.layer) + size([d.fc, d.norm, d.lm_head]) + kv_layer
    return dict(target=target, draft=draft)


def forward_flops(models, spec, batch: int, context: int) -> dict:
    """Matmul FLOPs of one (a) iteration and of one (c) decode step at
    ``batch`` requests of ``context`` keys, counted as the compiled graphs
    run them (padding rows included): ``2 * in * out`` per token and weight
    matrix, ``4 * keys * H_q * D`` per query and layer for attention.

    (a): the target verify over ``B * N`` tokens (lm_head included); each of
    the ``S - 1`` draft decode steps over ``B * K`` leaves (the draft layer,
    the lm_head, and ``fc`` where the draft applies it on every forward, as
    EAGLE-1's does; EAGLE-3's applies it once, in ``draft_input``); the draft
    extend over its ``B * N`` query rows (layer and ``fc``) and the lm_head of
    the ``B`` last rows. (c): ``B`` tokens through the target. The matmul
    count is exact (tested against ``FlopCounterMode``); the attention term is
    an estimate: every query over ``context`` keys (``context + S`` in a draft
    step), ignoring the tree's own keys and the growth of ``seq_len``.
    """
    t, d = models.target, models.draft
    sh = t.shape

    def mats(ws):
        return sum(2 * w.shape[0] * w.shape[1] for w in ws
                   if isinstance(w, torch.Tensor) and w.dim() == 2)

    def attn(keys):
        return 4 * keys * sh.num_heads * sh.head_dim

    layer = lambda w: mats(_fields(w))  # noqa: E731
    target_tok = sum(layer(w) for w in t.layers) + mats([t.lm_head])
    fc = mats([d.fc])
    draft_body = layer(d.layer) + (0 if isinstance(d, Eagle3Draft) else fc)
    extend_body = layer(d.layer) + fc
    draft_head = mats([d.lm_head])
    n, k, s = spec.num_draft_tokens, spec.topk, spec.num_steps
    a_mm = (batch * n * target_tok + (s - 1) * batch * k * (draft_body + draft_head)
            + batch * n * extend_body + batch * draft_head)
    a_attn = (batch * n * sh.num_layers * attn(context) + (s - 1) * batch * k * attn(context + s)
              + batch * n * attn(context))
    c_mm, c_attn = batch * target_tok, batch * sh.num_layers * attn(context)
    return dict(a=a_mm + a_attn, c=c_mm + c_attn, a_matmul=a_mm, c_matmul=c_mm)


def bench_point(cfg_tuple, batch, args, models, bandwidth=None, tflops=None) -> dict:
    p, k, s, n = cfg_tuple
    cuda = args.device == "cuda"
    scripted = None if args.real_acceptance else DEFAULT_SCRIPT
    total_iters = 2 + args.iters + 1 + 3 + 3  # warm-up, timed, sync count, profiler
    max_new = args.max_new_tokens or 2 * (total_iters * min(n, s + 1) + 8)
    # Branch semantics: (b) fills sglang's metadata, which drafts that way.
    lc = loop_config(cfg_tuple, batch=batch, context=args.context, max_new=max_new,
                     draft_attention="branch", backend=args.backend, scripted=scripted)
    spec = lc.spec
    eng = EagleEngine(lc, models, max_reqs=batch, buckets=[batch], graphs=cuda,
                      compile_backend=args.compile, compile_regions=args.compile_regions,
                      device=args.device)
    t0 = time.perf_counter()
    for prompt in random_prompts(batch, args.context, models.vocab_size, seed=batch):
        eng.submit(prompt, max_new)
    eng.admit()  # prefill every request (eager)
    if cuda:
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    st = eng.bucket_state(batch)
    snapshot = {key: v.clone() for key, v in st.items()}
    kv = (eng.pool.target_kv.k.clone(), eng.pool.target_kv.v.clone(),
          eng.pool.draft_kv.k.clone(), eng.pool.draft_kv.v.clone()) if args.smoke else None

    def restore():
        for key, v in st.items():
            v.copy_(snapshot[key])
        if kv is not None:
            for dst, src in zip((eng.pool.target_kv.k, eng.pool.target_kv.v,
                                 eng.pool.draft_kv.k, eng.pool.draft_kv.v), kv):
                dst.copy_(src)

    out_tokens = lambda: float(st["out_len"].sum())  # noqa: E731 (a sync, outside the timed loop)
    row = dict(page_size=p, topk=k, num_steps=s, num_draft_tokens=n, batch=batch,
               draft_attention=lc.draft_attention,
               context=args.context, compile=eng.compile_backend,
               compile_regions=eng.compile_regions,
               acceptance=("scripted:" + ",".join(map(str, DEFAULT_SCRIPT)) if scripted else "real"),
               preset=args.preset, layers=models.num_target_layers,
               draft_layers=models.num_draft_layers, dtype=str(models.dtype).replace("torch.", ""),
               prefill_s=round(prefill_s, 3))

    # (a) metadata in the graph: the engine's own compiled, captured iteration.
    t0 = time.perf_counter()
    eng.capture()
    row["capture_a_s"] = round(time.perf_counter() - t0, 2)
    restore()
    a = _measure(lambda: eng.launch(batch), out_tokens, args.iters, cuda)
    row["a_in_graph"] = a
    a_state = {key: v.clone() for key, v in st.items()}
    restore()

    # (b) host-built metadata, three graphs of the same compiled model.
    t0 = time.perf_counter()
    host = (SglangMetadataLoop(eng, batch, cuda, args.upstream_code) if args.upstream_code
            else HostMetadataLoop(eng, batch, cuda))
    row["capture_b_s"] = round(time.perf_counter() - t0, 2)
    restore()
    b = _measure(host.iteration, out_tokens, args.iters, cuda)
    row["b_host_metadata"] = b
    row["b_metadata_source"] = host.source
    if args.upstream_note:
        row["b_metadata_note"] = args.upstream_note
    if args.smoke:
        row["a_equals_b"] = bool(torch.equal(a_state["out_tokens"], st["out_tokens"]))
        # The whole loop state (draft features, candidate scores, ...), bitwise:
        # the same attention calls on the same keys give the same floats on CPU.
        row["a_state_equals_b"] = sorted(k for k, v in st.items() if not torch.equal(a_state[k], v)) or True
        row["b_metadata_mismatches"] = metadata_reads_as_builders(host)
    restore()

    # (c) plain greedy decoding, the same compiled model.
    seg, seq = greedy_segment(eng, batch, cuda)
    c = _measure(seg.run, lambda: float(seq.sum()), args.iters, cuda)
    row["c_greedy"] = c
    restore()

    # Flat per-row fields (loop_h200.json); floors from the bytes each forward reads.
    row.update(a_ms_per_iteration=a["ms_per_iteration"], a_gpu_idle=a["gpu_idle_share"],
               a_tokens_per_s=a["tokens_per_s"], c_ms_per_token=c["ms_per_iteration"],
               c_tokens_per_s=c["tokens_per_s"],
               a_over_c=round(a["tokens_per_s"] / c["tokens_per_s"], 3))
    if host.source == SGLANG_SOURCE:  # only sglang's own code is a (b)
        row.update(b_ms_per_iteration=b["ms_per_iteration"], b_source=f"sglang-{SGLANG_VERSION}",
                   a_over_b=round(a["tokens_per_s"] / b["tokens_per_s"], 3))
    else:
        row["model_b_over_a_ms"] = round(b["ms_per_iteration"] / a["ms_per_iteration"], 3)
    if bandwidth:
        nbytes = forward_bytes(models, batch, args.context)
        a_floor = (nbytes["target"] + s * nbytes["draft"]) / (bandwidth * 1e12) * 1e3
        c_floor = nbytes["target"] / (bandwidth * 1e12) * 1e3
        row.update(read_bandwidth_TBps=bandwidth, a_floor_ms=round(a_floor, 4), a_over_floor=round(a["ms_per_iteration"] / a_floor, 3),
                   c_floor_ms=round(c_floor, 4),
                   c_roofline_frac=round(c_floor / c["ms_per_iteration"], 4))
    flops = forward_flops(models, spec, batch, args.context)
    row.update(a_gflop=round(flops["a"] / 1e9, 1), c_gflop=round(flops["c"] / 1e9, 1))
    if tflops:
        # Which roof binds the row: the larger of the two floors.
        a_compute = flops["a"] / (tflops * 1e12) * 1e3
        c_compute = flops["c"] / (tflops * 1e12) * 1e3
        row.update(matmul_TFLOPs=tflops, a_compute_floor_ms=round(a_compute, 4),
                   c_compute_floor_ms=round(c_compute, 4))
        if bandwidth:
            row.update(a_bound="compute" if a_compute > row["a_floor_ms"] else "bandwidth",
                       c_bound="compute" if c_compute > row["c_floor_ms"] else "bandwidth")
    return row


def capture_timing(args) -> dict:
    """Cold compile + capture of an engine with ``args.capture_buckets`` in a
    fresh process (its own empty inductor cache), then a restart: another
    fresh process that loads the first one's ``cache_path`` file."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "eagle.cache")
        for phase in ("cold", "restart"):
            cmd = [sys.executable, os.path.abspath(__file__), "--capture-child", cache,
                   "--preset", args.preset, "--compile", args.compile, "--context", str(args.context),
                   "--capture-buckets", *map(str, args.capture_buckets)]
            if args.num_layers:
                cmd += ["--num-layers", str(args.num_layers)]
            if args.compile_regions is not None:
                cmd += ["--compile-regions" if args.compile_regions else "--no-compile-regions"]
            out[phase] = timing.fresh_process_row(cmd, os.path.join(tmp, f"inductor-{phase}"),
                                                  f"capture {phase}")
            print(f"capture {phase}: {out[phase]}", flush=True)
    return out


def capture_child(args) -> int:
    """One process: build the engine of `capture_timing` and time its capture."""
    models = make_models(args.preset, draft="random", device="cuda", num_layers=args.num_layers)
    p, k, s, n = CONFIGS[-1]
    buckets = sorted(args.capture_buckets)
    spec = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=n,
                               max_bs=buckets[-1], max_context_len=args.context + 64)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(buckets[-1]))
    lc = LoopConfig(spec, max_new_tokens=32, backend="fa3", draft_attention="branch")
    eng = EagleEngine(lc, models, buckets=buckets, compile_backend=args.compile, device="cuda",
                      cache_path=args.capture_child, compile_regions=args.compile_regions)
    t0 = time.perf_counter()
    per_bucket = eng.capture()
    total = time.perf_counter() - t0
    frames = eng.runner.compile_counter.frame_count
    print(json.dumps(dict(seconds=round(total, 2), frames=frames, config=list(CONFIGS[-1]),
                          per_bucket={str(b): round(x, 2) for b, x in per_bucket.items()})))
    return 0


def _resolve_upstream(args):
    """``(UpstreamSglang or None, note)`` for ``--upstream``; before anything imports
    Triton (on CPU sglang's kernels need Triton's interpreter mode)."""
    if args.upstream == "model":
        return None, ""
    # As sglang runs it: draft_decode_set_expand_metadata under torch.compile(dynamic=True)
    # (eager in the CPU smoke run, as the other benchmarks do).
    up, why = load_upstream_or_reason(device=args.device, fetch=args.upstream == "sglang",
                                      compile_expand=not args.smoke)
    if up is None and args.upstream == "sglang":
        raise SystemExit(f"--upstream sglang: sglang {SGLANG_VERSION}'s code is unavailable: {why}")
    if up is None:
        print(f"(b) falls back to the {MODEL_SOURCE}: {why}", file=sys.stderr)
        return None, f"sglang {SGLANG_VERSION} unavailable ({why})"
    return up, ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, every code path")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--configs", nargs="+", default=None,
                    help="P,topk,steps,N tuples, e.g. 16,4,5,8 (default: the three CONFIGS)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per request")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--compile", default="auto", choices=list(COMPILE_BACKENDS),
                    help="torch.compile backend of (a), (b) and (c) alike (default: inductor on "
                         "CUDA, none on CPU)")
    ap.add_argument("--compile-regions", action=argparse.BooleanOptionalAction, default=None,
                    help="the layers of (a), (b) and (c) as compiled regions "
                         "(EagleEngine(compile_regions=True)) or inline; default: the "
                         "engine's (regions under inductor)")
    ap.add_argument("--capture-buckets", type=int, nargs="+", default=None,
                    help="also time cold compile + capture of an engine with these buckets, and a "
                         "restart from its compile cache (fresh processes)")
    ap.add_argument("--capture-child", metavar="CACHE", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--real-acceptance", action="store_true")
    ap.add_argument("--upstream", choices=("auto", "sglang", "model"), default="auto",
                    help="metadata of (b): sglang 0.5.23's own replay functions (sglang; "
                         "FA3_SPEC_SGLANG_SRC names its sources offline), the project's "
                         "upstream-style model (model), or sglang when it loads (auto)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--append", action="store_true",
                    help="add rows to an existing --json file (split a long run over calls)")
    args = ap.parse_args(argv)
    if args.capture_child:
        args.preset = args.preset or "llama3-8b"
        args.context = args.context or 1024
        return capture_child(args)
    if args.smoke:
        args.device, args.backend = "cpu", "torch"
        args.preset = args.preset or "tiny"
        batches, configs = args.batches or [2], [(2, 4, 3, 6), (16, 1, 3, 4)]
        args.context, args.iters = args.context or 20, args.iters or 3
        torch.set_num_threads(1)
    else:
        args.device, args.backend = "cuda", "fa3"
        args.preset = args.preset or "llama3-8b"
        batches, configs = args.batches or BATCHES, CONFIGS
        args.context, args.iters = args.context or 1024, args.iters or 20
    if args.configs:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    args.upstream_code, args.upstream_note = _resolve_upstream(args)
    models = make_models(args.preset, draft="random", device=args.device,
                         num_layers=args.num_layers)
    rows = []
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as fh:
            rows = json.load(fh)["rows"]
    command = "python3 benchmarks/eagle_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               commands=[command], rows=rows)
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as fh:
            old = json.load(fh)
        out = {**old, "rows": rows, "commands": old.get("commands", []) + [command]}
    bandwidth = tflops = None
    if args.device == "cuda":
        from model_roofline import matmul_throughput, read_bandwidth

        bandwidth = round(read_bandwidth(), 3)
        tflops = round(matmul_throughput(), 1)
        out.update(read_bandwidth_TBps=bandwidth, matmul_TFLOPs=tflops)
        print(f"read bandwidth {bandwidth} TB/s, bf16 matmul {tflops} TFLOP/s", flush=True)
    if args.capture_buckets:
        timing = capture_timing(args)
        out.update(buckets=sorted(args.capture_buckets), cold_compile_capture_s=timing["cold"]["seconds"],
                   restart_s=timing["restart"]["seconds"], capture_detail=timing)
    for cfg in configs:
        for batch in batches:
            row = bench_point(cfg, batch, args, models, bandwidth, tflops)
            rows.append(row)
            a, b, c = row["a_in_graph"], row["b_host_metadata"], row["c_greedy"]
            print(f"P={cfg[0]} topk={cfg[1]} S={cfg[2]} N={cfg[3]} bs={batch} [{row['acceptance']}]: "
                  f"a {a['tokens_per_s']:.0f} tok/s {a['ms_per_iteration']:.2f} ms/it "
                  f"(floor x{row.get('a_over_floor')}) syncs {a['host_syncs_per_iteration']} "
                  f"idle {a['gpu_idle_share']} | b [{row['b_metadata_source']}] "
                  f"{b['ms_per_iteration']:.2f} ms/it syncs {b['host_syncs_per_iteration']} | "
                  f"c {c['ms_per_iteration']:.2f} ms/token ({row.get('c_roofline_frac')} of roofline) | "
                  f"a/b {row.get('a_over_b')} a/c {row['a_over_c']}", flush=True)
            if args.json:  # rewritten after every row: a cut-off run keeps what it measured
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as fh:
                    json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
