"""children.py: a job forked from the fork server (forkserver.py) runs as a fresh
interpreter would."""

import importlib.util
import json
import signal
import subprocess
import sys

import pytest

import children
from fa3_spec.harness.sglang_upstream import TRITON_VERSION, default_cache_dir

PROBE = '''
import json, os, sys
print(json.dumps(dict(argv=sys.argv, cwd=os.getcwd(), pythonpath=os.environ.get("PYTHONPATH"),
                      path=sys.path[:2], main=__name__,
                      main_module=sys.modules["__main__"].__dict__ is globals())))
print(json.dumps("torch" in sys.modules))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
'''


def _probe_both_ways(tmp):
    out = {}
    for fresh in (False, True):
        done = children.run([sys.executable, "-c", PROBE, "3", "x"], cwd=tmp, check=False,
                            env_extra={"PYTHONPATH": str(tmp / "extra")}, fresh=fresh)
        out[fresh] = (done.returncode, done.stdout, done.stderr)
    killed = children.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), "
                           "signal.SIGTERM)"], check=False)
    message = children.run([sys.executable, "-c", "import sys; sys.exit('bad input')"],
                           check=False)
    try:
        children.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    return out, killed.returncode, (message.returncode, message.stderr), timed_out, tmp


@pytest.mark.children(job=_probe_both_ways)
def test_a_forked_job_runs_as_a_fresh_interpreter_would(child):
    """The fork server's jobs see the argv, working directory, environment and
    ``__main__`` a fresh ``python -c`` sees, exit the same ways, and time out."""
    out, killed, message, timed_out, tmp = child.result()
    code, stdout, stderr = out[False]
    (seen, forked), (fresh_seen, fresh_forked) = ([json.loads(line) for line in out[f][1].splitlines()]
                                                  for f in (False, True))
    assert forked and not fresh_forked  # the fork had torch imported already; a fresh one not
    assert (code, seen, stderr) == (out[True][0], fresh_seen, out[True][2])
    assert code == 3 and "to stderr" in stderr
    assert seen["argv"] == ["-c", "3", "x"] and seen["pythonpath"] == str(tmp / "extra")
    assert seen["main"] == "__main__" and seen["path"] == ["", str(tmp / "extra")]
    assert seen["main_module"]  # the code's globals are sys.modules["__main__"]'s, as dynamo reads
    assert killed == -signal.SIGTERM
    assert message == (1, "bad input\n")
    assert timed_out


#: A kernel that calls one of Triton's own jit functions (``tl.sum``).
TOTAL = """import torch, triton, triton.language as tl


@triton.jit
def total(x_ptr, out_ptr):
    tl.store(out_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, 4)), axis=0))


x, out = torch.arange(4.0), torch.zeros(1)
total[(1,)](x, out)
print(out.item())
"""


def _triton_path():
    """Where Triton imports from: installed (None), else the cache the prefetch
    fills; ``False`` where there is none."""
    if importlib.util.find_spec("triton") is not None:
        return None
    cached = default_cache_dir() / f"triton-{TRITON_VERSION}"
    return str(cached) if (cached / "triton" / "__init__.py").is_file() else False


def _servers_with_triton(tmp):
    """A server started in Triton's compiled mode and one in its interpreter
    mode, each asked for a ``TRITON_INTERPRET=1`` job; and that job run fresh."""
    path = _triton_path()
    if path is False:
        return None
    base = children.env(**({} if path is None else {"PYTHONPATH": path}))
    base.pop("TRITON_INTERPRET", None)
    interpret = {**base, "TRITON_INTERPRET": "1"}
    (tmp / "total.py").write_text(TOTAL)
    out = {}
    for name, environment in (("compiled", base), ("interpreter", interpret)):
        server = children._ForkServer(environment)
        try:
            stdout, stderr, code = server.run(["total.py"], tmp, interpret, 300)
            out[name] = dict(triton=server.triton, serves_its_own=server.serves(environment),
                             serves_the_job=server.serves(interpret), code=code,
                             stdout=stdout, stderr=stderr[-2000:])
        finally:
            server.close()
    fresh = children.run([sys.executable, "total.py"], cwd=tmp, fresh=True,
                         env_extra={k: interpret[k] for k in ("PYTHONPATH", "TRITON_INTERPRET")
                                    if k in interpret})
    out["fresh"] = fresh.stdout
    return out


@pytest.mark.children(job=_servers_with_triton)
def test_a_server_that_imported_triton_forks_only_jobs_of_its_interpreter_mode(child):
    """Where Triton is installed, torch's dynamo imports it, and Triton makes its
    own jit functions (``tl.sum``) in the mode of that import. A server started
    in compiled mode does not serve a ``TRITON_INTERPRET=1`` job (such a job
    runs fresh): forked anyway, its kernel cannot call ``tl.sum``. A server
    started in interpreter mode serves it, and the fork computes what a fresh
    interpreter does."""
    found = child.result()
    if found is None:
        pytest.skip("no Triton installed or cached")
    compiled, interpreter = found["compiled"], found["interpreter"]
    if not compiled["triton"]:
        pytest.skip("this torch's preloads do not import Triton")
    assert compiled["serves_its_own"] and not compiled["serves_the_job"]
    assert compiled["code"] != 0 and "@triton.jit" in compiled["stderr"], compiled
    assert interpreter["triton"] and interpreter["serves_the_job"]
    assert (interpreter["code"], interpreter["stdout"].strip()) == (0, "6.0"), interpreter
    assert found["fresh"].strip() == "6.0"
