"""Decoder layers as compiled regions: one compile of a layer serves every layer.

Traced inline, the 32 layers of an 8B target make one large graph, and
inductor's work (its scheduler's fusion and its code generation above all)
grows with it. Here, while an
enclosing function is being compiled, each layer call is one custom op
instead, ``fa3_spec_eagle::decoder_layer_first`` for a layer whose input is
given whole (a forward's first layer, a draft layer) and
``fa3_spec_eagle::decoder_layer`` for the later layers (their input is the
previous layer's three parts):

* the enclosing graph sees the op as opaque (its fake gives the output
  shapes), so it compiles only what lies between the layers: embeddings,
  metadata builders, lm_heads, tree selection;
* the op runs a ``torch.compile(fullgraph=True)`` of the layer (`layer_body`
  in `fa3_spec.eagle.layer`), compiled once per *layer program*: the static
  facts of a call (the call structure of its attention metadata, the head
  shapes, the backend, which optional inputs it has, dtypes and device).
  The 31 target layers after the first share one program per forward; on
  FA3 the draft steps share one too (their calls' key bounds differ, but
  not the FA3 call they make: `fa3_equivalent_key_bound`). The
  token and row dimensions are marked dynamic, so a program serves every
  batch bucket above 1; bucket 1 (one row, a dimension of size 1, which
  dynamo specialises) compiles each program once more, unless it is called
  under size-oblivious sizes (`fa3_spec.graphs.CompilePolicy`'s
  ``size_oblivious``, which the engine's policy uses under ``aot_eager`` and
  ``eager``);
* under CUDA-graph capture the op's kernels are captured with the rest (the
  engine's warm-up call compiles every program before its capture), so a
  replay runs the layer's own compiled kernels with no Python.

Called eagerly (no enclosing compile), a region is a plain call of
`layer_body`: regions exist to make the enclosing compile cheaper, and an
eager prefill must not compile a program per prompt length.

Why a custom op and not ``torch.compiler.nested_compile_region``: with those
regions inductor emitted wrong tokens on the GPU and could not compile them
with a symbolic batch; this op is an ordinary inductor compile of an
ordinary function.

The residual stream is carried as ``x`` plus two unsummed deltas: a layer
returns its input ``x_in``, its attention branch ``attn_out`` and its MLP
branch ``mlp_out``, and the next layer adds ``(x_in + attn_out) + mlp_out``
first, so inductor fuses those adds into the next layer's RMSNorm as it
does inline (one kernel per layer boundary). No region returns a sum with a
matmul's result: inductor turns ``x + a @ w`` whose sum leaves the graph
into an ``addmm``, and cuBLAS's addmm copies ``x`` into the output before
the GEMM (one device-to-device copy per layer, with ``(x_mid, mlp_out)``
returned). The caller sums the last three
(`fa3_spec.eagle.layer.layer_output`).

The op mutates the layer's K/V cache (``mutates_args``), like
``fa3_spec::store_kv``, so inductor writes it in place. The programs compile
with `fa3_spec.graphs.INDUCTOR_OPTIONS` under inductor, whatever options the
enclosing compile was given.

Example (what `fa3_spec.eagle.models.LlamaTarget.forward` does with
``compile_regions="inductor"``)::

    x, deltas = embeddings, ()
    for w, k, v in zip(layers, kv.k, kv.v):
        x, *deltas = decoder_layer_region(shape, w, x, deltas, None, cos, sin, slots,
                                          metadata, k, v, "fa3", None, "inductor")
    out = layer_output(x, *deltas)
"""

from __future__ import annotations

import itertools
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..attention import fa3_equivalent_key_bound, resolve_attention_backend
from ..attention.expand_attention import expand_kernel, selected_key_bound
from ..graphs import compile_fullgraph, with_own_code
from ..metadata import CascadeMetadata, FA3Metadata
from .layer import LayerShape, LayerWeights, layer_body

#: ``torch.compile`` backends a region may be compiled with.
REGION_COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

#: The `FA3Metadata` fields a region passes on: every field attention reads
#: (a `DraftPrefixMetadata`'s ``draft_attention`` labels the builder's
#: semantics and is not read by attention; it is dropped).
_MD_TENSORS = ("page_table", "cache_seqlens", "cu_seqlens_q", "cu_seqlens_k")
_MD_STATICS = ("max_seqlen_q", "max_seqlen_k", "page_size", "causal", "window_left")

#: Compiled layer programs by their static key (filled on first call of each).
_COMPILED: Dict[tuple, object] = {}
_LOCK = threading.Lock()
#: Program numbers, never reused (not even after `clear_programs`): each
#: program's code object has its own name in dynamo's logs and caches.
_PROGRAM_NUMBERS = itertools.count()


def compiled_programs() -> int:
    """How many layer programs this process holds: compiled since it
    started or since the last `clear_programs` (each is one
    ``torch.compile`` of the layer, with its own dynamo cache entries)."""
    return len(_COMPILED)


def clear_programs() -> None:
    """Forget every compiled layer program: the next region call of each key
    compiles it afresh (a graph captured before keeps the kernels it baked in)."""
    with _LOCK:
        _COMPILED.clear()


def _encode_metadata(metadata, fa3: bool = False) -> Tuple[List[torch.Tensor], List[int]]:
    """``metadata`` -> (its calls' tensors, ``[kind, *statics per call]``):
    kind 0 for an `FA3Metadata`, 1 for a `CascadeMetadata`. With ``fa3``
    each call's ``max_seqlen_k`` is `fa3_equivalent_key_bound`'s: the same
    FA3 call, so the draft steps (whose expand calls differ only in that
    bound) share one program. An expand call that the expand kernel takes
    gets `fa3_spec.attention.expand_attention.selected_key_bound` instead:
    the kernel's tile follows the bound, and FA3's equivalent (127 for 1-127
    keys) would give it eight times the tile."""
    if isinstance(metadata, CascadeMetadata):
        kind = 1
    elif isinstance(metadata, FA3Metadata):
        kind = 0
    else:
        raise TypeError(f"metadata must be an FA3Metadata or a CascadeMetadata, "
                        f"got {type(metadata).__name__}")
    tensors, statics = [], [kind]
    for call in metadata.calls:
        tensors += [getattr(call, f) for f in _MD_TENSORS]
        values = {f: int(getattr(call, f)) for f in _MD_STATICS}
        if fa3:
            bound = selected_key_bound(call)
            values["max_seqlen_k"] = fa3_equivalent_key_bound(call) if bound is None else bound
        statics += [values[f] for f in _MD_STATICS]
    return tensors, statics


def _decode_metadata(tensors: List[torch.Tensor], statics: List[int]):
    """Inverse of `_encode_metadata` (the attention reads only these fields)."""
    n = len(_MD_TENSORS)
    calls = []
    for i in range(len(tensors) // n):
        s = statics[1 + i * len(_MD_STATICS): 1 + (i + 1) * len(_MD_STATICS)]
        calls.append(FA3Metadata(*tensors[i * n:(i + 1) * n], s[0], s[1], s[2], bool(s[3]),
                                 s[4]))
    if statics[0] == 0:
        return calls[0]
    return CascadeMetadata(calls[0], calls[1] if len(calls) > 1 else None)


def decoder_layer_region(shape, w, x: torch.Tensor, deltas: Sequence[torch.Tensor],
                         attn_in: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                         slots: torch.Tensor, metadata, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, attention_backend: str, num_splits: Optional[int],
                         compile_backend: Optional[str], plans: Optional[tuple] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer through a ``fa3_spec_eagle`` layer op (``decoder_layer_first``
    without ``deltas``, else ``decoder_layer``) while
    an enclosing function is compiled; `layer_body` itself eagerly, or when
    ``compile_backend`` is None (the layers inline).

    Args: as `fa3_spec.eagle.layer.layer_body` (``shape`` a `ModelShape`,
    ``w`` a `LayerWeights`, ``x [T, H]`` with ``deltas``, none or two ``[T, H]``,
    ``attn_in [T, H_a]`` or None, ``cos, sin [T, D/2]``, int64 ``slots
    [T]``, ``metadata`` an `FA3Metadata` or `CascadeMetadata`, this layer's
    ``k_cache, v_cache [num_pages, P, H_kv, D]``, the ``attention_backend``
    and ``num_splits``), ``compile_backend``, the region's ``torch.compile``
    backend (one of `REGION_COMPILE_BACKENDS`, or None: inline), and ``plans``, the
    FA3 scheduler plans the forward's layers share
    (`fa3_spec.attention.fa3_plans`) or None.

    Returns ``(x_in, attn_out, mlp_out)``, each ``[T, H]``, as `layer_body`
    (`fa3_spec.eagle.layer.layer_output` sums them). Writes the ``T``
    tokens' K/V at ``slots``.
    """
    deltas = list(deltas)
    if len(deltas) not in (0, 2):
        raise ValueError(f"deltas must be empty or the previous layer's two, got {len(deltas)}")
    if compile_backend and compile_backend not in REGION_COMPILE_BACKENDS:
        raise ValueError(f"compile_backend must be one of {REGION_COMPILE_BACKENDS}, "
                         f"got {compile_backend!r}")
    if not compile_backend or not torch.compiler.is_compiling():  # (a False from before: inline)
        return layer_body(shape, w, x, deltas, attn_in, cos, sin, slots, metadata, k_cache,
                          v_cache, attention_backend, num_splits, plans)
    md_tensors, md_statics = _encode_metadata(metadata,
                                              fa3=resolve_attention_backend(attention_backend,
                                                                            x.device) == "fa3")
    dims = [shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate_size]
    args = (attn_in, w.as_list(), cos, sin, slots, md_tensors, list(plans or ()), k_cache,
            v_cache, md_statics, dims, float(shape.rms_eps), attention_backend, num_splits, compile_backend)
    if not deltas:  # the layer's input is x itself, which an op may not return
        return (x, *torch.ops.fa3_spec_eagle.decoder_layer_first(x, *args))
    return tuple(torch.ops.fa3_spec_eagle.decoder_layer(x, *deltas, *args))


def _run_program(x: torch.Tensor, deltas: List[torch.Tensor], attn_in: Optional[torch.Tensor],
                 weights: List[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, md_tensors: List[torch.Tensor], plans: List[torch.Tensor],
                 k_cache: torch.Tensor, v_cache: torch.Tensor, md_statics: List[int],
                 dims: List[int], eps: float, attention_backend: str, num_splits: Optional[int],
                 compile_backend: str) -> tuple:
    """Both ops' body: the compiled program of this call's key, run.
    ``(x_in, attn_out, mlp_out)`` (`layer_body`), without ``x_in`` when
    ``deltas`` is empty."""
    # The expand kernel's choice is in the key: a program bakes in where its
    # expand calls run.
    key = (tuple(md_statics), tuple(dims), eps, attention_backend, num_splits, compile_backend,
           expand_kernel(),
           len(deltas), attn_in is not None, len(weights), len(plans), str(x.device),
           tuple(t.dtype for t in (x, cos, slots, k_cache, *weights, *md_tensors)))
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is None:
            fn = _COMPILED[key] = _compile_program(next(_PROGRAM_NUMBERS), md_statics, dims,
                                                   eps, attention_backend, num_splits, compile_backend)
    # One dispatch state for every call, so the program's guards agree from
    # call to call: grad off, and below the view/in-place tracking key
    # (torch's private RAII guard; under inductor the kernel ran above it on
    # one call and below it on the next, and every program compiled twice:
    # test_compile_regions.py fails without it).
    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        x, attn_in, cos, sin, slots = (_dynamic_rows(t) for t in (x, attn_in, cos, sin, slots))
        return tuple(fn(x, [_dynamic_rows(t) for t in deltas], attn_in, weights, cos, sin, slots,
                        [_dynamic_rows(t, ndim=t.dim()) for t in md_tensors],
                        [_dynamic_rows(t) for t in plans], k_cache, v_cache))


@torch.library.custom_op("fa3_spec_eagle::decoder_layer", mutates_args=("k_cache", "v_cache"))
def _decoder_layer_op(x: torch.Tensor, delta_attn: torch.Tensor, delta_mlp: torch.Tensor,
                      attn_in: Optional[torch.Tensor], weights: List[torch.Tensor],
                      cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                      md_tensors: List[torch.Tensor], plans: List[torch.Tensor],
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      md_statics: List[int], dims: List[int],
                      eps: float, attention_backend: str, num_splits: Optional[int],
                      compile_backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer after the first: its input is ``(x + delta_attn) + delta_mlp``
    (the previous layer's three parts); ``(x_in, attn_out, mlp_out)``."""
    return _run_program(x, [delta_attn, delta_mlp], attn_in, weights, cos, sin, slots,
                        md_tensors, plans, k_cache, v_cache, md_statics, dims, eps, attention_backend,
                        num_splits, compile_backend)


@torch.library.custom_op("fa3_spec_eagle::decoder_layer_first",
                         mutates_args=("k_cache", "v_cache"))
def _decoder_layer_first_op(x: torch.Tensor, attn_in: Optional[torch.Tensor],
                            weights: List[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                            slots: torch.Tensor, md_tensors: List[torch.Tensor],
                            plans: List[torch.Tensor], k_cache: torch.Tensor,
                            v_cache: torch.Tensor, md_statics: List[int], dims: List[int],
                            eps: float, attention_backend: str, num_splits: Optional[int],
                            compile_backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """A layer whose input is ``x`` as given (a forward's first layer, a
    draft layer); ``(attn_out, mlp_out)``."""
    return _run_program(x, [], attn_in, weights, cos, sin, slots, md_tensors, plans, k_cache,
                        v_cache, md_statics, dims, eps, attention_backend, num_splits, compile_backend)


def _dynamic_rows(t: Optional[torch.Tensor], ndim: int = 1) -> Optional[torch.Tensor]:
    """A view of ``t`` whose first ``ndim`` dimensions dynamo treats as
    dynamic. A view, so that the marking stays off the caller's tensor (a
    marked input would fail the guards of the frame that compiled the caller).

    The metadata's tensors are marked in every dimension: the draft steps
    share a program on FA3, and their expand call's page table grows by one
    column a step (one column per draft token), so a static width would
    compile the program once per step.
    A width of 1 (the first step under ``ancestors``) is still specialised by
    dynamo: one extra."""
    if t is None:
        return None
    alias = t.view(t.shape)
    for d in range(ndim):
        torch._dynamo.maybe_mark_dynamic(alias, d)
    return alias


@_decoder_layer_op.register_fake
def _decoder_layer_fake(x, *_):
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape)


@_decoder_layer_first_op.register_fake
def _decoder_layer_first_fake(x, *_):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _compile_program(index: int, md_statics: List[int], dims: List[int], eps: float,
                     attention_backend: str, num_splits: Optional[int], compile_backend: str):
    """``torch.compile(fullgraph=True)`` of one layer program
    (`fa3_spec.graphs.compile_fullgraph`: inductor gets the library's options).

    Each program gets a copy of the body's code object (`with_own_code`), so
    the programs of one iteration (the first target layer, the others, each
    draft step's metadata) never evict one another.
    """
    shape = LayerShape(*dims, rms_eps=eps)
    statics = list(md_statics)

    def program(x, deltas, attn_in, weights, cos, sin, slots, md_tensors, plans, k_cache,
                v_cache):
        out = layer_body(shape, LayerWeights.from_list(weights), x, deltas, attn_in, cos, sin,
                         slots, _decode_metadata(md_tensors, statics), k_cache, v_cache,
                         attention_backend, num_splits, tuple(plans) or None)
        return out if deltas else out[1:]  # never an input as an output

    fresh = with_own_code(program, f"decoder_layer_program_{index}")
    return compile_fullgraph(fresh, compile_backend=compile_backend, dynamic=None)
