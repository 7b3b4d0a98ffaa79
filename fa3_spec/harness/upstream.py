"""An upstream-style reference: metadata built the way host-synced engines do.

This is the parity oracle for the builders and the baseline of the
benchmarks. It mirrors the structure of an engine backend's replay path:
preallocated buffers filled in place, page tables sized by ``.item()`` on
the batch's longest sequence, the tree-verify mask read from the flat
``O(sum(seq_len) * N)`` custom mask, the draft prefix rebuilt every step.
Everything here syncs with the host; none of it is meant to be compiled.

``revert_pr_27360=True`` replays the pre-fix expand-table code for topk > 1
and page_size > 1: the ``num_steps``-wide ``cache_loc`` is scattered, not
sliced to ``decode_length``, into the ``decode_length + 1``-column row. On
CPU that surfaces as PyTorch's index-out-of-bounds error; in compiled GPU
code it is a silent write into the neighbouring row.

Returned metadata are clones of the buffers' live slices, so results stay
valid after the next call. Semantics are those of docs/semantics.md (padding
rows read nothing), not any one engine's quirks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import SpecConfig, cdiv
from ..metadata import CascadeMetadata, FA3Metadata
from ..tree import flat_from_tree_mask


class UpstreamStyleBuilder:
    """Host-synced metadata builder with in-place buffers (the baseline).

    Args:
        cfg: static configuration.
        device: where the buffers live.
        revert_pr_27360: replay the pre-#27360 unsliced scatter (A/B switch).
        scatter: ``scatter(table_view, index, pages)`` that fills the expand
            table in place; default `torch.Tensor.scatter_` (bounds-checked:
            an index error on CPU, a device-side assert on CUDA). Pass a
            kernel that trusts its indices (e.g. the scatter compiled by
            inductor with ``assert_indirect_indexing=False``) to study the
            pre-fix overflow as compiled graph code meets it: a silent write
            past the row (see ``compile_tests/memcheck_probe.py``).
    """

    def __init__(self, cfg: SpecConfig, device="cpu", *, revert_pr_27360: bool = False,
                 scatter=None):
        self.cfg = cfg
        self.revert_pr_27360 = revert_pr_27360
        self.scatter = scatter or torch.Tensor.scatter_
        rows = cfg.max_bs * max(cfg.topk, cfg.num_draft_tokens)
        i32 = dict(dtype=torch.int32, device=device)
        self.page_table = torch.zeros(rows, cfg.page_table_width, **i32)
        self.cache_seqlens = torch.zeros(rows, **i32)
        self.cu_seqlens_q = torch.zeros(rows + 1, **i32)
        self.cu_seqlens_k = torch.zeros(rows + 1, **i32)
        # One expand buffer per draft step, decode_length + 1 columns wide.
        self.expand_page_table = {
            step: torch.zeros(cfg.max_bs * cfg.topk, step + 2, **i32)
            for step in range(cfg.num_steps - 1)
        }
        self.expand_cache_seqlens = torch.zeros(cfg.max_bs * cfg.topk, **i32)
        self.verify_page_table = torch.zeros(cfg.max_bs * cfg.num_draft_tokens,
                                             cfg.num_draft_tokens, **i32)
        self.verify_cache_seqlens = torch.zeros(cfg.max_bs * cfg.num_draft_tokens, **i32)

    # ----------------------------------------------------------------- helpers
    def _fill_request_call(self, req_to_token, rows, lengths, q_per_row, max_k, causal,
                           cu_seqlens_q=None) -> FA3Metadata:
        p, bs = self.cfg.page_size, rows.shape[0]
        lengths = lengths * (lengths > 0)
        self.cache_seqlens[:bs].copy_(lengths)
        max_len = int(lengths.max().item()) if bs else 0  # host sync
        max_pages = cdiv(max_len, p)
        strided = torch.arange(0, max_pages * p, p, device=rows.device)
        pages = req_to_token[rows[:, None], strided[None, :]] // p
        pages = pages * (strided[None, :] < lengths[:, None])
        self.page_table[:bs, :max_pages].copy_(pages)
        self.page_table[:bs, max_pages:].fill_(0)
        if cu_seqlens_q is None:
            cu_seqlens_q = torch.arange(0, bs * q_per_row + 1, q_per_row, device=rows.device)
        self.cu_seqlens_q[: bs + 1].copy_(cu_seqlens_q)
        self.cu_seqlens_k[: bs + 1].copy_(F.pad(torch.cumsum(lengths, 0), (1, 0)))
        return FA3Metadata(
            self.page_table[:bs].clone(), self.cache_seqlens[:bs].clone(),
            self.cu_seqlens_q[: bs + 1].clone(), self.cu_seqlens_k[: bs + 1].clone(),
            q_per_row, max_k, p, causal,
        )

    # ------------------------------------------------------------------- modes
    def decode(self, *, req_to_token, req_pool_indices, seq_lens) -> FA3Metadata:
        return self._fill_request_call(req_to_token, req_pool_indices, seq_lens, 1,
                                       self.cfg.max_context_len, True)

    def draft_decode(self, step, *, req_to_token, req_pool_indices, seq_lens,
                     out_cache_loc=None):
        cfg, d = self.cfg, step + 1
        live = seq_lens > 0
        if cfg.topk == 1:
            return self._fill_request_call(req_to_token, req_pool_indices,
                                           (seq_lens + d) * live, 1,
                                           cfg.max_context_len + d, True)
        p, k = cfg.page_size, cfg.topk
        last = seq_lens % p
        prefix = self._fill_request_call(req_to_token, req_pool_indices, seq_lens - last,
                                         k, cfg.max_context_len, False)
        n = seq_lens.shape[0] * k
        cache_loc = out_cache_loc.reshape(n, cfg.num_steps)
        table = self.expand_page_table[step]
        table[:n].fill_(0)
        if p == 1:
            table[:n, :d].copy_(cache_loc[:, :d])
        else:
            if not self.revert_pr_27360:
                cache_loc = cache_loc[:, :d]  # the #27360 fix
                assert cache_loc.shape[1] <= table.shape[1]
            _scatter_distinct_pages(table, cache_loc, p, self.scatter)
        live_rows = live.repeat_interleave(k)
        table[:n] *= live_rows[:, None]
        self.expand_cache_seqlens[:n].copy_((last.repeat_interleave(k) + d) * live_rows)
        csl = self.expand_cache_seqlens[:n].clone()
        expand = FA3Metadata(
            table[:n].clone(), csl,
            torch.arange(n + 1, dtype=torch.int32, device=csl.device),
            F.pad(torch.cumsum(csl, 0, dtype=torch.int32), (1, 0)),
            1, d + p - 1, p, False,
        )
        return CascadeMetadata(prefix, expand)

    def target_verify(self, *, req_to_token, req_pool_indices, seq_lens, tree_mask=None,
                      custom_mask=None):
        """Chain verify, or tree verify from ``tree_mask`` / upstream's flat ``custom_mask``.

        Engines receive the flat mask ready-made; pass it as ``custom_mask`` to
        keep its construction (a host loop here) out of timings.
        """
        cfg, n = self.cfg, self.cfg.num_draft_tokens
        live = seq_lens > 0
        if tree_mask is None and custom_mask is None:
            return self._fill_request_call(req_to_token, req_pool_indices,
                                           (seq_lens + n) * live, n,
                                           cfg.max_context_len + n, True)
        prefix = self._fill_request_call(req_to_token, req_pool_indices, seq_lens, n,
                                         cfg.max_context_len, False)
        bs = seq_lens.shape[0]
        # Upstream receives the flat custom mask and cuts the draft part out.
        if custom_mask is None:
            custom_mask = flat_from_tree_mask(tree_mask, seq_lens)
        row_lens = seq_lens + n
        block_starts = F.pad(torch.cumsum(row_lens * n, 0), (1, 0))[:-1]
        j = torch.arange(n, device=seq_lens.device)
        idx = (block_starts[:, None, None] + j[None, :, None] * row_lens[:, None, None]
               + seq_lens[:, None, None] + j[None, None, :])
        mask = custom_mask[idx.reshape(-1)].view(bs * n, n) if bs else \
            torch.zeros(0, n, dtype=torch.bool, device=seq_lens.device)
        cols = torch.arange(n, device=seq_lens.device).expand(bs * n, n)
        order = torch.sort(torch.where(mask, cols, cols + n), dim=1).indices
        positions = seq_lens.repeat_interleave(n)[:, None] + order
        rows = req_pool_indices.repeat_interleave(n)
        self.verify_page_table[: bs * n].copy_(req_to_token[rows[:, None], positions])
        live_rows = live.repeat_interleave(n)
        csl = mask.sum(1) * live_rows
        self.verify_cache_seqlens[: bs * n].copy_(csl)
        expand = FA3Metadata(
            self.verify_page_table[: bs * n].clone(),
            self.verify_cache_seqlens[: bs * n].clone(),
            torch.arange(bs * n + 1, dtype=torch.int32, device=csl.device),
            F.pad(torch.cumsum(csl, 0, dtype=torch.int32), (1, 0)),
            1, n, 1, False,
        )
        return CascadeMetadata(prefix, expand)

    def draft_extend(self, *, req_to_token, req_pool_indices, seq_lens, extend_seq_lens):
        cfg = self.cfg
        ext = extend_seq_lens * (seq_lens > 0)
        cu_q = F.pad(torch.cumsum(ext, 0), (1, 0))
        return self._fill_request_call(req_to_token, req_pool_indices, seq_lens,
                                       cfg.num_draft_tokens, cfg.max_context_len, True,
                                       cu_seqlens_q=cu_q)

    def build(self, mode: str, *, step: int = 0, **kwargs):
        """Dispatch by mode name (a key of `fa3_spec.MODES`)."""
        if mode == "draft_decode":
            return self.draft_decode(step, **kwargs)
        return getattr(self, mode)(**kwargs)


def _scatter_distinct_pages(table: torch.Tensor, cache_loc: torch.Tensor, page_size: int,
                            scatter=torch.Tensor.scatter_):
    """Upstream's vectorised ``unique_consecutive``: scatter at run indices.

    The scatter target is sized by ``.item()`` on the largest run index; when
    ``cache_loc`` has more distinct pages than ``table`` has columns the
    slice clamps to the row and the scatter writes past it.
    """
    n = cache_loc.shape[0]
    if n == 0:
        return
    pages = (cache_loc // page_size).to(table.dtype)
    starts = torch.ones_like(pages, dtype=torch.bool)
    starts[:, 1:] = pages[:, 1:] != pages[:, :-1]
    positions = starts.cumsum(dim=1) - 1
    max_positions = int(positions.max().item()) + 1  # host sync
    scatter(table[:n, :max_positions], 1, positions, pages)
