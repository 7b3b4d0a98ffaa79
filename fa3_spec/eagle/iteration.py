"""One EAGLE iteration, all on the device: draft, tree, verify, accept, commit, extend.

`eagle_iteration` is a pure function of static-shaped device tensors (the
loop state, batch-major ``[B]``) except for the K/V it writes into the pool:
no host sync, no data-dependent shape, no Python branch on a tensor value.
It compiles with ``torch.compile(fullgraph=True)`` and is captured as one
CUDA graph per batch bucket (see `fa3_spec.eagle.engine`).

Per request ``b`` with ``seq_len`` tokens in both caches and the *root* (the
last emitted token, not yet in any cache) at position ``seq_len``:

1. **Draft.** ``S - 1`` draft steps. Step ``i`` feeds each of the ``K``
   leaves ``fc([embed(leaf token); parent's draft feature])`` at position
   ``seq_len + i`` and its own slot; each leaf proposes its top-``K`` and the
   ``K`` best of the ``K * K`` candidates by cumulative log-probability
   become the next leaves (EAGLE-2). What a leaf attends besides the prefix
   is ``lc.draft_attention`` (docs/semantics.md, "Draft decode"):

   * ``"ancestors"``: its true ancestors and itself. The draft slots are
     plain slots after the prefix (`draft_positions(..., "ancestors")`); the
     prefix call is built once per iteration, and each step's expand call
     inside the iteration from the running ancestor slots
     (`draft_ancestor_slots` over the selection's parent branch). No tail
     copy.
   * ``"branch"`` (sglang's semantics, for parity with it): the slots of
     its branch ``out_cache_loc[b, t, :i+1]``, whichever leaf held them
     before. The prefix's partial last page is first copied into every
     branch's first page (`draft_tail_copy_slots`), and all steps' metadata
     comes from `build_draft_iteration_metadata`.
2. **Tree.** Of all ``K + (S-1) K^2`` candidates take the ``N - 1`` best
   (ties broken by index, so a node's ancestors always come first), sorted
   by index, plus the root as node 0: ``tokens [B, N]``, ``parents [B, N]``
   (``-1`` at the root), tree mask ``[B, N, N]``. topk = 1 is a chain.
3. **Verify.** The target runs over the ``N`` nodes: node ``c`` at row
   position ``seq_len + c`` (its slot) and RoPE position ``seq_len +
   depth(c)``, through `build_target_verify_metadata` (tree cascade, or the
   causal chain call when topk = 1).
4. **Accept (greedy).** From the root, follow the child whose token is the
   target's argmax at its parent, as deep as it goes; emit the accepted
   drafts plus the argmax at the last accepted node (the bonus token), which
   becomes the next root. Rows with ``temperature > 0`` (``lc.sampling``)
   take the lossless sampled walk of `fa3_spec.eagle.sampling` instead
   (docs/semantics.md, "Lossless speculative sampling"); greedy rows keep
   this argmax walk, in the same graph.
5. **Commit.** Copy the target K/V of the accepted path's node ``i`` (at
   ``seq_len + path[i]``) to position ``seq_len + i`` (gather, then write;
   ``path[i] >= i``); ``seq_len`` grows by ``1 + accepted``.
6. **Draft extend** (`build_draft_extend_metadata`) over the ``1 + accepted``
   new positions with EAGLE's shift: draft position ``p`` consumes the token
   at ``p + 1`` and the target feature at ``p``. Its last position gives the
   new root's top-``K`` children and the feature for the next draft step
   (a padding row's: zeros).
7. **Output.** Append the emitted tokens to the device output buffer, stop
   at EOS or ``max_new_tokens``; a finished request becomes a padding row
   (``seq_len = 0``) that reads nothing and writes only slot 0.

An acceptance hook (`fa3_spec.eagle.acceptance`, benchmarks and studies)
replaces step 4's decision for every row: the same work, output that is not
the model's.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from ..batch import SpecBatch
from ..builders import (
    build_draft_decode_metadata,
    build_draft_extend_metadata,
    build_draft_iteration_metadata,
    build_draft_prefix_metadata,
    build_target_verify_metadata,
    draft_ancestor_slots,
    draft_positions,
    draft_tail_copy_slots,
)
from ..builders.prefill import extend_query_positions
from ..config import SpecConfig, check_draft_attention
from ..metadata_builder import DEFAULT_DRAFT_ATTENTION
from ..paged import BatchView, in_pool
from ..tree import tree_mask_from_parents
from .models import KVCache, SpecModel
from .decode import decode_step
from .sampling import (SamplingParams, choose_rows, sample_tokens, sample_tree, state_entries,
                       walk_tree)
from .vocab import vocab_argmax

#: Emitted tokens per iteration (accepted drafts + bonus) of the benchmarks'
#: scripted acceptance (`fa3_spec.eagle.acceptance.scripted_acceptance`); mean 3.5.
DEFAULT_SCRIPT = (3, 4, 2, 5, 3, 4)

State = Dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static configuration of the loop.

    Attributes:
        spec: fa3_spec's `SpecConfig` (``num_pages`` = the pool size).
        max_new_tokens: width of the device output buffer (largest
            ``max_new_tokens`` of a request).
        attention_backend: the attention (``"torch"``, ``"fa3"``, ``"auto"``).
        num_splits: FA3 split count (None: fa3_spec's default).
        max_eos: EOS ids a request may have at most (the state's ``eos``
            set per row is this wide, padded with -1; Llama 3.1 has 3).
        sampling: the iteration also runs the sampled walk and takes it for
            rows with ``temperature > 0`` (one sort of the verify logits per
            node); False: greedy only, and the engine refuses sampled requests.
        draft_attention: what a tree draft's leaf attends besides the prefix:
            ``"ancestors"``, its true ancestors (any slots, no tail copy),
            or ``"branch"``, its branch's slots (sglang's semantics; what
            the sglang-parity paths use). Output is exact either way; the
            draft's proposals, and so acceptance, differ. The default is
            ``"ancestors"``: EAGLE-2's own semantics, any allocator's slots,
            and no slower an iteration (the loop benchmark compares the
            two), so parity with sglang is no reason to keep a leaf reading
            keys that are not its ancestors.
    """

    spec: SpecConfig
    max_new_tokens: int
    attention_backend: str = "auto"
    num_splits: Optional[int] = None
    max_eos: int = 4
    sampling: bool = True
    draft_attention: str = DEFAULT_DRAFT_ATTENTION

    def __post_init__(self):
        check_draft_attention(self.draft_attention)
        s = self.spec
        candidates = s.topk + (s.num_steps - 1) * s.topk ** 2
        if s.num_draft_tokens < 2:
            raise ValueError("num_draft_tokens must be >= 2 (the root and one draft)")
        if s.num_draft_tokens - 1 > candidates:
            raise ValueError(
                f"num_draft_tokens - 1 = {s.num_draft_tokens - 1} exceeds the "
                f"{candidates} draft candidates of topk={s.topk}, num_steps={s.num_steps}")
        if s.num_pages is None:
            raise ValueError("spec.num_pages must be set (the KV pool size)")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.max_eos < 1:
            raise ValueError(f"max_eos must be >= 1, got {self.max_eos}")

    @property
    def max_depth(self) -> int:
        """Deepest accepted path: ``min(N - 1, S)`` drafts."""
        return min(self.spec.num_draft_tokens - 1, self.spec.num_steps)


def empty_state(lc: LoopConfig, models: SpecModel, max_bs: int, device, *,
                widths: Optional["StateWidths"] = None) -> State:
    """All-padding state for ``max_bs`` batch rows (every tensor batch-major).

    ``widths``: the widths of what an iteration carries and records
    (`StateWidths`), when iterations of several tree shapes share the state;
    None: ``lc``'s own shape. `eagle_iteration` refuses a state narrower than
    its shape.
    """
    w = StateWidths.of(lc) if widths is None else widths
    k, n, d = w.topk, w.tree, w.depth
    i64 = dict(dtype=torch.int64, device=device)
    z = lambda *s: torch.zeros(*s, **i64)  # noqa: E731
    return {
        "req_pool_indices": z(max_bs),
        "seq_lens": z(max_bs),  # 0 = padding row (free or finished)
        "root": z(max_bs),
        "cand_tokens": z(max_bs, k),
        "cand_scores": torch.zeros(max_bs, k, dtype=torch.float32, device=device),
        "draft_hidden": torch.zeros(max_bs, models.hidden_size, dtype=models.dtype, device=device),
        "out_tokens": z(max_bs, lc.max_new_tokens + 1),  # last column: trash
        "out_len": z(max_bs),
        "max_new": z(max_bs),
        "eos": torch.full((max_bs, lc.max_eos), -1, **i64),  # EOS ids of each row, -1: none
        "iters": z(max_bs),
        # What the last iteration did (read by the host for stats and drawings).
        "tree_tokens": z(max_bs, n),
        "parents": torch.full((max_bs, n), -1, **i64),
        "path": z(max_bs, d + 1),
        "accept_len": z(max_bs),  # tokens emitted before EOS/max truncation; 0 = padding
        **state_entries(max_bs, device),  # per-request sampling parameters (greedy rows)
    }


@dataclasses.dataclass(frozen=True)
class StateWidths:
    """Widths of the loop state that depend on a tree shape, so that
    iterations of several shapes (one per batch bucket) share one state and a
    request keeps its tokens when its rows move between them.

    ``topk``: candidates carried to the next iteration (the next root's
    best children by draft score, best first); an iteration of topk ``k``
    drafts from the first ``k``. ``tree``: draft-tree nodes recorded
    (``tree_tokens``, ``parents``; a smaller tree pads with token 0 and
    parent -1). ``depth``: accepted depth recorded (``path`` is ``depth + 1``
    wide; a shallower path repeats its last node, as a path does past its
    accepted depth).
    """

    topk: int
    tree: int
    depth: int

    @classmethod
    def of(cls, lc: "LoopConfig") -> "StateWidths":
        """The widths of ``lc``'s own shape."""
        return cls(lc.spec.topk, lc.spec.num_draft_tokens, lc.max_depth)

    @classmethod
    def covering(cls, configs) -> "StateWidths":
        """The narrowest widths that hold every one of ``configs`` (`LoopConfig`)."""
        configs = list(configs)
        if not configs:
            raise ValueError("configs must not be empty")
        return cls(max(c.spec.topk for c in configs),
                   max(c.spec.num_draft_tokens for c in configs),
                   max(c.max_depth for c in configs))

    def check_holds(self, lc: "LoopConfig") -> None:
        """`ValueError` if a state of these widths cannot carry ``lc``'s iterations."""
        own = StateWidths.of(lc)
        if self.topk < own.topk or self.tree < own.tree or self.depth < own.depth:
            raise ValueError(f"state widths {self} are narrower than the shape's own {own}")


def state_widths(st: State) -> StateWidths:
    """The `StateWidths` of a state (from its tensors' static shapes)."""
    return StateWidths(st["cand_tokens"].shape[1], st["parents"].shape[1],
                       st["path"].shape[1] - 1)


def _copy_kv_slots(kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.numel():
        kv.copy_slots(src, dst)


def draft_slots(lc: LoopConfig, view: BatchView) -> torch.Tensor:
    """int64 draft slots of the batch (0 on padding rows), read from each row at
    `draft_positions` of ``lc.draft_attention``: ``[B, K, S]`` in the branch
    layout, ``[B, K, S - 1]`` (leaf ``t``'s own slot at step ``i``) for ancestors."""
    cfg = lc.spec
    positions = draft_positions(cfg, view.seq_lens, lc.draft_attention)
    loc = view.slots(positions.flatten(1)).view(positions.shape)
    return torch.where(view.live.view(-1, 1, 1), loc, 0)


def _draft_steps(lc: LoopConfig, models: SpecModel, draft_kv: KVCache, view: BatchView,
                 st: State, batch: dict, metadata=None):
    """Draft steps -> every candidate's token, cumulative score and parent candidate."""
    cfg = lc.spec
    bs, k = view.batch_size, cfg.topk
    loc = draft_slots(lc, view)
    ancestors = lc.draft_attention == "ancestors"
    if ancestors:
        if metadata is not None:
            raise ValueError("draft metadata built outside the iteration is branch semantics "
                             "only: ancestor steps depend on the selection inside it")
        prefix = build_draft_prefix_metadata(cfg, **batch, draft_attention="ancestors")
        path = loc[:, :, :0]  # ancestor slots of the current leaves, [B, K, i + 1] at step i
    else:
        src, dst = draft_tail_copy_slots(cfg, seq_lens=view.seq_lens, out_cache_loc=loc)
        _copy_kv_slots(draft_kv, src, dst)
        steps = metadata
        if steps is None:
            steps = build_draft_iteration_metadata(cfg, **batch, out_cache_loc=loc)
    # The state may carry more candidates than this shape drafts from
    # (`StateWidths`): the first k, best first.
    tokens = st["cand_tokens"][:, :k].contiguous()
    scores = st["cand_scores"][:, :k].contiguous()
    # Per-leaf values (request-major, [B * K]) are indexed by each leaf's
    # request (``owner``) and branch (``branch``), not reshaped from [B, K]
    # views; likewise each child's parent leaf (``child_parent``) from a
    # [B, K, K] view. Under size-oblivious sizes such reshapes guard the batch
    # against 1 (in inductor's lowering; in the view's layout check for
    # chains, k = 1), which gives bucket 1 a frame of its own.
    owner = torch.arange(bs * k, device=tokens.device) // k  # request of each leaf
    branch = torch.arange(bs * k, device=tokens.device) % k  # its branch in the request
    hidden = st["draft_hidden"][owner]
    leaf = torch.arange(k, device=tokens.device).expand(bs, k)  # candidate index of each leaf
    child_parent = torch.arange(k * k, device=tokens.device) // k  # a child's leaf, of k
    parent_branch = leaf  # of each leaf, in the previous step (unused at step 0)
    all_tokens, all_scores, all_parents = [tokens], [scores], [torch.full_like(tokens, -1)]
    offset = k
    for i in range(cfg.num_draft_decode_steps):
        if ancestors:
            path = draft_ancestor_slots(path, parent_branch, loc[:, :, i])
            md = build_draft_decode_metadata(cfg, i, draft_attention="ancestors", **batch,
                                             ancestor_slots=path, prefix=prefix)
        else:
            md = steps[i]
        positions = view.seq_lens[owner] + i
        out = models.draft_forward(tokens.reshape(-1), hidden.reshape(bs * k, -1), positions,
                                   loc[owner, branch,
                                       i], md, draft_kv, attention_backend=lc.attention_backend,
                                   num_splits=lc.num_splits)
        top_lp, top_tok = models.draft_topk(out, k)  # target token ids
        cum = (scores.unsqueeze(-1) + top_lp.view(bs, k, k)).view(bs, k * k)
        top_tok = top_tok.view(bs, k * k)
        all_tokens.append(top_tok)
        all_scores.append(cum)
        all_parents.append(leaf[:, child_parent])
        best = torch.sort(cum, dim=-1, descending=True, stable=True).indices[:, :k]
        tokens, scores = top_tok.gather(1, best), cum.gather(1, best)
        parent_branch = torch.div(best, k, rounding_mode="floor")
        hidden = out.view(bs, k, -1).gather(
            1, parent_branch.unsqueeze(-1).expand(bs, k, models.hidden_size))
        leaf = offset + best
        offset += k * k
    return torch.cat(all_tokens, 1), torch.cat(all_scores, 1), torch.cat(all_parents, 1)


def _organize_tree(lc: LoopConfig, root, cand_tokens, cand_scores, cand_parents):
    """The ``N - 1`` best candidates plus the root: ``tokens, parents`` ``[B, N]``."""
    n = lc.spec.num_draft_tokens
    bs = root.shape[0]
    if lc.spec.topk == 1:  # a chain: candidate i is the child of candidate i - 1
        chosen = torch.arange(n - 1, device=root.device).expand(bs, n - 1)
    else:
        best = torch.sort(cand_scores, dim=-1, descending=True, stable=True).indices[:, : n - 1]
        chosen = torch.sort(best, dim=-1).values
    tokens = torch.cat([root.unsqueeze(1), cand_tokens.gather(1, chosen)], 1)
    parent_cand = cand_parents.gather(1, chosen)  # [B, N-1], -1: child of the root
    same = chosen.unsqueeze(1) == parent_cand.unsqueeze(2)  # [B, child, chosen]
    node = torch.arange(1, n, device=root.device)
    parent_node = torch.where(parent_cand < 0, 0, (same.long() * node).sum(-1))
    parents = torch.cat([torch.full_like(root, -1).unsqueeze(1), parent_node], 1)
    return tokens, parents


def _accept(lc: LoopConfig, tokens, parents, next_tokens, live, iters, acceptance=None):
    """Greedy walk from the root, or ``acceptance``'s decision:
    ``(path [B, D+1], accepted [B], bonus [B])``.

    ``path[:, i]`` is the node at depth ``i`` of the accepted path for
    ``i <= accepted`` (entries past it repeat the last accepted node).
    """
    depth_max = lc.max_depth
    if acceptance is not None:
        path, accepted = acceptance(tokens, parents, live, iters, depth_max)
    else:
        def argmax_child(cur, child):  # the child whose token is the target's argmax at cur
            return child & (tokens == next_tokens.gather(1, cur.unsqueeze(1)))

        path, accepted = walk_tree(parents, live, depth_max, argmax_child)
    accepted = torch.where(live, accepted, 0)
    last = path.gather(1, accepted.unsqueeze(1))
    bonus = next_tokens.gather(1, last).squeeze(1)
    return path, accepted, bonus


def draft_phase(lc: LoopConfig, models: SpecModel, draft_kv: KVCache,
                req_to_token: torch.Tensor, st: State, metadata=None) -> State:
    """Steps 1-2: draft steps and the tree -> ``tokens``, ``parents`` ``[B, N]``,
    ``tree_mask`` ``[B, N, N]``. ``metadata``: the draft steps' metadata
    (branch semantics only), or None to build it here."""
    batch = dict(req_to_token=req_to_token, req_pool_indices=st["req_pool_indices"],
                 seq_lens=st["seq_lens"])
    view = SpecBatch.create(lc.spec, **batch).view()
    cand = _draft_steps(lc, models, draft_kv, view, st, batch, metadata)
    tokens, parents = _organize_tree(lc, st["root"], *cand)
    return dict(tokens=tokens, parents=parents, tree_mask=tree_mask_from_parents(parents))


def verify_phase(lc: LoopConfig, models: SpecModel, target_kv: KVCache,
                 req_to_token: torch.Tensor, st: State, tree: State, metadata=None,
                 acceptance=None) -> State:
    """Steps 3-5: verify, acceptance (greedy, or sampled, or ``acceptance``'s), commit.
    ``metadata``: the verify metadata, or None to build it here
    (`build_target_verify_metadata`)."""
    cfg = lc.spec
    n, dmax = cfg.num_draft_tokens, lc.max_depth
    seq_lens = st["seq_lens"]
    bs = seq_lens.shape[0]
    batch = dict(req_to_token=req_to_token, req_pool_indices=st["req_pool_indices"],
                 seq_lens=seq_lens)
    view = SpecBatch.create(cfg, **batch).view()
    live = view.live
    tokens, parents, tree_mask = tree["tokens"], tree["parents"], tree["tree_mask"]
    depth = tree_mask.sum(-1) - 1

    # 3. Verify: node c at slot seq_len + c, RoPE position seq_len + depth(c).
    node = torch.arange(n, device=seq_lens.device)
    verify_slots = view.slots(view.seq_lens.unsqueeze(1) + node)
    verify_slots = torch.where(live.unsqueeze(1), verify_slots, 0)
    md = metadata
    if md is None:
        md = build_target_verify_metadata(cfg, **batch,
                                          tree_mask=None if cfg.topk == 1 else tree_mask)
    positions = view.seq_lens.unsqueeze(1) + depth
    hidden = models.target_forward(tokens.reshape(-1), positions.reshape(-1),
                                   verify_slots.reshape(-1), md, target_kv,
                                   attention_backend=lc.attention_backend, num_splits=lc.num_splits)
    logits = models.target_logits(hidden).view(bs, n, -1)
    next_tokens = vocab_argmax(logits)

    # 4. Greedy acceptance; sampled rows: the lossless walk (its counter: tokens emitted).
    path, accepted, bonus = _accept(lc, tokens, parents, next_tokens, live, st["iters"],
                                    acceptance)
    if lc.sampling and acceptance is None:
        sampled = sample_tree(logits, tokens, parents, live, SamplingParams.from_state(st),
                              st["out_len"], dmax)
        path, accepted, bonus = choose_rows(st["temperature"] > 0, sampled, (path, accepted, bonus))

    # 5. Commit the accepted path's target K/V to positions seq_len + i.
    i = torch.arange(dmax + 1, device=seq_lens.device)
    keep = (i <= accepted.unsqueeze(1)) & live.unsqueeze(1)
    src = torch.where(keep, verify_slots.gather(1, path), 0)
    dst = torch.where(keep, view.slots(view.seq_lens.unsqueeze(1) + i), 0)
    _copy_kv_slots(target_kv, src.reshape(-1), dst.reshape(-1))
    return dict(hidden=hidden.view(bs, n, -1), path=path, accepted=accepted, bonus=bonus,
                new_seq_lens=torch.where(live, view.seq_lens + accepted + 1, 0),
                extend_seq_lens=torch.where(live, accepted + 1, 0))


def extend_phase(lc: LoopConfig, models: SpecModel, draft_kv: KVCache,
                 req_to_token: torch.Tensor, st: State, tree: State, verified: State,
                 metadata=None) -> State:
    """Steps 6-7: draft extend and the output append -> the new state.
    ``metadata``: the extend metadata, or None to build it here
    (`build_draft_extend_metadata` over ``new_seq_lens``)."""
    cfg = lc.spec
    n, dmax = cfg.num_draft_tokens, lc.max_depth
    seq_lens = st["seq_lens"]
    bs = seq_lens.shape[0]
    view = SpecBatch.create(cfg, req_to_token=req_to_token, req_pool_indices=st["req_pool_indices"],
                            seq_lens=seq_lens).view()
    live = view.live
    tokens, parents = tree["tokens"], tree["parents"]
    path, accepted, bonus = verified["path"], verified["accepted"], verified["bonus"]
    hidden, new_seq = verified["hidden"], verified["new_seq_lens"]
    i = torch.arange(dmax + 1, device=seq_lens.device)

    # Emitted tokens: accepted drafts, then the bonus.
    next_node = torch.cat([path[:, 1:], path[:, -1:]], 1)
    emitted = torch.where(i < accepted.unsqueeze(1), tokens.gather(1, next_node),
                          bonus.unsqueeze(1))  # [B, D+1]

    # 6. Draft extend over the 1 + accepted new positions (EAGLE shift).
    md_ext = metadata
    if md_ext is None:
        md_ext = build_draft_extend_metadata(
            cfg, req_to_token=req_to_token, req_pool_indices=st["req_pool_indices"],
            seq_lens=new_seq, extend_seq_lens=verified["extend_seq_lens"])
    row, pos, owned = extend_query_positions(md_ext, new_seq, bs * n)
    j = (pos - view.seq_lens[row]).clamp(0, dmax)  # index within the extend
    ext_tokens = emitted[row, j]
    ext_hidden = models.draft_input(hidden[row, path[row, j]])
    ext_slots = req_to_token[view.rows[row], pos.clamp(0, req_to_token.shape[1] - 1)]
    ext_slots = torch.where(owned, in_pool(ext_slots, cfg.page_size, cfg.num_pages), 0)
    h_ext = models.draft_forward(ext_tokens, ext_hidden, pos, ext_slots, md_ext, draft_kv,
                                 attention_backend=lc.attention_backend, num_splits=lc.num_splits)
    last = (md_ext.cu_seqlens_q[1:].to(torch.int64) - 1).clamp(0, h_ext.shape[0] - 1)
    live_row = live.unsqueeze(1)
    draft_hidden = torch.where(live_row, h_ext[last], 0)
    # The head scores h_ext's rows ``last`` itself (see `normed_rows`); a
    # padding row's candidates are zeros, as in `empty_state`.
    cand_scores, cand_tokens = models.draft_topk(h_ext, st["cand_tokens"].shape[1], rows=last)
    cand_scores = torch.where(live_row, cand_scores, 0)
    cand_tokens = torch.where(live_row, cand_tokens, 0)

    # 7. Output append, EOS / length stop; finished rows become padding.
    out_tokens, out_len, finished = append_output(st, emitted, torch.where(live, accepted + 1, 0))

    widths = state_widths(st)
    new = dict(st)
    new.update(
        seq_lens=torch.where(finished, 0, new_seq),
        root=torch.where(live, bonus, st["root"]),
        cand_tokens=cand_tokens,
        cand_scores=cand_scores,
        draft_hidden=draft_hidden.to(st["draft_hidden"].dtype),
        out_tokens=out_tokens,
        out_len=out_len,
        iters=st["iters"] + live.long(),
        tree_tokens=_pad_columns(tokens, widths.tree, 0),
        parents=_pad_columns(parents, widths.tree, -1),
        path=_pad_columns(path, widths.depth + 1, None),
        accept_len=torch.where(live, accepted + 1, 0),
    )
    return new


def _pad_columns(x: torch.Tensor, width: int, fill: Optional[int]) -> torch.Tensor:
    """``x [B, c]`` widened to ``[B, width]`` with ``fill`` (None: its last column)."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    pad = x[:, -1:] if fill is None else torch.full_like(x[:, :1], fill)
    return torch.cat([x, pad.expand(-1, extra)], 1)


def append_output(st: State, emitted: torch.Tensor, emit: torch.Tensor):
    """Append up to ``emit [B]`` of each row's ``emitted [B, E]`` tokens to the
    output buffer, stopping after an EOS of the row or at its ``max_new``.

    Returns ``(out_tokens, out_len, finished)``; a row past its budget
    writes into the buffer's trash column only.
    """
    i = torch.arange(emitted.shape[1], device=emitted.device)
    is_eos = ((emitted.unsqueeze(-1) == st["eos"].unsqueeze(1)).any(-1)
              & (i < emit.unsqueeze(1)))
    hit_eos = is_eos.any(-1)
    emit = torch.where(hit_eos, is_eos.int().argmax(-1) + 1, emit)
    emit = torch.minimum(emit, (st["max_new"] - st["out_len"]).clamp(min=0))
    width = st["out_tokens"].shape[1] - 1  # the last column is a trash column
    column = torch.where(i < emit.unsqueeze(1), st["out_len"].unsqueeze(1) + i, width)
    out_tokens = st["out_tokens"].scatter(1, column.clamp(max=width), emitted)
    out_len = st["out_len"] + emit
    finished = (st["seq_lens"] > 0) & (hit_eos | (out_len >= st["max_new"]))
    return out_tokens, out_len, finished


def plain_iteration(lc: LoopConfig, models: SpecModel, target_kv: KVCache,
                    req_to_token: torch.Tensor, st: State) -> State:
    """One plain decode step over the loop state: what a batch bucket runs
    when it does not speculate.

    The target decodes each row's root at ``seq_len`` and emits its next
    token: the argmax, or for a row with ``temperature > 0`` a draw with the
    counter of the token's index in the output (as `sample_tokens` draws it
    for plain sampled decoding). The draft does not run, so that the step
    costs what plain decoding costs: the candidates and draft feature stay
    as the row's last speculative iteration left them, and the draft K/V of
    the positions decoded here is never written. A row that speculates again
    drafts from that state, its draft attending stale entries at those
    positions for the rest of the request: it accepts less from then on,
    while the target's verification keeps the output exact (greedy) or
    distributed as the target's (sampled) whatever the draft proposes. The
    recorded tree is the root alone (``accept_len`` 1, no draft offered).
    """
    seq_lens = st["seq_lens"]
    live = seq_lens > 0
    logits = decode_step(models, lc.spec, target_kv, req_to_token, st["req_pool_indices"],
                         seq_lens, st["root"], attention_backend=lc.attention_backend,
                         num_splits=lc.num_splits)
    if lc.sampling:
        nxt = sample_tokens(logits, SamplingParams.from_state(st), st["out_len"])
    else:
        nxt = vocab_argmax(logits)
    out_tokens, out_len, finished = append_output(st, nxt.unsqueeze(1), live.long())
    widths = state_widths(st)
    new = dict(st)
    new.update(
        seq_lens=torch.where(finished, 0, torch.where(live, seq_lens + 1, 0)),
        root=torch.where(live, nxt, st["root"]),
        out_tokens=out_tokens,
        out_len=out_len,
        iters=st["iters"] + live.long(),
        tree_tokens=_pad_columns(st["root"].unsqueeze(1), widths.tree, 0),
        parents=torch.full_like(st["parents"], -1),
        path=torch.zeros_like(st["path"]),
        accept_len=live.long(),
    )
    return new


def eagle_iteration(lc: LoopConfig, models: SpecModel, target_kv: KVCache, draft_kv: KVCache,
                    req_to_token: torch.Tensor, st: State, acceptance=None) -> State:
    """One speculative iteration over the batch state ``st`` (see the module docstring).

    Args:
        lc: static loop configuration.
        models: the target + draft pair (`SpecModel`).
        target_kv, draft_kv: the pool's caches (written in place).
        req_to_token: int32 ``[max_reqs, >= spec.draft_row_len_for(lc.draft_attention)]``.
        st: batch state from `empty_state` (rows ``[B]``; padding rows have
            ``seq_lens == 0``).
        acceptance: an acceptance hook (`fa3_spec.eagle.acceptance`) that
            decides the accepted path instead of the target, or None.

    Returns:
        The new state (same keys and shapes). Only the K/V caches are
        mutated; a caller that keeps the state in static buffers copies the
        result back (`step_in_place`). Every metadata is built inside, by
        fa3_spec builders: the three phases (`draft_phase`, `verify_phase`,
        `extend_phase`) also accept metadata built elsewhere (the benchmark's
        host-built baseline).
    """
    state_widths(st).check_holds(lc)  # static shapes: checked while tracing
    tree = draft_phase(lc, models, draft_kv, req_to_token, st)
    verified = verify_phase(lc, models, target_kv, req_to_token, st, tree,
                            acceptance=acceptance)
    return extend_phase(lc, models, draft_kv, req_to_token, st, tree, verified)


def step_in_place(fn, st: State) -> None:
    """``st[k].copy_(fn(st)[k])`` for every key: the state stays in its buffers
    (what a captured graph needs: fixed addresses)."""
    new = fn(st)
    for key, buf in st.items():
        buf.copy_(new[key])
