"""The EAGLE loop end to end: how fast an iteration runs against its floors,
against sglang's host-built metadata and against plain decoding; where its
GPU time goes; what sampling costs; what ancestor-exact drafting changes.

    python3 benchmarks/loop.py compare --smoke --json /tmp/loop.json      # CPU, tiny
    FA3_SPEC_SGLANG_SRC=$PWD/.sglang_src python3 benchmarks/loop.py compare \\
        --upstream sglang --configs 2,8,5,16 --batches 1 --json loop.json  # GPU
    python3 benchmarks/loop.py idle --configs 2,8,5,16 --batches 1 --decode --json idle.json
    python3 benchmarks/loop.py sampling --preset llama3-8b --batches 1 --json sampling.json
    python3 benchmarks/loop.py ancestors --json ancestors_cpu.json
    python3 benchmarks/loop.py costs --preset tiny --device cpu --batches 1 2 4 --out costs.json
    python3 benchmarks/loop.py policy --cost-profile costs.json --profiles high --json loop.json
"""

import sys

import loop_ancestors
import loop_compare
import loop_costs
import loop_policy
import loop_idle
import loop_sampling
import runs

COMMANDS = {"compare": loop_compare, "idle": loop_idle, "sampling": loop_sampling,
            "ancestors": loop_ancestors, "costs": loop_costs,
            "policy": loop_policy}


def main(argv=None) -> int:
    return runs.dispatch(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
