"""The README's Quickstart as a new user runs it.

The two commands of README.md's "Quickstart" block, taken from the README and
run as written (each with ``bash -c``, in order, stopping at the first that
fails) in a fresh clone of this checkout, its uncommitted changes laid over
it, with a fresh virtual environment (``python3 -m venv``) first on ``PATH``.
Nothing is installed beforehand, so pip resolves torch as it does for a new
user: where no CPU build is pinned, a CUDA build, which brings Triton. The
clone and the environment (several GB) are removed at the end.

    python3 .ci/quickstart.py           # run them (about ten minutes on 2 CPU cores)
    python3 .ci/quickstart.py --print   # print the two commands only

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WHAT_PIP_CHOSE = ("import importlib.util, torch; print('quickstart: torch', torch.__version__, "
                  "'| triton', 'installed' if importlib.util.find_spec('triton') else 'absent')")


def quickstart_commands(readme: str) -> list:
    """The command lines of the first fenced block of ``## Quickstart`` (a bash
    block), without blank and comment lines."""
    m = re.search(r"^## Quickstart\n(.*?)(?=^## |\Z)", readme, flags=re.S | re.M)
    if m is None:
        raise ValueError("README.md has no '## Quickstart' section")
    block = re.search(r"^```([\w-]*)\n(.*?)^```\s*$", m.group(1), flags=re.S | re.M)
    if block is None or block.group(1) != "bash":
        raise ValueError("the Quickstart does not open with a bash block")
    return [ln.strip() for ln in block.group(2).splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def fresh_clone(src: pathlib.Path, dest: pathlib.Path) -> None:
    """``git clone`` of ``src`` into ``dest``, then the working tree's changes over
    it: modified and untracked files (ignored ones excepted) copied, deleted ones
    removed. In a clean checkout this is the clone alone."""
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(src), str(dest)], check=True)

    def listed(*flags):
        out = subprocess.run(["git", "-C", str(src), "ls-files", "-z", *flags],
                             check=True, capture_output=True).stdout.decode()
        return [p for p in out.split("\0") if p]

    for rel in listed("--modified", "--others", "--exclude-standard"):
        if (src / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dest / rel)
    for rel in listed("--deleted"):
        (dest / rel).unlink(missing_ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--print", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    commands = quickstart_commands((ROOT / "README.md").read_text())
    if args.print:
        print("\n".join(commands))
        return 0

    work = pathlib.Path(tempfile.mkdtemp(prefix="fa3-spec-quickstart-"))
    try:
        repo, venv = work / "fa3_spec", work / "venv"
        fresh_clone(ROOT, repo)
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
        for i, command in enumerate(commands):
            print(f"quickstart $ {command}", flush=True)
            begin = time.perf_counter()
            rc = subprocess.run(["bash", "-c", command], cwd=repo, env=env).returncode
            print(f"quickstart: exit {rc} after {time.perf_counter() - begin:.0f} s", flush=True)
            if rc != 0:
                return rc
            if i == 0:  # what pip chose
                subprocess.run([str(venv / "bin" / "python"), "-c", WHAT_PIP_CHOSE],
                               cwd=repo, env=env, check=False)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
