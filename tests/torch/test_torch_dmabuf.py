"""The torch_dmabuf PyTorch backend (PrivateUse1 renamed "dmabuf") against real torch 2.15.

Run by tests/torch/run with DMABUF_RT_DEVICES=shmem,shmem DMABUF_RT_CAPACITY=512M, and a second
time with DMABUF_RT_NO_CACHING=1 added: tests whose expectations depend on caching read
NO_CACHING and assert the behaviour of the mode they run in. conftest.py checks after every
test that no device memory leaked.

Stats semantics asserted here (PyTorch's caching allocator): a tensor of n > 0 bytes allocates
n rounded up to a multiple of 512 ("allocated_bytes"; without caching, to whole pages, each
tensor being a mapping of its own) and requests exactly n ("requested_bytes"); sizes <= 1 MiB
come from the small pool, larger ones from the large pool; 0-byte tensors allocate nothing.
"""

import base64
import copy
import io
import json
import os
import pickle
import random
import re
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda import _memory_viz

import torch_dmabuf

# conftest.py has set the environment's defaults before this import.
NO_CACHING = os.environ.get("DMABUF_RT_NO_CACHING") == "1"

KiB = 1 << 10
MiB = 1 << 20

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]
ALLOWED_ERRORS = (RuntimeError, ValueError, IndexError)


# Without caching every tensor is a block of its own mapping, whole pages (seed 002's design).
GRANULE = os.sysconf("SC_PAGE_SIZE") if NO_CACHING else 512


def rounded(nbytes):
    """What the allocator accounts for a request of nbytes: PyTorch's caching allocator's
    512-byte multiples, or whole pages without caching."""
    return 0 if nbytes == 0 else -(-nbytes // GRANULE) * GRANULE


def stats(d=0):
    return torch.dmabuf.memory_stats(d)


def allocated(d=0):
    return torch.dmabuf.memory_allocated(d)


def reserved(d=0):
    return torch.dmabuf.memory_reserved(d)


def dev(i=0):
    return torch.device("dmabuf", i)


def capacity(d=0):
    return torch.dmabuf.mem_get_info(d)[1]


def sample(dtype, n, seed, shape=None):
    """n deterministic values of dtype on the CPU."""
    g = torch.Generator().manual_seed(seed)
    shape = shape if shape is not None else (n,)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dtype)


def device_count():
    return torch.dmabuf.device_count()


def parse_size(s):
    s = s.strip()
    shift = {"k": 10, "m": 20, "g": 30}.get(s[-1:].lower(), 0)
    return int(s[:-1] if shift else s) << shift


# ---------------------------------------------------------------------------------------------
# Devices and the accelerator
# ---------------------------------------------------------------------------------------------


def test_devices_come_from_the_environment():
    assert torch.dmabuf.is_available()
    specs = [s for s in os.environ.get("DMABUF_RT_DEVICES", "shmem").split(",") if s.strip()]
    assert torch.dmabuf.device_count() == len(specs)
    if "DMABUF_RT_CAPACITY" in os.environ:
        want = parse_size(os.environ["DMABUF_RT_CAPACITY"])
        for d in range(device_count()):
            assert torch.dmabuf.mem_get_info(d)[1] == want
    assert torch._C._get_privateuse1_backend_name() == "dmabuf"
    assert torch.device("dmabuf:0").type == "dmabuf"


def test_the_current_accelerator_is_dmabuf():
    acc = torch.accelerator.current_accelerator()
    assert acc is not None and acc.type == "dmabuf"
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == torch.dmabuf.device_count()
    assert torch.accelerator.current_device_index() == 0
    torch.accelerator.synchronize()
    torch.accelerator.synchronize(0)


def test_tensor_and_storage_attributes():
    x = torch.arange(10, dtype=torch.float32).to("dmabuf")
    assert x.is_dmabuf and x.device == dev(0)
    assert x.untyped_storage().is_dmabuf
    assert x.untyped_storage().device == dev(0)
    assert not torch.arange(3).is_dmabuf
    assert not torch.arange(3).untyped_storage().is_dmabuf
    y = torch.ones(3).dmabuf()
    assert y.device == dev(0)
    assert torch.equal(y.cpu(), torch.ones(3))


def test_factories_on_the_device():
    e = torch.empty(5, 7, device="dmabuf")
    assert e.shape == (5, 7) and e.dtype == torch.float32 and e.device == dev(0)
    assert torch.equal(torch.zeros(4, 3, device="dmabuf").cpu(), torch.zeros(4, 3))
    assert torch.equal(torch.ones(6, dtype=torch.int64, device="dmabuf").cpu(), torch.ones(6, dtype=torch.int64))
    assert torch.equal(torch.full((2, 2), 3.5, device="dmabuf").cpu(), torch.full((2, 2), 3.5))
    assert torch.equal(torch.arange(0, 100, 3, device="dmabuf").cpu(), torch.arange(0, 100, 3))
    r = torch.randn(1000, device="dmabuf")
    assert r.device == dev(0) and r.dtype == torch.float32
    rc = r.cpu()
    # 1000 standard normal draws: not all equal, mean within 5 sigma of 0.
    assert rc.std().item() > 0.5 and abs(rc.mean().item()) < 5 / 1000**0.5


def test_set_device_and_the_device_context_manager(two_devices):
    assert torch.dmabuf.current_device() == 0
    with torch.dmabuf.device(1):
        assert torch.dmabuf.current_device() == 1
        assert torch.empty(3, device="dmabuf").device == dev(1)
        assert torch.ones(3).to("dmabuf").device == dev(1)
        assert torch.ones(3).dmabuf().device == dev(1)
    assert torch.dmabuf.current_device() == 0
    torch.dmabuf.set_device(1)
    try:
        assert torch.dmabuf.current_device() == 1
        assert torch.accelerator.current_device_index() == 1
        assert torch.empty(2, device="dmabuf").device == dev(1)
    finally:
        torch.dmabuf.set_device(0)
    assert torch.empty(2, device="dmabuf").device == dev(0)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------

ROUND_TRIP_SIZES = [0, 1, 3, 511, 4097, 65537, MiB + 3]


@pytest.mark.parametrize("n", ROUND_TRIP_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(dtype, n):
    t = sample(dtype, n, seed=n)
    before = allocated()
    d = t.to("dmabuf")
    assert d.device == dev(0) and d.dtype == dtype and d.shape == t.shape
    assert allocated() - before == rounded(t.nbytes)
    if n:
        assert d.data_ptr() != t.data_ptr()
    back = d.cpu()
    assert back.device.type == "cpu"
    assert torch.equal(back, t)
    # Device to device on the same device, and back through .to("cpu").
    c = d.clone()
    assert c.device == dev(0)
    assert torch.equal(c.to("cpu"), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_round_trip_64_mib(dtype):
    n = (64 * MiB) // torch.empty(0, dtype=dtype).element_size()
    t = sample(dtype, n, seed=64)
    before = allocated()
    d = t.to("dmabuf")
    assert allocated() - before == 64 * MiB
    assert torch.equal(d.cpu(), t)
    del d
    assert allocated() == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool], ids=str)
def test_round_trip_through_the_second_device(two_devices, dtype):
    t = sample(dtype, 10007, seed=5)
    d1 = t.to("dmabuf:1")
    assert d1.device == dev(1)
    d0 = d1.to("dmabuf:0")
    assert d0.device == dev(0)
    assert torch.equal(d0.cpu(), t)
    assert torch.equal(t.dmabuf(1).cpu(), t)


def test_non_contiguous_host_tensors_to_the_device():
    base = sample(torch.float32, 0, seed=1, shape=(37, 53))
    cases = {
        "transpose": base.t(),
        "step slice": base[::3, 1::2],
        "expand": torch.arange(6.0).expand(4, 6),
        "permute": sample(torch.float64, 0, seed=2, shape=(3, 4, 5)).permute(2, 0, 1),
        "column": base[:, 7],
    }
    for name, t in cases.items():
        d = t.to("dmabuf")
        assert d.shape == t.shape, name
        assert torch.equal(d.cpu(), t), name
    # A dense non-overlapping layout is preserved (memory_format=torch.preserve_format).
    tt = base.t()
    assert tt.to("dmabuf").stride() == tt.stride()


def test_views_on_the_device_to_the_host_and_the_other_device():
    base = sample(torch.float32, 0, seed=3, shape=(40, 30))
    d = base.to("dmabuf")
    views = {
        "t": lambda x: x.t(),
        "step slice": lambda x: x[::3, 1::2],
        "rows": lambda x: x[5:17],
        "column": lambda x: x[:, 7],
        "flat step": lambda x: x.view(-1)[::7],
        "expand": lambda x: x[:1].expand(3, 30),
        "diagonal": lambda x: x.diagonal(),
        "unsqueeze expand": lambda x: x.unsqueeze(0).expand(2, 40, 30),
    }
    other = 1 if device_count() > 1 else 0
    for name, view in views.items():
        want = view(base)
        v = view(d)
        assert v.device == dev(0), name
        assert v.shape == want.shape and v.stride() == want.stride(), name
        assert torch.equal(v.cpu(), want), name
        assert torch.equal(v.contiguous().cpu(), want.contiguous()), name
        assert torch.equal(v.clone().cpu(), want), name
        moved = v.to(f"dmabuf:{other}")
        assert moved.device == dev(other), name
        assert torch.equal(moved.cpu(), want), name


def test_copies_into_strided_destinations():
    src = sample(torch.float32, 0, seed=4, shape=(8, 5))
    # Host to a strided device destination.
    want = torch.zeros(8, 10)
    want[:, ::2] = src
    d = torch.zeros(8, 10, device="dmabuf")
    d[:, ::2] = src
    assert torch.equal(d.cpu(), want)
    # Device (transposed source) to a strided device destination.
    dsrc = src.t().contiguous().to("dmabuf").t()
    d[:, 1::2].copy_(dsrc)
    want[:, 1::2].copy_(src)
    assert torch.equal(d.cpu(), want)
    # Device to a strided host destination.
    h = torch.full((10, 8), -1.0)
    h.t()[:, 3:8].copy_(d[:, ::2])
    hw = torch.full((10, 8), -1.0)
    hw.t()[:, 3:8].copy_(want[:, ::2])
    assert torch.equal(h, hw)


# ---------------------------------------------------------------------------------------------
# Compute through the CPU fallback
# ---------------------------------------------------------------------------------------------

EXACT_OPS = {
    "add": lambda a, b, m, i: a + b,
    "sub": lambda a, b, m, i: a - b,
    "mul": lambda a, b, m, i: a * b,
    "neg abs": lambda a, b, m, i: (-a).abs(),
    "maximum": lambda a, b, m, i: torch.maximum(a, b),
    "compare": lambda a, b, m, i: a > b,
    "where": lambda a, b, m, i: torch.where(a > 0, a, b),
    "cat": lambda a, b, m, i: torch.cat([a, b], dim=1),
    "stack": lambda a, b, m, i: torch.stack([a, b]),
    "index_select": lambda a, b, m, i: a.index_select(0, i),
    "gather": lambda a, b, m, i: a.gather(1, i.unsqueeze(1).expand(-1, 5) % 48),
    "argmax": lambda a, b, m, i: a.argmax(dim=1),
    "sort": lambda a, b, m, i: a.sort(dim=1).values,
    "topk": lambda a, b, m, i: a.topk(5, dim=0).indices,
    "masked_fill": lambda a, b, m, i: a.masked_fill(b < 0, 0.25),
    "clamp": lambda a, b, m, i: a.clamp(-0.5, 0.5),
    "int ops": lambda a, b, m, i: (i * 7 + 3) // 5 % 11 & 6,
    "scalar mul": lambda a, b, m, i: a * 3 + 1,
    "cpu 0-dim scalar": lambda a, b, m, i: a * torch.tensor(2.5),
    "reshape": lambda a, b, m, i: a.reshape(48, 64).t(),
}
CLOSE_OPS = {
    "div": lambda a, b, m, i: a / (b.abs() + 1),
    "matmul": lambda a, b, m, i: a @ m,
    "exp sin": lambda a, b, m, i: a.exp() + b.sin(),
    "sum": lambda a, b, m, i: a.sum(),
    "mean dim": lambda a, b, m, i: a.mean(dim=0),
    "softmax": lambda a, b, m, i: a.softmax(dim=1),
    "cumsum": lambda a, b, m, i: a.cumsum(dim=1),
    "norm": lambda a, b, m, i: torch.linalg.vector_norm(a, dim=1),
    "linear": lambda a, b, m, i: F.linear(a, m.t(), m[0]),
    "conv2d": lambda a, b, m, i: F.conv2d(a.view(1, 1, 64, 48), b[:9, :9].reshape(9, 1, 3, 3)[:4]),
}


@pytest.mark.parametrize("exact", [True, False], ids=["exact-ops", "float-ops"])
def test_fallback_ops_match_the_cpu(fallback_mode, exact):
    a = sample(torch.float32, 0, seed=10, shape=(64, 48))
    b = sample(torch.float32, 0, seed=11, shape=(64, 48))
    m = sample(torch.float32, 0, seed=12, shape=(48, 32))
    i = torch.randint(0, 64, (64,), generator=torch.Generator().manual_seed(13))
    da, db, dm, di = (x.to("dmabuf") for x in (a, b, m, i))
    ops = EXACT_OPS if exact else CLOSE_OPS
    for name, op in ops.items():
        want = op(a, b, m, i)
        got = op(da, db, dm, di)
        assert got.device == dev(0), name
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if exact:
            assert torch.equal(got.cpu(), want), name
        else:
            torch.testing.assert_close(got.cpu(), want, msg=name)


def test_in_place_ops_and_item(fallback_mode):
    a = sample(torch.float32, 0, seed=20, shape=(100,))
    d = a.to("dmabuf")
    ptr = d.data_ptr()
    d.mul_(2).add_(1)
    d[3] = 42.0
    d[10:20].zero_()
    d.masked_fill_(d < -1, -1)
    w = a.clone()
    w.mul_(2).add_(1)
    w[3] = 42.0
    w[10:20].zero_()
    w.masked_fill_(w < -1, -1)
    assert d.data_ptr() == ptr, "in-place ops keep the storage"
    assert torch.equal(d.cpu(), w)
    assert d[3].item() == 42.0
    assert d.sum().item() == pytest.approx(w.sum().item(), rel=1e-6)
    assert torch.arange(5, device="dmabuf").sum().item() == 10


def test_autograd_matches_the_cpu(fallback_mode):
    x = sample(torch.float32, 0, seed=30, shape=(16, 8))
    w = sample(torch.float32, 0, seed=31, shape=(8, 4))
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    xd, wd = x.to("dmabuf").requires_grad_(), w.to("dmabuf").requires_grad_()
    for xx, ww in ((xc, wc), (xd, wd)):
        ((xx.sin() @ ww).relu() ** 2).sum().backward()
    assert xd.grad.device == dev(0) and wd.grad.device == dev(0)
    torch.testing.assert_close(xd.grad.cpu(), xc.grad)
    torch.testing.assert_close(wd.grad.cpu(), wc.grad)
    # d(sum(x*x))/dx = 2x, exactly.
    y = x.to("dmabuf").requires_grad_()
    (y * y).sum().backward()
    assert torch.equal(y.grad.cpu(), 2 * x)


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def conv_net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )


def train(model, optimizer, device, batches):
    model = copy.deepcopy(model).to(device)
    assert all(p.device.type == torch.device(device).type for p in model.parameters())
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return torch.stack(losses), state


def check_training(model, optimizer, batches):
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_losses, cpu_state = train(model, optimizer, "cpu", batches)
    dm_losses, dm_state = train(model, optimizer, "dmabuf", batches)
    torch.testing.assert_close(dm_losses, cpu_losses)
    assert dm_state.keys() == cpu_state.keys()
    for k in cpu_state:
        torch.testing.assert_close(dm_state[k], cpu_state[k], msg=k)
    # The steps did something (so equality is not that of two no-ops).
    assert any(not torch.equal(cpu_state[k], init[k]) for k in init)
    assert cpu_losses[-1] < cpu_losses[0]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlp_training_matches_the_cpu(fallback_mode, optimizer):
    torch.manual_seed(0)
    model = mlp()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    check_training(model, optimizer, [(x, y)] * 5)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_conv_net_training_matches_the_cpu(optimizer):
    torch.manual_seed(0)
    model = conv_net()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    check_training(model, optimizer, [(x, y)] * 5)


def test_mixing_the_two_devices_in_one_op_raises(two_devices):
    a = torch.ones(4, device="dmabuf:0")
    b = torch.ones(4, device="dmabuf:1")
    for op in (lambda: a + b, lambda: torch.mul(b, a), lambda: torch.cat([a, b])):
        with pytest.raises(RuntimeError) as e:
            op()
        msg = str(e.value)
        assert "dmabuf:0" in msg and "dmabuf:1" in msg, msg


def test_mixing_with_a_cpu_tensor_raises_but_cpu_scalars_are_allowed():
    a = torch.arange(4.0, device="dmabuf")
    with pytest.raises(RuntimeError) as e:
        a + torch.ones(4)
    msg = str(e.value)
    assert "cpu" in msg and "dmabuf" in msg, msg
    r = a + torch.tensor(2.0)
    assert r.device == dev(0)
    assert torch.equal(r.cpu(), torch.arange(4.0) + 2)
    assert torch.equal((a * 3).cpu(), torch.arange(4.0) * 3)


def test_fallback_mode_switch():
    assert torch_dmabuf.fallback_mode() == "zero_copy"
    torch_dmabuf.set_fallback_mode("copy")
    assert torch_dmabuf.fallback_mode() == "copy"
    torch_dmabuf.set_fallback_mode("zero_copy")
    assert torch_dmabuf.fallback_mode() == "zero_copy"
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        torch_dmabuf.set_fallback_mode("sideways")
    assert torch_dmabuf.fallback_mode() == "zero_copy"


# ---------------------------------------------------------------------------------------------
# Two devices
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("non_blocking", [False, True])
def test_copies_between_the_two_devices(two_devices, non_blocking):
    t = sample(torch.float32, 0, seed=40, shape=(4 * MiB // 4,))
    x = t.to("dmabuf:0")
    before0, before1 = allocated(0), allocated(1)
    for _ in range(3):
        y = x.to("dmabuf:1", non_blocking=non_blocking)
        assert y.device == dev(1)
        assert allocated(0) == before0
        assert allocated(1) == before1 + 4 * MiB
        if non_blocking:
            # Like CUDA: y is ready for another stream or the host once the devices are synced.
            torch.dmabuf.synchronize(0)
            torch.dmabuf.synchronize(1)
        z = torch.empty_like(x)
        z.copy_(y, non_blocking=non_blocking)
        if non_blocking:
            torch.dmabuf.synchronize(0)
            torch.dmabuf.synchronize(1)
        assert torch.equal(y.cpu(), t)
        assert torch.equal(z.cpu(), t)
        del y, z
    assert allocated(1) == before1


def test_peer_copy_on_a_side_stream_of_the_destination(two_devices):
    t = sample(torch.int64, 0, seed=41, shape=(1 << 20,))
    x = t.to("dmabuf:0")
    y = torch.zeros_like(t, device="dmabuf:1")
    s1 = torch.dmabuf.Stream(device=1)
    assert s1.device == dev(1)
    with torch.dmabuf.stream(s1):
        y.copy_(x, non_blocking=True)
        e = torch.dmabuf.Event()
        e.record(s1)
    e.synchronize()
    assert e.query()
    assert torch.equal(y.cpu(), t)


# ---------------------------------------------------------------------------------------------
# Streams and events
# ---------------------------------------------------------------------------------------------


def test_default_current_and_new_streams():
    for d in range(device_count()):
        ds = torch.dmabuf.default_stream(d)
        assert ds.stream_id == 0 and ds.device == dev(d)
        cs = torch.dmabuf.current_stream(d)
        assert cs.stream_id == 0 and cs.device == dev(d)
    assert torch.dmabuf.current_stream().device == dev(0)
    s = torch.dmabuf.Stream()
    assert s.stream_id != 0 and s.device == dev(0)
    with torch.dmabuf.stream(s):
        cur = torch.dmabuf.current_stream()
        assert cur.stream_id == s.stream_id and cur.device == s.device
    assert torch.dmabuf.current_stream().stream_id == 0
    torch.dmabuf.set_stream(s)
    try:
        assert torch.dmabuf.current_stream().stream_id == s.stream_id
    finally:
        torch.dmabuf.set_stream(torch.dmabuf.default_stream())
    assert torch.dmabuf.current_stream().stream_id == 0
    assert torch.dmabuf.Stream(priority=0).stream_id != 0
    s.synchronize()
    assert s.query()


def test_the_default_stream_is_synchronous():
    n = 16 * MiB
    p = torch.full((n,), 5, dtype=torch.uint8).pin_memory()
    d = torch.empty(n, dtype=torch.uint8, device="dmabuf")
    d.copy_(p, non_blocking=True)
    # Nothing can still be queued on the default stream when the call has returned.
    assert torch.dmabuf.default_stream().query()
    assert torch.dmabuf.current_stream().query()
    assert torch.equal(d.cpu(), p)


def test_a_side_stream_copy_ordered_by_an_event():
    n = 64 * MiB
    src_host = torch.arange(n // 8, dtype=torch.int64)
    src = src_host.to("dmabuf")
    mid = torch.zeros(n // 8, dtype=torch.int64, device="dmabuf")
    out = torch.zeros(n // 8, dtype=torch.int64, device="dmabuf")
    s1, s2 = torch.dmabuf.Stream(), torch.dmabuf.Stream()
    assert s1.stream_id != s2.stream_id
    with torch.dmabuf.stream(s1):
        mid.copy_(src, non_blocking=True)
        written = torch.dmabuf.Event()
        written.record()  # on the current stream, s1
    # s2 reads mid only after s1 has written it.
    s2.wait_event(written)
    with torch.dmabuf.stream(s2):
        out.copy_(mid, non_blocking=True)
    done = s2.record_event()
    done.synchronize()
    assert done.query() and written.query()
    assert torch.equal(out.cpu(), src_host)
    # The current (default) stream waits on an event too, then sees the data.
    with torch.dmabuf.stream(s1):
        mid.fill_(-1)
        filled = s1.record_event()
    torch.dmabuf.current_stream().wait_event(filled)
    assert torch.equal(mid.cpu(), torch.full((n // 8,), -1, dtype=torch.int64))


def test_wait_stream_orders_two_streams():
    t = sample(torch.float32, 0, seed=50, shape=(8 * MiB // 4,))
    a = t.to("dmabuf")
    b = torch.zeros_like(a)
    c = torch.zeros_like(a)
    s1, s2 = torch.dmabuf.Stream(), torch.dmabuf.Stream()
    with torch.dmabuf.stream(s1):
        b.copy_(a, non_blocking=True)
    s2.wait_stream(s1)
    with torch.dmabuf.stream(s2):
        c.copy_(b, non_blocking=True)
    s2.synchronize()
    assert s2.query()
    assert torch.equal(c.cpu(), t)


def test_event_query_synchronize_and_elapsed_time():
    n = 64 * MiB
    src = torch.ones(n, dtype=torch.uint8, device="dmabuf")
    dst = torch.empty_like(src)
    s = torch.dmabuf.Stream()
    start = torch.dmabuf.Event(enable_timing=True)
    end = torch.dmabuf.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record(s)
    with torch.dmabuf.stream(s):
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
    end.record(s)
    end.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    assert start.query() and end.query()
    ms = start.elapsed_time(end)
    assert isinstance(ms, float)
    # 256 MiB were copied between the two events, which were recorded within the wall interval.
    assert 0 < ms <= wall_ms + 1.0, (ms, wall_ms)
    # A second synchronize and query on a completed event are harmless.
    end.synchronize()
    assert end.query()
    assert torch.equal(dst[-4096:].cpu(), torch.ones(4096, dtype=torch.uint8))


def test_event_flags_and_waiting_on_the_default_stream():
    e = torch.dmabuf.Event(enable_timing=False, blocking=True, interprocess=False)
    s = torch.dmabuf.Stream()
    x = torch.zeros(1 << 20, device="dmabuf")
    with torch.dmabuf.stream(s):
        x.add_(3)
    e.record(s)
    e.wait()  # the current (default) stream waits for s
    e.synchronize()
    assert e.query()
    assert torch.equal(x.cpu(), torch.full((1 << 20,), 3.0))


def test_torch_event_and_stream_and_accelerator_streams():
    s = torch.Stream(device="dmabuf")
    assert s.device.type == "dmabuf" and s.stream_id != 0
    e1 = torch.Event(device="dmabuf", enable_timing=True)
    e2 = torch.Event(device="dmabuf", enable_timing=True)
    assert e1.device.type == "dmabuf"
    default = torch.accelerator.current_stream()
    assert default.stream_id == 0 and default.device.type == "dmabuf"
    assert torch.accelerator.current_stream(0).stream_id == 0
    # torch.optim (Adam, even on CPU tensors) asks this of the accelerator's current stream.
    assert default.is_capturing() is False
    torch.accelerator.set_stream(s)
    try:
        assert torch.accelerator.current_stream() == s
        assert torch.dmabuf.current_stream().stream_id == s.stream_id
        x = torch.ones(4 * MiB, dtype=torch.uint8, device="dmabuf")
        y = torch.empty_like(x)
        e1.record()  # on the current stream, s
        y.copy_(x, non_blocking=True)
        e2.record()
    finally:
        torch.accelerator.set_stream(default)
    assert torch.accelerator.current_stream().stream_id == 0
    e2.synchronize()
    assert e1.query() and e2.query()
    assert e1.elapsed_time(e2) >= 0
    torch.accelerator.synchronize()
    assert s.query()
    assert torch.equal(y[:4096].cpu(), torch.ones(4096, dtype=torch.uint8))


def test_record_stream_keeps_the_block_until_the_stream_passes():
    n = 16 * MiB
    busy_src = torch.ones(64 * MiB, dtype=torch.uint8, device="dmabuf")
    busy_dst = torch.empty_like(busy_src)
    t = torch.full((n,), 7, dtype=torch.uint8, device="dmabuf")
    out = torch.zeros(n, dtype=torch.uint8, device="dmabuf")
    ptr = t.data_ptr()
    s = torch.dmabuf.Stream()
    with torch.dmabuf.stream(s):
        for _ in range(8):
            busy_dst.copy_(busy_src, non_blocking=True)  # keeps s busy for a while
        out.copy_(t, non_blocking=True)  # s reads t last
    t.record_stream(s)
    before = allocated()
    del t
    # As in PyTorch, the caller's free counts at once; the block waits for s.
    assert allocated() == before - n
    u = torch.empty(n, dtype=torch.uint8, device="dmabuf")
    reused = u.data_ptr() == ptr
    s_done_at_reuse = s.query()
    if reused:
        assert s_done_at_reuse, "the block of t was handed out again before s finished reading it"
    u.fill_(0)
    s.synchronize()
    assert torch.equal(out.cpu(), torch.full((n,), 7, dtype=torch.uint8))


def test_the_current_stream_is_per_thread():
    s = torch.dmabuf.Stream()
    # The barrier only sequences the two threads' steps; its timeout guards against a hang.
    barrier = threading.Barrier(2, timeout=60)
    t = sample(torch.float32, 0, seed=60, shape=(1 << 18,))

    def side():
        try:
            torch.dmabuf.set_stream(s)
            barrier.wait()  # 1: main checks its own current stream
            barrier.wait()  # 2: main has made a stream of its own current
            cur = torch.dmabuf.current_stream()
            assert cur.stream_id == s.stream_id and cur.device == s.device
            x = t.to("dmabuf")
            y = torch.empty_like(x)
            y.copy_(x, non_blocking=True)  # on s
            ev = torch.dmabuf.Event()
            ev.record()  # on s
            ev.synchronize()
            return torch.equal(y.cpu(), t)
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(1) as ex:
        f = ex.submit(side)
        mine = torch.dmabuf.Stream()
        try:
            barrier.wait()
            main_after_side_set = torch.dmabuf.current_stream().stream_id
            torch.dmabuf.set_stream(mine)
            barrier.wait()
            side_ok = f.result(timeout=60)
            main_at_end = torch.dmabuf.current_stream().stream_id
        except BaseException:
            barrier.abort()
            raise
        finally:
            torch.dmabuf.set_stream(torch.dmabuf.default_stream())
    assert mine.stream_id != s.stream_id
    assert main_after_side_set == 0, "another thread's set_stream changed this thread's stream"
    assert side_ok is True
    assert main_at_end == mine.stream_id


def test_threads_compute_on_the_devices():
    ndev = device_count()

    def worker(i):
        d = i % ndev
        torch.dmabuf.set_device(d)
        assert torch.dmabuf.current_device() == d
        g = torch.Generator().manual_seed(100 + i)
        for _ in range(15):
            a = torch.randn(129, 33, generator=g)
            b = torch.randn(33, 17, generator=g)
            da, db = a.to("dmabuf"), b.to("dmabuf")
            assert da.device == dev(d)
            r = (da @ db + i).relu()
            assert r.device == dev(d)
            torch.testing.assert_close(r.cpu(), (a @ b + i).relu())
            k = torch.arange(1000, device="dmabuf") * (i + 1)
            assert k.sum().item() == 499500 * (i + 1)
        return d

    with ThreadPoolExecutor(4) as ex:
        got = [f.result(timeout=120) for f in [ex.submit(worker, i) for i in range(4)]]
    assert got == [i % ndev for i in range(4)]
    # The device is per thread: the workers' set_device did not move this thread.
    assert torch.dmabuf.current_device() == 0


# ---------------------------------------------------------------------------------------------
# Pinned memory
# ---------------------------------------------------------------------------------------------


def test_pin_memory_and_is_pinned():
    t = torch.arange(1000, dtype=torch.float32)
    assert not t.is_pinned()
    p = t.pin_memory()
    assert p.is_pinned() and p.device.type == "cpu"
    assert p.data_ptr() != t.data_ptr()
    assert torch.equal(p, t)
    assert p.pin_memory().data_ptr() == p.data_ptr(), "pinning a pinned tensor is a no-op"
    e = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    assert e.is_pinned()
    assert not torch.ones(3, device="dmabuf").is_pinned()


def test_pin_memory_with_the_device_argument():
    t = torch.arange(100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.15 deprecates the argument
        try:
            p = t.pin_memory("dmabuf")
        except (RuntimeError, TypeError) as e:
            pytest.skip(f"torch 2.15 refuses pin_memory(device): {e}")
        assert p.is_pinned("dmabuf")
    assert p.is_pinned()
    assert torch.equal(p, t)


def test_non_blocking_copies_with_pinned_memory():
    n = 16 * MiB // 4
    p = torch.arange(n, dtype=torch.float32).pin_memory()
    d = torch.empty(n, device="dmabuf")
    back = torch.zeros(n).pin_memory()
    s = torch.dmabuf.Stream()
    with torch.dmabuf.stream(s):
        d.copy_(p, non_blocking=True)  # host to device, queued on s
        back.copy_(d, non_blocking=True)  # device to host, after it on s
        e = torch.dmabuf.Event()
        e.record()
    e.synchronize()
    assert e.query()
    assert torch.equal(back, p)
    # .to(non_blocking=True) from pinned memory, then a sync of the device.
    d2 = p.to("dmabuf", non_blocking=True)
    torch.dmabuf.synchronize()
    assert torch.equal(d2.cpu(), p)


# ---------------------------------------------------------------------------------------------
# Memory statistics
# ---------------------------------------------------------------------------------------------

CORE_STATS = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
]


def test_memory_stats_has_pytorchs_keys():
    x = torch.empty(10, device="dmabuf")  # noqa: F841  (the allocator is in use)
    for d in range(device_count()):
        s = stats(d)
        for name in CORE_STATS:
            for pool in ("all", "small_pool", "large_pool"):
                for metric in ("current", "peak", "allocated", "freed"):
                    key = f"{name}.{pool}.{metric}"
                    assert key in s, key
                    assert isinstance(s[key], int) and s[key] >= 0, (key, s[key])
                all_, small, large = (s[f"{name}.{p}.current"] for p in ("all", "small_pool", "large_pool"))
                assert all_ == small + large, name
        assert s["num_ooms"] >= 0 and s["num_alloc_retries"] >= 0
        assert s["allocated_bytes.all.current"] == allocated(d)
        assert s["reserved_bytes.all.current"] == reserved(d)
        assert s["allocated_bytes.all.current"] <= s["reserved_bytes.all.current"]


def test_a_1_mib_tensor_allocates_exactly_1_mib():
    s0 = stats()
    x = torch.empty(MiB // 4, dtype=torch.float32, device="dmabuf")
    s1 = stats()
    assert allocated() - s0["allocated_bytes.all.current"] == MiB
    assert s1["requested_bytes.all.current"] - s0["requested_bytes.all.current"] == MiB
    assert s1["allocation.all.current"] - s0["allocation.all.current"] == 1
    assert s1["allocation.all.allocated"] - s0["allocation.all.allocated"] == 1
    # 1 MiB is the largest small-pool size, as in PyTorch.
    assert s1["allocated_bytes.small_pool.current"] - s0["allocated_bytes.small_pool.current"] == MiB
    assert s1["allocated_bytes.large_pool.current"] == s0["allocated_bytes.large_pool.current"]
    assert reserved() >= allocated()
    assert torch.dmabuf.max_memory_allocated() >= allocated()
    del x
    s2 = stats()
    assert s2["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"]
    assert s2["requested_bytes.all.current"] == s0["requested_bytes.all.current"]
    assert s2["allocation.all.freed"] - s0["allocation.all.freed"] == 1
    y = torch.empty(MiB + 1, dtype=torch.uint8, device="dmabuf")
    s3 = stats()
    assert s3["allocated_bytes.large_pool.current"] - s0["allocated_bytes.large_pool.current"] == rounded(MiB + 1)
    del y


@pytest.mark.parametrize("nbytes", [1, 100, 511, 512, 513, 1000, 4097, 65535, MiB - 1, MiB + 1, 3 * MiB + 5])
def test_allocated_is_rounded_and_requested_is_exact(nbytes):
    s0 = stats()
    x = torch.empty(nbytes, dtype=torch.uint8, device="dmabuf")
    s1 = stats()
    assert s1["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"] == rounded(nbytes)
    assert s1["requested_bytes.all.current"] - s0["requested_bytes.all.current"] == nbytes
    assert s1["active_bytes.all.current"] - s0["active_bytes.all.current"] == rounded(nbytes)
    del x
    s2 = stats()
    assert s2["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"]
    assert s2["requested_bytes.all.current"] == s0["requested_bytes.all.current"]
    assert s2["allocation.all.allocated"] - s0["allocation.all.allocated"] == 1
    assert s2["allocation.all.freed"] - s0["allocation.all.freed"] == 1


def test_zero_element_tensors_allocate_nothing():
    s0 = stats()
    for dtype in DTYPES:
        zs = [
            torch.empty(0, dtype=dtype, device="dmabuf"),
            torch.zeros(3, 0, dtype=dtype, device="dmabuf"),
            torch.empty(0, dtype=dtype).to("dmabuf"),
        ]
        assert all(z.numel() == 0 and z.device == dev(0) for z in zs)
        assert zs[1].shape == (3, 0)
        assert zs[2].cpu().shape == (0,)
        del zs
    s1 = stats()
    for key in ("allocated_bytes.all.current", "allocation.all.allocated", "requested_bytes.all.allocated"):
        assert s1[key] == s0[key], key


def test_peak_and_reset_peak():
    torch.dmabuf.reset_peak_memory_stats()
    base = allocated()
    assert torch.dmabuf.max_memory_allocated() == base
    assert torch.dmabuf.max_memory_reserved() == reserved()
    a = torch.empty(MiB, dtype=torch.uint8, device="dmabuf")
    b = torch.empty(3 * MiB, dtype=torch.uint8, device="dmabuf")
    assert torch.dmabuf.max_memory_allocated() == base + 4 * MiB
    assert torch.dmabuf.max_memory_reserved() >= reserved() >= allocated()
    del b
    assert allocated() == base + MiB
    assert torch.dmabuf.max_memory_allocated() == base + 4 * MiB
    assert stats()["allocated_bytes.all.peak"] == base + 4 * MiB
    torch.dmabuf.reset_peak_memory_stats(0)
    assert torch.dmabuf.max_memory_allocated() == base + MiB
    assert torch.dmabuf.max_memory_reserved() == reserved()
    del a
    assert torch.dmabuf.max_memory_allocated() == base + MiB
    assert allocated() == base
    # The accelerator API resets the same peak.
    torch.accelerator.reset_peak_memory_stats(0)
    assert torch.accelerator.max_memory_allocated(0) == base


def test_reset_accumulated_memory_stats():
    x = torch.empty(MiB, dtype=torch.uint8, device="dmabuf")
    torch.dmabuf.reset_accumulated_memory_stats()
    s = stats()
    assert s["allocation.all.allocated"] == 0 and s["allocation.all.freed"] == 0
    assert s["allocated_bytes.all.allocated"] == 0 and s["allocated_bytes.all.freed"] == 0
    assert s["num_ooms"] == 0 and s["num_alloc_retries"] == 0
    assert s["allocated_bytes.all.current"] == allocated() >= MiB, "current values are kept"
    y = torch.empty(3 * MiB, dtype=torch.uint8, device="dmabuf")
    del y
    s = stats()
    assert s["allocation.all.allocated"] == 1 and s["allocation.all.freed"] == 1
    assert s["allocated_bytes.all.allocated"] == 3 * MiB and s["allocated_bytes.all.freed"] == 3 * MiB
    del x
    torch.accelerator.reset_accumulated_memory_stats(0)
    assert torch.accelerator.memory_stats(0)["allocation.all.freed"] == 0


def test_reserved_after_a_free_caching_or_not():
    torch.dmabuf.empty_cache()
    base_alloc, base_res = allocated(), reserved()
    assert base_alloc == 0 and base_res == 0, "nothing is live between tests"
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="dmabuf")
    live_res = reserved()
    assert allocated() == 3 * MiB
    assert live_res >= 3 * MiB
    free, total = torch.dmabuf.mem_get_info()
    assert free == total - live_res
    del x
    assert allocated() == 0
    if NO_CACHING:
        # Every free goes back to the memory source.
        assert reserved() == 0
        assert torch.dmabuf.mem_get_info()[0] == total
    else:
        # The block stays cached.
        assert reserved() == live_res
        assert reserved() > allocated()
        assert torch.dmabuf.mem_get_info()[0] == total - live_res
        # And is reused: the same request needs no new memory.
        y = torch.empty(3 * MiB, dtype=torch.uint8, device="dmabuf")
        assert reserved() == live_res
        del y
    torch.dmabuf.empty_cache()
    assert reserved() == 0
    assert tuple(torch.dmabuf.mem_get_info()) == (total, total)


def test_empty_cache_keeps_only_what_live_tensors_need():
    torch.dmabuf.empty_cache()
    assert reserved() == 0
    keep = torch.empty(MiB // 4, dtype=torch.float32, device="dmabuf")
    junk = [torch.empty(n, dtype=torch.uint8, device="dmabuf") for n in (5 * MiB, 700 * KiB, 33 * MiB, 12345)]
    del junk
    torch.dmabuf.empty_cache()
    assert allocated() == MiB
    # The live 1 MiB needs at most one small segment (2 MiB) or 2 MiB chunk of an expandable one.
    assert MiB <= reserved() <= 2 * MiB, reserved()
    assert torch.dmabuf.mem_get_info()[0] == capacity() - reserved()
    del keep
    torch.accelerator.empty_cache()
    assert reserved() == 0
    assert torch.accelerator.memory_reserved(0) == 0


def test_mem_get_info_is_capacity_minus_reserved():
    x = [torch.empty(n, dtype=torch.uint8, device="dmabuf") for n in (1000, 2 * MiB, 11 * MiB)]
    for d in range(device_count()):
        free, total = torch.dmabuf.mem_get_info(d)
        assert free == total - reserved(d)
        assert 0 <= free <= total
        assert tuple(torch.accelerator.get_memory_info(d)) == (free, total)
    free, total = torch.dmabuf.mem_get_info()
    assert (free, total) == tuple(torch.dmabuf.mem_get_info(0))
    assert (free, total) == tuple(torch.dmabuf.mem_get_info(torch.device("dmabuf:0")))
    del x


def test_accelerator_memory_functions_agree_with_torch_dmabuf():
    base = torch.accelerator.memory_allocated(0)
    x = torch.empty(3 * MiB + 100, dtype=torch.uint8, device="dmabuf")
    assert torch.accelerator.memory_allocated(0) - base == rounded(3 * MiB + 100)
    assert torch.accelerator.memory_allocated() == torch.dmabuf.memory_allocated(0)
    for d in range(device_count()):
        assert torch.accelerator.memory_allocated(d) == torch.dmabuf.memory_allocated(d)
        assert torch.accelerator.max_memory_allocated(d) == torch.dmabuf.max_memory_allocated(d)
        assert torch.accelerator.memory_reserved(d) == torch.dmabuf.memory_reserved(d)
        assert torch.accelerator.max_memory_reserved(d) == torch.dmabuf.max_memory_reserved(d)
        acc = torch.accelerator.memory_stats(d)
        ours = stats(d)
        for name in CORE_STATS:
            for pool in ("all", "small_pool", "large_pool"):
                for metric in ("current", "peak", "allocated", "freed"):
                    key = f"{name}.{pool}.{metric}"
                    assert acc[key] == ours[key], key
        assert acc["num_ooms"] == ours["num_ooms"]
        assert acc["num_alloc_retries"] == ours["num_alloc_retries"]
    del x
    assert torch.accelerator.memory_allocated(0) == base


def test_stats_are_per_device(two_devices):
    s0, s1 = stats(0), stats(1)
    x = torch.empty(5 * MiB, dtype=torch.uint8, device="dmabuf:1")
    assert stats(0)["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"]
    assert stats(0)["allocation.all.allocated"] == s0["allocation.all.allocated"]
    assert allocated(1) - s1["allocated_bytes.all.current"] == 5 * MiB
    torch.dmabuf.reset_peak_memory_stats(1)
    assert torch.dmabuf.max_memory_allocated(1) == allocated(1)
    del x
    assert allocated(1) == s1["allocated_bytes.all.current"]


def test_thousands_of_tensors_of_random_sizes():
    rng = random.Random(20260607)
    s0 = stats()
    live = []  # (tensor, nbytes)
    created = nonzero = 0

    def check():
        s = stats()
        assert s["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"] == sum(rounded(n) for _, n in live)
        assert s["requested_bytes.all.current"] - s0["requested_bytes.all.current"] == sum(n for _, n in live)
        assert s["allocation.all.current"] - s0["allocation.all.current"] == sum(1 for _, n in live if n)
        # No two live tensors share memory.
        spans = sorted((t.data_ptr(), n) for t, n in live if n)
        for (p, n), (q, _) in zip(spans, spans[1:]):
            assert p + n <= q, "two live tensors overlap"

    while created < 5000:
        for _ in range(100):
            r = rng.random()
            if r < 0.03:
                n = 0
            elif r < 0.6:
                n = rng.randint(1, 4096)
            elif r < 0.95:
                n = rng.randint(4097, MiB + 4096)
            else:
                n = rng.randint(MiB + 4097, 8 * MiB)
            live.append((torch.empty(n, dtype=torch.uint8, device="dmabuf"), n))
            created += 1
            nonzero += n > 0
        check()
        rng.shuffle(live)
        del live[: len(live) * 2 // 3]
        check()
    live.clear()
    s1 = stats()
    assert s1["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"]
    assert s1["requested_bytes.all.current"] == s0["requested_bytes.all.current"]
    assert s1["allocation.all.current"] == s0["allocation.all.current"]
    assert s1["allocation.all.allocated"] - s0["allocation.all.allocated"] == nonzero
    assert s1["allocation.all.freed"] - s0["allocation.all.freed"] == nonzero
    assert s1["num_ooms"] == s0["num_ooms"]


# ---------------------------------------------------------------------------------------------
# Out of memory
# ---------------------------------------------------------------------------------------------


def mentions_size(msg, n):
    human = [f"{n / MiB:.2f} MiB", f"{n / (1 << 30):.2f} GiB"]
    return str(n) in msg or any(h in msg for h in human)


def test_over_capacity_raises_out_of_memory_and_allocation_recovers():
    total = capacity()
    n = total + 2 * MiB
    s0 = stats()
    with pytest.raises(torch.OutOfMemoryError) as e:
        torch.empty(n, dtype=torch.uint8, device="dmabuf")
    msg = str(e.value)
    del e
    assert mentions_size(msg, n), msg
    s1 = stats()
    assert s1["num_ooms"] == s0["num_ooms"] + 1
    assert s1["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"]
    assert s1["allocation.all.current"] == s0["allocation.all.current"]
    # OutOfMemoryError is a RuntimeError, as in PyTorch.
    with pytest.raises(RuntimeError):
        torch.empty(n // 4 + 1, dtype=torch.float32, device="dmabuf")
    assert stats()["num_ooms"] == s0["num_ooms"] + 2
    # Afterwards the device serves what it has.
    x = torch.empty(total // 2, dtype=torch.uint8, device="dmabuf")
    x[:4096].fill_(9)
    x[-4096:].fill_(8)
    assert torch.equal(x[:4096].cpu(), torch.full((4096,), 9, dtype=torch.uint8))
    assert torch.equal(x[-4096:].cpu(), torch.full((4096,), 8, dtype=torch.uint8))
    assert allocated() - s0["allocated_bytes.all.current"] == rounded(total // 2)
    del x
    assert stats()["num_ooms"] == s0["num_ooms"] + 2


def test_a_request_fits_again_once_a_holder_is_freed():
    total = capacity()
    n = (total * 6 // 10) // (2 * MiB) * (2 * MiB)
    base = allocated()
    a = torch.empty(n, dtype=torch.uint8, device="dmabuf")
    ooms = stats()["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(n, dtype=torch.uint8, device="dmabuf")
    assert stats()["num_ooms"] == ooms + 1
    assert allocated() == base + n
    del a
    b = torch.empty(n, dtype=torch.uint8, device="dmabuf")
    assert allocated() == base + n
    del b
    # Larger than the cached block: the cache is released and the request served, no OOM.
    c = torch.empty(n + 6 * MiB, dtype=torch.uint8, device="dmabuf")
    assert allocated() == base + n + 6 * MiB
    del c
    assert stats()["num_ooms"] == ooms + 1


# ---------------------------------------------------------------------------------------------
# Snapshots and torch.cuda._memory_viz
# ---------------------------------------------------------------------------------------------

BLOCK_STATES = {"active_allocated", "active_awaiting_free", "inactive"}


def segments_of(snapshot_segments, d):
    return [s for s in snapshot_segments if s["device"] == d]


def check_segments(segs, d):
    assert sum(s["total_size"] for s in segs) == reserved(d)
    assert sum(s["allocated_size"] for s in segs) == allocated(d)
    live = 0
    for s in segs:
        assert s["segment_type"] in ("small", "large")
        assert isinstance(s["address"], int) and isinstance(s["stream"], int)
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"], s
        seg_live = 0
        for b in s["blocks"]:
            assert b["state"] in BLOCK_STATES, b
            assert s["address"] <= b["address"] < s["address"] + s["total_size"]
            if b["state"] == "active_allocated":
                seg_live += b["size"]
                assert 0 < b["requested_size"] <= b["size"]
        assert s["allocated_size"] == seg_live
        assert s["active_size"] >= s["allocated_size"]
        live += seg_live
    assert live == allocated(d)


def test_memory_snapshot_matches_the_stats():
    x = torch.empty(1000, dtype=torch.uint8, device="dmabuf")
    y = torch.empty(3 * MiB, dtype=torch.uint8, device="dmabuf")
    z = torch.empty(5000, dtype=torch.uint8, device="dmabuf:1") if device_count() > 1 else None
    snap = torch.dmabuf.memory_snapshot()
    assert isinstance(snap, list)
    for d in range(device_count()):
        check_segments(segments_of(snap, d), d)
    blocks = {b["address"]: b for s in segments_of(snap, 0) for b in s["blocks"]}
    assert blocks[x.data_ptr()]["state"] == "active_allocated"
    assert blocks[x.data_ptr()]["size"] == rounded(1000) and blocks[x.data_ptr()]["requested_size"] == 1000
    assert blocks[y.data_ptr()]["size"] == 3 * MiB and blocks[y.data_ptr()]["requested_size"] == 3 * MiB
    if z is not None:
        b1 = {b["address"]: b for s in segments_of(snap, 1) for b in s["blocks"]}
        assert b1[z.data_ptr()]["size"] == rounded(5000) and b1[z.data_ptr()]["requested_size"] == 5000
    full = torch.dmabuf.memory._snapshot()
    assert {(s["device"], s["address"], s["total_size"]) for s in full["segments"]} == {
        (s["device"], s["address"], s["total_size"]) for s in snap
    }
    del x, y, z


def trace_of(snapshot, d):
    traces = snapshot["device_traces"]
    assert isinstance(traces, list) and len(traces) >= d + 1
    return traces[d]


def test_recorded_history_traces_allocations_and_frees():
    torch.dmabuf.memory._record_memory_history(enabled="all")
    try:
        x = torch.empty(1000, dtype=torch.uint8, device="dmabuf")
        ptr = x.data_ptr()
        del x
        snap = torch.dmabuf.memory._snapshot()
    finally:
        torch.dmabuf.memory._record_memory_history(enabled=None)
    trace = trace_of(snap, 0)
    for e in trace:
        assert {"action", "size", "stream"} <= e.keys(), e
    actions = [(e["action"], e.get("addr")) for e in trace]
    allocs = [k for k, a in enumerate(actions) if a == ("alloc", ptr)]
    assert allocs, f"no alloc of {ptr:#x} in the trace"
    i = allocs[-1]
    assert trace[i]["size"] in (1000, rounded(1000))
    assert ("free_completed", ptr) in actions[i + 1 :]
    # Once recording is off, allocations are no longer traced (a size no other test uses, so
    # that the check holds even if the bounded history has dropped older entries).
    y = torch.empty(12412, dtype=torch.uint8, device="dmabuf")
    yptr = y.data_ptr()
    del y
    after = trace_of(torch.dmabuf.memory._snapshot(), 0)
    assert not any(e["action"] == "alloc" and e.get("addr") == yptr and e["size"] in (12412, rounded(12412)) for e in after)


def test_record_stream_free_is_requested_then_completed():
    s = torch.dmabuf.Stream()
    torch.dmabuf.memory._record_memory_history(enabled="all")
    try:
        t = torch.ones(4 * MiB, dtype=torch.uint8, device="dmabuf")
        out = torch.empty_like(t)
        ptr = t.data_ptr()
        with torch.dmabuf.stream(s):
            out.copy_(t, non_blocking=True)
        t.record_stream(s)
        del t
        s.synchronize()
        torch.dmabuf.empty_cache()  # processes completed frees, as PyTorch's does
        snap = torch.dmabuf.memory._snapshot()
    finally:
        torch.dmabuf.memory._record_memory_history(enabled=None)
    actions = [(e["action"], e.get("addr")) for e in trace_of(snap, 0)]
    allocs = [k for k, a in enumerate(actions) if a == ("alloc", ptr)]
    assert allocs, f"no alloc of {ptr:#x} in the trace"
    rest = actions[allocs[-1] + 1 :]
    assert ("free_requested", ptr) in rest
    j = rest.index(("free_requested", ptr))
    assert ("free_completed", ptr) in rest[j + 1 :]
    assert torch.equal(out[-10:].cpu(), torch.ones(10, dtype=torch.uint8))


def write_fake_flamegraph(home):
    """_memory_viz's segments/memory pipe their collapsed stacks through ~/.cache/flamegraph.pl
    (downloaded from GitHub if missing): a stand-in that echoes its input keeps the test
    offline and lets it read the stacks back."""
    cache = home / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    script = cache / "flamegraph.pl"
    script.write_text("#!/bin/sh\nexec cat\n")
    script.chmod(0o755)


def run_memory_viz(args, home):
    env = dict(os.environ, HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_dump_snapshot_is_read_by_memory_viz(tmp_path):
    path = tmp_path / "snap.pickle"
    torch.dmabuf.memory._record_memory_history(enabled="all")
    try:
        keep = [torch.empty(n, dtype=torch.uint8, device="dmabuf") for n in (1000, 300 * KiB, 3 * MiB, 25 * MiB)]
        gone = torch.empty(5 * MiB, dtype=torch.uint8, device="dmabuf")
        del gone
        torch.dmabuf.memory._dump_snapshot(str(path))
    finally:
        torch.dmabuf.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert set(data) >= {"segments", "device_traces"}
    check_segments(segments_of(data["segments"], 0), 0)
    live_requested = sum(
        b["requested_size"] for s in data["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    )
    total_reserved = sum(s["total_size"] for s in data["segments"])
    assert total_reserved == sum(reserved(d) for d in range(device_count()))
    del keep

    home = tmp_path / "home"
    write_fake_flamegraph(home)

    r = run_memory_viz(["stats", str(path)], home)
    assert r.returncode == 0, r.stderr
    assert f"segments: {len(data['segments'])}\n" in r.stdout
    assert f"total_reserved: {_memory_viz._format_size(total_reserved)}\n" in r.stdout
    assert f"total_allocated: {_memory_viz._format_size(live_requested)}\n" in r.stdout

    r = run_memory_viz(["trace", str(path)], home)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    for i, entries in enumerate(data["device_traces"]):
        if entries:
            assert f"Device {i} ----------------\n{len(entries)} entries\n" in r.stdout

    out = tmp_path / "segments.txt"
    r = run_memory_viz(["segments", str(path), "-o", str(out)], home)
    assert r.returncode == 0, r.stderr
    stacks = out.read_text().splitlines()
    assert stacks and all(line.startswith("stream_") for line in stacks)
    # The collapsed stacks account for every byte of every segment.
    assert sum(int(line.rsplit(" ", 1)[1]) for line in stacks) == total_reserved
    assert any(";active_allocated;" in line for line in stacks)

    html = tmp_path / "trace.html"
    r = run_memory_viz(["trace_plot", str(path), "-o", str(html)], home)
    assert r.returncode == 0, r.stderr
    assert "Active Memory Timeline" in html.read_text()


def test_memory_viz_functions_on_a_live_snapshot():
    torch.dmabuf.memory._record_memory_history(enabled="all")
    try:
        keep = [torch.empty(n, dtype=torch.uint8, device="dmabuf") for n in (512, 2 * MiB + 1)]
        snap = torch.dmabuf.memory._snapshot()
    finally:
        torch.dmabuf.memory._record_memory_history(enabled=None)
    text = _memory_viz.segsum(snap)
    assert f"segments: {len(snap['segments'])}\n" in text
    assert "total_reserved: " in text
    assert "entries" in _memory_viz.trace(snap)
    stacks = _memory_viz.segments(snap, format_flamegraph=lambda lines: lines)
    assert sum(int(line.rsplit(" ", 1)[1]) for line in stacks.splitlines()) == sum(
        s["total_size"] for s in snap["segments"]
    )
    html = _memory_viz.trace_plot(snap)
    assert "Active Memory Timeline" in html
    # The plot embeds the pickled snapshot: it decodes back to the same data.
    blob = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))[0]["base64"]
    assert pickle.loads(base64.b64decode(blob)) == snap
    assert "Allocator State History" in _memory_viz.segment_plot(snap)
    del keep


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

BAD_CALLS = {
    "empty": lambda i: torch.empty(4, device=f"dmabuf:{i}"),
    "to": lambda i: torch.ones(4).to(f"dmabuf:{i}"),
    "set_device": lambda i: torch.dmabuf.set_device(i),
    "Stream": lambda i: torch.dmabuf.Stream(device=i),
    "mem_get_info": lambda i: torch.dmabuf.mem_get_info(i),
    "memory_stats": lambda i: torch.dmabuf.memory_stats(i),
    "memory_allocated": lambda i: torch.dmabuf.memory_allocated(i),
    "synchronize": lambda i: torch.dmabuf.synchronize(i),
    "current_stream": lambda i: torch.dmabuf.current_stream(i),
}


@pytest.mark.parametrize("index", [99, -5])
@pytest.mark.parametrize("call", list(BAD_CALLS), ids=str)
def test_a_bad_device_index_raises(call, index):
    with pytest.raises(ALLOWED_ERRORS):
        BAD_CALLS[call](index)
    # The process carries on unharmed.
    assert torch.dmabuf.current_device() == 0
    assert torch.ones(2, device="dmabuf").sum().item() == 2


def test_an_index_just_past_the_last_device_raises():
    n = device_count()
    with pytest.raises(ALLOWED_ERRORS):
        torch.empty(1, device=f"dmabuf:{n}")
    with pytest.raises(ALLOWED_ERRORS):
        torch.dmabuf.set_device(n)
    assert torch.empty(1, device=f"dmabuf:{n - 1}").device == dev(n - 1)


# ---------------------------------------------------------------------------------------------
# Serialization and random numbers
# ---------------------------------------------------------------------------------------------


def test_save_and_load_keep_tensors_on_their_device():
    a = sample(torch.float32, 0, seed=70, shape=(33, 7))
    b = sample(torch.int64, 0, seed=71, shape=(100,))
    obj = {"a": a.to("dmabuf:0"), "b": b.to(f"dmabuf:{device_count() - 1}"), "c": b.clone(), "t": a.t().to("dmabuf")}
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    got = torch.load(buf)
    assert got["a"].device == dev(0)
    assert got["b"].device == dev(device_count() - 1)
    assert got["c"].device.type == "cpu"
    assert got["t"].device == dev(0) and got["t"].shape == (7, 33)
    assert torch.equal(got["a"].cpu(), a)
    assert torch.equal(got["b"].cpu(), b)
    assert torch.equal(got["t"].cpu(), a.t())
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert on_cpu["a"].device.type == "cpu" and torch.equal(on_cpu["a"], a)
    buf.seek(0)
    moved = torch.load(buf, map_location=f"dmabuf:{device_count() - 1}")
    assert moved["a"].device == dev(device_count() - 1) and torch.equal(moved["a"].cpu(), a)
    # A module's state dict on the device.
    m = nn.Linear(5, 3).to("dmabuf")
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    assert all(v.device == dev(0) for v in sd.values())
    for k, v in m.state_dict().items():
        assert torch.equal(sd[k].cpu(), v.cpu()), k


def draws(d=None):
    device = "dmabuf" if d is None else f"dmabuf:{d}"
    x = torch.randn(1000, device=device)
    u = torch.rand(1000, device=device)
    k = torch.randint(0, 1000, (1000,), device=device)
    drop = F.dropout(torch.ones(1000, device=device), p=0.5, training=True)
    return [t.cpu() for t in (x, u, k, drop)]


def same(xs, ys):
    return all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_manual_seed_makes_random_ops_reproducible():
    torch.dmabuf.manual_seed(1234)
    first = draws()
    torch.dmabuf.manual_seed(1234)
    second = draws()
    assert same(first, second)
    torch.dmabuf.manual_seed(1235)
    third = draws()
    assert not any(torch.equal(x, y) for x, y in zip(first[:3], third[:3]))
    # The draws are random-looking: not a constant.
    assert first[0].unique().numel() == 1000
    assert 300 < int((first[3] == 0).sum()) < 700
    # Without reseeding, the stream of numbers moves on.
    assert not torch.equal(draws()[0], third[0])


def test_manual_seed_all_and_torch_manual_seed_cover_every_device():
    torch.dmabuf.manual_seed_all(7)
    a = [draws(d) for d in range(device_count())]
    torch.dmabuf.manual_seed_all(7)
    b = [draws(d) for d in range(device_count())]
    assert all(same(x, y) for x, y in zip(a, b))
    torch.manual_seed(7)
    c = [draws(d) for d in range(device_count())]
    assert all(same(x, y) for x, y in zip(a, c))
    torch.manual_seed(8)
    d = draws(0)
    assert not torch.equal(d[0], a[0][0])
