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


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
