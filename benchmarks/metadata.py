"""What the speculative metadata costs against upstream: per scenario, inside
the draft loop against its floor, on the host of the CUDA-graph runner, and
the sglang adapter against sglang's own replay-time functions.

    python3 benchmarks/metadata.py scenarios --kinds metadata draft_loop --json scenarios.json
    python3 benchmarks/metadata.py perf --json perf.json
    python3 benchmarks/metadata.py staging --batches 1 8 64 --json staging.json
    FA3_SPEC_SGLANG_SRC=$PWD/.sglang_src python3 benchmarks/metadata.py adapter --json adapter.json
    python3 benchmarks/metadata.py SUBCOMMAND --smoke --json /tmp/out.json     # CPU, tiny
"""

import sys

import metadata_adapter
import metadata_perf
import metadata_scenarios
import metadata_staging
import runs

COMMANDS = {"scenarios": metadata_scenarios, "perf": metadata_perf, "staging": metadata_staging,
            "adapter": metadata_adapter}


def main(argv=None) -> int:
    return runs.dispatch(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
