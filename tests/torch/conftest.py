"""Fixtures for the torch_dmabuf suite (tests/torch/test_torch_dmabuf.py).

tests/torch/run runs the suite with DMABUF_RT_DEVICES=shmem,shmem DMABUF_RT_CAPACITY=512M, and
a second time with DMABUF_RT_NO_CACHING=1 added. The defaults below only matter when pytest is
run by hand; the runtime reads these variables once, at first use, so they must be set before
torch_dmabuf touches a device.
"""

import gc
import os
import sys

os.environ.setdefault("DMABUF_RT_DEVICES", "shmem,shmem")
os.environ.setdefault("DMABUF_RT_CAPACITY", "512M")

import pytest  # noqa: E402
import torch  # noqa: E402

import torch_dmabuf  # noqa: E402,F401  (renames PrivateUse1 to "dmabuf", registers torch.dmabuf)

NO_CACHING = os.environ.get("DMABUF_RT_NO_CACHING") == "1"


def device_count():
    return torch.dmabuf.device_count()


def settle():
    """Drops unreachable tensors, and those a failed test's traceback kept alive (pytest keeps
    the last failure in sys.last_*), and waits for every device's streams."""
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    gc.collect()
    for d in range(device_count()):
        torch.dmabuf.synchronize(d)


def allocated_per_device():
    return [torch.dmabuf.memory_allocated(d) for d in range(device_count())]


@pytest.fixture(scope="session", autouse=True)
def allocator_in_use():
    """torch.accelerator.memory_stats (and so torch.dmabuf's) is {} until the allocator has
    served a first allocation, as torch.cuda.memory_stats is before CUDA is initialized: one
    allocation per device up front lets any test, run alone, read the stats."""
    for d in range(device_count()):
        torch.empty(1, device=f"dmabuf:{d}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item, for the fixture below."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def no_leak_and_clean_state(request, allocator_in_use):
    """Every test starts on device 0 with the default streams current and the default
    fallback mode, and must leave each device's allocated bytes where it found them (after
    its streams are synchronized). A failed test is not checked: its traceback still holds
    its tensors."""
    for d in range(device_count()):
        torch.dmabuf.set_stream(torch.dmabuf.default_stream(d))
    torch.dmabuf.set_device(0)
    settle()
    before = allocated_per_device()
    yield
    settle()
    after = allocated_per_device()
    # Reset before asserting, so one failure does not spill into the next test.
    for d in range(device_count()):
        torch.dmabuf.set_stream(torch.dmabuf.default_stream(d))
    torch.dmabuf.set_device(0)
    if hasattr(torch_dmabuf, "set_fallback_mode"):
        torch_dmabuf.set_fallback_mode("zero_copy")
    call = getattr(request.node, "report_call", None)
    if call is not None and call.failed:
        return
    assert after == before, f"device memory leaked by the test: allocated bytes per device {before} -> {after}"


@pytest.fixture
def two_devices():
    if device_count() < 2:
        pytest.skip(f"needs two dmabuf devices, DMABUF_RT_DEVICES gives {device_count()}")


@pytest.fixture(params=["zero_copy", "copy"])
def fallback_mode(request):
    """Runs the test under each CPU-fallback mode (restored to the default afterwards)."""
    previous = torch_dmabuf.fallback_mode()
    torch_dmabuf.set_fallback_mode(request.param)
    assert torch_dmabuf.fallback_mode() == request.param
    yield request.param
    torch_dmabuf.set_fallback_mode(previous)
