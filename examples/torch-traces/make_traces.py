#!/usr/bin/env python3
"""Record real allocation traces from PyTorch (CPU) for `dmabuf-rt replay`.

Runs four workloads on CPU under
``torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True)``
and converts every allocation/free the profiler saw into the replay format, one JSON
object per line, sorted by time:

    {"t": <ns>, "op": "alloc"|"free", "addr": <int>, "size": <int>}

Where the events come from (``--via``):

* ``tree`` (default): the profiler's raw result,
  ``prof.profiler.kineto_results.experimental_event_tree()``; every node whose tag is
  ``_EventType.Allocation`` carries ``start_time_ns`` (integer ns), ``extra_fields.ptr``,
  ``extra_fields.alloc_size`` (negative for a free) and ``extra_fields.device``.
* ``chrome``: the Kineto chrome-trace export (``prof.export_chrome_trace``); its
  ``"[memory]"`` instant events carry ``ts`` (microseconds, 3 decimals), ``args.Addr``,
  ``args.Bytes`` (negative for a free) and ``args["Device Type"]`` (0 = CPU).

Both are the same events (the chrome export is written from the same result); ``tree``
gives exact integer nanoseconds.

Conversion rules (see README.md):

* only CPU events of this process (device type CPU); zero-byte events are dropped;
* events are sorted by time, ties kept in the profiler's order (stable sort);
* ``t`` is rebased so that the first kept event is at 0;
* a free whose address is not live in the trace (allocated before profiling began) is
  dropped; a free carries the size of its alloc;
* blocks still live at the end of the trace get no free line.

Usage:
    python make_traces.py [--out DIR] [--only NAME ...] [--via tree|chrome]
"""

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

WORKLOADS = ["transformer_train", "cnn_train", "varlen_infer", "kv_decode"]


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, causal=True, kv_cache=None):
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).split(d, dim=2)
        q = q.view(b, s, h, d // h).transpose(1, 2)
        k = k.view(b, s, h, d // h).transpose(1, 2)
        v = v.view(b, s, h, d // h).transpose(1, 2)
        if kv_cache is not None:
            # KV cache grown with torch.cat each step (a new, larger tensor every token).
            if kv_cache.get("k") is not None:
                k = torch.cat([kv_cache["k"], k], dim=2)
                v = torch.cat([kv_cache["v"], v], dim=2)
            kv_cache["k"], kv_cache["v"] = k, v
            # With a cache, the single new query attends to everything: no mask needed.
            causal = causal and s > 1
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        y = y.transpose(1, 2).contiguous().view(b, s, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d, heads, causal):
        super().__init__()
        self.causal = causal
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.ln1(x), causal=self.causal, kv_cache=kv_cache)
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, heads, causal=True) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, start_pos=0, caches=None):
        b, s = idx.shape
        pos = torch.arange(start_pos, start_pos + s, dtype=torch.long)
        x = self.tok(idx) + self.pos(pos)
        for i, blk in enumerate(self.blocks):
            x = blk(x, kv_cache=None if caches is None else caches[i])
        return self.head(self.ln_f(x))


class Encoder(nn.Module):
    """BERT-like: token + position embeddings, bidirectional blocks, pooled output."""

    def __init__(self, vocab, d, heads, layers, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.ln_e = nn.LayerNorm(d)
        self.blocks = nn.ModuleList([Block(d, heads, causal=False) for _ in range(layers)])
        self.pool = nn.Linear(d, d)

    def forward(self, idx):
        b, s = idx.shape
        x = self.ln_e(self.tok(idx) + self.pos(torch.arange(s)))
        for blk in self.blocks:
            x = blk(x)
        return x, torch.tanh(self.pool(x[:, 0]))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-18 layout: 7x7 stem, 4 stages of 2 basic blocks, avgpool, fc."""

    def __init__(self, classes=1000, widths=(64, 128, 256, 512)):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1))
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# --------------------------------------------------------------------------------------
# Workloads. Each builds its model *inside* the profiled region, so parameters, gradients
# and optimizer state are in the trace as they would be on a device.
# --------------------------------------------------------------------------------------


def transformer_train(cfg):
    vocab, d, heads, layers, seq, batch, steps = 8192, 512, 8, 6, 256, 8, 5
    cfg.update(vocab=vocab, d_model=d, heads=heads, layers=layers, seq=seq, batch=batch, steps=steps)
    model = GPT(vocab, d, heads, layers, seq)
    # foreach=True: the multi-tensor path that is the default on GPUs.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    for _ in range(steps):
        idx = torch.randint(0, vocab, (batch, seq + 1))
        x, y = idx[:, :-1], idx[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
        del logits
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del loss, idx, x, y


def cnn_train(cfg):
    batch, res, classes, steps = 16, 128, 1000, 5
    cfg.update(batch=batch, resolution=res, classes=classes, steps=steps, layout="ResNet-18")
    model = ResNet(classes)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)
    for _ in range(steps):
        x = torch.randn(batch, 3, res, res)
        y = torch.randint(0, classes, (batch,))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del loss, x, y


def varlen_infer(cfg):
    vocab, d, heads, layers, max_len, requests = 8192, 512, 8, 4, 512, 20
    rng = random.Random(1234)
    shapes = [(rng.randint(1, 8), rng.randint(16, 512)) for _ in range(requests)]
    cfg.update(vocab=vocab, d_model=d, heads=heads, layers=layers, requests=requests,
               shapes_batch_seq=shapes)
    model = Encoder(vocab, d, heads, layers, max_len)
    model.eval()
    with torch.no_grad():
        for b, s in shapes:
            idx = torch.randint(0, vocab, (b, s))
            hidden, pooled = model(idx)
            # The "response": copy the pooled vector out, drop the rest.
            out = pooled.clone()
            del hidden, pooled, idx, out


def kv_decode(cfg):
    vocab, d, heads, layers, max_len = 8192, 512, 8, 4, 512
    rng = random.Random(4321)
    # (batch, prompt length, new tokens) per sequence group.
    seqs = [(4, rng.randint(16, 64), rng.randint(90, 140)) for _ in range(3)]
    cfg.update(vocab=vocab, d_model=d, heads=heads, layers=layers, sequences_batch_prompt_new=seqs,
               cache="torch.cat per token")
    model = GPT(vocab, d, heads, layers, max_len)
    model.eval()
    with torch.no_grad():
        for b, prompt, new in seqs:
            caches = [dict() for _ in range(layers)]
            idx = torch.randint(0, vocab, (b, prompt))
            logits = model(idx, 0, caches)  # prefill
            pos = prompt
            out = []
            for _ in range(new):
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                out.append(nxt)
                logits = model(nxt, pos, caches)
                pos += 1
            tokens = torch.cat(out, dim=1)
            del caches, logits, idx, out, tokens, nxt


# --------------------------------------------------------------------------------------
# Profiling and conversion
# --------------------------------------------------------------------------------------


def raw_events_tree(prof):
    """(t_ns, addr, signed_bytes) for every CPU allocation event, in profiler order."""
    alloc_tag = torch._C._profiler._EventType.Allocation
    out = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:
        n = stack.pop()
        if n.tag == alloc_tag:
            f = n.extra_fields
            if f.device.type == "cpu":
                out.append((int(n.start_time_ns), int(f.ptr), int(f.alloc_size)))
        stack.extend(reversed(n.children))
    return out


def raw_events_chrome(prof):
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            data = json.load(fh)
    finally:
        os.unlink(path)
    evs = data["traceEvents"] if isinstance(data, dict) else data
    pid = os.getpid()
    out = []
    for e in evs:
        if e.get("name") != "[memory]" or e.get("pid") != pid:
            continue
        a = e["args"]
        if a.get("Device Type") != 0:  # c10::DeviceType::CPU
            continue
        out.append((int(round(float(e["ts"]) * 1000)), int(a["Addr"]), int(a["Bytes"])))
    return out


def convert(raw):
    """Applies the conversion rules; returns (lines, stats)."""
    raw = sorted(enumerate(raw), key=lambda p: (p[1][0], p[0]))  # stable by time
    live = {}
    lines = []
    st = dict(raw_events=len(raw), zero_size=0, dropped_frees=0, size_mismatch=0, realloc_live=0)
    t0 = None
    cur = peak = 0
    for _, (t, addr, nbytes) in raw:
        if nbytes == 0:
            st["zero_size"] += 1
            continue
        if t0 is None:
            t0 = t
        t -= t0
        if nbytes > 0:
            if addr in live:
                # Never seen in practice; would mean a free the profiler missed. Close the
                # old block so the trace stays valid, and count it.
                st["realloc_live"] += 1
                lines.append((t, "free", addr, live.pop(addr)))
                cur -= lines[-1][3]
            live[addr] = nbytes
            cur += nbytes
            peak = max(peak, cur)
            lines.append((t, "alloc", addr, nbytes))
        else:
            size = live.pop(addr, None)
            if size is None:
                st["dropped_frees"] += 1
                continue
            if size != -nbytes:
                st["size_mismatch"] += 1
            cur -= size
            lines.append((t, "free", addr, size))
    st.update(
        events=len(lines),
        allocs=sum(1 for l in lines if l[1] == "alloc"),
        frees=sum(1 for l in lines if l[1] == "free"),
        peak_live_bytes=peak,
        live_at_end=len(live),
        live_bytes_at_end=sum(live.values()),
        distinct_sizes=len({l[3] for l in lines if l[1] == "alloc"}),
        max_block=max((l[3] for l in lines), default=0),
        duration_ns=lines[-1][0] if lines else 0,
    )
    return lines, st


def run(name, out_dir, via):
    torch.manual_seed(0)
    random.seed(0)
    cfg = {}
    fn = globals()[name]
    wall = time.time()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(cfg)
    wall = time.time() - wall
    raw = raw_events_tree(prof) if via == "tree" else raw_events_chrome(prof)
    lines, st = convert(raw)
    path = os.path.join(out_dir, f"{name}.jsonl")
    with open(path, "w") as fh:
        for t, op, addr, size in lines:
            fh.write(f'{{"t":{t},"op":"{op}","addr":{addr},"size":{size}}}\n')
    st.update(file=path, file_bytes=os.path.getsize(path), wall_s=round(wall, 1), config=cfg)
    print(f"{name}: {st['events']} events ({st['allocs']} allocs, {st['frees']} frees), "
          f"peak live {st['peak_live_bytes']} B ({st['peak_live_bytes'] / 2**20:.1f} MiB), "
          f"{st['distinct_sizes']} distinct sizes, {st['file_bytes']} bytes, {st['wall_s']} s")
    print("  " + json.dumps({k: v for k, v in st.items() if k != "config"}))
    print("  config " + json.dumps(cfg))
    sys.stdout.flush()
    return st


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--only", nargs="*", choices=WORKLOADS)
    ap.add_argument("--via", choices=["tree", "chrome"], default="tree")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, via {args.via}")
    for name in args.only or WORKLOADS:
        run(name, args.out, args.via)


if __name__ == "__main__":
    main()
