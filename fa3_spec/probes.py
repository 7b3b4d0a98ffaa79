"""Compile and capture probes shared by the runner and the audit.

Each answers one question about a function, with torch's own machinery:

* `graph_breaks`: where does dynamo break the graph, and why?
* `RecordingBackend`: a ``torch.compile`` backend that counts compiled
  frames (a second frame for one call site is a recompile) and lists every
  data-dependent node (``item``/``tolist`` and values with unbacked
  symbols): each is a host sync on CUDA, even when ``fullgraph=True``
  accepted it (torch 2.13 captures ``.item()`` as an unbacked symbol).
* `count_host_syncs`: synchronising CUDA calls, via
  ``torch.cuda.set_sync_debug_mode``.
* `capture`: warm up on a side stream, then capture one call in a CUDA graph.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def graph_breaks(fn: Callable, *args) -> tuple:
    """``(count, reasons)`` of graph breaks when dynamo traces ``fn(*args)``.

    Counted from the break reasons as well as ``graph_break_count``: on some
    torch versions (seen on 2.13) a break that ends the frame is listed in
    ``break_reasons`` while ``graph_break_count`` stays 0.
    """
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    reasons = [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    return max(explained.graph_break_count, len(reasons)), reasons


class RecordingBackend:
    """A ``torch.compile`` backend that audits each graph, then delegates.

    Records the number of compiled frames (``frame_count``; more than one for
    one call site means a recompile) and every data-dependent node: ``item``
    / ``tolist`` calls and any value carrying unbacked symbols (``nonzero``,
    value-sized slices, ...). Such nodes are host syncs on CUDA. The check is
    needed because recent torch versions (seen on 2.13) accept ``Tensor.item``
    under ``fullgraph=True`` by capturing it as an unbacked symbol.
    """

    def __init__(self, backend: str = "aot_eager"):
        self.backend = backend
        self.frame_count = 0
        self.data_dependent: list = []

    def __call__(self, gm, example_inputs):
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        self.frame_count += 1
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            unbacked = free_unbacked_symbols(value) if value is not None else set()
            if (node.op == "call_method" and node.target in ("item", "tolist")) or unbacked:
                self.data_dependent.append(f"{node.op}:{getattr(node.target, '__name__', node.target)}")
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


def count_host_syncs(fn: Callable, *args, calls: int = 2) -> tuple:
    """``(count, messages)`` of synchronizing CUDA calls in ``calls`` runs.

    One un-counted warm-up call comes first, so one-time process set-up
    (lazy CUDA/library initialisation) is not charged to the step.
    """
    fn(*args)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only torch's per-call report counts, not its "prototype feature" notice.
    messages = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    return len(messages), messages


def capture(fn: Callable, *args, warmup: int = 2, pool=None, **kwargs):
    """Warm ``fn(*args, **kwargs)`` up on a side stream, then capture one call.

    Returns ``(graph, out)``: replaying ``graph`` recomputes ``out`` in place
    from the same input buffers. ``pool`` shares a memory pool between graphs.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args, **kwargs)
    return graph, out
