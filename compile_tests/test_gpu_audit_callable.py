"""`audit_callable` on CUDA: the host-sync and CUDA-graph columns.

Skipped without CUDA. Each subject has one known defect at the line marked
``# defect``; the host-sync finding must point at it.
"""

import pytest
import torch

from fa3_spec.audit import audit_callable
from test_audit_callable import clean, defect_line, fills_a_buffer, uses_item

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def copies_to_host(lens, out):
    host = lens.cpu()  # defect
    return out * host.to(out.device)


def scales_by_a_host_scalar(scale, out):
    """``scale`` is a 0-dim CPU tensor: its value is baked into the captured
    kernel's arguments, so a refilled ``scale`` is not seen by replay."""
    return out * scale


def _pair(device="cuda"):
    example = (torch.tensor([3, 0, 5, 2], device=device), torch.ones(4, device=device))
    variant = (torch.tensor([1, 4, 0, 6], device=device), torch.full((4,), 2.0, device=device))
    return example, variant


@pytest.mark.parametrize("fn", [uses_item, copies_to_host], ids=lambda f: f.__name__)
def test_host_sync_reported_at_its_line(fn):
    example, variant = _pair()
    row = audit_callable(fn, example, variants=[variant])
    assert row.host_syncs and row.host_syncs > 0 and not row.clean
    syncs = [f for f in row.findings if f.column == "host_syncs" and f.line is not None]
    assert any(f.line == defect_line(fn) for f in syncs), row.problems


def test_item_fails_capture_with_a_message():
    example, variant = _pair()
    row = audit_callable(uses_item, example, variants=[variant])
    assert row.cuda_graph == "fail"
    assert any(f.column == "cuda_graph" and f.message for f in row.findings), row.problems


def test_clean_function_captures_and_replays_every_variant():
    example, variant = _pair()
    row = audit_callable(clean, example, variants=[variant])
    assert row.clean, row.problems
    assert row.host_syncs == 0 and row.cuda_graph == "ok"


def test_buffer_fill_captures_and_replays():
    lens = torch.tensor([3, 0, 5, 2], device="cuda")
    buf = torch.zeros(4, dtype=torch.int64, device="cuda")
    row = audit_callable(fills_a_buffer, (lens, buf), variants=[(lens + 1, buf)],
                         writable=["buf"])
    assert row.clean and row.cuda_graph == "ok", row.problems


def test_replay_mismatch_is_reported():
    out = torch.ones(4, device="cuda")
    row = audit_callable(scales_by_a_host_scalar, (torch.tensor(2.0), out),
                         variants=[(torch.tensor(3.0), out)])
    assert row.cuda_graph == "fail", row.problems
    assert any(f.column == "cuda_graph" and f.op == "replay" for f in row.findings)
