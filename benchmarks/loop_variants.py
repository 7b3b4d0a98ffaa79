"""The loop's variants beside the engine's own iteration, (a): (b) the same
iteration with its metadata filled on the host before each replay, and (c)
plain greedy decoding without speculation, each compiled and captured as (a)
is, over the same requests.

(b) is three captured phases (draft, verify + accept + commit, extend +
output) reading static metadata: `HostMetadataLoop` copies the project's
upstream-style model's metadata into them; `SglangMetadataLoop` has sglang
0.5.23's own replay functions fill sglang's buffers, which the phases read
through `fa3_spec.integrations.sglang.metadata_views`. (c) is one decode step
per replay (`greedy_segment`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.utils._pytree as pytree

import fa3_spec
from fa3_spec import SpecBatch
from fa3_spec.eagle import EagleEngine
from fa3_spec.eagle.decode import decode_step
from fa3_spec.eagle.iteration import draft_phase, draft_slots, extend_phase, verify_phase
from fa3_spec.eagle.vocab import vocab_argmax
from fa3_spec.graphs import capture, compile_fullgraph
from fa3_spec.harness.sglang_upstream import SGLANG_VERSION
from fa3_spec.harness.upstream import UpstreamStyleBuilder
from fa3_spec.integrations import sglang

import timing

SGLANG_SOURCE = f"sglang-{SGLANG_VERSION} replay functions"
MODEL_SOURCE = "fa3_spec upstream-style model"


def compiled(fn, compile_backend: str):
    """``fn`` compiled as the engine compiles (a) (``"none"``: as is), so that
    (a), (b) and (c) run the same compiled model."""
    if compile_backend == "none":
        return fn
    return compile_fullgraph(fn, compile_backend=compile_backend, dynamic=False)


class Segment:
    """``fn()`` captured as a CUDA graph (replay), or called directly on CPU.

    ``out`` holds the outputs at fixed addresses after each run."""

    def __init__(self, fn, graphs: bool, pool=None, compile_backend: str = "none"):
        fn = compiled(fn, compile_backend)
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
        be = engine.policy.compile_backend or "none"
        st, m, r2t = self.view, engine.iteration_models, pool.req_to_token
        n = lc.spec.num_draft_tokens
        tree_mask = torch.tril(torch.ones(bucket, n, n, dtype=torch.bool, device=engine.device))
        # Static metadata (values refilled before each replay), valid for the capture.
        self.md_draft, self.md_verify, self.md_extend = self._static_metadata(
            self.live_batch(), self.draft_slot_table(), tree_mask)
        saved = {k: v.clone() for k, v in st.items()}
        st["seq_lens"].zero_()  # capture on padding rows: nothing real is written
        gpool = torch.cuda.graph_pool_handle() if graphs else None
        self.a = Segment(lambda: draft_phase(lc, m, pool.draft_kv, r2t, st, self.md_draft),
                         graphs, gpool, be)
        self.b = Segment(lambda: verify_phase(lc, m, pool.target_kv, r2t, st, self.a.out,
                                              self.md_verify, acceptance=engine.acceptance),
                         graphs, gpool, be)

        def extend_and_store():
            new = extend_phase(lc, m, pool.draft_kv, r2t, st, self.a.out, self.b.out,
                               self.md_extend)
            for k, buf in st.items():
                buf.copy_(new[k])
            return {}

        self.c = Segment(extend_and_store, graphs, gpool, be)
        for k, v in st.items():
            v.copy_(saved[k])

    def live_batch(self) -> dict:
        """The bucket's live ``req_to_token``, ``req_pool_indices`` and ``seq_lens``."""
        st = self.view
        return dict(req_to_token=self.eng.pool.req_to_token,
                    req_pool_indices=st["req_pool_indices"], seq_lens=st["seq_lens"])

    def draft_slot_table(self) -> torch.Tensor:
        """``[B, topk, steps]`` slots the draft steps write, from the live state."""
        return draft_slots(self.lc, SpecBatch.create(self.spec, **self.live_batch()).view())

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
        """Every draft step's metadata for ``batch`` and slots ``loc``, into the static buffers."""
        fresh = [self.ref.draft_decode(i, **batch, out_cache_loc=loc)
                 for i in range(self.spec.num_steps - 1)]
        timing.copy_leaves(self.md_draft, tuple(fresh))

    def fill_verify(self, batch, tree_mask):
        """The verify metadata for the drafted ``[B, N, N]`` ``tree_mask``."""
        if self.spec.topk == 1:
            verify = self.ref.target_verify(**batch)
        else:
            seq_host = batch["seq_lens"].tolist()  # host sync, as upstream engines hold seq_lens on the CPU
            verify = self.ref.target_verify(**batch, custom_mask=flat_custom_mask(tree_mask, seq_host))
        timing.copy_leaves(self.md_verify, verify)

    def fill_extend(self, batch, new_seq_lens, extend_seq_lens):
        """The draft extend's metadata over the accepted lengths."""
        ext = self.ref.draft_extend(req_to_token=batch["req_to_token"],
                                    req_pool_indices=batch["req_pool_indices"],
                                    seq_lens=new_seq_lens, extend_seq_lens=extend_seq_lens)
        timing.copy_leaves(self.md_extend, ext)

    def iteration(self):
        """One iteration of (b): each phase's metadata filled on the host, then its replay."""
        batch = self.live_batch()
        self.fill_draft(batch, self.draft_slot_table())
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

    spec, batch, loc = host.spec, host.live_batch(), host.draft_slot_table()
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
                             attention_backend=engine.lc.attention_backend, num_splits=engine.lc.num_splits)
        tok.copy_(vocab_argmax(logits))
        seq.copy_(torch.where(seq > 0, seq + 1, 0))
        return {}

    saved = seq.clone()
    seq.zero_()
    seg = Segment(step, graphs, compile_backend=engine.policy.compile_backend or "none")
    seq.copy_(saved)
    return seg, seq
