"""The host driver: admission, finish, joins, bucket runners, asynchronous readback.

`EagleEngine` keeps the loop state (`fa3_spec.eagle.iteration.empty_state`)
in static device buffers of ``max_bs`` rows. Between iterations the host

* admits waiting requests into free rows: a pool row and pages
  (`KVPool.allocate`), then an eager prefill of target and draft whose
  metadata comes from `fa3_spec.build_prefill_metadata`, written into the
  state rows on the device (the first token is picked on the device too:
  the argmax, or a draw for sampled requests, `fa3_spec.eagle.sampling`);
* launches one iteration for the smallest bucket that covers every occupied
  row (``state[:bucket]``): a speculative iteration of the bucket's tree
  shape, or a plain decode step where the bucket does not speculate
  (``shapes``; the state is as wide as the widest shape, `StateWidths`, so a
  request keeps its tokens when the batch moves between buckets), through
  one `fa3_spec.graphs.CUDAGraphRunner` per shape over
  caller-owned buffers (the state's bucket views): on CUDA the iteration is
  compiled with inductor (the batch dimension dynamic, so every bucket
  above 1 shares one compiled frame: `fa3_spec.graphs.CompilePolicy`) and
  captured as one CUDA graph per bucket; on CPU it is called, eagerly by default;
* copies the state's outputs into pinned host memory with a non-blocking
  copy and records an event, then handles the *previous* iteration's copy:
  the host runs one iteration ahead of what it has read. Finished requests
  are already padding rows on the device (``seq_len = 0``), so the extra
  iteration never reads or writes their pages; the host frees them when it
  reads the copy, and their rows are reused by the next admission.

Nothing in an iteration waits for the host. `fa3_spec.eagle.greedy.greedy_generate`
is the reference: plain greedy decoding of the same target on decode metadata.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..attention import resolve_attention_backend
from ..frozen import FrozenModule
from ..graphs import (CompilePolicy, CUDAGraphRunner, check_buckets, load_compile_cache,
                      save_compile_cache, with_own_code)
from .acceptance import AcceptanceHook
from .iteration import (LoopConfig, State, StateWidths, eagle_iteration, empty_state,
                        plain_iteration, step_in_place)
from .models import SpecModel
from .policy import check_shape_ints
from .pool import KVPool
from .prefill import check_max_new_tokens, check_prompt, eos_set, prefill_forward
from .sampling import RequestSampling, SamplingParams
from .stats import EngineStats

#: State keys the host reads back after every iteration.
READBACK = ("out_tokens", "out_len", "seq_lens", "accept_len", "tree_tokens", "parents", "path")


@dataclasses.dataclass
class Request:
    rid: int
    prompt: List[int]
    max_new_tokens: int
    eos_ids: Tuple[int, ...] = ()
    sampling: RequestSampling = RequestSampling()  # greedy unless given
    row: int = -1  # req_to_token row while admitted
    slot: int = -1  # batch row while admitted
    since: int = 0  # first iteration (launch index) that saw it admitted
    output: Optional[List[int]] = None
    accept_lens: List[int] = dataclasses.field(default_factory=list)  # per iteration
    admitted_s: float = 0.0  # host clock at admission
    finished_s: float = 0.0  # host clock when its finish was read back
    error: Optional[str] = None  # why it could not be admitted (then no output)
    started: bool = False  # its state row is live on the device
    emitted: int = 0  # output tokens the host has read back


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """A finished request, as `EagleEngine.pop_results` hands it over.

    ``tokens``: its output (None when it failed); ``accept_lens``: tokens
    accepted per iteration (`EagleEngine.request_stats`); ``seconds``: from admission to the host reading
    its finish (shared with the batch it ran in); ``seed``: its sampling
    seed; ``error``: why it could not be admitted, or None.
    """

    tokens: Optional[List[int]]
    accept_lens: List[int]
    seconds: float
    seed: int
    error: Optional[str] = None


def draft_vocab_size(models: SpecModel) -> int:
    """Tokens the draft head proposes from: ``models.draft_vocab_size`` when the
    model defines it (a reduced-vocabulary draft head), else ``vocab_size``."""
    return int(getattr(models, "draft_vocab_size", models.vocab_size))


def default_buckets(max_bs: int) -> List[int]:
    """The engine's default buckets: the powers of two up to 256 below
    ``max_bs``, then ``max_bs``."""
    return [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_bs] + [max_bs]


def _with_shape(lc: LoopConfig, shape: Optional[Tuple[int, int, int]]) -> LoopConfig:
    """``lc`` drafting ``shape`` (None: ``lc`` itself, whose pool and page
    geometry a plain decode step uses)."""
    return lc if shape is None else dataclasses.replace(lc, spec=lc.spec.with_shape(*shape))


def _bucket_shapes(lc: LoopConfig, buckets: Sequence[int], shapes) -> Dict[int, Optional[tuple]]:
    """Every bucket's shape: ``shapes``' entry, else ``lc.spec``'s."""
    own = (lc.spec.topk, lc.spec.num_steps, lc.spec.num_draft_tokens)
    if shapes is None:
        return {b: own for b in buckets}
    if not isinstance(shapes, Mapping):
        raise TypeError(f"shapes must map buckets to (topk, num_steps, num_draft_tokens) or "
                        f"None, got {type(shapes).__name__}")
    bad = [b for b in shapes if isinstance(b, bool) or not isinstance(b, int)]
    if bad:
        raise ValueError(f"shapes must be keyed by int buckets, got {bad!r}")
    unknown = sorted(set(shapes) - set(buckets), key=str)
    if unknown:
        raise ValueError(f"shapes names {unknown}, which are not buckets {list(buckets)}")
    out = {}
    for b in buckets:
        shape = shapes.get(b, own)
        out[b] = None if shape is None else check_shape_ints(shape, f"shapes[{b}]")
    return out


def _speculative_step(bound: FrozenModule, models: SpecModel, pool: KVPool, acceptance):
    """The captured step of a speculating bucket: one EAGLE iteration, in place."""
    def iteration(**st: torch.Tensor) -> dict:
        step_in_place(lambda s: eagle_iteration(bound.lc, models, pool.target_kv, pool.draft_kv,
                                                pool.req_to_token, s, acceptance=acceptance),
                      st)
        return {}
    return iteration


def _plain_step(bound: FrozenModule, models: SpecModel, pool: KVPool):
    """The captured step of a bucket that does not speculate: one plain decode step."""
    def iteration(**st: torch.Tensor) -> dict:
        step_in_place(lambda s: plain_iteration(bound.lc, models, pool.target_kv,
                                                pool.req_to_token, s), st)
        return {}
    return iteration


class EagleEngine:
    """Serve requests with the EAGLE loop (see the module docstring).

    Args:
        lc: `LoopConfig` (``lc.spec.max_bs`` = batch rows; ``lc.spec.num_pages``
            = pool size). ``lc.attention_backend="auto"`` is resolved here (``"fa3"``
            where FA3 runs on ``device``, else ``"torch"``); the engine's
            ``lc`` says which. ``lc.spec.topk`` must not exceed the draft's
            vocabulary (``models.draft_vocab_size`` when it has one, else ``vocab_size``).
        models: a `SpecModel`. ``lc.spec.max_context_len`` must not exceed
            its RoPE table (``models.max_positions``): a position past it
            would be rotated as the last one, silently wrong.
        max_reqs: ``req_to_token`` rows, an int >= 1 (None: ``2 * max_bs``).
        buckets: batch sizes to run/capture, ints in ``[1, max_bs]`` that
            include ``max_bs`` (`fa3_spec.graphs.check_buckets`; default: the
            powers of two up to 256 below ``max_bs``, plus ``max_bs``). A
            batch runs in the smallest bucket that holds it, the other rows
            padding. Under inductor bucket 1 is a frame of its own
            (`fa3_spec.graphs.CompilePolicy.for_loop`): leaving 1 out trades
            batch-1 speed for compile time.
        graphs: capture one CUDA graph per bucket (CUDA only; default: on
            with CUDA).
        compile_backend: one of `fa3_spec.graphs.COMPILE_BACKENDS`: the
            ``torch.compile(fullgraph=True)`` backend of the iteration
            (``"auto"``: inductor on CUDA, none on CPU; None means ``"none"``).
        cache_path: a file for PyTorch's compile caches (loaded before the
            first shape's capture, written once after the last one's; without
            graphs, where each bucket compiles on its first launch, written
            once after the first `run`), so a restarted process skips most of
            inductor's work for every shape.
        device: where everything lives.
        seed: pool page shuffle.
        policy: a `fa3_spec.graphs.CompilePolicy` to use as it is, instead of
            the one resolved from ``compile_backend`` and ``graphs`` (leave
            those at their defaults), e.g. regions under a CPU backend.
        acceptance: an acceptance hook that decides each iteration's accepted
            path instead of the target (`fa3_spec.eagle.acceptance`; for
            benchmarks: the outputs are not the model's), or None. With a
            hook the engine refuses sampled requests.
        shapes: per bucket, the tree shape ``(topk, num_steps,
            num_draft_tokens)`` its iterations draft, or None for a plain
            decode step (`fa3_spec.eagle.iteration.plain_iteration`); a bucket
            not named runs ``lc.spec``'s shape. Typically the choice of
            `fa3_spec.eagle.policy.choose_shapes`. Every shape shares the
            pool (``lc.spec.num_pages`` must hold the largest shape's rows),
            the state and ``lc``'s other settings; each distinct shape is
            compiled and captured once, for its buckets.

    Attributes: ``policy``, the `fa3_spec.graphs.CompilePolicy` resolved from
    those (``policy.regions``: the decoder layers run as compiled regions),
    ``iteration_models``, the models the iteration runs, ``shapes``, every
    bucket's shape (None: plain decoding), and ``widths``, the state's
    `StateWidths`.
    """

    def __init__(self, lc: LoopConfig, models: SpecModel, *, max_reqs: Optional[int] = None,
                 buckets: Optional[Sequence[int]] = None, graphs: Optional[bool] = None,
                 compile_backend: Optional[str] = "auto", cache_path: Optional[str] = None,
                 device="cpu", seed: int = 0, acceptance: Optional[AcceptanceHook] = None,
                 policy: Optional[CompilePolicy] = None,
                 shapes: Optional[Mapping[int, Optional[Tuple[int, int, int]]]] = None):
        if max_reqs is not None and (isinstance(max_reqs, bool) or not isinstance(max_reqs, int)
                                     or max_reqs < 1):
            raise ValueError(f"max_reqs must be an int >= 1 (None: 2 * max_bs), got {max_reqs!r}")
        if lc.spec.max_context_len > models.max_positions:
            raise ValueError(
                f"lc.spec.max_context_len={lc.spec.max_context_len} exceeds the model's RoPE "
                f"table of {models.max_positions} positions (max_position_embeddings): "
                "positions past it would be rotated as the last one")
        self.device = torch.device(device)
        # Resolved here, eagerly: a compiled iteration cannot look for the FA3
        # provider (an import) while dynamo traces it.
        lc = dataclasses.replace(lc,
                                 attention_backend=resolve_attention_backend(lc.attention_backend,
                                                                             self.device))
        self.lc = lc
        self.spec = lc.spec
        self.models = models
        self.max_bs = lc.spec.max_bs
        if buckets is None:
            buckets = default_buckets(self.max_bs)
        self.buckets = check_buckets(buckets, self.max_bs)
        self.shapes = _bucket_shapes(lc, self.buckets, shapes)
        # Each distinct shape and the buckets that run it (plain decoding last).
        by_shape: Dict[Optional[tuple], List[int]] = {}
        for b in self.buckets:
            by_shape.setdefault(self.shapes[b], []).append(b)
        by_shape = dict(sorted(by_shape.items(), key=lambda kv: (kv[0] is None, kv[0] or ())))
        self._loop_configs = {}
        for shape, where in by_shape.items():
            try:
                self._loop_configs[shape] = _with_shape(lc, shape)
            except ValueError as exc:
                raise ValueError(f"shapes[{where[0]}] = {shape}: {exc}") from None
        for name, shape_lc in [("lc.spec", lc)] + [
                (f"shapes[{b}]", self._loop_configs[s]) for b, s in self.shapes.items() if s]:
            if shape_lc.spec.topk > draft_vocab_size(models):
                raise ValueError(
                    f"{name}: topk={shape_lc.spec.topk} exceeds the draft's vocabulary of "
                    f"{draft_vocab_size(models)} tokens: every tree node draws its topk "
                    "children from it")
        speculating = [c for s, c in self._loop_configs.items() if s is not None]
        #: Widths of the state every shape shares (`StateWidths`): the
        #: speculating shapes' (``lc``'s own when every bucket decodes plainly).
        self.widths = StateWidths.covering(speculating or [lc])
        regions_available = hasattr(models, "with_compile_regions")
        if policy is None:
            policy = CompilePolicy.for_loop(
                device=self.device, compile_backend=compile_backend, graphs=graphs,
                buckets=self.buckets, regions_available=regions_available)
        elif not isinstance(policy, CompilePolicy):
            raise TypeError(f"policy must be a CompilePolicy, got {type(policy).__name__}")
        elif compile_backend != "auto" or graphs is not None:
            raise ValueError("give policy, or compile_backend and graphs, not both")
        elif policy.regions and not regions_available:
            raise ValueError(f"policy.regions needs models with with_compile_regions; "
                             f"{type(models).__name__} has none")
        elif policy.graphs and self.device.type != "cuda":
            raise ValueError("policy.graphs needs a CUDA device")
        self.policy = policy
        #: The compile-cache file `capture` loads and writes (None: none).
        self.cache_path = cache_path
        self._save_cache_after_run = False
        self.pool = KVPool(lc.spec, max_reqs=2 * self.max_bs if max_reqs is None else max_reqs,
                           target_layers=models.num_target_layers,
                           draft_layers=models.num_draft_layers, num_kv_heads=models.num_kv_heads,
                           head_dim=models.head_dim, dtype=models.dtype, device=device, seed=seed,
                           draft_attention=lc.draft_attention,
                           also=[c.spec for c in speculating])
        self.state = empty_state(lc, models, self.max_bs, self.device, widths=self.widths)
        self._views: Dict[int, State] = {}
        step_models = (models.with_compile_regions(self.policy.compile_backend)
                       if self.policy.regions else models)
        #: The models the iteration runs (their layers inline or as compiled regions).
        self.iteration_models = step_models
        self.acceptance = acceptance
        # One runner per shape, over the buckets that run it. Each shape's loop
        # ints reach its compiled iteration through a module, so they stay
        # compile-time constants whatever other shapes or engines compiled.
        runners: Dict[object, CUDAGraphRunner] = {}
        for shape, where in by_shape.items():
            bound = FrozenModule.holding(lc=self._loop_configs[shape])
            step = (_speculative_step(bound, step_models, self.pool, acceptance)
                    if shape is not None else _plain_step(bound, step_models, self.pool))
            # One code object per shape: the shapes' compiled frames never evict
            # one another, and engines of the same shape share theirs.
            step = with_own_code(step, "plain_decode_step" if shape is None else
                                 "eagle_iteration_" + "_".join(map(str, shape)), shared=True)
            runners[shape] = CUDAGraphRunner(
                step, buckets=where,
                policy=self.policy, buffers=self.bucket_state, warmup=1)
        #: The runner of each distinct shape (None: plain decoding).
        self.shape_runners: Dict[Optional[tuple], CUDAGraphRunner] = runners
        #: The runner of each bucket.
        self.runners: Dict[int, CUDAGraphRunner] = {b: runners[self.shapes[b]]
                                                    for b in self.buckets}
        self._waiting: List[Request] = []
        self._slots: List[Optional[Request]] = [None] * self.max_bs
        self._done: Dict[int, Request] = {}  # finished or failed, until collected
        self._next_rid = 0
        self._pending = None  # (host copy, event, bucket) of the last launched iteration
        self._pinned = [None, None]
        self._parity = 0
        #: Running aggregates (`fa3_spec.eagle.stats.EngineStats`).
        self.stats = EngineStats(max_depth=self.widths.depth, topk=self.widths.topk)

    # ------------------------------------------------------------- requests
    def submit(self, prompt: Sequence[int], max_new_tokens: int,
               eos_id: Union[int, Sequence[int]] = -1, *, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None) -> int:
        """Queue a request; returns its id. It joins at the next free row.

        ``eos_id``: one EOS token id or several (at most ``lc.max_eos``);
        the output stops after the first of them (included). -1: none.

        Sampling (docs/semantics.md, "Lossless speculative sampling"):
        ``temperature >= 0`` (0 = greedy, exact to `greedy_generate`),
        ``top_k >= 0`` (0 = off; above the vocabulary = off), ``0 < top_p <= 1``;
        ``seed`` (an int64; None: a fresh one, see `seed_of`) makes the
        output reproducible, alone or in any batch.

        Raises:
            TypeError: a prompt that is not a sequence of ints.
            ValueError: a prompt token outside ``[0, vocab_size)``, a
                ``max_new_tokens`` that is not an int >= 1, an EOS id that is
                not an int below ``vocab_size``, more EOS ids than ``lc.max_eos``, a request that can never fit the
                configuration (`KVPool.check_request`), a sampling value out
                of range, or ``temperature > 0`` on a loop built with
                ``LoopConfig(sampling=False)`` or on an engine with an
                acceptance hook.
        """
        prompt = check_prompt("prompt", prompt, self.models.vocab_size)
        max_new_tokens = check_max_new_tokens("max_new_tokens", max_new_tokens)
        sampling = RequestSampling.create(temperature, top_k, top_p, seed)
        if sampling.temperature > 0 and not self.lc.sampling:
            raise ValueError("temperature > 0 needs a loop built with LoopConfig(sampling=True)")
        if sampling.temperature > 0 and self.acceptance is not None:
            raise ValueError("temperature > 0: this engine's acceptance hook decides every "
                             "accepted path, so nothing would be sampled")
        if max_new_tokens > self.lc.max_new_tokens:
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the loop's "
                             f"max_new_tokens={self.lc.max_new_tokens}")
        eos = eos_set(eos_id, self.models.vocab_size)
        if len(eos) > self.lc.max_eos:
            raise ValueError(f"eos_id has {len(eos)} ids; the loop holds at most "
                             f"max_eos={self.lc.max_eos}")
        self.pool.check_request(len(prompt), max_new_tokens)
        rid = self._next_rid
        self._next_rid += 1
        self._waiting.append(Request(rid, prompt, max_new_tokens, eos, sampling))
        return rid

    def _request(self, rid: int) -> Request:
        for req in self._waiting:
            if req.rid == rid:
                return req
        for req in self._slots:
            if req is not None and req.rid == rid:
                return req
        if rid in self._done:
            return self._done[rid]
        raise KeyError(f"no request {rid!r} here: never submitted, or already collected "
                       "by pop_results")

    def seed_of(self, rid: int) -> int:
        """The sampling seed of request ``rid`` (given, or drawn at submission),
        until its result is collected."""
        return self._request(rid).sampling.seed

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or self.active > 0 or self._pending is not None

    def request_at(self, row: int) -> Optional[int]:
        """The id of the request in batch row ``row`` (None when the row is free),
        as the host knows it: a row's request stays there until the host reads
        its finish (e.g. inside an ``on_iteration`` callback of `step`)."""
        if not 0 <= row < self.max_bs:
            raise ValueError(f"row must be in [0, {self.max_bs}), got {row}")
        req = self._slots[row]
        return None if req is None else req.rid

    def results(self) -> Dict[int, List[int]]:
        """Outputs of the finished requests not yet collected, by id (failed
        requests are in `failures`). The engine keeps them: a long-running
        caller collects them with `pop_results` instead."""
        return {rid: r.output for rid, r in self._done.items() if r.error is None}

    def failures(self) -> Dict[int, str]:
        """Requests that could not be admitted (their prefill raised), not yet
        collected: id -> the error. The other requests ran on."""
        return {rid: r.error for rid, r in self._done.items() if r.error is not None}

    def request_stats(self) -> Dict[int, dict]:
        """Per finished request not yet collected: ``accept_lens`` (tokens
        accepted per iteration: accepted drafts + 1; the last may exceed what
        EOS or ``max_new_tokens`` let it emit) and ``seconds`` from its
        admission to the host reading its finish (shared with its batch)."""
        return {rid: dict(accept_lens=list(r.accept_lens), seconds=r.finished_s - r.admitted_s)
                for rid, r in self._done.items() if r.error is None}

    def pop_results(self) -> Dict[int, RequestResult]:
        """Hand over every finished (or failed) request and forget it: the
        engine's memory does not grow with the requests it has served."""
        done, self._done = self._done, {}
        return {rid: RequestResult(r.output, r.accept_lens, r.finished_s - r.admitted_s,
                                   r.sampling.seed, r.error)
                for rid, r in done.items()}

    # ------------------------------------------------------------ admission
    def _admit(self) -> None:
        """Admit waiting requests into free rows: pool rows and pages, prefill,
        then their state rows.

        A request that cannot be admitted does not hold up the others: if the
        batch's prefill fails, each of its requests is tried alone, and one
        that fails alone is finished with its error (`failures`) and its row
        and pages freed. An interrupt (not an ``Exception``) frees the batch,
        puts it back at the head of the queue and propagates. No state row is
        live before its prefill succeeded (``seq_lens``, which makes a row
        live, is written last).
        """
        batch: List[Request] = []
        free = [i for i, r in enumerate(self._slots) if r is None]
        try:
            while self._waiting and free:
                req = self._waiting[0]
                if not self.pool.can_allocate(len(req.prompt), req.max_new_tokens):
                    break
                req.row = self.pool.allocate(len(req.prompt), req.max_new_tokens)
                self._waiting.pop(0)
                req.slot = free.pop(0)
                req.since = self.stats.iterations
                req.admitted_s = time.perf_counter()
                self._slots[req.slot] = req
                batch.append(req)
            if batch:
                self._start_each(batch)
        except BaseException:
            pending = [req for req in batch if not req.started and req.error is None]
            self._unassign(pending)
            self._waiting[:0] = pending
            raise

    def _unassign(self, batch: List[Request]) -> None:
        for req in batch:
            self.pool.release(req.row)
            self._slots[req.slot] = None
            req.row = req.slot = -1

    def _start_each(self, batch: List[Request]) -> None:
        """`_start` the batch; if it raises, each request alone (module docstring)."""
        try:
            self._start(batch)
            return
        except Exception as exc:  # noqa: BLE001 (re-raised below for a lone request's peers)
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
        for req in batch:
            try:
                self._start([req])
            except Exception as exc:  # noqa: BLE001 (recorded on the request)
                self._fail(req, exc)

    def _fail(self, req: Request, exc: Exception) -> None:
        self._unassign([req])
        req.error = f"{type(exc).__name__}: {exc}"
        req.finished_s = time.perf_counter()
        self._done[req.rid] = req
        self.stats.failed += 1

    def _start(self, batch: List[Request]) -> None:
        """Prefill ``batch`` (rows and slots assigned) and write its state rows."""
        pool, st, dev = self.pool, self.state, self.device
        params = SamplingParams.stack([r.sampling for r in batch], device=dev)
        first, h, scores, cand, _ = prefill_forward(
            self.models, self.spec, pool.target_kv, pool.draft_kv, pool.req_to_token,
            [r.row for r in batch], [r.prompt for r in batch], attention_backend=self.lc.attention_backend,
            num_splits=self.lc.num_splits, sampling=params if self.lc.sampling else None,
            topk=self.widths.topk)
        idx = torch.tensor([r.slot for r in batch], dtype=torch.int64, device=dev)
        lens = torch.tensor([len(r.prompt) for r in batch], dtype=torch.int64, device=dev)
        max_new = torch.tensor([r.max_new_tokens for r in batch], dtype=torch.int64, device=dev)
        width = self.lc.max_eos
        eos = torch.tensor([list(r.eos_ids) + [-1] * (width - len(r.eos_ids)) for r in batch],
                           dtype=torch.int64, device=dev)
        done = (first.unsqueeze(1) == eos).any(1) | (max_new <= 1)  # on the device: no sync
        st["req_pool_indices"][idx] = torch.tensor([r.row for r in batch], dtype=torch.int64,
                                                   device=dev)
        st["root"][idx] = first
        st["cand_tokens"][idx] = cand
        st["cand_scores"][idx] = scores
        st["draft_hidden"][idx] = h.to(st["draft_hidden"].dtype)
        out = torch.zeros(len(batch), st["out_tokens"].shape[1], dtype=torch.int64, device=dev)
        out[:, 0] = first
        st["out_tokens"][idx] = out
        st["out_len"][idx] = 1
        st["max_new"][idx] = max_new
        st["eos"][idx] = eos
        st["iters"][idx] = 0
        st["accept_len"][idx] = 0
        for key, value in params._asdict().items():
            st[key][idx] = value
        st["seq_lens"][idx] = torch.where(done, 0, lens)  # last: the rows are live from here
        for req in batch:
            req.started = True
        self.stats.admitted += len(batch)

    # ------------------------------------------------------------- iteration
    def bucket_for(self, rows: int) -> int:
        """The smallest bucket that holds ``rows`` occupied rows."""
        for bucket in self.buckets:
            if bucket >= rows:
                return bucket
        raise ValueError(f"rows={rows} exceeds the largest bucket {self.buckets[-1]}")

    @property
    def runner(self) -> CUDAGraphRunner:
        """The runner of every bucket, when they all run one shape (`runners`
        otherwise)."""
        if len(self.shape_runners) != 1:
            raise AttributeError(f"this engine runs {len(self.shape_runners)} shapes, each with "
                                 "its own runner: use runners[bucket] or shape_runners")
        return next(iter(self.shape_runners.values()))

    def loop_config(self, bucket: int) -> LoopConfig:
        """The `LoopConfig` a bucket's iterations run (``lc`` with the bucket's
        shape; ``lc`` itself for a bucket that does not speculate)."""
        return self._loop_configs[self.shapes[self.bucket_for(bucket)]]

    def bucket_state(self, bucket: int) -> State:
        """The loop state's first ``bucket`` rows (views of the engine's buffers:
        what the bucket's graph reads and writes)."""
        if bucket not in self._views:
            self._views[bucket] = {k: v[:bucket] for k, v in self.state.items()}
        return self._views[bucket]

    def capture(self) -> Dict[int, float]:
        """Compile and capture the iteration for every bucket (CUDA graphs), or,
        without graphs, get the buckets ready; returns seconds per bucket.

        Every row is a padding row while capturing, so warm-up and capture
        runs read nothing and write only slot 0; the state is restored after.
        Called on the first launch if not called before.
        """
        saved = {k: v.clone() for k, v in self.state.items()}
        self.state["seq_lens"].zero_()
        seconds: Dict[int, float] = {}
        # The engine, not each runner, loads and saves the cache file: one
        # save per process, since a file saved twice keeps only the second
        # save's artifacts of each kind (`fa3_spec.graphs.cache`).
        caching = self.cache_path is not None and self.policy.strategy != "eager"
        if caching:
            load_compile_cache(self.cache_path)
        try:
            for runner in self.shape_runners.values():
                seconds.update(runner.capture())
            if caching and self.policy.graphs:
                save_compile_cache(self.cache_path)
            # Without graphs nothing has compiled yet: the first run compiles.
            self._save_cache_after_run = caching and not self.policy.graphs
            return dict(sorted(seconds.items()))
        finally:
            for k, v in self.state.items():
                v.copy_(saved[k])

    def admit(self) -> None:
        """Admit waiting requests into free rows now (prefill included), as
        `step` does before each launch."""
        self._admit()

    def launch(self, bucket: int) -> None:
        """Run one iteration over the first ``bucket`` rows (a graph replay when
        captured), with no readback: what `step` launches, for benchmarks."""
        if not all(r.captured for r in self.shape_runners.values()):
            self.capture()
        start = time.perf_counter()
        self.runners[bucket].replay(bucket, bucket)
        self.stats.launch_seconds += time.perf_counter() - start

    def _readback(self, bucket: int):
        view = self.bucket_state(bucket)
        if self.device.type != "cuda":
            return {k: view[k].clone() for k in READBACK}, None
        p = self._parity
        self._parity ^= 1
        if self._pinned[p] is None:
            self._pinned[p] = {k: torch.empty(self.state[k].shape, dtype=self.state[k].dtype,
                                              pin_memory=True) for k in READBACK}
        host = {k: self._pinned[p][k][:bucket] for k in READBACK}
        for k in READBACK:
            host[k].copy_(view[k], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _consume(self, host, event, iteration: int, on_iteration=None) -> None:
        if event is not None:
            event.synchronize()  # waits for that iteration only; the next one is queued
        # Host copies (synced by the event above): read each into Python once,
        # not one tensor index per slot.
        seq = host["seq_lens"].tolist()  # ok-host
        out_len, accept = host["out_len"].tolist(), host["accept_len"].tolist()  # ok-host
        counted = host["accept_len"].clone()
        emitted = 0
        for slot in range(len(seq)):
            req = self._slots[slot]
            if req is None or req.since > iteration:  # admitted after this copy was taken
                counted[slot] = 0
                continue
            if accept[slot] > 0:
                req.accept_lens.append(accept[slot])
            emitted += out_len[slot] - max(req.emitted, 1)  # the prefill's token: not counted
            req.emitted = out_len[slot]
            if seq[slot] == 0:  # finished (padding on the device already)
                req.output = host["out_tokens"][slot, : out_len[slot]].tolist()  # ok-host
                self.pool.release(req.row)
                self._slots[slot] = None
                self._done[req.rid] = req
                req.finished_s = time.perf_counter()
                self.stats.finished += 1
        self.stats.record(counted, host["parents"], host["path"], emitted)
        if on_iteration is not None:
            on_iteration(self, host)

    def step(self, on_iteration: Optional[Callable] = None) -> bool:
        """Admit, launch one iteration, then read the previous one. False when idle."""
        self._admit()
        occupied = [i for i, r in enumerate(self._slots) if r is not None]
        launched = None
        if occupied:
            bucket = self.bucket_for(occupied[-1] + 1)
            start = time.perf_counter()
            self.launch(bucket)
            launched = self._readback(bucket) + (self.stats.iterations, start)
            self.stats.iterations += 1
        if self._pending is not None:
            host, event, iteration, started = self._pending
            self._consume(host, event, iteration, on_iteration)
            self.stats.readback_seconds += time.perf_counter() - started
            self.stats.readbacks += 1
        self._pending = launched
        return self.has_work

    def run(self, progress: Optional[Callable] = None) -> Dict[int, List[int]]:
        """Run until every submitted request has finished; returns the outputs
        by id (`results`; requests that could not be admitted: `failures`)."""
        while self.step(progress):
            pass
        if self._save_cache_after_run:
            self._save_cache_after_run = False
            save_compile_cache(self.cache_path)
        return self.results()

    def device_outputs(self) -> Dict[int, List[int]]:
        """Outputs so far of the admitted requests, read from the device buffer (syncs)."""
        out = {}
        for req in self._slots:
            if req is not None:
                n = int(self.state["out_len"][req.slot])
                out[req.rid] = self.state["out_tokens"][req.slot, :n].tolist()  # ok-host
        return out
