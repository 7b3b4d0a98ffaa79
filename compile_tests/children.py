"""Tests whose work runs in child processes, run side by side at the end of the session.

A benchmark smoke, a notebook or a cross-process cache check spends its time in
a child Python (importing torch, tracing, compiling) while pytest only waits
for it. Such a test is marked ``@pytest.mark.children(job=job)``: ``job(tmp, **params)``
(``tmp`` a fresh directory, ``params`` the test's parametrization) does the
child-process work and returns what the test checks, which the test gets from
``child.result()`` (the ``child`` fixture; an exception in the job is raised
there). conftest.py moves these tests to the end of the session, in their
order, and the first of them to run starts every selected job, `PARALLEL` at a
time, so the children of later tests run while earlier ones are checked.

Children run with the environment the session started with (not what a test
set in this process since, e.g. ``TRITON_INTERPRET`` from the sglang
fixture), one torch/OpenMP thread each when several run at once (two
children with two threads each on CI's two cores would oversubscribe them),
and are killed if the session ends first.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import threading

#: Jobs at once: CI's 2 cores by default; FA3_SPEC_TEST_CHILDREN=1 runs them one
#: after another.
PARALLEL = max(1, int(os.environ.get("FA3_SPEC_TEST_CHILDREN",
                                     min(2, len(os.sched_getaffinity(0))))))

_ENV = dict(os.environ)  # as the session started (conftest imports this first)
_running: set = set()
_lock = threading.Lock()


def env(**extra) -> dict:
    """The environment of a child: the session's initial one, one thread if side by side."""
    out = dict(_ENV)
    if PARALLEL > 1:
        out.setdefault("OMP_NUM_THREADS", "1")
    out.update(extra)
    return out


def run(cmd, *, cwd=None, timeout=600, check=True, env_extra=None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, check=check, capture_output=True, text=True)`` in `env`,
    killed when the session ends first; a failure names the command and its stderr."""
    # Its own process group: a kill reaches its children too (a notebook's kernel).
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(**(env_extra or {})), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    with _lock:
        _running.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill(proc)
        proc.communicate()
        raise
    finally:
        with _lock:
            _running.discard(proc)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                             f"{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_running():
    """Kill every child `run` started that is still running (the session is ending)."""
    with _lock:
        for proc in list(_running):
            _kill(proc)


def _skipped(item) -> bool:
    """Marked skip, or skipif with a condition already true (no job for it)."""
    return item.get_closest_marker("skip") is not None or any(
        any(a is True for a in m.args) or m.kwargs.get("condition") is True
        for m in item.iter_markers("skipif"))


class Jobs:
    """The session's jobs, started together at the first request."""

    def __init__(self, session, tmp_path_factory):
        self._session = session
        self._tmp = tmp_path_factory
        self._pool = None
        self._futures: dict = {}

    def _submit(self, item):
        job = item.get_closest_marker("children").kwargs["job"]
        params = dict(getattr(getattr(item, "callspec", None), "params", {}))
        tmp = self._tmp.mktemp(re.sub(r"\W", "_", item.name)[:40], numbered=True)
        self._futures[item.nodeid] = self._pool.submit(job, tmp, **params)

    def future(self, item):
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(PARALLEL,
                                                               thread_name_prefix="child")
            for other in self._session.items:
                if other.get_closest_marker("children") is not None and not _skipped(other):
                    self._submit(other)
        if item.nodeid not in self._futures:
            self._submit(item)
        return self._futures[item.nodeid]

    def close(self):
        if self._pool is None:
            return
        self._pool.shutdown(wait=False, cancel_futures=True)
        kill_running()


class Child:
    """What the ``child`` fixture gives a test: its job's result, when done."""

    def __init__(self, future):
        self._future = future

    def result(self):
        return self._future.result()
