import os

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
def upstream():
    """sglang 0.5.23's own metadata code, obtained from its wheel at run time
    (`fa3_spec.harness.sglang_upstream`); the test skips, with the reason,
    when it cannot be had."""
    from fa3_spec.harness.sglang_upstream import SGLANG_VERSION, load_upstream_or_reason

    up, why = load_upstream_or_reason(device=SGLANG_DEVICE)
    if up is None:
        pytest.skip(f"sglang {SGLANG_VERSION}'s own code is unavailable here: {why}")
    return up


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
