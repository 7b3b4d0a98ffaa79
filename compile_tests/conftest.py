import os

import children  # first: it keeps the environment the session started with
import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" is the default profile (CPU, 2 cores); "dev" runs many more examples.
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=2000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("FA3_SPEC_HYPOTHESIS_PROFILE", "ci"))

# sglang's Triton kernels run on CPU only in Triton's interpreter, a mode fixed
# when Triton is first imported (the `upstream` fixture). Children keep the
# environment the test run started with (children.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--kernels", action="append", default=[], metavar="NAME=VALUE",
                     help="run the tests on these op kernels (fa3_spec.eagle.parse_kernels), "
                          "e.g. --kernels expand_attention=fa3; repeat for more")


def pytest_configure(config):
    """``--kernels``: select the op kernels before any test compiles or captures;
    tests that choose a kernel themselves put this choice back."""
    pairs = config.getoption("--kernels")
    if pairs:
        from fa3_spec.eagle.kernels import parse_kernels, select_kernels
        try:
            kernels = parse_kernels(pairs)
        except ValueError as e:
            raise pytest.UsageError(f"--kernels: {e}") from None
        select_kernels(kernels)


def pytest_collection_modifyitems(items):
    """Tests marked ``children`` (children.py) run last, in their order: their jobs run
    beside the in-process tests, then side by side while pytest only waits for them."""
    items[:] = ([i for i in items if i.get_closest_marker("children") is None]
                + [i for i in items if i.get_closest_marker("children") is not None])


@pytest.fixture(scope="session", autouse=True)
def _child_jobs(request, tmp_path_factory):
    if children.PARALLEL > 1:  # one core for this process, one for the children (children.py)
        torch.set_num_threads(1)
    jobs = children.Jobs(request.session, tmp_path_factory)
    if children.PARALLEL > 1:
        jobs.start()
    yield jobs
    jobs.close()


@pytest.fixture
def child(request, _child_jobs):
    """The result of this test's ``@pytest.mark.children(job=...)``: ``child.result()``."""
    if request.node.get_closest_marker("children") is None:
        raise pytest.UsageError("the child fixture needs @pytest.mark.children(job=...)")
    return children.Child(_child_jobs.future(request.node))


def pytest_terminal_summary(terminalreporter):
    if children.SECONDS:
        terminalreporter.write_sep("=", "children jobs (their own time; the tests mostly wait)")
        for nodeid, s in sorted(children.SECONDS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{s:7.2f}s job      {nodeid}")


def pytest_unconfigure(config):
    children.kill_running()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean cache (no cross-test cache-limit hits)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """Pin torch to one CPU thread for the test (the EAGLE loop's many small ops
    run several times faster that way on a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: Where the sglang parity tests run sglang's own code (its Triton kernels run
#: in Triton's interpreter on CPU).
SGLANG_DEVICE = os.environ.get("FA3_SPEC_SGLANG_DEVICE",
                               "cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def upstream(_child_jobs):
    """sglang 0.5.23's own metadata code, obtained from its wheel at run time
    (`fa3_spec.harness.sglang_upstream`); the test skips, with the reason,
    when it cannot be had."""
    from fa3_spec.harness.sglang_upstream import SGLANG_VERSION, load_upstream_or_reason

    _child_jobs.wait_prefetch()  # children.py: no two processes fill the cache at once
    up, why = load_upstream_or_reason(device=SGLANG_DEVICE)
    if up is None:
        pytest.skip(f"sglang {SGLANG_VERSION}'s own code is unavailable here: {why}")
    return up


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
