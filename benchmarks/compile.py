"""Compile and start-up cost: the engine's cold compile + capture of its
buckets and its restart from a compile cache, the layers as compiled regions
against inline, and the CUDA-graph runner's capture per step mode.

    python3 benchmarks/compile.py engine --modes dynamic --layers regions --json engine.json  # GPU
    python3 benchmarks/compile.py regions --layers 2 8 32 --json regions_cpu.json
    python3 benchmarks/compile.py regions --smoke --json /tmp/regions.json                  # CPU
    python3 benchmarks/compile.py runner --json runner.json                                 # GPU
    python3 benchmarks/compile.py runner --smoke --json /tmp/runner.json                    # CPU
"""

import sys

import compile_engine
import compile_regions
import compile_runner
import runs

COMMANDS = {"engine": compile_engine, "regions": compile_regions, "runner": compile_runner}


def main(argv=None) -> int:
    return runs.dispatch(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
