"""What the model's kernels cost on the GPU: the skinny GEMMs against cuBLAS,
the per-layer K/V write, FA3's decode calls (split counts, a shared
scheduler plan), and a tree's expand call on FA3 and on the expand kernel.
Each needs CUDA.

    python3 benchmarks/kernel_bench.py gemm --json gemm.json
    python3 benchmarks/kernel_bench.py kv-store --json kv_store.json
    python3 benchmarks/kernel_bench.py fa3-decode --json fa3_decode.json
    python3 benchmarks/kernel_bench.py expand --json expand.json
"""

import sys

import kernel_expand
import kernel_fa3_decode
import kernel_gemm
import kernel_kv_store
import runs

COMMANDS = {"gemm": kernel_gemm, "kv-store": kernel_kv_store, "fa3-decode": kernel_fa3_decode,
            "expand": kernel_expand}


def main(argv=None) -> int:
    return runs.dispatch(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
