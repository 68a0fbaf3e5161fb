"""Hostile review 35: the PyTorch backend (python/torch_dmabuf) under a careless or hostile user.
The Rust-side tests are in tests/hostile_review35.rs; the numbering is shared. Run as
tests/torch/run does (DMABUF_RT_DEVICES=shmem,shmem DMABUF_RT_CAPACITY=512M). Streams are held
with a gate: a stream callback (dmabuf_rt_stream_add_callback, through ctypes on the library the
package loaded) written in C and compiled here, so that it needs no GIL.

Findings (each test failed on c2b2fe7; all are fixed, see tests/hostile_review35.rs):

1. (`test_a_tensor_freed_under_its_stream_is_not_reissued_to_another_stream_before_it_ran`, both
   sizes) CUDA-correct code reads another stream's data. Under `with torch.dmabuf.stream(s1)`:
   `x = torch.full(..., 1.0)`, a d2h `out.copy_(x, non_blocking=True)` queued on s1 (held by a
   gate), `del x`; then under s2: `y = torch.empty(n)` gets x's address ("same address: True"),
   `y.fill_(2.0)`; open the gate: `out` reads [2.0], want [1.0]. PyTorch reuses a block freed on
   a stream only for allocations on that stream (the free is stream-ordered, so no
   record_stream is needed for the allocating stream). Here allocations know no stream:
   `DmabufAllocator::allocate` calls `dmabuf_rt_device_alloc(device, n, &ptr)`
   (csrc/allocator.cpp:67), which is `allocate_raw(size, None)` (src/ffi/runtime.rs:312), and a
   copy queued on a stream records nothing on the device block (`Runtime::copy`,
   src/ffi/runtime.rs:595-680: only pinned host memory gets `host_record`), so the free at
   `del x` returns the block at once. The fallback on s2 waits for s2 only (CpuAccess), so the
   write lands before s1's copy. Only ops on the default stream (which synchronize the whole
   device) are safe; the README promises CUDA's stream rules ("`tensor.record_stream(s)` defers
   the reuse..."), and this is the case record_stream is documented as not needed for.
2. (`test_a_16_tib_request_is_refused_not_served_from_a_1_mib_run`; also
   `test_requests_past_capacity_raise_and_stats_stay[4611686018427387904]`) On a 512 MiB device,
   after an 8 MiB tensor was freed, `torch.empty((1 << 44) + (1 << 20), dtype=torch.uint8,
   device="dmabuf:0")` returns a tensor: "memory_allocated 0 -> 17592187092992"; a 4 MiB tensor
   allocated next lies 16777216 bytes into it, and a copy into that part of the 16 TiB tensor
   overwrites it ("it holds [9, 238] (want [9])"). `torch.empty(1 << 62)` is likewise served
   when run alone ("DID NOT RAISE OutOfMemoryError", allocated_bytes 4611686018427387904 with
   4198400 reserved), and after earlier tests left punched units in the arena it panics
   inside the allocator instead: "RuntimeError: allocating device memory:
   dmabuf_rt_device_alloc: queue operation failed: internal error (panic): removal index (is 0)
   should be < len (is 0)" (src/caching/arena.rs:614, `merged.remove(0)` in `Arena::finish`,
   from `pick_around_holes`). Cause: the page-stitched arena counts units in u32 and truncates:
   `Arena::home_fit` calls `self.free.fit(n as u32)` and plans `(s, n as u32)`
   (src/caching/arena.rs:627-628; likewise 639 and `pick_around_holes`'s `n as u32`, 576), so
   2^32 + 256 units (16 TiB + 1 MiB at 4 KiB a unit) fit a run of 256 and 2^50 units a run of
   0; nothing compares the request with the capacity before `arena_cached`
   (src/caching/pool/stitched.rs:124-128). The first request, before the arena exists, is
   refused correctly.

Verified (passing): `untyped_storage().resize_()` grows after the stream's queued h2d copy (the
copy is synchronous) and keeps the bytes; a view over a storage shrunk to 16 or 0 bytes is
refused (RuntimeError from the fallback, ValueError from the d2h copy's range check), not read
past its end; a resize past capacity raises OutOfMemoryError and keeps the tensor and the
stats; requests of capacity + 1 and 1 TiB raise OutOfMemoryError with num_ooms counted and
allocation working after; a record_stream'ed, freed tensor is not reused while its stream is
held (allocations and a fallback fill do not wait for it), and `empty_cache()` afterwards
(which waits for the streams, as CUDA's does) leaves reserved within 2 MiB of allocated;
transposed, stepped, expanded, empty, 0-dim and channels_last views copy to the host, to the
other device and into strided destinations as on the CPU; an expanded destination is refused;
dtype-converting and broadcasting copies match the CPU and bad shapes raise; three threads
allocating and freeing each other's tensors (600 tensors) lose nothing and leave memory_allocated
where it was; a receiver killed (SIGKILL) while holding a 4 MiB tensor: the producer's block
stays active while held and is given back after the kill; an event recorded on device 1's
stream and waited on by device 0's stream orders a peer copy, and recording it on device 0
afterwards is refused.
"""

import ctypes
import gc
import os
import signal
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

import torch_dmabuf

TIMEOUT = 120


# ---- a gate: a stream callback (through the C API, the same library the backend loaded) that
# holds the stream until opened. Work queued behind it cannot have run while it is closed. The
# callback is C (compiled here), not Python: a Python callback needs the GIL, which a blocking
# torch call (a synchronize inside storage.resize_) holds while it waits for the stream.

_LIB = ctypes.CDLL(os.path.join(os.path.dirname(torch_dmabuf.__file__), "lib", "libdmabuf_rt.so"))
_LIB.dmabuf_rt_stream_add_callback.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p]
_LIB.dmabuf_rt_stream_add_callback.restype = ctypes.c_int
_LIB.dmabuf_rt_last_error.restype = ctypes.c_char_p

_GATE_C = r"""
#include <stdint.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>
/* state[0]: 1 once opened; state[1]: 1 once the callback began; state[2]: 1 if it gave up */
void gate_cb(uint64_t stream, int status, void *ud) {
  (void)stream; (void)status;
  volatile int *st = (volatile int *)ud;
  __atomic_store_n(&st[1], 1, __ATOMIC_SEQ_CST);
  struct timespec end; clock_gettime(CLOCK_MONOTONIC, &end); end.tv_sec += 60;
  while (!__atomic_load_n(&st[0], __ATOMIC_SEQ_CST)) {
    struct timespec now; clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec > end.tv_sec) { __atomic_store_n(&st[2], 1, __ATOMIC_SEQ_CST); return; }
    struct timespec tick = {1, 0};
    syscall(SYS_futex, &st[0], FUTEX_WAIT, 0, &tick, 0, 0);
  }
}
void gate_open(void *ud) {
  int *st = (int *)ud;
  __atomic_store_n(&st[0], 1, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, &st[0], FUTEX_WAKE, 1 << 30, 0, 0, 0);
}
"""


def _build_gate_lib():
    import subprocess
    import tempfile

    d = tempfile.mkdtemp(prefix="r35gate")
    src, so = os.path.join(d, "gate.c"), os.path.join(d, "gate.so")
    with open(src, "w") as f:
        f.write(_GATE_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so, src], check=True)
    return ctypes.CDLL(so)


_GATE = _build_gate_lib()
_GATE.gate_open.argtypes = [ctypes.c_void_p]
_GATE_CB = ctypes.cast(_GATE.gate_cb, ctypes.c_void_p)


class Gate:
    """Holds `stream` at this point until `open()` (it gives up after 60 s, and `timed_out`
    then says the test's own ordering failed, which the test reports)."""

    def __init__(self, stream):
        self.state = (ctypes.c_int * 3)()
        rc = _LIB.dmabuf_rt_stream_add_callback(stream.stream_id, _GATE_CB, ctypes.addressof(self.state))
        assert rc == 0, _LIB.dmabuf_rt_last_error()

    def open(self):
        _GATE.gate_open(ctypes.addressof(self.state))

    @property
    def entered(self):
        return self.state[1] == 1

    @property
    def timed_out(self):
        return self.state[2] == 1


def settle():
    gc.collect()
    for d in range(torch.dmabuf.device_count()):
        torch.dmabuf.synchronize(d)


def two_streams(device=0):
    s1 = torch.dmabuf.Stream(device)
    s2 = torch.dmabuf.Stream(device)
    while s2.stream_id == s1.stream_id:
        s2 = torch.dmabuf.Stream(device)
    return s1, s2


# ---- 1. stream-ordered reuse (PyTorch's rule: a block freed on a stream is reused only by
# allocations on that stream, so work queued there before the free still sees its bytes)


@pytest.mark.parametrize("n", [1 << 10, 1 << 20])
def test_a_tensor_freed_under_its_stream_is_not_reissued_to_another_stream_before_it_ran(n):
    settle()
    s1, s2 = two_streams()
    out = torch.zeros(n, pin_memory=True)
    with torch.dmabuf.stream(s1):
        x = torch.full((n,), 1.0, device="dmabuf:0")  # allocated with s1 current
        gate = Gate(s1)
        out.copy_(x, non_blocking=True)  # d2h queued on s1, behind the gate
        x_ptr = x.data_ptr()
        del x  # CUDA: safe, the block returns to s1's pool and is reused in s1's order
    with torch.dmabuf.stream(s2):
        y = torch.empty(n, device="dmabuf:0")
        same = y.data_ptr() == x_ptr
        y.fill_(2.0)  # the fallback waits for s2 only (s1 is s1's business)
    gate.open()
    s1.synchronize()
    assert not gate.timed_out, "the test's gate timed out: something waited for the gated stream"
    got = out.unique().tolist()
    assert got == [1.0], (
        f"a d2h copy queued on stream s1 before its source was freed (allocated under s1) read {got}, "
        f"want [1.0]: the freed block was reissued to an allocation on stream s2 (same address: {same}) "
        "and written there before s1 ran the copy"
    )
    del y


def test_record_stream_on_a_freed_tensor_keeps_the_block_for_the_stream_then_empty_cache():
    settle()
    n = 4 << 20
    s1, _ = two_streams()
    out = torch.zeros(n // 4, pin_memory=True)
    x = torch.full((n // 4,), 3.0, device="dmabuf:0")
    with torch.dmabuf.stream(s1):
        gate = Gate(s1)
        out.copy_(x, non_blocking=True)
    x.record_stream(s1)
    del x
    # Reuse whatever memory there is now, and write it (from the default stream's thread).
    fill = [torch.empty(n // 4, device="dmabuf:0") for _ in range(4)]
    with torch.dmabuf.stream(torch.dmabuf.Stream(0)):
        for f in fill:
            f.fill_(9.0)
    gate.open()
    s1.synchronize()
    assert not gate.timed_out, "an allocation waited for the gated stream"
    got = out.unique().tolist()
    assert got == [3.0], f"d2h from a record_stream'ed, freed tensor read {got}"
    del fill
    torch.dmabuf.empty_cache()  # waits for the streams (as CUDA's does), then gives back
    assert torch.dmabuf.memory_reserved(0) <= torch.dmabuf.memory_allocated(0) + (2 << 20)


# ---- 2. storages resized under views and streams


def test_untyped_storage_resize_keeps_bytes_and_the_stream_work_into_it():
    settle()
    s1, _ = two_streams()
    src = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
    with torch.dmabuf.stream(s1):
        t = torch.zeros(1 << 16, device="dmabuf:0")
        t.copy_(src, non_blocking=True)  # h2d queued on s1
    st = t.untyped_storage()
    st.resize_(st.nbytes() * 2)  # the copy to the new block is synchronous: after s1
    torch.dmabuf.synchronize(0)
    assert st.nbytes() == 2 * (1 << 18)
    assert torch.equal(t.cpu(), src), "resize_ lost the h2d copy queued on s1 before it"
    # Shrinking under the view: reads are refused, not read past the end.
    st.resize_(16)
    with pytest.raises(RuntimeError, match="storage"):
        t.sum()
    with pytest.raises((RuntimeError, ValueError)):
        t.cpu()
    st.resize_(0)
    with pytest.raises((RuntimeError, ValueError)):
        t.cpu()
    del t, st


def test_resize_of_a_storage_bigger_than_capacity_raises_and_keeps_the_tensor():
    settle()
    t = torch.arange(1024, dtype=torch.float32, device="dmabuf:0")
    st = t.untyped_storage()
    before = torch.dmabuf.memory_allocated(0)
    with pytest.raises(torch.OutOfMemoryError):
        st.resize_(1 << 40)
    assert st.nbytes() == 4096
    assert torch.equal(t.cpu(), torch.arange(1024, dtype=torch.float32))
    assert torch.dmabuf.memory_allocated(0) == before


# ---- 3. OOM and errors


@pytest.mark.parametrize("nbytes", [(512 << 20) + 1, 1 << 40, (1 << 62)])
def test_requests_past_capacity_raise_and_stats_stay(nbytes):
    settle()
    stats0 = torch.dmabuf.memory_stats(0)
    alloc0 = torch.dmabuf.memory_allocated(0)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(nbytes, dtype=torch.uint8, device="dmabuf:0")
    assert torch.dmabuf.memory_allocated(0) == alloc0
    s = torch.dmabuf.memory_stats(0)
    assert s["num_ooms"] == stats0["num_ooms"] + 1
    assert s["reserved_bytes.all.current"] >= 0
    x = torch.ones(1 << 20, device="dmabuf:0")
    assert x.sum().item() == float(1 << 20)


def test_a_16_tib_request_is_refused_not_served_from_a_1_mib_run():
    settle()
    w = torch.empty(8 << 20, dtype=torch.uint8, device="dmabuf:0")
    del w  # a free run of 8 MiB in the arena
    alloc0 = torch.dmabuf.memory_allocated(0)
    n = (1 << 44) + (1 << 20)
    try:
        y = torch.empty(n, dtype=torch.uint8, device="dmabuf:0")
    except torch.OutOfMemoryError:
        return
    got = torch.dmabuf.memory_allocated(0)
    z = torch.full((4 << 20,), 9, dtype=torch.uint8, device="dmabuf:0")
    o = z.data_ptr() - y.data_ptr()
    if 0 <= o < n:
        y[o : o + 4096].copy_(torch.full((4096,), 0xEE, dtype=torch.uint8))
    zs = z.cpu().unique().tolist()
    del y, z
    pytest.fail(
        f"torch.empty({n}) on a 512 MiB device returned a tensor: memory_allocated {alloc0} -> {got}; a 4 MiB tensor "
        f"allocated next lies {o} bytes into it, and after a copy into that part of the 16 TiB tensor it holds {zs} "
        "(want [9])"
    )


def test_copies_of_odd_shapes_match_the_cpu():
    settle()
    base = torch.arange(6 * 7 * 5, dtype=torch.float64).reshape(6, 7, 5)
    d = base.to("dmabuf:0")
    cases = {
        "transposed": lambda t: t.transpose(0, 2),
        "stepped": lambda t: t[::2, 1::3, ::-1] if False else t[::2, 1::3],
        "expanded": lambda t: t[:1].expand(4, 7, 5),
        "empty": lambda t: t[:, :0],
        "scalar": lambda t: t[1, 2, 3],
        "channels_last": lambda t: t.unsqueeze(0).contiguous(memory_format=torch.channels_last),
    }
    for name, f in cases.items():
        want = f(base)
        got = f(d)
        assert torch.equal(got.cpu(), want), name
        # Into a fresh device tensor of the same view shape, then back.
        e = torch.empty_like(want, device="dmabuf:1")
        e.copy_(got)
        assert torch.equal(e.cpu(), want.contiguous()), name
        # Host to a strided device destination.
        dst = torch.zeros(14, 10, 6, dtype=torch.float64, device="dmabuf:0")[::2, ::2, :5][:6, :7]
        if want.dim() == 3 and tuple(want.shape) == (6, 7, 5):
            dst.copy_(want)
            assert torch.equal(dst.cpu(), want), name
    # Into an expanded (self-overlapping) destination: refused as on the CPU.
    with pytest.raises(RuntimeError):
        torch.zeros(1, 5, device="dmabuf:0").expand(3, 5).copy_(torch.ones(3, 5))


def test_a_copy_from_a_dtype_mismatch_and_a_broadcast():
    settle()
    src = torch.arange(10, dtype=torch.int64)
    d = torch.empty(3, 10, dtype=torch.float16, device="dmabuf:0")
    d.copy_(src)
    assert torch.equal(d.cpu(), src.to(torch.float16).expand(3, 10))
    with pytest.raises(RuntimeError):
        d.copy_(torch.arange(7))
    with pytest.raises(RuntimeError):
        torch.empty(10, device="dmabuf:0").copy_(torch.empty(0))


# ---- 4. threads freeing what others allocated


def test_threads_free_what_others_allocate_and_nothing_is_lost():
    settle()
    base = torch.dmabuf.memory_allocated(0)
    import queue as pyqueue

    q = pyqueue.Queue()
    errors = []
    rounds = 300

    def producer(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for i in range(rounds):
                n = int(torch.randint(1, 200_000, (1,), generator=g))
                t = torch.full((n,), float(seed * 1000 + i), device="dmabuf:0")
                q.put((t, float(seed * 1000 + i), n))
        except Exception as e:
            errors.append(repr(e))
        q.put(None)

    def consumer():
        done = 0
        try:
            while done < 2:
                item = q.get(timeout=TIMEOUT)
                if item is None:
                    done += 1
                    continue
                t, v, n = item
                got = t.cpu()
                if got.numel() != n or not bool((got == v).all()):
                    errors.append(f"tensor of {n} holding {v}: read {got.unique()[:5].tolist()}")
                del t, item, got
        except Exception as e:
            errors.append(repr(e))

    ths = [threading.Thread(target=producer, args=(s,)) for s in (1, 2)] + [threading.Thread(target=consumer)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in ths), "hung"
    assert not errors, errors[:5]
    settle()
    assert torch.dmabuf.memory_allocated(0) == base


# ---- 5. torch.multiprocessing: the receiver dies


def _holder(q, out):
    t = q.get(timeout=TIMEOUT)
    out.put(("got", float(t.sum().item())))
    time.sleep(3600)  # held until killed


def test_a_receiver_killed_while_holding_a_tensor_gives_its_block_back():
    settle()
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_holder, args=(q, out))
    p.start()
    try:
        def active():
            return torch.dmabuf.memory_stats(1)["active_bytes.all.current"]

        base = active()
        x = torch.ones(4 << 20, dtype=torch.uint8, device="dmabuf:1")
        q.put(x)
        kind, v = out.get(timeout=TIMEOUT)
        assert kind == "got" and v == float(4 << 20)
        del x
        gc.collect()
        # Held by the receiver: not reusable yet.
        assert active() >= base + (4 << 20), "the held block was let go while the receiver holds it"
        os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
        deadline = time.monotonic() + 30
        while active() != base and time.monotonic() < deadline:
            time.sleep(0.05)  # a wait for a condition, with a deadline; not an ordering
        assert active() == base, (
            f"after the receiver was killed, device 1 still has {active() - base} active bytes for the tensor it held"
        )
        y = torch.full((4 << 20,), 5, dtype=torch.uint8, device="dmabuf:1")
        assert y.sum().item() == 5 * (4 << 20)
    finally:
        if p.is_alive():
            p.kill()
        p.join(TIMEOUT)


# ---- 6. streams and events across devices


def test_an_event_recorded_on_one_device_and_waited_on_by_another_devices_stream():
    settle()
    s0 = torch.dmabuf.Stream(0)
    s1 = torch.dmabuf.Stream(1)
    e = torch.dmabuf.Event()
    a = torch.zeros(1 << 16, device="dmabuf:1")
    src = torch.full((1 << 16,), 4.0).pin_memory()
    with torch.dmabuf.stream(s1):
        gate = Gate(s1)
        a.copy_(src, non_blocking=True)
        e.record(s1)
    s0.wait_event(e)
    b = torch.empty(1 << 16, device="dmabuf:0")
    with torch.dmabuf.stream(s0):
        b.copy_(a, non_blocking=True)  # peer copy on s0, after e
    gate.open()
    s0.synchronize()
    assert not gate.timed_out
    assert b.cpu().unique().tolist() == [4.0]
    # The event now belongs to device 1: recording it on a device 0 stream is refused clearly.
    with pytest.raises(RuntimeError):
        e.record(s0)
    # A forged stream of device 1 presented as device 0's.
    forged = torch.Stream(stream_id=s1.stream_id, device_index=0, device_type=20)
    t = torch.ones(16, device="dmabuf:0")
    try:
        t.record_stream(forged)
    except (RuntimeError, ValueError):
        pass
    del t
    settle()
