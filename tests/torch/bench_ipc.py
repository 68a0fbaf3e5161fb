"""Sharing a 64 MiB tensor with another process and reading it there (issue 14): a dmabuf
tensor through torch.multiprocessing (an IPC handle; the receiver maps the producer's pages)
against torch's CPU shared-memory tensors (``share_memory_()`` + the same queue), in the same
run, with the same consumer process (spawned once, warm) reading every byte of each tensor.

Prints per-tensor latency (put to the consumer's read done, medians; CLOCK_MONOTONIC is
system-wide), the bytes the producer copies to share (``share_memory_()`` copies a tensor
that is not yet in shared memory; the handle copies nothing), the bytes pickled through the
queue's pipe, and the fds the consumer holds with 32 tensors alive.

    python tests/torch/bench_ipc.py [--quick]
"""
import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

import torch_dmabuf  # noqa: F401

MB = 1 << 20


def fds():
    return len(os.listdir("/proc/self/fd"))


def consumer(q, out):
    held = []
    while True:
        msg = q.get()
        if msg is None:
            break
        kind, t = msg
        if kind == "hold":
            held.append(t)
            out.put(fds())
            continue
        if kind == "drop":
            held.clear()
            out.put(fds())
            continue
        s = float(t.sum(dtype=torch.float64).item())  # reads every byte where it lies
        out.put((time.monotonic(), s))
        del t


def run(device, n, rounds, q, out):
    lat = []
    copied = pickled = 0
    for r in range(rounds):
        if device == "cpu":
            t = torch.full((n // 4,), float(r), dtype=torch.float32)
            before = time.monotonic()
            t.share_memory_()  # copies the tensor into a shared-memory file
            copied += n
        else:
            t = torch.full((n // 4,), float(r), dtype=torch.float32, device=device)
            torch.dmabuf.synchronize(0)
            before = time.monotonic()
        if r == 0:
            pickled = len(ForkingPickler.dumps(t))
        q.put(("read", t))
        done, s = out.get()
        assert s == float(r) * (n // 4), (device, r, s)
        lat.append(done - before)
        del t
    return statistics.median(lat), copied // rounds, pickled


def held_fds(device, q, out, k=32):
    base = None
    q.put(("drop", None))
    base = out.get()
    ts = []
    for _ in range(k):
        t = torch.ones(1024, device=device) if device != "cpu" else torch.ones(1024).share_memory_()
        ts.append(t)
        q.put(("hold", t))
        after = out.get()
    q.put(("drop", None))
    out.get()
    return after - base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds = 5 if args.quick else 20
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out))
    p.start()
    n = 64 * MB
    rows = {}
    for device in ("dmabuf:0", "cpu"):
        run(device, n, 2, q, out)  # warm
        lat, copied, pickled = run(device, n, rounds, q, out)
        rows[device] = (lat, copied, pickled, held_fds(device, q, out))
    q.put(None)
    p.join()
    print(f"sharing a 64 MiB float32 tensor with a spawned process that reads it all ({rounds} rounds, medians)")
    print(f"{'how':<34} {'latency ms':>11} {'bytes copied':>13} {'bytes pickled':>14} {'fds for 32 alive':>17}")
    names = {"dmabuf:0": "dmabuf tensor (IPC handle)", "cpu": "CPU tensor, share_memory_()"}
    for d, (lat, copied, pickled, nfds) in rows.items():
        print(f"{names[d]:<34} {lat * 1e3:>11.2f} {copied:>13} {pickled:>14} {nfds:>17}")
    (a, _, _, fa), (b, _, _, fb) = rows["dmabuf:0"], rows["cpu"]
    print(f"ratio dmabuf/cpu: latency {a / b:.2f}x, fds {fa}/{fb}")


if __name__ == "__main__":
    main()
