"""Tests whose work runs in child processes, run beside the rest of the test run.

A benchmark smoke, a notebook, a CLI run or a cross-process cache check spends
its time in a child Python (importing torch, tracing, compiling) while pytest
only waits for it. Such a test is marked ``@pytest.mark.children(job=job)``:
``job(tmp, **params)`` (``tmp`` a fresh directory, ``params`` the test's
parametrization) does the child-process work and returns what the test checks,
which the test gets from ``child.result()`` (the ``child`` fixture; an exception
in the job is raised there).

CI has two cores and the in-process tests keep about one busy. So, with
`PARALLEL` = 2 (the default): every selected job is submitted before the first
test and they run one at a time beside the in-process tests; conftest.py
moves the children tests to the end of the run, and from the first of them
on (pytest then only waits) `PARALLEL` jobs run at once. Every torch runs one
thread: this process (conftest.py) and each child (``OMP_NUM_THREADS=1``), so
that no two multi-threaded processes share the two cores (their OpenMP threads
would spin against each other: many-small-op tests then run several times
slower). Jobs marked ``heavy=True`` are submitted first, so that no long job
is the last to start. ``FA3_SPEC_TEST_CHILDREN=1``: torch's default threads, and the jobs
run one after another once the children tests are reached. Beside the tests,
a first job (`PREFETCH`) fills sglang's cache before any other process reads it.

Children run with the environment the test run started with (not what a test
set in this process since, e.g. ``TRITON_INTERPRET`` from conftest.py)
and are killed if the test run ends first. Each job's own time is listed at the
end of the run (the children tests' durations are mostly waiting).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

#: Jobs at once when only children tests are left: CI's 2 cores by default;
#: FA3_SPEC_TEST_CHILDREN=1 runs them one after another, nothing beside other tests.
PARALLEL = max(1, int(os.environ.get("FA3_SPEC_TEST_CHILDREN",
                                     min(2, len(os.sched_getaffinity(0))))))

_ENV = dict(os.environ)  # as the test run started (conftest imports this first)
_running: set = set()
#: nodeid -> a finished job's own wall time (listed at the end of the run).
SECONDS: dict = {}
_lock = threading.Lock()


def env(**extra) -> dict:
    """The environment of a child: the test run's initial one, one thread (PARALLEL > 1)."""
    out = dict(_ENV)
    if PARALLEL > 1:
        out.setdefault("OMP_NUM_THREADS", "1")
    out.update(extra)
    return out


#: The head of a child script that runs Triton kernels in Triton's interpreter:
#: the installed Triton, else the one the sglang parity tests cache; with
#: neither, it prints ``{"skip": ...}`` as its one JSON line and exits.
#: ``refusal(applies, call, *args)`` gives ``[not applies(*args), the
#: TypeError call(*args) raised, or ""]``.
TRITON_INTERPRETER_PREAMBLE = '''import json, sys
import torch
from fa3_spec.harness.sglang_upstream import TRITON_VERSION, default_cache_dir
try:
    import triton
except ImportError:
    sys.path.append(str(default_cache_dir() / f"triton-{TRITON_VERSION}"))
    try:
        import triton
    except ImportError as e:
        print(json.dumps({"skip": f"no triton: {e}"}))
        sys.exit(0)


def refusal(applies, call, *args):
    refused = not applies(*args)
    try:
        call(*args)
        return [refused, ""]
    except TypeError as e:
        return [refused, str(e)]
'''


def triton_interpreter_job(code: str):
    """A children job running ``code`` (which starts with
    `TRITON_INTERPRETER_PREAMBLE`) under ``TRITON_INTERPRET=1``; the job
    returns the JSON of its last stdout line."""
    def job(tmp):
        done = run([sys.executable, "-c", code], env_extra={"TRITON_INTERPRET": "1"})
        return json.loads(done.stdout.strip().splitlines()[-1])

    return job


#: The ``env_extra`` names a forked job may set: read when used, not when torch or
#: the library is imported. ``TRITON_INTERPRET`` only where the fork server has
#: not imported Triton (torch's dynamo does where Triton is installed) or has the
#: job's mode (`_ForkServer.serves`). A ``PYTHONPATH`` that made another torch or
#: Triton importable would not reach the preloaded modules; no job sets one.
FORKABLE_ENV = frozenset({"TRITON_INTERPRET", "PYTHONPATH"})


def run(cmd, *, cwd=None, timeout=600, check=True, env_extra=None,
        fresh=False) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, check=check, capture_output=True, text=True)`` in `env`,
    killed when the test run ends first; a failure names the command and its stderr.

    A Python command (``sys.executable`` first) runs as a fork of the fork server
    (forkserver.py), which has imported torch and the library already, unless
    ``fresh`` (a test of what a command imports), ``env_extra`` sets a name
    outside `FORKABLE_ENV`, or the server cannot serve its environment."""
    extra = dict(env_extra or {})
    environment = env(**extra)
    if not fresh and cmd[0] == sys.executable and len(cmd) > 1 and set(extra) <= FORKABLE_ENV:
        server = _server()
        if server is not None and server.serves(environment):
            out, err, code = server.run([str(c) for c in cmd[1:]], cwd or os.getcwd(),
                                        environment, timeout)
            return _done(cmd, code, out, err, check)
    # Its own process group: a kill reaches its children too (a notebook's kernel).
    proc = subprocess.Popen(cmd, cwd=cwd, env=environment, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    with _lock:
        _running.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill(proc.pid)
        proc.communicate()
        raise
    finally:
        with _lock:
            _running.discard(proc.pid)
    return _done(cmd, proc.returncode, out, err, check)


def _done(cmd, code, out, err, check) -> subprocess.CompletedProcess:
    if check and code != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {code}:\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, code, out, err)


class _ForkServer:
    """The client of one forkserver.py process started in ``environment`` (`env` by
    default): `run` sends a request and polls its directory for the exit status."""

    def __init__(self, environment=None):
        self._env = env() if environment is None else dict(environment)
        self._dirs = tempfile.TemporaryDirectory(prefix="fa3_spec_forks_")
        log = pathlib.Path(self._dirs.name) / "server.stderr"  # a file: a pipe could fill
        with open(log, "wb") as err:
            self._proc = subprocess.Popen([sys.executable, str(_HERE / "forkserver.py")],
                                          env=self._env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=err,
                                          start_new_session=True, cwd=str(_HERE))
        self._write = threading.Lock()
        self._count = 0
        try:
            #: Whether the server's preloads imported Triton.
            self.triton = bool(json.loads(self._proc.stdout.readline())["triton"])
        except (ValueError, KeyError, TypeError):
            self._proc.kill()
            raise RuntimeError(f"forkserver.py did not start: "
                               f"{log.read_text(errors='replace')[-2000:]}") from None

    def serves(self, environment) -> bool:
        """Whether a fork runs a job in ``environment`` as a fresh interpreter would:
        Triton, once imported, keeps the interpreter mode of its import."""
        return not self.triton or (environment.get("TRITON_INTERPRET")
                                   == self._env.get("TRITON_INTERPRET"))

    def run(self, argv, cwd, environment, timeout):
        with self._write:
            self._count += 1
            where = pathlib.Path(self._dirs.name) / str(self._count)
            where.mkdir()
            self._proc.stdin.write((json.dumps(dict(argv=argv, cwd=str(cwd), env=environment,
                                                    dir=str(where))) + "\n").encode())
            self._proc.stdin.flush()
        pid = None
        deadline = time.monotonic() + timeout
        try:
            while not (where / "status").exists():
                if pid is None and (where / "pid").exists():
                    pid = int((where / "pid").read_text())
                    with _lock:
                        _running.add(pid)
                if self._proc.poll() is not None:
                    raise RuntimeError("forkserver.py exited")
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout)
                time.sleep(0.05)
        except BaseException:
            if pid is None and (where / "pid").exists():
                pid = int((where / "pid").read_text())
            if pid is not None:
                _kill(pid)
            raise
        finally:
            if pid is not None:
                with _lock:
                    _running.discard(pid)
        return ((where / "stdout").read_text(errors="replace"),
                (where / "stderr").read_text(errors="replace"),
                int((where / "status").read_text()))

    def close(self):
        _kill(self._proc.pid)
        self._dirs.cleanup()


_HERE = pathlib.Path(__file__).resolve().parent
#: ``"server"``: the one `_ForkServer` once asked for, or None (it did not start, or
#: the test run is ending): jobs then run as fresh processes.
_FORK = {}


def _server():
    with _lock:
        if "server" not in _FORK:
            try:
                _FORK["server"] = _ForkServer()
            except (OSError, RuntimeError) as e:
                sys.stderr.write(f"children: no fork server, fresh processes instead ({e})\n")
                _FORK["server"] = None
        return _FORK["server"]


def _kill(pid):
    """SIGKILL to the process group ``pid`` leads, or to ``pid`` alone when it leads
    none yet (a fork that has not reached its ``setsid``)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            pass


def kill_running():
    """Kill every child `run` started that is still running, and the fork server
    (the test run is ending)."""
    with _lock:
        for pid in list(_running):
            _kill(pid)
        server = _FORK.get("server")
        if server is not None:
            server.close()
        _FORK["server"] = None


def _skipped(item) -> bool:
    """Marked skip, or skipif with a condition already true (no job for it)."""
    return item.get_closest_marker("skip") is not None or any(
        any(a is True for a in m.args) or m.kwargs.get("condition") is True
        for m in item.iter_markers("skipif"))


#: The first job when jobs run beside the in-process tests: sglang's source and Triton
#: into their cache (`fa3_spec.harness.sglang_upstream`), fetched as the ``upstream``
#: fixture would fetch them, so that no process reads that cache while another one
#: (this process's fixture, a child) fills it. The other jobs and the fixture wait for it.
PREFETCH = [sys.executable, "-c", "from fa3_spec.harness.sglang_upstream import "
            "load_upstream_or_reason as load; load(fetch=True)"]


class Jobs:
    """The test run's jobs: all submitted before the first test, one running at a time
    beside the in-process tests, `PARALLEL` at a time once only children tests are left."""

    def __init__(self, session, tmp_path_factory):
        self._session = session
        self._tmp = tmp_path_factory
        self._pool = concurrent.futures.ThreadPoolExecutor(PARALLEL, thread_name_prefix="child")
        self._gate = threading.Semaphore(1)  # widened to PARALLEL by `widen`
        self._widened = False
        self._started = False
        self._prefetch = None
        self._futures: dict = {}

    def start(self):
        if self._started:
            return
        self._started = True
        items = [item for item in self._session.items
                 if item.get_closest_marker("children") is not None and not _skipped(item)]
        # Jobs marked ``heavy=True`` (half a minute or more each) first: the
        # last job to end sets when the tests end, so no long one starts last.
        items.sort(key=lambda item: not item.get_closest_marker("children").kwargs.get("heavy"))
        if items and PARALLEL > 1:  # one after another (PARALLEL = 1) needs no prefetch
            self._prefetch = self._pool.submit(self._gated, "(sglang prefetch)",
                                               lambda: run(PREFETCH, timeout=1800, check=False))
        for item in items:
            self._submit(item)

    def wait_prefetch(self):
        """Until the prefetch (if any) has ended, however it ended."""
        if self._prefetch is not None:
            concurrent.futures.wait([self._prefetch])

    def _gated(self, name, fn):
        with self._gate:
            begin = time.perf_counter()
            try:
                return fn()
            finally:
                SECONDS[name] = time.perf_counter() - begin

    def _submit(self, item):
        job = item.get_closest_marker("children").kwargs["job"]
        params = dict(getattr(getattr(item, "callspec", None), "params", {}))
        tmp = self._tmp.mktemp(re.sub(r"\W", "_", item.name)[:40], numbered=True)

        def gated():
            self.wait_prefetch()  # before the gate: the prefetch needs it
            return self._gated(item.nodeid, lambda: job(tmp, **params))

        self._futures[item.nodeid] = self._pool.submit(gated)

    def widen(self):
        """Only children tests are left: this process now just waits; run PARALLEL at once."""
        if not self._widened:
            self._widened = True
            for _ in range(PARALLEL - 1):
                self._gate.release()

    def future(self, item):
        self.start()  # FA3_SPEC_TEST_CHILDREN=1: nothing started before the children tests
        self.widen()
        if item.nodeid not in self._futures:
            self._submit(item)
        return self._futures[item.nodeid]

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
        kill_running()


class Child:
    """What the ``child`` fixture gives a test: its job's result, when done."""

    def __init__(self, future):
        self._future = future

    def result(self):
        return self._future.result()
