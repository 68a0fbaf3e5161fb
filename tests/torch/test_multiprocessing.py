"""dmabuf tensors through torch.multiprocessing (issue 14): zero-copy by IPC handle.

A tensor (or a view) put on a torch.multiprocessing queue arrives in the other process on the
same device index over the same pages: the receiver sees the producer's bytes, the producer
sees the receiver's writes after synchronization, the producer's freed tensor is not reused
while the receiver holds it, a received tensor cannot be re-shared, and a producer that exits
with its tensor in flight neither crashes the receiver nor leaks. The spawn method, and fork
both before the parent used a device (works) and after (a clear error in the child).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.multiprocessing as mp

import torch_dmabuf  # noqa: F401

TIMEOUT = 120


def _consumer(q, out):
    """Receives tensors and reports what it saw; writes into the first one."""
    try:
        items = []
        while True:
            t = q.get(timeout=TIMEOUT)
            if t is None:
                break
            items.append(t)
        report = [(str(t.device), tuple(t.shape), float(t.double().sum().item())) for t in items]
        items[0].fill_(7.0)
        torch.dmabuf.synchronize(items[0].device.index)
        out.put(("ok", report))
        # Hold them until told to let go.
        assert q.get(timeout=TIMEOUT) == "release"
        del items, t
        out.put(("released", None))
    except Exception as e:  # reported to the parent, which fails the test with it
        out.put(("error", f"{type(e).__name__}: {e}"))


def _get(out):
    kind, value = out.get(timeout=TIMEOUT)
    assert kind != "error", value
    return kind, value


def test_tensors_and_views_cross_with_spawn_and_the_producers_free_waits():
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consumer, args=(q, out))
    p.start()
    try:
        x = torch.arange(4096, dtype=torch.float32, device="dmabuf:1")
        view = x.view(64, 64)[3:9, 10:50:3]  # a strided view with a storage offset
        y = torch.ones(1 << 20, dtype=torch.float16, device="dmabuf:0")
        q.put(y)
        q.put(view)
        q.put(x)
        q.put(None)
        want_view = float(view.double().sum().item())
        base = torch.dmabuf.memory_allocated(1)
        del x, view, y
        # The freed tensors' blocks are held for the receiver: new tensors do not get them.
        churn = [torch.full((4096,), 3.0, device="dmabuf:1") for _ in range(50)]
        kind, report = _get(out)
        assert kind == "ok"
        assert report[0] == ("dmabuf:0", (1 << 20,), float(1 << 20))
        assert report[1][0:2] == ("dmabuf:1", (6, 14)) and report[1][2] == want_view
        assert report[2] == ("dmabuf:1", (4096,), float(sum(range(4096))))
        assert all(float(c.sum().item()) == 3.0 * 4096 for c in churn)
        del churn
        q.put("release")
        assert _get(out)[0] == "released"
    finally:
        p.join(TIMEOUT)
    assert p.exitcode == 0
    torch.dmabuf.synchronize(1)
    assert torch.dmabuf.memory_allocated(1) <= base


def _writer(q, out):
    try:
        t = q.get(timeout=TIMEOUT)
        t[100:200] = -1.0
        torch.dmabuf.synchronize(t.device.index)
        out.put(("ok", None))
        assert q.get(timeout=TIMEOUT) == "release"
        del t
        out.put(("released", None))
    except Exception as e:
        out.put(("error", f"{type(e).__name__}: {e}"))


def test_the_receivers_writes_are_seen_by_the_producer():
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_writer, args=(q, out))
    p.start()
    try:
        t = torch.zeros(1000, device="dmabuf:0")
        q.put(t)
        _get(out)
        torch.dmabuf.synchronize(0)
        assert t[100:200].eq(-1.0).all().item() and t[:100].eq(0).all().item() and t[200:].eq(0).all().item()
        q.put("release")
        _get(out)
    finally:
        p.join(TIMEOUT)
    assert p.exitcode == 0


def _summer(conn):
    """Receives one tensor on a Pipe and sends back its sum and how many elements are 5."""
    try:
        t = conn.recv()
        conn.send(("ok", (float(t.double().sum().item()), int(t.eq(5.0).sum().item()))))
        del t
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def test_a_tensor_sent_from_a_stream_carries_the_streams_work_as_a_fence():
    # A Pipe pickles on the sending thread, under its current stream: the handle carries that
    # stream's queued work (here ~1 GB of copies, then the tensor's own fill) as a fence, the
    # producer does not wait for it, and the receiver's open does.
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_summer, args=(there,))
    p.start()
    try:
        n = 1 << 20
        s = torch.dmabuf.Stream()
        x = torch.zeros(n, device="dmabuf:0")
        torch.dmabuf.synchronize(0)
        big = torch.empty(48 << 20, dtype=torch.uint8, device="dmabuf:0")
        host = torch.zeros(48 << 20, dtype=torch.uint8)
        with torch.dmabuf.stream(s):
            for _ in range(20):
                big.copy_(host, non_blocking=True)
            x.copy_(torch.full((n,), 5.0), non_blocking=True)
            here.send(x)
        kind, value = here.recv()
        assert kind == "ok", value
        assert value == (5.0 * n, n), f"the receiver read {value}, not the stream's copy"
        s.synchronize()
        del big
    finally:
        p.join(TIMEOUT)
    assert p.exitcode == 0


def _reshare(q, out):
    from multiprocessing.reduction import ForkingPickler

    try:
        t = q.get(timeout=TIMEOUT)
        # What a queue's feeder thread does with what is put on it (it reports errors on
        # stderr only, so pickle here to see it).
        try:
            ForkingPickler.dumps(t)
            out.put(("error", "a received tensor was shared onward"))
            return
        except RuntimeError as e:
            why = str(e)
        ForkingPickler.dumps(t.clone())  # a clone can be shared
        del t
        out.put(("ok", why))
    except Exception as e:
        out.put(("error", f"{type(e).__name__}: {e}"))


def test_a_received_tensor_cannot_be_shared_onward():
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_reshare, args=(q, out))
    p.start()
    try:
        q.put(torch.ones(10, device="dmabuf:0"))
        _, why = _get(out)
        assert "cannot be shared onward" in why, why
    finally:
        p.join(TIMEOUT)
    assert p.exitcode == 0


def _run(script, tmp_path):
    """Runs `script` as a program of its own (spawned children re-import it by path)."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    r = subprocess.run([sys.executable, str(path)], env=dict(os.environ), capture_output=True, text=True, timeout=TIMEOUT)
    return r.returncode, r.stdout + r.stderr


def test_a_producer_that_exits_with_its_tensor_in_flight_neither_crashes_nor_leaks_the_receiver(tmp_path):
    code, text = _run(
        """
        import torch, torch.multiprocessing as mp, torch_dmabuf

        def producer(q, opened, gone_early):
            t = torch.full((1 << 16,), 5.0, device="dmabuf:0")
            q.put(t)
            if not gone_early:
                opened.get(timeout=60)   # the receiver opened it; exit now
            else:
                q.close(); q.join_thread()   # the tensor is in the pipe; exit before it is opened

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            for gone_early in (False, True):
                q, opened = ctx.Queue(), ctx.Queue()
                p = ctx.Process(target=producer, args=(q, opened, gone_early))
                p.start()
                if gone_early:
                    p.join(60)
                    assert p.exitcode == 0
                    try:
                        t = q.get(timeout=60)
                        print("UNEXPECTED: opened a tensor of a process that is gone")
                    except RuntimeError as e:
                        print("REFUSED:", str(e).splitlines()[0][:200])
                else:
                    t = q.get(timeout=60)
                    opened.put(1)
                    p.join(60)
                    assert p.exitcode == 0
                    print("AFTER EXIT:", float(t.sum().item()))
                    del t
            print("DONE")
        """,
        tmp_path,
    )
    assert code == 0, text
    assert f"AFTER EXIT: {5.0 * (1 << 16)}" in text, text
    assert "REFUSED:" in text and "gone" in text, text
    assert "DONE" in text, text


def test_fork_before_the_first_use_works_and_after_it_the_child_says_why(tmp_path):
    code, text = _run(
        """
        import torch, torch.multiprocessing as mp, torch_dmabuf

        def consumer(q, out):
            try:
                t = q.get(timeout=60)
                out.put(float(t.sum().item()))
            except Exception as e:
                out.put(f"{type(e).__name__}: {e}")

        def late_child(out):
            try:
                torch.zeros(4, device="dmabuf:0")
                out.put("UNEXPECTED: a child forked after the first use used the device")
            except Exception as e:
                out.put(str(e).splitlines()[0][:300])

        if __name__ == "__main__":
            ctx = mp.get_context("fork")
            q, out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=consumer, args=(q, out))
            p.start()                      # forked before this process used a device
            q.put(torch.full((100,), 2.0, device="dmabuf:0"))
            print("EARLY FORK:", out.get(timeout=60))
            p.join(60)
            p = ctx.Process(target=late_child, args=(out,))
            p.start()                      # forked after
            print("LATE FORK:", out.get(timeout=60))
            p.join(60)
        """,
        tmp_path,
    )
    assert code == 0, text
    assert "EARLY FORK: 200.0" in text, text
    assert "LATE FORK:" in text and "spawn" in text and "UNEXPECTED" not in text, text
