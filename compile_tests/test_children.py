"""children.py: a test marked ``children(whole=True)`` runs in a child pytest and
the child's outcome (passed; failed, with its report; skipped, with its reason)
is the session's; a job forked from the fork server (forkserver.py) runs as a
fresh interpreter would."""

import json
import os
import signal
import sys

import pytest

import children

SAMPLE = '''
import pytest

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("not here")
'''


@pytest.mark.children(whole=True)
def test_a_whole_test_runs_in_a_child_pytest():
    assert children.IN_CHILD and os.environ[children.IN_CHILD_ENV] == "1"


def _sample_outcomes(tmp):
    sample = tmp / "test_sample.py"
    sample.write_text(SAMPLE)
    got = {}
    for name in ("test_fails", "test_skips", "test_missing"):  # a pass: the test above
        (tmp / name).mkdir()
        got[name] = children.run_whole_test(f"{sample}::{name}", tmp / name)
    return got


@pytest.mark.children(job=_sample_outcomes)
def test_the_child_outcome_is_read_from_its_report(child):
    got = child.result()
    assert got["test_fails"]["outcome"] == "failed"
    assert "one is not two" in got["test_fails"]["message"]
    assert got["test_skips"] == dict(outcome="skipped", message="not here")
    assert got["test_missing"]["outcome"] == "failed"  # nothing ran: a failure, not a pass
    assert "ran 0 tests" in got["test_missing"]["message"]


PROBE = '''
import json, os, sys
print(json.dumps(dict(argv=sys.argv, cwd=os.getcwd(), interpret=os.environ.get("TRITON_INTERPRET"),
                      path0=sys.path[0], main=__name__)))
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
    return out, killed.returncode, (message.returncode, message.stderr)


@pytest.mark.children(job=_probe_both_ways)
def test_a_forked_job_runs_as_a_fresh_interpreter_would(child):
    """The fork server's jobs see the argv, working directory, environment and
    ``__main__`` a fresh ``python -c`` sees, and exit the same ways."""
    out, killed, message = child.result()
    code, stdout, stderr = out[False]
    assert (code, stdout, stderr) == out[True]
    assert code == 3 and "to stderr" in stderr
    seen = json.loads(stdout)
    assert seen["argv"] == ["-c", "3", "x"] and seen["interpret"] == "1"
    assert seen["main"] == "__main__" and seen["path0"] == ""
    assert killed == -signal.SIGTERM
    assert message == (1, "bad input\n")
