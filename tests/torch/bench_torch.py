#!/usr/bin/env python3
"""Benchmarks of the torch_dmabuf backend against plain CPU tensors. Prints tables, asserts
nothing about time.

  (a) torch.empty + free per size on dmabuf (caching allocator), on the CPU, and on dmabuf with
      DMABUF_RT_NO_CACHING=1 (the runtime reads its environment once, so that column comes
      from a subprocess of this script: `bench_torch.py --part alloc --json`);
  (b) host-to-device and device-to-host copy bandwidth against a CPU-to-CPU copy_;
  (c) training steps of a small MLP and a small conv net on dmabuf with the copying and the
      zero-copy CPU fallback, and on the CPU.

    python tests/torch/bench_torch.py            # about 30-60 s
    python tests/torch/bench_torch.py --quick    # under 15 s, for CI

Each measurement runs for a fixed time budget (at least a few repetitions) and reports the
median, so the total time is bounded whatever the machine's speed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_dmabuf

KiB = 1 << 10
MiB = 1 << 20

ALLOC_SIZES = [512, 64 * KiB, MiB, 16 * MiB]
COPY_SIZES = [MiB, 16 * MiB, 64 * MiB]


def fmt_size(n):
    if n >= MiB:
        return f"{n // MiB} MiB"
    if n >= KiB:
        return f"{n // KiB} KiB"
    return f"{n} B"


def fmt_ratio(a, b):
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def sync():
    torch.dmabuf.synchronize()


def measure(fn, budget, min_samples=3, max_samples=1000):
    """Median seconds per call of fn, over samples of several calls each, taken until
    `budget` seconds have passed (at least min_samples of them). The first call is a warm-up
    that also sizes the samples (about a tenth of the budget each)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    inner = max(1, min(1000, int(budget / 10 / max(first, 1e-7))))
    samples = []
    deadline = time.perf_counter() + budget
    while len(samples) < min_samples or (time.perf_counter() < deadline and len(samples) < max_samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def table(title, header, rows):
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for k, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))


# ---- (a) allocation ----------------------------------------------------------------------------


def alloc_ns(device, budget):
    """ns per torch.empty + free (the tensor is dropped at once) for each size."""
    out = {}
    for n in ALLOC_SIZES:

        def op(n=n):
            torch.empty(n, dtype=torch.uint8, device=device)

        out[n] = measure(op, budget) * 1e9
    if device != "cpu":
        sync()
    return out


def alloc_no_caching(quick):
    """The dmabuf column with DMABUF_RT_NO_CACHING=1, from a subprocess of this script."""
    env = dict(os.environ, DMABUF_RT_NO_CACHING="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--part", "alloc", "--json"] + (["--quick"] if quick else [])
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        print("  (the no-caching subprocess timed out)")
        return None
    if r.returncode != 0:
        print(f"  (the no-caching subprocess failed with status {r.returncode}: {r.stderr.strip()[-400:]})")
        return None
    data = json.loads(r.stdout.strip().splitlines()[-1])
    return {int(k): v for k, v in data["dmabuf"].items()}


def part_alloc(budget, quick, as_json):
    dm = alloc_ns("dmabuf", budget)
    if as_json:
        print(json.dumps({"dmabuf": dm}))
        return
    cpu = alloc_ns("cpu", budget)
    if os.environ.get("DMABUF_RT_NO_CACHING") == "1":
        nc = dm
        print("\n  (DMABUF_RT_NO_CACHING=1 is set in this process: the dmabuf column is not caching either)")
    else:
        nc = alloc_no_caching(quick)
    rows = []
    for n in ALLOC_SIZES:
        ncn = nc.get(n) if nc else None
        rows.append(
            [
                fmt_size(n),
                f"{dm[n]:.0f}",
                f"{cpu[n]:.0f}",
                f"{ncn:.0f}" if ncn is not None else "n/a",
                fmt_ratio(dm[n], cpu[n]),
                fmt_ratio(ncn, dm[n]),
            ]
        )
    table(
        "(a) torch.empty + free, ns per op",
        ["size", "dmabuf", "cpu", "dmabuf no-caching", "dmabuf/cpu", "no-caching/dmabuf"],
        rows,
    )


# ---- (b) copies --------------------------------------------------------------------------------


def part_copy(budget):
    rows = []
    for n in COPY_SIZES:
        host = torch.empty(n, dtype=torch.uint8).fill_(1)
        host2 = torch.empty(n, dtype=torch.uint8).fill_(2)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(3)
        d = torch.empty(n, dtype=torch.uint8, device="dmabuf")
        d.fill_(4)
        d2 = torch.empty(n, dtype=torch.uint8, device="dmabuf")
        d2.fill_(5)

        def gbps(fn):
            return n / measure(fn, budget) / 1e9

        h2d = gbps(lambda: d.copy_(host))
        h2d_pinned = gbps(lambda: d.copy_(pinned))
        d2h = gbps(lambda: host.copy_(d))
        d2d = gbps(lambda: d2.copy_(d))
        cpu = gbps(lambda: host2.copy_(host))
        sync()
        rows.append(
            [
                fmt_size(n),
                f"{h2d:.2f}",
                f"{h2d_pinned:.2f}",
                f"{d2h:.2f}",
                f"{d2d:.2f}",
                f"{cpu:.2f}",
                fmt_ratio(h2d, cpu),
                fmt_ratio(d2h, cpu),
            ]
        )
        del host, host2, pinned, d, d2
    table(
        "(b) copy bandwidth, GB/s (blocking copy_)",
        ["size", "H2D", "H2D pinned", "D2H", "D2D", "cpu copy_", "H2D/cpu", "D2H/cpu"],
        rows,
    )


# ---- (c) training ------------------------------------------------------------------------------


def mlp():
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)), (64, 512)


def conv_net():
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )
    return model, (32, 3, 32, 32)


def step_ms(make, device, budget):
    torch.default_generator.manual_seed(0)  # the model is initialized on the CPU
    model, shape = make()
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(device)
    y = torch.randint(0, 10, (shape[0],), generator=g).to(device)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if device != "cpu":
            sync()

    return measure(step, budget) * 1e3


def part_train(budget):
    have_modes = hasattr(torch_dmabuf, "set_fallback_mode") and hasattr(torch_dmabuf, "fallback_mode")
    previous = torch_dmabuf.fallback_mode() if have_modes else None
    rows = []
    try:
        for name, make in (("MLP 512-1024-10, batch 64", mlp), ("conv net 3-16-32, 32x32, batch 32", conv_net)):
            times = {}
            for mode in ("copy", "zero_copy"):
                if have_modes:
                    torch_dmabuf.set_fallback_mode(mode)
                    times[mode] = step_ms(make, "dmabuf", budget)
                else:
                    times[mode] = None
            cpu = step_ms(make, "cpu", budget)
            rows.append(
                [
                    name,
                    f"{times['copy']:.2f}" if times["copy"] is not None else "n/a",
                    f"{times['zero_copy']:.2f}" if times["zero_copy"] is not None else "n/a",
                    f"{cpu:.2f}",
                    fmt_ratio(times["copy"], cpu),
                    fmt_ratio(times["zero_copy"], cpu),
                ]
            )
    finally:
        if have_modes:
            torch_dmabuf.set_fallback_mode(previous)
    table(
        "(c) training step (forward, backward, SGD), ms per step",
        ["model", "dmabuf copy", "dmabuf zero_copy", "cpu", "copy/cpu", "zero_copy/cpu"],
        rows,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short budgets (under 15 s in all), for CI")
    ap.add_argument("--part", choices=["all", "alloc", "copy", "train"], default="all")
    ap.add_argument("--json", action="store_true", help="with --part alloc: print the dmabuf column as JSON")
    args = ap.parse_args()
    if args.json and args.part != "alloc":
        ap.error("--json goes with --part alloc")

    budget = 0.05 if args.quick else 0.5
    if args.json:
        part_alloc(budget, args.quick, as_json=True)
        return

    start = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; "
        f"DMABUF_RT_DEVICES={os.environ.get('DMABUF_RT_DEVICES', '(default: shmem)')}, "
        f"{torch.dmabuf.device_count()} device(s), capacity {torch.dmabuf.mem_get_info(0)[1] / MiB:.0f} MiB; "
        f"caching {'off' if os.environ.get('DMABUF_RT_NO_CACHING') == '1' else 'on'}; "
        f"fallback {torch_dmabuf.fallback_mode() if hasattr(torch_dmabuf, 'fallback_mode') else 'n/a'}"
        f"{'; --quick' if args.quick else ''}"
    )
    if args.part in ("all", "alloc"):
        part_alloc(budget, args.quick, as_json=False)
    if args.part in ("all", "copy"):
        part_copy(budget * 0.6)
    if args.part in ("all", "train"):
        part_train(budget * 2)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
