"""Draft heads on a real model: how much each head's drafts are accepted, per
tree shape, draft semantics and temperature, on held-out chat prompts; whether
the loop stays exact to greedy decoding; and what the loop's speed is against
plain decoding of the same model.

    python3 benchmarks/draft_heads.py accept --model SMOL --head HEAD --head derived \\
        --device cuda --timed 4,5,8 --json draft_heads.json
"""

import sys

import draft_accept
import runs

COMMANDS = {"accept": draft_accept}


def main(argv=None) -> int:
    return runs.dispatch(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
