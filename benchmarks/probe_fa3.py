"""Probe FA3's raw conventions on the device (empty rows, unowned queries).

python3 benchmarks/probe_fa3.py  -> prints what FA3 returns for a row with
cache_seqlens = 0 and for queries past cu_seqlens_q[-1], before fa3_spec's
normalisation. Informational; the tests assert the normalised behaviour.
"""

import torch

from fa3_spec.attention import fa3_paged_attention, provider_version

if __name__ == "__main__":
    torch.manual_seed(0)
    dev = "cuda"
    k = torch.randn(8, 2, 2, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(4, 8, 128, device=dev, dtype=torch.bfloat16)
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device=dev)
    seqlens = torch.tensor([3, 0], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=dev)  # query 3 unowned
    print("provider:", provider_version())
    for splits in (1, 4):
        out, lse = fa3_paged_attention(q, k, v, table, seqlens, cu, 2, 128 ** -0.5, False, splits)
        print(f"num_splits={splits}: lse[0] per query =", lse[0].tolist())
        print("   |out| per query =", out.float().abs().amax(dim=(1, 2)).tolist())
