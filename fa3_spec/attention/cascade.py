"""Attention over fa3_spec metadata: one call, or a prefix + expand cascade.

`cascade_attention` takes FA3's per-layer arguments (``window_size``,
``softcap``, ``sinks``, FP8 descales) with the names and meanings of
``flash_attn_with_kvcache``, and keeps them exact across the log-sum-exp
merge of a cascade. Everything here is static Python checks plus plain torch
ops around the FA3 custom op, so a step compiles with ``fullgraph=True`` and
captures into one CUDA graph.
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

from .._validate import MAX_WINDOW
from ..metadata import CascadeMetadata, FA3Metadata
from .expand_attention import expand_attention, expand_call_applies, expand_kernel
from .fa3_op import (attention_out_dtype, default_num_splits, fa3_paged_attention,
                     fa3_scheduler_plan, same_split_key_bound)
from .merge import add_attention_sink, merge_float
from .providers import fa3_available, find_provider, require
from .reference import paged_attention_reference

ATTENTION_BACKENDS = ("auto", "fa3", "torch")

#: The FP8 format FA3 reads (its largest finite value is 448).
FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0


def _check(q, k_cache, v_cache) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [total_q, H_q, D], got shape {tuple(getattr(q, 'shape', ()))}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            raise ValueError(f"{name} must be [num_pages, page_size, H_kv, D], got {tuple(cache.shape)}")
        if cache.device != q.device:
            raise ValueError(f"{name} is on {cache.device} but q is on {q.device}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError("k_cache and v_cache must agree on [num_pages, page_size, H_kv]")
    if k_cache.dtype != v_cache.dtype or not k_cache.is_floating_point():
        raise TypeError(f"k_cache and v_cache must share one floating dtype, got "
                        f"{k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype.itemsize == 1 and k_cache.dtype != FP8:
        raise TypeError(f"FP8 KV caches must be {FP8} (what FA3 reads), got {k_cache.dtype}")
    if q.dtype == FP8 and k_cache.dtype != FP8:
        raise TypeError(f"an FP8 q needs FP8 ({FP8}) caches, got {k_cache.dtype}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"H_q={q.shape[1]} must be a multiple of H_kv={k_cache.shape[2]}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head dim {q.shape[2]} != k_cache head dim {k_cache.shape[3]}")


def _calls(metadata) -> list:
    """``[(name, FA3Metadata)]`` of the calls ``metadata`` describes, checked."""
    if isinstance(metadata, FA3Metadata):
        calls = [("single", metadata)]
    elif isinstance(metadata, CascadeMetadata):
        calls = [("prefix", metadata.prefix)]
        if metadata.expand is not None:
            calls.append(("expand", metadata.expand))
    else:
        raise TypeError(f"metadata must be FA3Metadata or CascadeMetadata, got {type(metadata).__name__}")
    for name, md in calls:
        if md.cu_seqlens_q.shape[0] != md.num_rows + 1 or md.page_table.shape[0] != md.num_rows:
            raise ValueError(
                f"the {name} call's metadata is inconsistent: cache_seqlens has {md.num_rows} rows, "
                f"page_table {md.page_table.shape[0]}, cu_seqlens_q {md.cu_seqlens_q.shape[0]} entries "
                f"(must be rows + 1)"
            )
    return calls


def _check_query_rows(q: torch.Tensor, calls: list) -> None:
    """Static rule: ``q`` has at least ``rows * max_seqlen_q`` rows for every call.

    ``cu_seqlens_q[-1]`` is a device value, but the metadata bounds it
    statically by ``rows * max_seqlen_q`` (every builder clamps per-row query
    counts to ``max_seqlen_q``), so this is what guarantees that no call reads
    past ``q``. Draft extend sizes ``q`` at that bound (``B * N``) and packs its
    real queries at the front; rows past ``cu_seqlens_q[-1]`` get output 0. A
    ``q`` packed to fewer rows than the bound must be padded to it.
    """
    for name, md in calls:
        need = md.num_rows * md.max_seqlen_q
        if q.shape[0] < need:
            raise ValueError(
                f"q has {q.shape[0]} query rows, but the {name} call has {md.num_rows} rows of up to "
                f"max_seqlen_q={md.max_seqlen_q} queries, so its cu_seqlens_q may reach {need}: "
                f"q needs at least {need} rows (pad it to that static bound; rows past "
                f"cu_seqlens_q[-1] get output 0)"
            )


def _check_plans(plans, calls, q, window: tuple) -> tuple:
    """``plans`` as one entry per call (None entries where there are none)."""
    if plans is None:
        return (None,) * len(calls)
    if window != (-1, -1):
        raise ValueError(f"plans cannot be used with window_size={window}: fa3_plans plans "
                         "calls without one (build window metadata, window_left=, instead)")
    if not isinstance(plans, (tuple, list)) or len(plans) != len(calls):
        raise ValueError(f"plans must be a tuple of {len(calls)} plans (one per call of the "
                         f"metadata, from fa3_plans), got {plans!r:.80}")
    for (name, _), plan in zip(calls, plans):
        if not isinstance(plan, torch.Tensor) or plan.dtype != torch.int32 or plan.dim() != 1:
            raise TypeError(f"plans: the {name} call's plan must be a 1-D int32 tensor "
                            f"(fa3_plans), got {plan!r:.80}")
        if plan.device != q.device:
            raise ValueError(f"plans: the {name} call's plan is on {plan.device}, q on {q.device}")
    return tuple(plans)


def resolve_attention_backend(attention_backend: str, device) -> str:
    """``attention_backend`` (one of `ATTENTION_BACKENDS`) as the attention on
    ``device`` runs it: ``"auto"`` is ``"fa3"`` where FA3 runs there (`fa3_available`), else
    ``"torch"``. Call it eagerly before compiling a step that says
    ``"auto"`` or ``"fa3"``: the first lookup of the provider imports it
    (an eager call with ``"fa3"`` looks it up too)."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                         f"got {attention_backend!r}")
    if attention_backend == "auto":
        device = torch.device(device)
        return "fa3" if device.type == "cuda" and fa3_available(device) else "torch"
    if attention_backend == "fa3" and not torch.compiler.is_compiling():
        find_provider()  # found now, so that a compiled step can ask about it
    return attention_backend


def _check_window(window_size, metadata) -> tuple:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
    for side in (left, right):
        if (isinstance(side, bool) or not isinstance(side, numbers.Integral)
                or not -1 <= side <= MAX_WINDOW):
            raise ValueError(f"window_size entries must be ints in [-1, {MAX_WINDOW}] "
                             f"(-1 = unbounded), got {window_size!r}")
    window = (int(left), int(right))
    if window != (-1, -1) and any(md.window_left >= 0 for md in metadata.calls):
        raise ValueError(
            f"window_size={window} given with sliding-window metadata, which already carries its "
            "window (build_metadata(..., window_left=W)); pass no window_size"
        )
    if window != (-1, -1) and not isinstance(metadata, CascadeMetadata) and not (
            metadata.causal or metadata.max_seqlen_q == 1):
        raise ValueError(
            f"window_size={window} cannot be applied to a non-causal call with up to "
            f"{metadata.max_seqlen_q} queries per row (such as a draft prefix call, whose K branches "
            "share one position): FA3 aligns the window as if the queries were consecutive. "
            "A sliding-window layer needs sliding-window metadata from the builders."
        )
    if window != (-1, -1) and isinstance(metadata, CascadeMetadata):
        raise ValueError(
            f"window_size={window} cannot be applied to a CascadeMetadata: the prefix call's queries "
            "(a request's K draft branches or N tree tokens) all sit at one position, while FA3 aligns "
            "a window bottom-right as if they were consecutive, so the window would be wrong. "
            "A sliding-window layer needs sliding-window metadata from the builders."
        )
    return window


def _check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a Python float (static), got {type(softcap).__name__}")
    if not softcap >= 0.0 or softcap == float("inf"):
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap}")
    return float(softcap)


def _check_vector(name: str, t, shape: tuple, q: torch.Tensor, meaning: str) -> Optional[torch.Tensor]:
    """``t`` as float32 (float64 beside a float64 ``q``) after checking it is a
    floating ``shape`` tensor on ``q``'s device."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {meaning} = {list(shape)}, got {list(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return t.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _check_out(out, shape: tuple, dtype: torch.dtype, q: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out must be [total_q, H_q, Dv] = {list(shape)}, got {list(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out must be {dtype} (the output dtype of this call), got {out.dtype}")
    if out.device != q.device:
        raise ValueError(f"out is on {out.device} but q is on {q.device}")


def _quantize_q(q: torch.Tensor, q_descale: Optional[torch.Tensor], md: FA3Metadata) -> torch.Tensor:
    """``q`` as FP8 for FP8 KV: ``q / q_descale`` of its request and KV head, saturated."""
    if q.dtype == FP8:
        return q
    qf = q.float()
    if q_descale is not None and md.num_rows > 0:
        req = md.query_rows(q.shape[0]).clamp(max=md.num_rows - 1)
        group = q.shape[1] // q_descale.shape[1]
        scale = q_descale[req].repeat_interleave(group, dim=1)  # [total_q, H_q]
        qf = qf / scale.unsqueeze(-1)
    return qf.clamp(-_FP8_MAX, _FP8_MAX).to(FP8)


def _per_row(scale: Optional[torch.Tensor], md: FA3Metadata, num_requests: int, name: str):
    """Map per-request ``[B, H_kv]`` scales to the rows of ``md`` (branches repeat their request's)."""
    if scale is None or md.num_rows == num_requests:
        return scale
    if num_requests == 0 or md.num_rows % num_requests:
        raise ValueError(
            f"cannot map {name} of {num_requests} requests to the {md.num_rows} rows of the expand "
            "call: its rows must be a whole number of branches per request"
        )
    return scale.repeat_interleave(md.num_rows // num_requests, dim=0)


def _as_page_size(cache: torch.Tensor, page_size: int, name: str = "cache") -> torch.Tensor:
    """View ``cache`` ``[pages, P, H, D]`` with pages of ``page_size`` tokens."""
    pages, p, heads, dim = cache.shape
    if p == page_size:
        return cache
    if p % page_size:
        raise ValueError(f"cannot view {name}'s pages of {p} tokens as pages of {page_size}")
    if pages > 1 and cache.stride(0) != p * cache.stride(1):
        raise ValueError(
            f"{name} must be contiguous across its page and token dims (stride(0) == page_size * "
            f"stride(1)) to be re-viewed with pages of {page_size} token(s), as this call needs "
            f"(the tree-verify expand call reads single-token pages); got shape {tuple(cache.shape)} "
            f"with strides {tuple(cache.stride())}. Pass a cache laid out [num_pages, page_size, "
            f"H_kv, D] in memory (e.g. not a permuted view), or cache.contiguous()"
        )
    return cache.view(pages * p // page_size, page_size, heads, dim)


def attention_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: FA3Metadata,
    *,
    softmax_scale: float,
    attention_backend: str,
    num_splits: Optional[int] = None,
    softcap: float = 0.0,
    window_size: tuple = (-1, -1),
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    scheduler_metadata: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call: ``(out [total_q, H, Dv], lse [H, total_q])``, normalised.

    No argument checking (`cascade_attention` does it); descales are already
    per row of ``md`` (float32 ``[md.num_rows, H_kv]``) and an FP8 ``q`` is
    already quantised. ``scheduler_metadata``: this call's plan from
    `fa3_plans` (FA3 only; the torch backend ignores it).

    Under ``"fa3"`` with the expand kernel selected (the default; see
    `select_expand_kernel`) an expand call
    (`expand_call_applies`: one query per row in page size 1) runs
    ``fa3_spec::expand_attention``, a Triton kernel that reads the same keys
    (`fa3_spec.attention.expand_attention` says why; the call's plan is then
    unused).

    Queries that no row owns, or that see no key, get output 0 and LSE
    ``-inf`` whatever the backend. FA3 leaves unowned queries unwritten and
    gives an empty row (``cache_seqlens = 0``, or a window with no key) a
    non-finite LSE (``compile_tests/test_gpu_attention_args.py`` records
    which); its output there is not guaranteed finite. Any
    non-finite LSE (``+inf``, ``-inf``, NaN) is mapped to ``-inf`` and its
    output to 0; every finite LSE is kept.
    """
    window_size = _call_window(md, window_size)
    k_view = _as_page_size(k_cache, md.page_size, "k_cache")
    v_view = _as_page_size(v_cache, md.page_size, "v_cache")
    extra = dict(softcap=softcap, window_size=window_size, q_descale=q_descale,
                 k_descale=k_descale, v_descale=v_descale)
    if attention_backend == "torch":
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        return paged_attention_reference(q, k_view, v_view, md, softmax_scale,
                                         compute_dtype=compute, **extra)
    descaled = any(t is not None for t in (q_descale, k_descale, v_descale))
    if expand_kernel() == "triton" and expand_call_applies(md, q, softcap=softcap,
                                                           window_size=window_size,
                                                           descaled=descaled):
        out, lse = expand_attention(q, k_view, v_view, md.page_table, md.cache_seqlens,
                                    md.cu_seqlens_q, md.max_seqlen_k, softmax_scale)
    else:
        splits, left, right = _fa3_statics(md, k_cache.shape[2], num_splits, window_size)
        out, lse = fa3_paged_attention(
            q, k_view, v_view, md.page_table, md.cache_seqlens, md.cu_seqlens_q,
            md.max_seqlen_q, softmax_scale, md.causal, splits,
            softcap, left, right, q_descale, k_descale, v_descale, scheduler_metadata,
        )
    owned = torch.arange(q.shape[0], device=q.device) < md.cu_seqlens_q[-1]
    has_keys = owned.unsqueeze(0) & torch.isfinite(lse)
    lse = torch.where(has_keys, lse, float("-inf"))
    out = torch.where(has_keys.transpose(0, 1).unsqueeze(-1), out, 0)
    return out, lse


def _call_window(md: FA3Metadata, window_size: tuple) -> tuple:
    """The window of ``md``'s call: its own where it carries one (sliding-window
    metadata), else ``window_size``."""
    if md.window_left >= 0:
        return (md.window_left, 0 if md.causal else -1)
    return window_size


def _fa3_statics(md: FA3Metadata, num_kv_heads: int, num_splits: Optional[int],
                 window_size: tuple) -> tuple:
    """``(num_splits, window_left, window_right)`` of ``md``'s FA3 call, the
    window already ``md``'s own where it has one (`attention_call`)."""
    splits = num_splits or default_num_splits(md.num_rows, num_kv_heads, md.max_seqlen_k)
    # A window side at least the call's key bound reads every key: pass "unbounded"
    # (-1) so that FA3's int32 window arguments never see a huge value.
    left, right = (-1 if side >= md.max_seqlen_k else side for side in window_size)
    return splits, left, right


def fa3_plans(metadata: Union[FA3Metadata, CascadeMetadata], *, num_heads: int, head_dim: int,
              k_cache: torch.Tensor, v_cache: torch.Tensor, num_splits: Optional[int] = None,
              softcap: float = 0.0) -> tuple:
    """One FA3 scheduler plan per call of ``metadata``, for every layer of a
    forward to share (`cascade_attention`'s ``plans``).

    Each FA3 call plans its work in a small kernel of its own before it runs
    (``prepare_varlen_num_blocks``). The plan depends only on the call's
    metadata, split count, window and head shapes, which the layers of one
    forward share: made once here, the layers of a deep target launch one
    planning kernel per call instead of one per layer, with the same outputs
    bit for bit. The gain is smaller than the planning kernels' time, because
    they mostly overlap other kernels and FA3 then launches a small fill
    kernel per layer.

    Args: the forward's ``metadata``; its layers' query heads ``num_heads``
    and ``head_dim``; one layer's ``k_cache, v_cache [num_pages, P, H_kv,
    D]`` (shapes and dtype only); the ``num_splits`` and ``softcap`` the
    layers pass to `cascade_attention` (which refuses plans together with a
    ``window_size``: give windowed layers window metadata instead). Returns
    a tuple of int32 tensors, one per call (`fa3_scheduler_plan`).
    Traceable and capturable: no host sync, one
    ``fa3_spec::fa3_scheduler_plan`` op per call. Needs a provider that
    plans (`provider_plans`).
    """
    num_kv_heads = k_cache.shape[2]
    plans = []
    for _, md in _calls(metadata):
        splits, left, right = _fa3_statics(md, num_kv_heads, num_splits,
                                           _call_window(md, (-1, -1)))
        plans.append(fa3_scheduler_plan(
            md.cache_seqlens, md.cu_seqlens_q, md.max_seqlen_q,
            md.page_table.shape[1] * md.page_size, num_heads, num_kv_heads, head_dim,
            v_cache.shape[-1], k_cache.dtype, md.page_size, md.causal, splits, softcap > 0,
            left, right))
    return tuple(plans)


def fa3_equivalent_key_bound(md: FA3Metadata, window_size: tuple = (-1, -1)) -> int:
    """The largest ``max_seqlen_k`` that gives ``md`` the same FA3 call.

    `attention_call` passes FA3 no key bound: on the ``"fa3"`` backend
    ``md.max_seqlen_k`` only chooses the default split count
    (`default_num_splits`, which reads whole blocks of 128 keys) and turns
    window sides at least that long into "unbounded" (-1). So without a
    window (``window_size`` ``(-1, -1)`` and ``md.window_left < 0``) every
    bound in one such block makes the same kernel call, with the same
    arguments and so the same output bit for bit; this returns the block's
    last value (`fa3_op.same_split_key_bound`), still an upper bound on
    ``cache_seqlens``. With a window it returns ``md.max_seqlen_k``.

    Example: bounds 1 to 127 all give 127 (one split unless ``num_splits``
    says otherwise), 1000 gives 1023 (7 blocks of 128 keys either way).
    `fa3_spec.eagle.regions` keys its compiled layer programs on it, so that
    the draft steps, whose expand calls differ only in their bound (1, 2,
    3, ... draft tokens), share one program. Not for the ``"torch"``
    backend, which materialises ``max_seqlen_k`` keys per row.
    """
    if md.window_left >= 0 or tuple(window_size) != (-1, -1):
        return md.max_seqlen_k
    return same_split_key_bound(md.max_seqlen_k)


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: Union[FA3Metadata, CascadeMetadata],
    *,
    softmax_scale: Optional[float] = None,
    attention_backend: str = "auto",
    num_splits: Optional[int] = None,
    return_lse: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    plans: Optional[tuple] = None,
):
    """Attention of ``q`` over the paged KV cache described by ``metadata``.

    Args:
        q: ``[total_q, H_q, D]`` floating point, in the query order of the
            metadata (request major: ``[B*K]`` draft branches, ``[B*N]``
            verify tokens, ...). It must have at least ``rows *
            max_seqlen_q`` rows for each call (the static bound of
            ``cu_seqlens_q[-1]``, so no call reads past ``q``); draft extend
            takes ``B * N`` with its real queries packed at the front.
        k_cache, v_cache: ``[num_pages, page_size, H_kv, D]``, bf16/fp16 or
            ``float8_e4m3fn`` for FA3, any float dtype for ``"torch"``. GQA:
            ``H_q % H_kv == 0``. A call with another page size (the
            tree-verify expand uses 1) views them, which needs
            ``stride(0) == page_size * stride(1)``.
        metadata: `FA3Metadata` (one call) or `CascadeMetadata` (prefix call
            + expand call, merged by log-sum-exp).
        softmax_scale: default ``D ** -0.5``.
        attention_backend: ``"fa3"`` (the custom op), ``"torch"`` (pure-PyTorch
            reference, CPU or GPU), ``"auto"`` (FA3 on sm90 if importable).
        num_splits: FA3 split count (static, >= 1); default from static bounds.
        return_lse: also return the float32 ``[H_q, total_q]`` LSE (natural
            log, over the scaled and capped scores, sink included).
        window_size: ``(left, right)``, FA3's sliding window, -1 = unbounded.
            Bottom-right aligned: query ``i`` of a row's ``n`` queries sits at
            position ``seqlen_k - n + i`` and sees keys ``t`` with ``pos - left
            <= t <= pos + right`` (``right`` is 0 when causal). Single
            `FA3Metadata` calls only: a cascade's prefix queries share one
            position, so a `CascadeMetadata` with a window raises ValueError
            (sliding-window layers need sliding-window metadata).
        softcap: ``> 0`` caps each call's scaled scores,
            ``softcap * tanh(score / softcap)``. Elementwise on scores, so the
            merge stays exact. The ``"torch"`` backend implements it; on
            ``"fa3"`` a provider built without it (tokenspeed-fa3) raises
            NotImplementedError naming the provider, in Python, before any
            kernel runs.
        sinks: ``[H_q]`` attention-sink logits (gpt-oss), one per query head,
            in the units of the scaled scores: a key with logit ``s_h`` and
            value 0 that enters the softmax denominator exactly once.
        q_descale, k_descale, v_descale: FP8 KV (caches ``float8_e4m3fn``):
            float ``[B, H_kv]`` dequantisation scales, one per request and KV
            head (``B`` = rows of the single or prefix call); ``x = x_fp8 *
            descale``. A bf16/fp16 ``q`` is quantised for FA3 as
            ``q / q_descale`` (1 when None), saturated to +-448, cast to FP8;
            an FP8 ``q`` is used as is. The expand call's rows are branches
            (``B*K`` draft, ``B*N`` tree verify): each takes its request's
            scales. The output is bf16.
        out: optional ``[total_q, H_q, Dv]`` buffer of the output dtype; the
            result is written into it (a copy at the end) and it is returned.
        plans: FA3 scheduler plans from `fa3_plans` for this ``metadata``,
            ``num_splits`` and ``softcap`` (one per call), shared by the
            layers of a forward; None: each FA3 call plans for itself. The
            ``"torch"`` backend ignores them.

    Returns:
        ``out [total_q, H_q, Dv]`` in ``q.dtype`` (bf16 for FP8 KV), and with
        ``return_lse`` the LSE. A query that sees no key gets output 0, never
        NaN, and LSE ``-inf`` (``s_h`` with a sink).

    Sinks are applied once, after the merge, as a third key set:
    ``o' = o * e^l / (e^l + e^s)``, ``l' = log(e^l + e^s)`` per (query, head)
    (`fa3_spec.attention.merge.add_attention_sink`). Why not FA3's own
    ``sinks`` argument: its LSE includes the sink, so passing it to both calls
    of a cascade counts it twice (as upstream sglang's topk > 1 cascade does),
    and passing it to one call would tie exactness to how each build treats a
    sink on an empty row (padding rows, empty prefixes). After the merge the
    math is exact for every backend and every metadata shape, an empty key
    set gives output 0 and LSE ``s`` by construction, and the cost is a few
    elementwise ops that inductor fuses with the merge.

    Errors (raised in Python at call or trace time; under
    ``torch.compile(fullgraph=True)`` dynamo reports them as ``Unsupported``
    with this message): ValueError/TypeError naming the argument for shapes,
    dtypes, devices; NotImplementedError for a feature the FA3 provider
    lacks (`fa3_spec.attention.provider_features`).

    Compiles with ``fullgraph=True`` (FA3 is an opaque custom op with a fake;
    the merge and sink are plain torch) and runs inside CUDA-graph capture;
    every argument above except tensors' values is static.
    """
    calls = _calls(metadata)
    _check(q, k_cache, v_cache)
    _check_query_rows(q, calls)
    attention_backend = resolve_attention_backend(attention_backend, q.device)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(
            f"num_splits must be a static int >= 1 (FA3 rejects 0 under tracing), got {num_splits!r}")
    window = _check_window(window_size, metadata)
    softcap = _check_softcap(softcap)
    fp8 = k_cache.dtype == FP8
    if attention_backend == "fa3" and softcap > 0:
        require("softcap", f"softcap={softcap}")
    if attention_backend == "fa3" and fp8:
        require("fp8_kv", "an FP8 KV cache")

    first = calls[0][1]
    num_requests, hkv = first.num_rows, k_cache.shape[2]
    descales = {}
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None and not fp8:
            raise ValueError(f"{name} applies to FP8 KV caches ({FP8}) only; k_cache is {k_cache.dtype}")
        descales[name] = _check_vector(name, t, (num_requests, hkv), q,
                                       "[B, H_kv] (one scale per request and KV head)")
    sinks = _check_vector("sinks", sinks, (q.shape[1],), q, "[H_q] (one logit per query head)")
    out_dtype = attention_out_dtype(FP8 if fp8 else q.dtype)
    _check_out(out, (q.shape[0], q.shape[1], v_cache.shape[-1]), out_dtype, q)

    if fp8:
        q = _quantize_q(q, descales["q_descale"], first)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    plans = _check_plans(plans, calls, q, window)
    results = []
    for (_, md), plan in zip(calls, plans):
        rows = {n: _per_row(t, md, num_requests, n) for n, t in descales.items()}
        results.append(attention_call(
            q, k_cache, v_cache, md, softmax_scale=scale, attention_backend=attention_backend, num_splits=num_splits,
            softcap=softcap, window_size=window, scheduler_metadata=plan, **rows,
        ))
    o, lse = results[0]
    if len(results) == 2:
        o, lse = merge_float(o, lse, *results[1])
    if sinks is not None:
        o, lse = add_attention_sink(o, lse, sinks)
    o = o.to(out_dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o
