#!/usr/bin/env python
"""Replay JSONL allocation traces through PyTorch's real CUDACachingAllocator on a
GPU-less host (stub libcudart/libcuda/NVML built from stub/; run it through ./run, which
builds them and sets LD_PRELOAD, LD_LIBRARY_PATH and TORCH_PEER_BUILD).

Prints per trace: peak reserved / peak allocated (torch.cuda.max_memory_*), ns per op,
OOMs, num_alloc_retries / num_device_alloc / num_device_free, and optionally the minimum
capacity (bisection in 2 MiB steps with set_per_process_memory_fraction, as dmabuf-rt's
--find-min-capacity does: smallest capacity at which the repeated replay has no OOM).
"""
import argparse, array, ctypes, glob, json, os, statistics, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STEP = 2 << 20


def load_trace(path):
    kind, slot, size = array.array("b"), array.array("q"), array.array("q")
    live, free_slots, nslots = {}, [], 0
    for line in open(path):
        line = line.strip()
        if not line:
            continue
        ev = json.loads(line)
        op = ev["op"]
        if op == "alloc":
            if ev["addr"] in live:
                raise ValueError(f"{path}: addr {ev['addr']} allocated twice")
            s = free_slots.pop() if free_slots else nslots
            nslots = max(nslots, s + 1)
            live[ev["addr"]] = s
            kind.append(0); slot.append(s); size.append(int(ev["size"]))
        elif op == "free":
            s = live.pop(ev["addr"], None)
            if s is None:
                continue  # free of an unknown block: skipped
            free_slots.append(s)
            kind.append(1); slot.append(s); size.append(0)
    return kind, slot, size, nslots


def as_ptr(arr, ctype):
    addr, _ = arr.buffer_info()
    return ctypes.cast(addr, ctypes.POINTER(ctype))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="*", default=sorted(glob.glob(os.path.join(ROOT, "examples", "torch-traces", "*.jsonl"))))
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--timing-runs", type=int, default=3, help="timed replays per trace (median reported)")
    ap.add_argument("--find-min-capacity", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object per trace")
    ap.add_argument("--capacity", type=int, default=0,
                    help="cap the measured replay at this many bytes")
    ap.add_argument("--cap-via", choices=["stub", "fraction"], default="stub",
                    help="how a capacity is imposed: stub = the fake device's memory (cudaMalloc / "
                         "cuMemCreate fail beyond it, like a real GPU of that size); fraction = "
                         "torch.cuda.set_per_process_memory_fraction")
    args = ap.parse_args()

    import torch
    assert torch.cuda.is_available(), "stub CUDA not active: run through benches/torch-peer/run (LD_PRELOAD)"
    torch.cuda.init()
    torch.empty(1, device="cuda"); torch.cuda.synchronize(); torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    build = os.environ.get("TORCH_PEER_BUILD")
    assert build, "TORCH_PEER_BUILD unset: run through benches/torch-peer/run"
    lib = ctypes.CDLL(os.path.join(build, "replay", "libtorchreplay.so"))
    lib.tp_replay.restype = ctypes.c_int
    lib.tp_replay.argtypes = [ctypes.POINTER(ctypes.c_int8), ctypes.POINTER(ctypes.c_int64),
                              ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    stubdrv = ctypes.CDLL("libcuda.so.1")
    stubdrv.stub_set_total_mem.argtypes = [ctypes.c_ulonglong]

    def set_cap(cap):
        """cap in bytes, 0 = uncapped (the full fake device)"""
        if args.cap_via == "stub":
            stubdrv.stub_set_total_mem(cap or total)
        else:
            torch.cuda.set_per_process_memory_fraction(min(1.0, (cap + 0.5) / total) if cap else 1.0)

    def fresh():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()

    def run(tr, mode=0, repeat=args.repeat):
        kind, slot, size, nslots = tr
        out = (ctypes.c_int64 * 3)()
        rc = lib.tp_replay(as_ptr(kind, ctypes.c_int8), as_ptr(slot, ctypes.c_int64),
                           as_ptr(size, ctypes.c_int64), len(kind), nslots, repeat, mode, out)
        assert rc == 0, "no CUDA allocator registered"
        assert out[2] == 0, f"{out[2]} non-OOM allocator errors"
        return out[0], out[1]

    if not args.json:
        print(f"# torch {torch.__version__}, device '{torch.cuda.get_device_name(0)}' "
              f"{total / 2**30:.0f} GiB (stub), PYTORCH_CUDA_ALLOC_CONF={conf or '(default)'}, repeat {args.repeat}, capacity via {args.cap_via}")
        print(f"{'trace':26} {'ops':>8} {'peak_res_MiB':>12} {'peak_alloc_MiB':>14} {'ratio':>6} "
              f"{'ns/op':>7} {'loop_ns':>7} {'ooms':>4} {'retries':>7} {'dev_alloc':>9} {'dev_free':>8} {'min_cap_MiB':>11}")
    for path in args.traces:
        tr = load_trace(path)
        ops = len(tr[0]) * args.repeat
        # 1) the measured replay: stats from the first run on a fresh (emptied) allocator
        set_cap(args.capacity)
        fresh()
        ns0, ooms = run(tr)
        st = torch.cuda.memory_stats()
        peak_res, peak_alloc = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        rec = dict(trace=os.path.basename(path), alloc_conf=conf, cap_via=args.cap_via, ops=ops, repeat=args.repeat,
                   peak_reserved_bytes=peak_res, peak_allocated_bytes=peak_alloc,
                   ratio=peak_res / peak_alloc if peak_alloc else 0.0, ooms=ooms,
                   num_alloc_retries=st.get("num_alloc_retries", 0),
                   num_device_alloc=st.get("num_device_alloc", 0),
                   num_device_free=st.get("num_device_free", 0))
        # 2) timing: median of more runs, each on an emptied allocator; loop-only overhead
        rec["capacity_bytes"] = args.capacity or total
        times = [ns0]
        for _ in range(args.timing_runs - 1):
            fresh(); times.append(run(tr)[0])
        loop = min(run(tr, mode=1)[0] for _ in range(3))
        med = statistics.median(times)
        rec["ns_per_op"] = med / ops
        rec["ns_per_op_first_run"] = ns0 / ops
        rec["loop_overhead_ns_per_op"] = loop / ops
        rec["ns_per_op_minus_loop"] = (med - loop) / ops
        # 3) minimum capacity, bisected as dmabuf-rt does
        rec["min_capacity_bytes"] = None
        set_cap(0)
        if args.find_min_capacity and ooms == 0:
            lo, hi = peak_alloc // STEP, -(-peak_res // STEP)
            while lo < hi:
                mid = (lo + hi) // 2
                ok = False
                if mid > 0:
                    set_cap(mid * STEP)
                    fresh()
                    ok = run(tr)[1] == 0
                if ok:
                    hi = mid
                else:
                    lo = mid + 1
            rec["min_capacity_bytes"] = hi * STEP
            set_cap(0)
        fresh()
        if args.json:
            print(json.dumps(rec), flush=True)
        else:
            mc = rec["min_capacity_bytes"]
            print(f"{rec['trace'][:26]:26} {ops:8d} {peak_res / 2**20:12.1f} {peak_alloc / 2**20:14.1f} "
                  f"{rec['ratio']:6.3f} {rec['ns_per_op']:7.1f} {rec['loop_overhead_ns_per_op']:7.1f} {ooms:4d} "
                  f"{rec['num_alloc_retries']:7d} {rec['num_device_alloc']:9d} {rec['num_device_free']:8d} "
                  f"{(mc / 2**20 if mc else float('nan')):11.0f}", flush=True)


if __name__ == "__main__":
    main()
