"""sglang 0.5.23's own FA3 metadata code, obtained at run time and run with small stubs.

Nothing of sglang is committed to this repository. `load_upstream` gets the
few source files it needs from the sglang 0.5.23 wheel (``pip download``,
cached under ``~/.cache/fa3_spec``; or a directory named by
``FA3_SPEC_SGLANG_SRC`` holding the extracted files, for machines without a
network), cuts the pieces it runs out of ``flashattention_backend.py`` with
`ast` and executes them in a namespace of its own, where sglang's other
imports are stubs these pieces never touch:

* ``FlashAttentionBackend`` (whole class; methods run: ``init_cuda_graph_state``,
  ``_bind_metadata_buffers``, ``_apply_cuda_graph_metadata``,
  ``_set_decode_page_metadata``, ``init_forward_metadata_in_graph``),
  ``FlashAttentionMetadata`` and the module-level
  ``draft_decode_set_expand_metadata`` (its ``torch.compile`` decorator
  dropped unless ``compile_expand=True``);
* the Triton kernels those call (``normal_decode_set_metadata``,
  ``draft_extend_set_metadata``, ``build_trtllm_mha_page_table``), imported
  from their own files, and ``assert_buffer_fits``.

A backend instance is built without a model runner (``object.__new__`` plus
the attributes these methods read), configured as a plain FA3 backend: no
sliding window, no encoder, no local attention, no unified (translating) KV
pool, no scheduler-metadata precompute.

On CUDA the Triton kernels run natively. On CPU they run in Triton's
interpreter (``TRITON_INTERPRET=1``, set before Triton is first imported; a
pinned Triton is pip-installed into the cache if none is importable).

API::

    upstream = load_upstream()                 # None if it cannot be had
    upstream, reason = load_upstream_or_reason()
    backend = upstream.backend(cfg, req_to_token, step=0, device="cpu")
    backend.buffers                            # sglang's own buffer dicts
    backend.draft_decode(req_pool_indices=..., seq_lens=..., out_cache_loc=...)
    backend.target_verify(req_pool_indices=..., seq_lens=..., custom_mask=..., num_real_rows=...)
    backend.draft_extend(req_pool_indices=..., seq_lens=..., extend_seq_lens=...)
    backend.draft_extend_in_graph(...)         # the captured draft-extend kernel
    upstream.draft_decode_set_expand_metadata  # the module-level function itself

``cfg`` is a `fa3_spec.integrations.sglang.SglangConfig`. `sglang_batch`
makes random batches in sglang's conventions (for tests and benchmarks).
"""

from __future__ import annotations

import __future__
import ast
import dataclasses
import glob
import os
import pathlib
import subprocess
import sys
import types
import zipfile
from typing import Optional

import torch

from ..integrations.sglang import SglangConfig

SGLANG_VERSION = "0.5.23"
#: Triton pip-installed for the CPU interpreter when none is importable.
TRITON_VERSION = "3.9.0"
SOURCE_ENV = "FA3_SPEC_SGLANG_SRC"
CACHE_ENV = "FA3_SPEC_CACHE"

BACKEND_FILE = "sglang/srt/layers/attention/flashattention_backend.py"
METADATA_FILE = "sglang/kernels/ops/attention/metadata.py"
TRTLLM_FILE = "sglang/kernels/ops/attention/trtllm_mha_page_table.py"
UTILS_FILE = "sglang/kernels/ops/attention/utils.py"
#: Everything read from the wheel (carry these to an offline machine).
SOURCE_FILES = (BACKEND_FILE, METADATA_FILE, TRTLLM_FILE, UTILS_FILE)


class UpstreamUnavailable(RuntimeError):
    """sglang's code (or Triton to run it) cannot be had here; the message says why."""


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_ENV, "~/.cache/fa3_spec")).expanduser()


# ------------------------------------------------------------------ sources
def upstream_source(cache_dir=None, *, fetch: bool = True) -> pathlib.Path:
    """Directory holding `SOURCE_FILES` (``FA3_SPEC_SGLANG_SRC``, or extracted from the wheel)."""
    given = os.environ.get(SOURCE_ENV)
    if given:
        root = pathlib.Path(given)
        missing = [f for f in SOURCE_FILES if not (root / f).is_file()]
        if missing:
            raise UpstreamUnavailable(f"{SOURCE_ENV}={given} lacks {missing}")
        return root
    base = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
    home = base / f"sglang-{SGLANG_VERSION}"
    root = home / "src"
    if all((root / f).is_file() for f in SOURCE_FILES):
        return root
    wheels = sorted(glob.glob(str(home / f"sglang-{SGLANG_VERSION}-*.whl")))
    if not wheels:
        if not fetch:
            raise UpstreamUnavailable(f"no sglang {SGLANG_VERSION} wheel in {home}")
        home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-q", f"sglang=={SGLANG_VERSION}", "-d", str(home)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(glob.glob(str(home / f"sglang-{SGLANG_VERSION}-*.whl")))
        if done.returncode != 0 or not wheels:
            raise UpstreamUnavailable(
                f"pip download sglang=={SGLANG_VERSION} failed: {done.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for name in SOURCE_FILES:
            wheel.extract(name, root)
    return root


EAGLE3_MODEL_FILE = "sglang/srt/models/llama_eagle3.py"


def upstream_file(name: str, cache_dir=None, *, fetch: bool = True) -> pathlib.Path:
    """One more file of sglang's wheel (``name``, e.g. `EAGLE3_MODEL_FILE`),
    extracted next to `SOURCE_FILES` (or read from ``FA3_SPEC_SGLANG_SRC``)."""
    root = upstream_source(cache_dir, fetch=fetch)
    path = root / name
    if path.is_file():
        return path
    home = root.parent
    wheels = sorted(glob.glob(str(home / f"sglang-{SGLANG_VERSION}-*.whl")))
    if not wheels:
        raise UpstreamUnavailable(f"{name} is not in {root} and no sglang {SGLANG_VERSION} "
                                  f"wheel is in {home}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extract(name, root)
    return path


def _import_triton(device: torch.device, cache_dir, fetch: bool):
    """Triton, in interpreter mode on CPU. That mode is fixed by the environment
    when Triton is first imported, so a CPU process must start with
    ``TRITON_INTERPRET=1`` (the test suite's conftest sets it); this module never
    changes the environment."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu" and not interpret:
        raise UpstreamUnavailable(
            "sglang's Triton kernels run on CPU only in Triton's interpreter: start the "
            "process with TRITON_INTERPRET=1")
    if device.type != "cpu" and interpret:
        raise UpstreamUnavailable("TRITON_INTERPRET=1 is set; the kernels would not run on CUDA")
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        if device.type != "cpu":
            raise UpstreamUnavailable("triton is not importable")
    base = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
    target = base / f"triton-{TRITON_VERSION}"
    if not (target / "triton" / "__init__.py").is_file():
        if not fetch:
            raise UpstreamUnavailable(f"triton is not importable and not in {target}")
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
               f"triton=={TRITON_VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise UpstreamUnavailable(f"pip install triton failed: {done.stderr.strip()[-300:]}")
    sys.path.append(str(target))
    try:
        import triton  # noqa: F401,F811
    except ImportError as e:
        raise UpstreamUnavailable(f"triton from {target} does not import: {e}")


def _load_module(path: pathlib.Path, name: str) -> types.ModuleType:
    """Execute one self-contained upstream file (it imports only torch and triton)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # triton's jit looks its kernels' module up
    spec.loader.exec_module(module)
    return module


def _exec_pieces(path: pathlib.Path, names: tuple, namespace: dict, *, drop_decorators=()) -> None:
    """Compile the top-level definitions ``names`` of ``path`` into ``namespace``.

    Line numbers are kept (tracebacks and ``inspect`` point into the real
    file); ``from __future__ import annotations`` applies, as in the file.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {node.name: node for node in tree.body
             if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names}
    missing = set(names) - set(found)
    if missing:
        raise UpstreamUnavailable(f"{path.name} has no {sorted(missing)}")
    for name in drop_decorators:
        found[name].decorator_list = []
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)
    exec(code, namespace)


# ------------------------------------------------------------------- stubs
class _ForwardMode:
    """The few ``ForwardMode`` predicates the metadata paths ask."""

    def __init__(self, name: str):
        self.name = name

    def is_decode_or_idle(self):
        return self.name in ("DECODE", "IDLE")

    def is_idle(self):
        return self.name == "IDLE"

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"

    def is_draft_extend_v2(self):
        return self.name == "DRAFT_EXTEND_V2"

    def is_extend(self, include_draft_extend_v2: bool = False):
        return self.name == "TARGET_VERIFY" or (include_draft_extend_v2 and self.is_draft_extend_v2())

    def is_dllm_extend(self):
        return False


DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2 = (_ForwardMode(n) for n in
                                          ("DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"))


class _Translator:
    """A plain (non-unified) KV pool: reads and writes are not translated."""

    is_translating = False
    reads_are_translated = False


def _not_here(name):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{name} is stubbed out: not used by the FA3 metadata paths run here")
    return fail


class _AttentionBackend:
    pass


# --------------------------------------------------------------- the code
class UpstreamSglang:
    """sglang 0.5.23's FA3 metadata code, loaded (see the module docstring)."""

    def __init__(self, root: pathlib.Path, device, *, compile_expand: bool = False):
        self.root, self.device = root, torch.device(device)
        self.metadata_kernels = _load_module(root / METADATA_FILE, "_fa3_spec_sglang_metadata")
        self.trtllm_kernels = _load_module(root / TRTLLM_FILE, "_fa3_spec_sglang_trtllm")
        ns = dict(torch=torch, Optional=Optional, dataclass=dataclasses.dataclass,
                  TYPE_CHECKING=False, AttentionBackend=_AttentionBackend,
                  normal_decode_set_metadata=self.metadata_kernels.normal_decode_set_metadata,
                  draft_extend_set_metadata=self.metadata_kernels.draft_extend_set_metadata,
                  prepare_swa_spec_page_table_triton=self.metadata_kernels.prepare_swa_spec_page_table_triton,
                  build_trtllm_mha_page_table=self.trtllm_kernels.build_trtllm_mha_page_table,
                  maybe_create_verify_mask=lambda **kwargs: None,
                  IdSpaceKind=types.SimpleNamespace(FULL="full", SLIDING_WINDOW="swa"))
        for name in ("build_ragged_target_verify_geometry", "_build_pa_page_table",
                     "per_step_draft_out_cache_loc", "merge_state_v2", "get_parallel", "get_spec",
                     "get_exec", "get_model", "get_memory", "get_schedule"):
            ns[name] = _not_here(name)
        _exec_pieces(root / UTILS_FILE, ("assert_buffer_fits",), ns)
        _exec_pieces(root / BACKEND_FILE, ("FlashAttentionMetadata", "FlashAttentionBackend",
                                           "draft_decode_set_expand_metadata"), ns,
                     drop_decorators=("draft_decode_set_expand_metadata",))
        if compile_expand:  # as sglang runs it: torch.compile(dynamic=True)
            ns["draft_decode_set_expand_metadata"] = torch.compile(
                ns["draft_decode_set_expand_metadata"], dynamic=True)
        self.namespace = ns
        self.FlashAttentionBackend = ns["FlashAttentionBackend"]
        self.FlashAttentionMetadata = ns["FlashAttentionMetadata"]

    @property
    def draft_decode_set_expand_metadata(self):
        return self.namespace["draft_decode_set_expand_metadata"]

    def backend(self, cfg: SglangConfig, req_to_token: torch.Tensor, *, step: int = 0,
                is_draft_runner: bool = True) -> "UpstreamBackend":
        """One ``FlashAttentionBackend`` (``speculative_step_id = step``) with its CUDA-graph buffers."""
        return UpstreamBackend(self, cfg, req_to_token, step, is_draft_runner)

    def draft_backends(self, cfg: SglangConfig, req_to_token) -> list:
        """The draft worker's per-step backends (``FlashAttentionMultiStepBackend``)."""
        return [self.backend(cfg, req_to_token, step=i) for i in range(cfg.num_steps - 1)]


class UpstreamBackend:
    """A ``FlashAttentionBackend`` instance built without a model runner.

    ``buffers`` maps sglang's attribute names (``decode_cuda_graph_metadata``,
    ...) to its dictionaries of buffer tensors (the same tensor objects the
    backend fills), as `fa3_spec.integrations.sglang.allocate_buffers` names them.
    """

    def __init__(self, upstream: UpstreamSglang, cfg: SglangConfig, req_to_token, step: int,
                 is_draft_runner: bool):
        b = object.__new__(upstream.FlashAttentionBackend)
        device = req_to_token.device
        attrs = dict(
            max_context_len=cfg.context_len, device=device, page_size=cfg.page_size,
            max_num_pages=cfg.max_num_pages, topk=cfg.topk, speculative_num_steps=cfg.num_steps,
            speculative_num_draft_tokens=cfg.num_draft_tokens, speculative_step_id=step,
            req_to_token=req_to_token, kv_index_translator=_Translator(), token_to_kv_pool=None,
            use_sliding_window_kv_pool=False, has_swa=False, sliding_window_size=None,
            is_prefill_aware_swa=False, local_attn_builder=None, is_encoder_decoder=False,
            use_mla=False, _get_scheduler_metadata=None, is_draft_runner=is_draft_runner,
            skip_prefill=False, fa_impl_ver=3, _decode_uses_static_max_seqlen_k=False,
            _verify_mask=None, forward_metadata=None, forward_metadata_spec_decode_expand=None,
        )
        for name, value in attrs.items():
            setattr(b, name, value)
        b.init_cuda_graph_state(cfg.max_bs, cfg.max_bs * max(cfg.topk, cfg.num_draft_tokens))
        self.backend, self.cfg, self.step = b, cfg, step
        self._bound = set()  # (mode, bs, num_tokens) already bound, as at capture time

    @property
    def buffers(self) -> dict:
        names = ("decode_cuda_graph_metadata", "draft_decode_metadata_topk_normal",
                 "draft_decode_metadata_topk_expand", "target_verify_metadata",
                 "target_verify_metadata_topk_normal", "target_verify_metadata_topk_expand",
                 "draft_extend_metadata")
        return {n: {k: v for k, v in getattr(self.backend, n).items() if isinstance(k, str)}
                for n in names if hasattr(self.backend, n)}

    def _bind(self, mode, bs, num_tokens, spec_info, device):
        """``_bind_metadata_buffers`` once per (mode, bs, num_tokens): sglang binds
        at capture time and replays only ``_apply_cuda_graph_metadata``."""
        key = (mode.name, bs, num_tokens)
        if key not in self._bound:
            self.backend._bind_metadata_buffers(bs, num_tokens, None, mode, spec_info, device)
            self._bound.add(key)

    def _apply(self, mode, bs, req_pool_indices, seq_lens, spec_info, out_cache_loc=None,
               num_tokens=None):
        b = self.backend
        self._bind(mode, bs, num_tokens or bs, spec_info, seq_lens.device)
        b._apply_cuda_graph_metadata(
            plan=None, bs=bs, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
            encoder_lens=None, forward_mode=mode, spec_info=spec_info, seq_lens_cpu=None,
            out_cache_loc=out_cache_loc)
        return b.forward_metadata, b.forward_metadata_spec_decode_expand

    def draft_decode(self, *, req_pool_indices, seq_lens, out_cache_loc=None):
        """Replay-time metadata of this draft step (``DECODE`` with a draft ``spec_info``)."""
        spec_info = types.SimpleNamespace(is_draft_input=lambda: True)
        return self._apply(DECODE, seq_lens.shape[0], req_pool_indices, seq_lens, spec_info,
                           out_cache_loc)

    def target_verify(self, *, req_pool_indices, seq_lens, custom_mask=None, num_real_rows=None):
        """Replay-time target-verify metadata; ``num_real_rows`` (default: all) are
        the requests ``spec_info.positions`` covers, the rest are padding."""
        bs, n = seq_lens.shape[0], self.cfg.num_draft_tokens
        real = bs if num_real_rows is None else num_real_rows
        spec_info = types.SimpleNamespace(
            custom_mask=custom_mask, ragged_verify_layout=None,
            positions=torch.zeros(real * n, dtype=torch.int64, device=seq_lens.device))
        return self._apply(TARGET_VERIFY, bs, req_pool_indices, seq_lens, spec_info,
                           num_tokens=bs * n)

    def draft_extend(self, *, req_pool_indices, seq_lens, extend_seq_lens):
        """Replay-time (out-of-graph) draft-extend-v2 metadata."""
        spec_info = self._extend_spec_info(extend_seq_lens)
        return self._apply(DRAFT_EXTEND_V2, seq_lens.shape[0], req_pool_indices, seq_lens,
                           spec_info, num_tokens=seq_lens.shape[0] * self.cfg.num_draft_tokens)

    def draft_extend_in_graph(self, *, req_pool_indices, seq_lens, extend_seq_lens):
        """The draft-extend kernel sglang records inside its graph
        (``init_forward_metadata_in_graph``: ``draft_extend_set_metadata``)."""
        bs = seq_lens.shape[0]
        spec_info = self._extend_spec_info(extend_seq_lens)
        self._bind(DRAFT_EXTEND_V2, bs, bs * self.cfg.num_draft_tokens, spec_info, seq_lens.device)
        fb = types.SimpleNamespace(forward_mode=DRAFT_EXTEND_V2, batch_size=bs,
                                   req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                                   extend_seq_lens=extend_seq_lens, out_cache_loc=None)
        self.backend.init_forward_metadata_in_graph(fb)

    def _extend_spec_info(self, extend_seq_lens):
        return types.SimpleNamespace(
            num_tokens_per_req=self.cfg.num_draft_tokens, extend_seq_lens_cpu=None,
            extend_seq_lens_tensor=extend_seq_lens)


def load_upstream_or_reason(cache_dir=None, *, device="cpu", fetch: bool = True,
                            compile_expand: bool = False):
    """``(UpstreamSglang, "")``, or ``(None, reason)`` when it cannot be had."""
    try:
        device = torch.device(device)
        root = upstream_source(cache_dir, fetch=fetch)
        _import_triton(device, cache_dir, fetch)
        return UpstreamSglang(root, device, compile_expand=compile_expand), ""
    except (UpstreamUnavailable, OSError, subprocess.SubprocessError, SyntaxError,
            ImportError) as e:
        return None, f"{type(e).__name__}: {e}"


def load_upstream(cache_dir=None, *, device="cpu", fetch: bool = True,
                  compile_expand: bool = False) -> Optional[UpstreamSglang]:
    """sglang 0.5.23's FA3 metadata code, or None (see `load_upstream_or_reason`)."""
    return load_upstream_or_reason(cache_dir, device=device, fetch=fetch,
                                   compile_expand=compile_expand)[0]


# ------------------------------------------------------------------ batches
@dataclasses.dataclass
class SglangBatch:
    """One padded batch in sglang's conventions (see `sglang_batch`)."""

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    custom_mask: torch.Tensor
    extend_seq_lens: torch.Tensor
    num_real_rows: int

    def inputs(self, mode: str) -> dict:
        """Keyword inputs of ``mode`` (``draft_decode``, ``target_verify``, ``draft_extend``)."""
        kw = dict(req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens)
        if mode == "draft_decode":
            kw["out_cache_loc"] = self.out_cache_loc
        elif mode == "target_verify":
            kw["custom_mask"] = self.custom_mask
        elif mode == "draft_extend":
            kw["extend_seq_lens"] = self.extend_seq_lens
        return kw


def make_req_to_token(cfg: SglangConfig, pool_size: int, generator: torch.Generator,
                      device="cpu") -> torch.Tensor:
    """int32 ``[pool_size + 1, cfg.req_to_token_width]``: row 0 zeros (reserved);
    every other position holds a slot of a page of its own row, pages shuffled
    over a pool whose page 0 is never used (positions past a request's length
    hold stale-looking but valid slots, as reused rows do)."""
    p, width = cfg.page_size, cfg.req_to_token_width
    pages_per_row = -(-width // p)
    perm = torch.randperm(pool_size * pages_per_row, generator=generator) + 1
    pages = perm.view(pool_size, pages_per_row, 1)
    slots = (pages * p + torch.arange(p)).reshape(pool_size, -1)[:, :width]
    r2t = torch.cat([torch.zeros(1, width, dtype=torch.int64), slots])
    return r2t.to(torch.int32).to(device)


def sglang_batch(cfg: SglangConfig, req_to_token: torch.Tensor, raw_bs: int, bucket: int,
                 generator: torch.Generator, *, random_slots: bool = False,
                 seq_lens=None) -> SglangBatch:
    """A random batch of ``raw_bs`` requests padded to ``bucket`` rows as sglang pads.

    Real requests use distinct rows ``>= 1`` of ``req_to_token`` and
    ``1 <= seq_len <= context_len``; draft slots follow sglang's layout
    (``P > 1`` and ``topk > 1``: each branch on its own pages, its token 0 at
    in-page offset ``seq_len % P``, branch 0 continuing on the prefix's partial
    last page; otherwise fresh consecutive slots), or
    are arbitrary non-negative slots with ``random_slots``. ``custom_mask``
    is the flat mask of random trees (prefix columns True) for the real
    requests, followed by random slack bits; ``extend_seq_lens`` in
    ``[1, min(N, seq_len)]``. Padding rows: row 0, ``seq_len = pad_seq_len``,
    slots 0, ``extend_seq_len = N``. ``seq_lens`` fixes the real requests' lengths.
    """
    from ..integrations.sglang import pad_batch

    g, p, k, s, n = generator, cfg.page_size, cfg.topk, cfg.num_steps, cfg.num_draft_tokens
    device = req_to_token.device
    rows = torch.randperm(req_to_token.shape[0] - 1, generator=g)[:raw_bs] + 1
    seq = torch.randint(1, cfg.context_len + 1, (raw_bs,), generator=g)
    if seq_lens is not None:  # given lengths of the real requests
        seq = torch.as_tensor(seq_lens, dtype=torch.int64).reshape(raw_bs)
    if random_slots:
        loc = torch.randint(0, 1 << 20, (raw_bs, k, s), generator=g)
    elif p > 1 and k > 1:
        last = (seq % p).view(-1, 1, 1)
        region = -(-(p - 1 + s) // p)  # pages per branch
        fresh = torch.randperm(raw_bs * k * region, generator=g).view(raw_bs, k, region)
        fresh = fresh + (1 << 20) // p  # away from req_to_token's pages
        # Branch 0 continues on the prefix's partial last page (the tail other
        # branches copy from, as sglang's draft allocation does).
        tail_page = req_to_token.cpu()[rows, (seq - 1).clamp(min=0)].to(torch.int64) // p
        fresh[:, 0, 0] = torch.where(last.view(-1) > 0, tail_page, fresh[:, 0, 0])
        pos = last + torch.arange(s).view(1, 1, s)
        pos = pos.expand(raw_bs, k, s)
        loc = torch.gather(fresh, 2, pos // p) * p + pos % p
    else:  # consecutive fresh slots, token 0 at in-page offset seq_len % P
        span = -(-(p - 1 + k * s) // p)
        base = (torch.randperm(raw_bs, generator=g) * span + (1 << 20) // p) * p
        loc = (base + seq % p).view(-1, 1, 1) + torch.arange(k * s).view(1, k, s)
    custom, ext = [], torch.zeros(raw_bs, dtype=torch.int64)
    for b in range(raw_bs):
        parents = [-1] + [int(torch.randint(0, c, (1,), generator=g)) for c in range(1, n)]
        anc = torch.eye(n, dtype=torch.bool)
        for c in range(1, n):
            anc[c] |= anc[parents[c]]
        custom.append(torch.cat([torch.ones(n, int(seq[b]), dtype=torch.bool), anc], 1).view(-1))
        ext[b] = int(torch.randint(1, min(n, int(seq[b])) + 1, (1,), generator=g))
    custom.append(torch.randint(0, 2, (int(torch.randint(0, 64, (1,), generator=g)),),
                                generator=g).bool())
    padded = pad_batch(cfg, bucket, req_pool_indices=rows, seq_lens=seq,
                       out_cache_loc=loc.reshape(-1), extend_seq_lens=ext)
    return SglangBatch(
        req_to_token=req_to_token,
        req_pool_indices=padded["req_pool_indices"].to(device),
        seq_lens=padded["seq_lens"].to(device),
        out_cache_loc=padded["out_cache_loc"].to(device),
        custom_mask=torch.cat(custom).to(device),
        extend_seq_lens=padded["extend_seq_lens"].to(device),
        num_real_rows=raw_bs,
    )
