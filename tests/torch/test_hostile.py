"""Regression tests for what a hostile review of torch_dmabuf found (issue 11): each failed
before its fix (a segfault, silently wrong data, or a confusing error)."""

import pytest
import torch

import torch_dmabuf

MiB = 1 << 20


def two_devices():
    if torch.dmabuf.device_count() < 2:
        pytest.skip("needs two dmabuf devices (DMABUF_RT_DEVICES=shmem,shmem)")


def busy(stream, device):
    """Queues ~1 GB of copies on `stream` so that it is still running when the test goes on."""
    big = torch.empty(48 * MiB, dtype=torch.uint8, device=device)
    host = torch.zeros(48 * MiB, dtype=torch.uint8)
    with torch.dmabuf.stream(stream):
        for _ in range(20):
            big.copy_(host, non_blocking=True)
    return big


def test_conjugate_and_negative_views_copy_and_compute_as_on_the_cpu():
    # These recursed through PyTorch's Conjugate fallback until the stack overflowed.
    x = torch.tensor([1 + 2j, 3j, -1 - 1j], dtype=torch.complex64)
    d = x.dmabuf()
    assert torch.equal(d.conj().cpu(), x.conj())
    assert torch.equal(d.conj().resolve_conj().cpu(), x.conj().resolve_conj())
    assert torch.equal(torch.zeros_like(d).copy_(d.conj()).cpu(), x.conj())
    assert torch.equal((d.conj() + 1).cpu(), x.conj() + 1)
    assert torch.equal(d.conj().imag.cpu(), x.conj().imag)  # a negative view
    assert "dmabuf" in str(d.conj())
    # Kernels that honour the conj bit themselves got the unconjugated data.
    a = torch.randn(4, 4, dtype=torch.complex64)
    v = torch.randn(5, dtype=torch.complex64)
    torch.testing.assert_close((a.dmabuf() @ a.dmabuf().mH).cpu(), a @ a.mH)
    torch.testing.assert_close(torch.dot(v.dmabuf().conj(), v.dmabuf()).cpu(), torch.dot(v.conj(), v))
    torch.testing.assert_close(torch.mm(a.dmabuf().conj(), a.dmabuf()).cpu(), torch.mm(a.conj(), a))


def test_a_queued_copy_into_freed_pinned_memory_never_lands_in_a_new_pinned_tensor():
    s = torch.dmabuf.Stream()
    keep = busy(s, "dmabuf:0")
    src = torch.full((MiB,), 7.0, device="dmabuf")
    pinned = torch.empty(MiB).pin_memory()
    with torch.dmabuf.stream(s):
        pinned.copy_(src, non_blocking=True)  # queued behind the busy work
    del pinned  # freed before the copy has run
    other = torch.zeros(MiB).pin_memory()  # may reuse the block only after s passes
    s.synchronize()
    assert int((other != 0).sum()) == 0, "the late copy wrote into a new pinned tensor"
    del keep


def test_resize_keeps_what_the_current_stream_queued_into_the_tensor():
    s = torch.dmabuf.Stream()
    keep = busy(s, "dmabuf:0")
    x = torch.zeros(MiB, device="dmabuf")
    with torch.dmabuf.stream(s):
        x.copy_(torch.full((MiB,), 7.0), non_blocking=True)
        x.resize_(2 * MiB)
        victim = torch.zeros(MiB, device="dmabuf")  # may get x's old block
    s.synchronize()
    assert torch.equal(x[:MiB].cpu(), torch.full((MiB,), 7.0))
    assert int((victim.cpu() != 0).sum()) == 0
    del keep


def test_a_non_blocking_peer_copy_waits_for_the_source_devices_current_stream():
    two_devices()
    s0, s1 = torch.dmabuf.Stream(0), torch.dmabuf.Stream(1)
    src = torch.zeros(MiB, device="dmabuf:0")
    dst = torch.full((MiB,), -1.0, device="dmabuf:1")
    keep = busy(s0, "dmabuf:0")
    prev0, prev1 = torch.dmabuf.current_stream(0), torch.dmabuf.current_stream(1)
    torch.dmabuf.set_stream(s0)
    torch.dmabuf.set_stream(s1)
    try:
        src.copy_(torch.full((MiB,), 7.0), non_blocking=True)  # on s0
        dst.copy_(src, non_blocking=True)  # on s1: must wait for s0
    finally:
        torch.dmabuf.set_stream(prev0)
        torch.dmabuf.set_stream(prev1)
    torch.dmabuf.synchronize(0)
    torch.dmabuf.synchronize(1)
    assert torch.equal(dst.cpu(), torch.full((MiB,), 7.0))
    del keep


def test_storage_growth_stays_on_the_tensors_device():
    two_devices()
    a = torch.arange(4.0, device="dmabuf:1")
    b = torch.zeros(2, device="dmabuf:1")
    with torch.dmabuf.device(0):
        b.set_(a.untyped_storage(), 0, (8,), (1,))  # grows a dmabuf:1 storage
    assert b.untyped_storage().device == torch.device("dmabuf:1")
    assert torch.equal(b[:4].cpu(), torch.arange(4.0))
    for mode in ("copy", "zero_copy"):
        torch_dmabuf.set_fallback_mode(mode)
        try:
            a1 = torch.ones(5, device="dmabuf:1")
            out = torch.empty(0, device="dmabuf:1")
            with torch.dmabuf.device(0):
                torch.add(a1, a1, out=out)
            assert out.untyped_storage().device == torch.device("dmabuf:1"), mode
            assert torch.equal(out.cpu(), torch.full((5,), 2.0)), mode
        finally:
            torch_dmabuf.set_fallback_mode("zero_copy")


def test_a_tensor_whose_storage_shrank_under_it_is_refused_not_read_past_its_end():
    x = torch.arange(100.0, device="dmabuf")
    x.untyped_storage().resize_(8)
    with pytest.raises(RuntimeError, match="needs 400 bytes of its storage"):
        x + 1
    assert x.untyped_storage().nbytes() == 8, "a read regrew the storage"


def test_overlapping_copies_are_refused_as_on_the_cpu():
    x = torch.arange(10.0, device="dmabuf")
    with pytest.raises(RuntimeError, match="single memory location"):
        x[1:].copy_(x[:-1])
    assert torch.equal(x.cpu(), torch.arange(10.0))


def test_errors_name_device_indices_as_numbers():
    two_devices()
    e = torch.Event(device="dmabuf:0")
    e.record(torch.dmabuf.Stream(0))
    with pytest.raises(RuntimeError, match="event device index 0 does not match the recording stream's device 1"):
        e.record(torch.dmabuf.Stream(1))


def test_a_cpu_generator_for_a_dmabuf_op_is_refused():
    g = torch.Generator()
    with pytest.raises(RuntimeError, match="Expected a 'dmabuf' device type for generator but found 'cpu'"):
        torch.empty(10, device="dmabuf").normal_(generator=g)
    t = torch.empty(10, device="dmabuf").normal_(generator=torch.Generator(device="dmabuf"))
    assert t.device.type == "dmabuf"


def test_a_forged_stream_is_refused_when_made_current():
    forged = torch.Stream(stream_id=12345, device_index=0, device_type=20)
    with pytest.raises(ValueError, match="stream"):
        torch.dmabuf.set_stream(forged)
    assert torch.dmabuf.current_stream().stream_id == 0
    assert torch.equal((torch.ones(3, device="dmabuf") + 1).cpu(), torch.full((3,), 2.0))
