"""A fork server for the test run's child Pythons (children.py starts it).

Most of a short child job's CPU time is importing torch and the library. This
process imports them once, then forks a child per request, so each job starts
where a fresh ``python`` would be after those imports. The server starts no
thread, so a fork is a clean copy. Where Triton is installed, torch's dynamo
imports it, and Triton makes its own library's jit functions at import in the
mode ``TRITON_INTERPRET`` then names: so the server's first line says whether
Triton is loaded (``{"triton": true}``), and the client forks no job that
names another mode.

Protocol: one JSON request per line on stdin, ``{"argv", "cwd", "env", "dir"}``;
``argv`` is what follows the interpreter (``-c CODE ...``, ``-m MODULE ...`` or
``SCRIPT ...``). The job's stdout and stderr go to ``dir/stdout`` and
``dir/stderr``; the server writes its pid to ``dir/pid`` and, once it ended, its
exit code to ``dir/status`` (negative: killed by that signal, as with
`subprocess`). Each job leads its own process group. The server exits when stdin
closes.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import runpy
import select
import sys
import traceback
import types

#: What every job finds imported.
PRELOAD = ("torch", "torch._dynamo", "fa3_spec", "fa3_spec.eagle")


def _write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _run_job(request: dict) -> int:
    """In the forked child: become the job's interpreter and run it; its exit code."""
    os.setsid()
    out = pathlib.Path(request["dir"])
    null = os.open(os.devnull, os.O_RDONLY)  # stdin is the server's request pipe
    os.dup2(null, 0)
    os.close(null)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = list(request["argv"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0:0] = ["", *extra]
            # The code runs in a fresh __main__ module, as with ``python -c``: dynamo
            # builds guards on a function's globals through sys.modules[__module__].
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0:0] = [os.getcwd(), *extra]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0:0] = [str(pathlib.Path(argv[0]).resolve().parent), *extra]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:  # as the interpreter exits: an int, None (0), else printed (1)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    jobs: dict = {}  # pid -> its directory
    sys.stdout.write(json.dumps({"triton": "triton" in sys.modules}) + "\n")
    sys.stdout.flush()
    stdin = sys.stdin.buffer
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        if readable:
            line = stdin.readline()
            if not line:
                break
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os._exit(_run_job(request))
            jobs[pid] = pathlib.Path(request["dir"])
            _write(jobs[pid] / "pid", str(pid))
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _write(jobs.pop(pid) / "status", str(os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    serve()
