"""What the two fallback modes do, counted with PyTorch's profiler: the zero-copy fallback runs
CPU kernels on the device pages (no copy for inputs, none for out= results such as add and mm
produce), the copying fallback moves every operand to the host and back."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torch_dmabuf


def copies(f):
    """How many device copies (`aten::_copy_from`) and host round trips (`aten::_to_cpu`) `f`
    makes."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        f()
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("aten::_copy_from", 0), counts.get("aten::_to_cpu", 0)


@pytest.fixture
def mode():
    yield torch_dmabuf.set_fallback_mode
    torch_dmabuf.set_fallback_mode("zero_copy")


def test_the_zero_copy_fallback_copies_nothing_for_inputs_and_out_results(mode):
    a, b = torch.randn(64, 32).dmabuf(), torch.randn(32, 16).dmabuf()
    mode("zero_copy")
    for name, f in [
        ("add", lambda: a + a),
        ("mm", lambda: a @ b),
        ("sum", lambda: a.sum(0)),
        ("in-place", lambda: a.mul_(1.0)),
        ("view", lambda: a.t().narrow(0, 0, 4)),
    ]:
        assert copies(f) == (0, 0), name
    torch.testing.assert_close((a @ b).cpu(), a.cpu() @ b.cpu())


def test_the_copying_fallback_moves_operands_to_the_host_and_back(mode):
    a = torch.randn(64, 32).dmabuf()
    mode("copy")
    n_copies, round_trips = copies(lambda: a + a)
    assert round_trips >= 1 and n_copies >= 2, (n_copies, round_trips)
    torch.testing.assert_close((a + a).cpu(), 2 * a.cpu())
