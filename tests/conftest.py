import os
import sys

import pytest

# bench/ (the model zoo, bundled chains and traces) is not installed: append the checkout so
# tests can import it, while an installed vmalloc/scheduler still comes first on sys.path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)


# cuBLAS gives the same bits on every run only with a fixed workspace: set before any test
# module imports torch, for the GPU tests that compare gradients bit for bit
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture
def no_gc():
    """Python's cyclic collector off for one test: what must be freed at once must be freed by
    reference counts alone."""
    import gc
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def deterministic_kernels():
    """Deterministic kernels for one test (bit-for-bit comparisons on a GPU: a kernel that adds
    with atomics then raises instead of differing by run-to-run noise); put back after it, since
    other GPU tests measure memory with PyTorch's defaults."""
    import torch
    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
              torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[:2]
    torch.use_deterministic_algorithms(before[2], warn_only=before[3])


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Set in the pytest run that tests/test_fake_cuda.py starts on the fake libcuda (tests/fake_cuda).
FAKE_CUDA = os.environ.get("VMALLOC_FAKE_CUDA") == "1"


def pytest_collection_modifyitems(config, items):
    """gpu tests skip without a device, except those marked driver on the fake libcuda; fake_cuda
    tests run only there."""
    real = _cuda_available()
    no_gpu = pytest.mark.skip(reason="needs a CUDA device; none is present")
    not_fake = pytest.mark.skip(reason="runs on the fake libcuda only (tests/test_fake_cuda.py)")
    for item in items:
        if "fake_cuda" in item.keywords and not FAKE_CUDA:
            item.add_marker(not_fake)
        elif "gpu" in item.keywords and not real and not (FAKE_CUDA and "driver" in item.keywords):
            item.add_marker(no_gpu)


if FAKE_CUDA:
    @pytest.fixture(autouse=True)
    def _driver_contract_kept(request):
        """On the fake libcuda every test must keep the driver's contract: a violation the fake
        recorded during the test fails it, naming the call. A test that misuses the driver on
        purpose sets `fake.expected_violations`."""
        from fake_cuda import FakeDriver

        fake = FakeDriver()
        before = fake.get("violations")
        request.node.fake_driver = fake
        fake.expected_violations = 0
        yield
        fake.revive()  # a test that shut the driver down (fake.deinit()) gets it back
        new = fake.violations()[before:]
        got = fake.get("violations") - before
        assert got == fake.expected_violations, (
            f"{got} driver contract violation(s) (expected {fake.expected_violations}):\n"
            + "\n".join(new))

    @pytest.fixture
    def fake(request):
        """The fake libcuda's test controls (tests marked fake_cuda)."""
        return request.node.fake_driver
