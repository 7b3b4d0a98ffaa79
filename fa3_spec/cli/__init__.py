"""The ``fa3-spec`` command: ``audit``, ``eagle`` and ``train-draft``.

Each subcommand's module is imported only when that subcommand runs (or
prints its help), so ``fa3-spec audit`` never imports the EAGLE engine and
``fa3-spec --help`` imports neither.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

#: Subcommand -> (its module, which defines ``add_parser(subparsers)`` and
#: ``run(args)``; its one-line help).
COMMANDS = {
    "audit": ("fa3_spec.cli.audit",
              "graph breaks, recompiles, data-dependent ops, host syncs and CUDA-graph capture "
              "of every metadata builder, or of any function (--callable); exit 0 clean, "
              "1 unclean, 2 invalid invocation"),
    "eagle": ("fa3_spec.eagle.cli",
              "run the reference EAGLE loop on a random preset or a Hugging Face checkpoint; "
              "exit 0 done, 1 a greedy mismatch, 2 invalid invocation"),
    "train-draft": ("fa3_spec.train.cli",
                    "train an EAGLE-3 draft head for a local Hugging Face Llama against the "
                    "target itself; exit 0 done, 2 invalid invocation"),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fa3-spec", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub, help=help_text)
        else:
            sub.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    return importlib.import_module(COMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    sys.exit(main())
