"""children.py: a job forked from the fork server (forkserver.py) runs as a fresh
interpreter would."""

import json
import signal
import subprocess
import sys

import pytest

import children

PROBE = '''
import json, os, sys
print(json.dumps(dict(argv=sys.argv, cwd=os.getcwd(), interpret=os.environ.get("TRITON_INTERPRET"),
                      path0=sys.path[0], main=__name__)))
print(json.dumps("torch" in sys.modules))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
'''


def _probe_both_ways(tmp):
    out = {}
    for fresh in (False, True):
        done = children.run([sys.executable, "-c", PROBE, "3", "x"], cwd=tmp, check=False,
                            env_extra={"TRITON_INTERPRET": "1"}, fresh=fresh)
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
    return out, killed.returncode, (message.returncode, message.stderr), timed_out


@pytest.mark.children(job=_probe_both_ways)
def test_a_forked_job_runs_as_a_fresh_interpreter_would(child):
    """The fork server's jobs see the argv, working directory, environment and
    ``__main__`` a fresh ``python -c`` sees, exit the same ways, and time out."""
    out, killed, message, timed_out = child.result()
    code, stdout, stderr = out[False]
    (seen, forked), (fresh_seen, fresh_forked) = ([json.loads(line) for line in out[f][1].splitlines()]
                                                  for f in (False, True))
    assert forked and not fresh_forked  # the fork had torch imported already; a fresh one not
    assert (code, seen, stderr) == (out[True][0], fresh_seen, out[True][2])
    assert code == 3 and "to stderr" in stderr
    assert seen["argv"] == ["-c", "3", "x"] and seen["interpret"] == "1"
    assert seen["main"] == "__main__" and seen["path0"] == ""
    assert killed == -signal.SIGTERM
    assert message == (1, "bad input\n")
    assert timed_out
