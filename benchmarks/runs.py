"""How a benchmark entry point runs: its subcommands, the command it records,
its JSON output and the fresh child processes some measurements need.

Every entry point (``benchmarks/NAME.py``) is a table of subcommands, each a
module with ``PROG`` (``"NAME.py SUB"``), ``HELP`` (one line) and
``main(argv) -> int``; `dispatch` runs the one ``argv[0]`` names. The scripts
run as ``python3 benchmarks/NAME.py SUB ...`` from the repository root, with
fa3_spec installed; Python puts ``benchmarks/`` first on ``sys.path``, so
``import runs`` finds this module.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def dispatch(doc: str, commands: dict, argv=None) -> int:
    """Run ``commands[argv[0]].main(argv[1:])``; usage (exit 2) for a missing
    or unknown subcommand, ``doc`` and the subcommands' help for ``-h``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = doc.strip() + "\n\nsubcommands:\n" + "\n".join(
        f"  {name:<12} {module.HELP}" for name, module in commands.items())
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] not in commands:
        got = f"unknown subcommand {argv[0]!r}" if argv else "a subcommand is needed"
        print(f"{got}\n\n{usage}", file=sys.stderr)
        return 2
    return commands[argv[0]].main(argv[1:])


def script(name: str) -> str:
    """The absolute path of ``benchmarks/NAME`` (for child processes)."""
    return str(HERE / name)


def command_line(prog: str, argv) -> str:
    """The command a result file records: ``python3 benchmarks/PROG ARGS``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python3", f"benchmarks/{prog}"] + args)


def commit():
    """The commit a result ran on: ``FA3_SPEC_COMMIT`` if set (a copy of the
    tree without its ``.git``), else git's ``HEAD``, else None."""
    if os.environ.get("FA3_SPEC_COMMIT"):
        return os.environ["FA3_SPEC_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                              capture_output=True, text=True)
    except OSError:  # no git
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def device_name(device) -> str:
    """The CUDA device's name, or ``"cpu"``."""
    import torch

    return torch.cuda.get_device_name() if str(device).startswith("cuda") else "cpu"


def write_json(path, doc) -> None:
    """Write ``doc`` to ``path`` (its folder made if missing), one-space indent.
    Callers rewrite the file after every row, so a cut-off run keeps its rows."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


def fresh_process_row(cmd, inductor_cache_dir: str, what: str) -> dict:
    """Run ``cmd`` (a child benchmark process) with ``inductor_cache_dir`` as
    its inductor cache (a new folder: a cold compile) and return its last
    stdout line parsed as JSON. A child that fails ends this process (exit 1)
    with ``what`` and the tail of the child's stderr."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache_dir)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
