#!/usr/bin/env python3
"""Record real allocation traces from PyTorch (CPU) for `dmabuf-rt replay`.

Runs ten workloads on CPU under
``torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True)``
and converts every allocation/free the profiler saw into the replay format, one JSON
object per line, sorted by time:

    {"t": <ns>, "op": "alloc"|"free", "addr": <int>, "size": <int>}
    {"t": <ns>, "op": "step"}

Step lines (newer workloads only) come from sentinel allocations; see SENTINEL_BYTES.

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
* blocks still live at the end of the trace get no free line;
* an allocation of SENTINEL_BYTES becomes a step line; it and its free are dropped.

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

WORKLOADS = ["transformer_train", "cnn_train", "varlen_infer", "kv_decode",
             "llm_serving", "moe_train", "finetune_ckpt", "cnn_multires",
             "transformer_train_small", "varlen_infer_seed2"]

# Step markers. The profiler's timestamps are on its own clock, so a step boundary is
# recorded *in* the allocation stream: an allocation of SENTINEL_BYTES (a size no workload
# allocates; checked at conversion) freed at once. The conversion turns each such
# alloc/free pair into one {"t": ..., "op": "step"} line at the alloc's time and drops both
# events. The first four workloads predate step markers and emit none.
SENTINEL_BYTES = 999_983  # odd (a prime): no tensor of any workload has this many bytes
_markers = [0]


def step_marker():
    """Marks a step boundary in the trace (see SENTINEL_BYTES)."""
    torch.empty(SENTINEL_BYTES, dtype=torch.uint8)  # freed at once: a temporary
    _markers[0] += 1


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


class MoE(nn.Module):
    """Mixture of experts: a linear router, top-k experts per token (each an MLP), the
    outputs weighted by the renormalized router probabilities. Which tokens go to which
    expert depends on the data, so the expert batch sizes change every step."""

    def __init__(self, d, experts, hidden, k):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(experts)])

    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(b * s, d)
        probs = F.softmax(self.gate(x), dim=-1)
        w, top = probs.topk(self.k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        counts = []
        for e, expert in enumerate(self.experts):
            tok, slot = (top == e).nonzero(as_tuple=True)
            counts.append(tok.numel())
            if tok.numel() == 0:
                continue
            y = expert(x[tok]) * w[tok, slot].unsqueeze(-1)
            out = out.index_add(0, tok, y)
        # Switch-style load-balancing loss: fraction routed times mean probability.
        frac = torch.tensor(counts, dtype=x.dtype) / (b * s * self.k)
        aux = (frac * probs.mean(dim=0)).sum() * len(self.experts)
        return out.view(b, s, d), aux, counts


class MoEBlock(nn.Module):
    def __init__(self, d, heads, experts, hidden, k):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.moe = MoE(d, experts, hidden, k)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        y, aux, counts = self.moe(self.ln2(x))
        return x + y, aux, counts


class MoEGPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, max_len, experts, hidden, k):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([MoEBlock(d, heads, experts, hidden, k) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        b, s = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(s))
        aux, counts = 0.0, []
        for blk in self.blocks:
            x, a, c = blk(x)
            aux = aux + a
            counts.append(c)
        return self.head(self.ln_f(x)), aux, counts


# --------------------------------------------------------------------------------------
# Workloads. Each builds its model *inside* the profiled region, so parameters, gradients
# and optimizer state are in the trace as they would be on a device.
# --------------------------------------------------------------------------------------


def transformer_train(cfg):
    _gpt_train(cfg, vocab=8192, d=512, heads=8, layers=6, seq=256, batch=8, steps=5, markers=False)


def transformer_train_small(cfg):
    """transformer_train at another size (and with step markers)."""
    _gpt_train(cfg, vocab=8192, d=384, heads=6, layers=4, seq=192, batch=6, steps=6, markers=True)


def _gpt_train(cfg, vocab, d, heads, layers, seq, batch, steps, markers):
    cfg.update(vocab=vocab, d_model=d, heads=heads, layers=layers, seq=seq, batch=batch, steps=steps)
    model = GPT(vocab, d, heads, layers, seq)
    # foreach=True: the multi-tensor path that is the default on GPUs.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    for _ in range(steps):
        if markers:
            step_marker()
        idx = torch.randint(0, vocab, (batch, seq + 1))
        x, y = idx[:, :-1], idx[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
        del logits
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del loss, idx, x, y
    if markers:
        step_marker()


def _cnn_step(model, opt, batch, res, classes):
    """One SGD step of the CNN on a random batch at resolution `res` (cnn_train, cnn_multires)."""
    x = torch.randn(batch, 3, res, res)
    y = torch.randint(0, classes, (batch,))
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    del loss, x, y


def cnn_train(cfg):
    batch, res, classes, steps = 16, 128, 1000, 5
    cfg.update(batch=batch, resolution=res, classes=classes, steps=steps, layout="ResNet-18")
    model = ResNet(classes)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)
    for _ in range(steps):
        _cnn_step(model, opt, batch, res, classes)


def varlen_infer(cfg):
    _varlen_infer(cfg, seed=1234, requests=20, markers=False)


def varlen_infer_seed2(cfg):
    """varlen_infer with another seed and more requests (and a step marker per request)."""
    _varlen_infer(cfg, seed=98765, requests=24, markers=True)


def _varlen_infer(cfg, seed, requests, markers):
    vocab, d, heads, layers, max_len = 8192, 512, 8, 4, 512
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 8), rng.randint(16, 512)) for _ in range(requests)]
    cfg.update(vocab=vocab, d_model=d, heads=heads, layers=layers, requests=requests,
               shapes_batch_seq=shapes)
    model = Encoder(vocab, d, heads, layers, max_len)
    model.eval()
    with torch.no_grad():
        for b, s in shapes:
            if markers:
                step_marker()
            idx = torch.randint(0, vocab, (b, s))
            hidden, pooled = model(idx)
            # The "response": copy the pooled vector out, drop the rest.
            out = pooled.clone()
            del hidden, pooled, idx, out
        if markers:
            step_marker()


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


def _serve_forward(model, toks, starts, caches):
    """One iteration of continuous batching: the new tokens of every running request (a
    whole prompt for a request that just joined, one token for the others) go through the
    linear layers as one flattened batch; attention runs per request against its own KV
    cache (grown by torch.cat). Returns the logits at each request's last position."""
    lens = [t.numel() for t in toks]
    idx = torch.cat(toks).unsqueeze(0)
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, lens)])
    x = model.tok(idx) + model.pos(pos)
    d = x.shape[-1]
    for li, blk in enumerate(model.blocks):
        a, h = blk.attn, blk.attn.heads
        ys = []
        for r, seg in enumerate(a.qkv(blk.ln1(x)).split(lens, dim=1)):
            s = seg.shape[1]
            q, k, v = (t.view(1, s, h, d // h).transpose(1, 2) for t in seg.split(d, dim=2))
            c = caches[r][li]
            if c.get("k") is not None:
                k = torch.cat([c["k"], k], dim=2)
                v = torch.cat([c["v"], v], dim=2)
            c["k"], c["v"] = k, v
            y = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
            ys.append(y.transpose(1, 2).reshape(1, s, d))
        x = x + a.proj(torch.cat(ys, dim=1))
        x = x + blk.mlp(blk.ln2(x))
    last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))])
    return model.head(model.ln_f(x[0, last]))


def llm_serving(cfg):
    vocab, d, heads, layers, max_len, max_batch = 8192, 384, 6, 2, 512, 8
    rng = random.Random(777)
    # (arrival iteration, prompt length, output length) per request.
    reqs, at = [], 0
    for _ in range(20):
        at += rng.choice([1, 2, 3, 4, 5, 6])
        reqs.append((at, rng.randint(8, 160), rng.randint(4, 40)))
    cfg.update(vocab=vocab, d_model=d, heads=heads, layers=layers, max_batch=max_batch,
               requests_arrival_prompt_output=reqs, cache="torch.cat per request per token")
    model = GPT(vocab, d, heads, layers, max_len)
    model.eval()
    pending = list(reqs)
    running = []  # dicts: caches, next input, position, tokens still to generate
    batches = []
    it = 0
    with torch.no_grad():
        while pending or running:
            if not running:
                it = max(it, pending[0][0])  # idle until the next arrival: no iteration
            step_marker()
            while pending and pending[0][0] <= it and len(running) < max_batch:
                _, prompt, out_len = pending.pop(0)
                running.append(dict(caches=[dict() for _ in range(layers)],
                                    inp=torch.randint(0, vocab, (prompt,)), pos=0, left=out_len))
            if running:
                batches.append(len(running))
                logits = _serve_forward(model, [r["inp"] for r in running], [r["pos"] for r in running],
                                        [r["caches"] for r in running])
                nxt = logits.argmax(dim=-1).tolist()  # sampled tokens go back to the host
                del logits
                for r, tok in zip(running, nxt):
                    r["pos"] += r["inp"].numel()
                    r["inp"] = torch.tensor([tok])
                    r["left"] -= 1
                # Finished requests leave; their KV caches are freed.
                running = [r for r in running if r["left"] > 0]
            it += 1
        step_marker()
    cfg.update(iterations=it, batch_per_iteration=batches)


def moe_train(cfg):
    vocab, d, heads, layers, seq, batch, steps = 4096, 256, 4, 2, 128, 8, 5
    experts, hidden, k = 8, 512, 2
    cfg.update(vocab=vocab, d_model=d, heads=heads, layers=layers, seq=seq, batch=batch, steps=steps,
               experts=experts, expert_hidden=hidden, top_k=k)
    model = MoEGPT(vocab, d, heads, layers, seq, experts, hidden, k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    routed = []
    for _ in range(steps):
        step_marker()
        idx = torch.randint(0, vocab, (batch, seq + 1))
        x, y = idx[:, :-1], idx[:, 1:]
        logits, aux, counts = model(x)
        routed.append(counts)
        loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1)) + 0.01 * aux
        del logits, aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del loss, idx, x, y
    step_marker()
    cfg.update(tokens_per_expert_per_step_per_layer=routed)


def finetune_ckpt(cfg):
    from torch.utils.checkpoint import checkpoint

    vocab, d, heads, layers, max_len, steps = 8192, 384, 6, 4, 256, 6
    rng = random.Random(55)
    shapes = [(rng.randint(4, 6), rng.randint(160, 224)) for _ in range(steps)]
    cfg.update(vocab=vocab, d_model=d, heads=heads, layers=layers, steps=steps, shapes_batch_seq=shapes,
               frozen="tok, pos embeddings", checkpoint="every block, use_reentrant=False")
    model = GPT(vocab, d, heads, layers, max_len)
    model.tok.weight.requires_grad_(False)
    model.pos.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            weight_decay=0.01, foreach=True)
    for b, s in shapes:
        step_marker()
        idx = torch.randint(0, vocab, (b, s + 1))
        x, y = idx[:, :-1], idx[:, 1:]
        h = model.tok(x) + model.pos(torch.arange(s))
        for blk in model.blocks:
            # Activations inside the block are recomputed in backward, not kept.
            h = checkpoint(blk, h, use_reentrant=False)
        logits = model.head(model.ln_f(h))
        loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
        del logits, h
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del loss, idx, x, y
    step_marker()


def cnn_multires(cfg):
    batch, classes = 8, 1000
    resolutions = [96, 128, 160, 112, 144, 96, 128]
    cfg.update(batch=batch, resolutions=resolutions, classes=classes, steps=len(resolutions),
               layout="ResNet-18")
    model = ResNet(classes)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)
    for res in resolutions:
        step_marker()
        _cnn_step(model, opt, batch, res, classes)
    step_marker()


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
    """Applies the conversion rules; returns (lines, stats). A line is (t, op, addr, size);
    a step marker (the sentinel's alloc, see SENTINEL_BYTES) is (t, "step", None, None)."""
    raw = sorted(enumerate(raw), key=lambda p: (p[1][0], p[0]))  # stable by time
    live = {}
    sentinels = set()
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
        if nbytes == SENTINEL_BYTES:
            sentinels.add(addr)
            lines.append((t, "step", None, None))
            continue
        if nbytes == -SENTINEL_BYTES and addr in sentinels:
            sentinels.discard(addr)
            continue
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
    mem = [l for l in lines if l[1] != "step"]
    st.update(
        events=len(mem),
        allocs=sum(1 for l in mem if l[1] == "alloc"),
        frees=sum(1 for l in mem if l[1] == "free"),
        step_markers=len(lines) - len(mem),
        sentinels_unfreed=len(sentinels),
        peak_live_bytes=peak,
        live_at_end=len(live),
        live_bytes_at_end=sum(live.values()),
        distinct_sizes=len({l[3] for l in mem if l[1] == "alloc"}),
        max_block=max((l[3] for l in mem), default=0),
        duration_ns=lines[-1][0] if lines else 0,
    )
    return lines, st


def run(name, out_dir, via):
    torch.manual_seed(0)
    random.seed(0)
    cfg = {}
    _markers[0] = 0
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
            if op == "step":
                fh.write(f'{{"t":{t},"op":"step"}}\n')
            else:
                fh.write(f'{{"t":{t},"op":"{op}","addr":{addr},"size":{size}}}\n')
    # Every marker the workload set must have become a step line: otherwise the profiler
    # missed one, or a real allocation had the sentinel's size.
    if st["step_markers"] != _markers[0] or st["sentinels_unfreed"]:
        raise SystemExit(f"{name}: {_markers[0]} step markers set, {st['step_markers']} found, "
                         f"{st['sentinels_unfreed']} sentinels not freed")
    st.update(file=path, file_bytes=os.path.getsize(path), wall_s=round(wall, 1), config=cfg)
    print(f"{name}: {st['events']} events ({st['allocs']} allocs, {st['frees']} frees), "
          f"peak live {st['peak_live_bytes']} B ({st['peak_live_bytes'] / 2**20:.1f} MiB), "
          f"{st['distinct_sizes']} distinct sizes, {st['step_markers']} step markers, "
          f"{st['file_bytes']} bytes, {st['wall_s']} s")
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
