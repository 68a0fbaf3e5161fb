//! Hostile review 33: `SyncedMemory` (src/synced/, its C API in src/ffi/capi/synced.rs) and the
//! Paddle plugin's C ABI (src/ffi/paddle.rs), as a careless or hostile multi-threaded caller
//! drives them. The C-side tests are in tests/hostile_review33_capi.rs (each in a child process
//! of its own); the numbering is shared. Findings (each test failed on efacac1; all are fixed):
//!
//! 1. (capi `a_head_query_from_a_stream_callback_while_a_call_waits_for_the_push_behind_it`)
//!    A stream callback asks a SyncedMemory for its head (a query, "moves nothing") while
//!    another thread's `dmabuf_rt_synced_host_data` on it waits for an asynchronous push queued
//!    behind the callback on that stream: the waiting call holds the object's lock through the
//!    wait (`Runtime::with_synced`, src/ffi/runtime.rs:742-749, `lock(&mem)` held across `f`,
//!    whose `SyncedMemory::settle` blocks on the push's event), the query waits for the lock,
//!    the push waits for the callback. Deadlock (still hung after 20 s, 4 of 4 runs), not
//!    refused: the wait-for graph behind `DMABUF_RT_WOULD_DEADLOCK` knows events, not this lock.
//! 2. (`a_refused_wait_for_the_push_keeps_the_push_and_the_head`; capi
//!    `a_transition_from_a_callback_before_its_own_push_is_refused_not_hung`) A call whose wait
//!    for the push in flight is refused (`WouldDeadlock`: made from a host callback queued before
//!    the push on the same queue) is treated as a failed push: `SyncedMemory::settle`
//!    (src/synced/mod.rs, `self.pending.take()` then `inspect_err(|_| self.head = AtHost)`) has
//!    dropped the pending event and moves the head from `Synced` to `AtHost` (C: head 1, not 3).
//!    The push is still queued and runs after the callback: a device write made after the
//!    refusal (`mutable_device_data` + fill 0xEE) is overwritten by the old host bytes; the host
//!    view ends all 0x11, with or without the builder's queue. A refused call must change
//!    nothing.
//! 3. (capi `a_synchronous_read_waits_for_a_push_on_another_devices_stream`,
//!    `device_synchronize_waits_for_a_push_on_another_devices_stream`) A push on a stream of
//!    another device (allowed: "Any stream may be used") is never made known to the
//!    SyncedMemory's device: `SyncedMemory::async_device_push` queues the copy on that stream's
//!    queue, but unlike `Runtime::copy` (`track_foreign`, src/ffi/runtime.rs) nothing tells
//!    device 0. With device 1's stream held, `dmabuf_rt_device_synchronize(0)` returns and a
//!    synchronous `dmabuf_rt_memcpy` of the device pointer (head SYNCED) reads the bytes from
//!    before the push (all 0x11, want 0x22).
//! 4. (capi `device_memory_lent_to_a_synced_memory_is_not_freed_under_it`,
//!    `host_memory_lent_to_a_synced_memory_is_not_freed_under_it`) Memory lent with
//!    `_set_device_data` / `_set_host_data` can be freed under the SyncedMemory with
//!    `dmabuf_rt_device_free` / `dmabuf_rt_host_free` (status OK); the next allocation of that
//!    size is the same block, and the SyncedMemory's next transition writes into the new owner's
//!    memory (all 0xC3 / 0x77 where the owner wrote 0x5A). The header says the caller "must not",
//!    but both are safe C functions and nothing refuses the free or keeps the block: the
//!    SyncedMemory keeps only a counted `Mem` (`Buf::Borrowed`, src/synced/store.rs), which keeps
//!    the pages mapped, not the block allocated.
//! 5. (capi `paddle_callbacks_refuse_a_device_that_does_not_exist`) The Paddle stream, event and
//!    host/unified-memory callbacks ignore their `C_Device`: with device 7 or `i32::MAX` of 2,
//!    `create_event`, `record_event` (with a stream), `query_event`, `synchronize_event`,
//!    `query_stream`, `synchronize_stream` (non-NULL stream), `stream_wait_event`,
//!    `stream_add_callback`, `destroy_stream`, `destroy_event`, `host_memory_allocate`,
//!    `unified_memory_allocate` succeed (37 calls in all, device -1 and a NULL device included),
//!    where the size hints were made to refuse such a device (issue 9, defect 12). These
//!    functions take `_dev` and never call `dev_id`/`Runtime::device` (src/ffi/paddle.rs).
//! 6. (capi `paddle_async_d2h_into_memory_freed_before_the_stream_ran_it`) An asynchronous d2h
//!    copy into unified memory, then `unified_memory_deallocate` (status 0) before the stream
//!    ran it: `Runtime::unified_free` drops the segment, unmapping it at once, and the stream
//!    thread then writes into the unmapped range: SIGSEGV of the process (gdb: thread "shmem",
//!    `copy_avx2` from `queue::engine::cpu_copy`, dst 0x7ffff732b000). Pinned host memory is
//!    protected against exactly this (`Runtime::host_record`: "even if the caller frees it at
//!    once", the same test's first half passes); unified memory is not (`Runtime::copy` makes the
//!    host side a `Mem::from_raw`, which holds nothing).
//! 7. (`a_second_push_on_another_queue_orders_that_queue_after_the_first`) A second
//!    `async_device_push` on another queue while the first is in flight returns Ok and queues
//!    nothing (head `Synced`: `async_device_push` returns at `Head::Synced` before looking at
//!    `pending`), so work the caller then submits to the second queue is not ordered after the
//!    first push: with q1 held, a copy out of the device view on q2 completes and reads the old
//!    bytes (all 0x11, want 0x22), though the contract is "work submitted to that queue
//!    afterwards sees the pushed bytes". The C API is the same (`_async_device_push` from
//!    SYNCED "does nothing").
//!
//! The fixes: 1, the queries read what the last finished call left (`Runtime::synced_facts`),
//! and a call waits for a push in flight with the object unlocked (`Runtime::with_synced`); 2,
//! a refused wait changes nothing (`SyncedMemory::settle`), and a call that replaces memory is
//! refused with it; 3, a push on another device's stream is tracked by the memory's device
//! (`track_foreign`); 4, frees of memory lent to a live SyncedMemory are refused
//! (`Runtime::lend_to_synced`); 5, every Paddle callback checks its device (`check_dev`); 6,
//! a stream's copy into unified memory holds its segment (`Runtime::unified_mem`); 7, a push
//! from `Synced` makes its queue wait for the push in flight.
//!
//! Verified (passing, capi): huge sizes (usize::MAX, isize::MAX + 1, isize::MAX, 1 TiB,
//! capacity + 1) are created and refused at first access, with no out-pointer written, the head
//! left UNINITIALIZED and nothing allocated; dead, zero and garbage handles, NULL out-pointers,
//! lent pointers that are NULL, foreign, of the other device, past a block's end, or the
//! object's own memory (interior pointers too), pushes with bad streams or from the wrong head
//! are refused with the right status and lose no data; one handle hammered from eight threads
//! and destroyed under them (60 rounds) gives only OK / INVALID_HANDLE / INVALID_ARGUMENT and
//! leaks nothing; a transition from a callback before its own push is refused with
//! `DMABUF_RT_WOULD_DEADLOCK`, not hung (its effect on the state is finding 2). Paddle:
//! overlapping d2d copies (synchronous and on a stream, both directions, shifts 1, 4096 and
//! 1 MiB + 3) move like memmove; the same wrong-size frees, overrunning memsets and copies, and
//! racing frees and destroys from eight threads (200 rounds) give exactly one winner each and
//! leave nothing allocated; `finalize` twice, then calls: its dropped streams and events are
//! refused, live memory and SyncedMemory objects still work, new streams and callbacks work.

mod common;

use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use common::{QueueGate, summary};
use dmabuf_rt::caching::{CachingAllocator, Config, HostCachingAllocator};
use dmabuf_rt::queue::{HostBuffer, Queue, fill_now};
use dmabuf_rt::source::ShmemSource;
use dmabuf_rt::synced::{Head, SyncedMemory};

const SIZE: usize = 64 * 1024 + 100;

fn limit() -> Duration {
    Duration::from_secs(20 * common::time_scale() as u64)
}

fn allocators() -> (CachingAllocator, HostCachingAllocator) {
    let dev = CachingAllocator::builder(ShmemSource::new().reserve(false))
        .config(Config::parse("expandable_segments:False").unwrap())
        .capacity(1 << 30)
        .build()
        .unwrap();
    (dev, HostCachingAllocator::new(ShmemSource::new().reserve(false)))
}

/// Finding 2. A host callback queued before a push on the same queue calls `host_data`: the
/// wait for the push is refused (WouldDeadlock), correctly, but the refusal forgets the push
/// and moves the head to AtHost. The callback then writes the device view (mutable, 0xEE):
/// after the callback the forgotten push runs and copies the old host bytes (0x11) over it.
/// Fixed: the refusal changes nothing (head `Synced`, push pending), and the device access is
/// refused too, since the push still to run would overwrite the write.
#[test]
fn a_refused_wait_for_the_push_keeps_the_push_and_the_head() {
    for with_queue in [true, false] {
        let (dev, host) = allocators();
        let own = Arc::new(Queue::new().unwrap());
        let b = SyncedMemory::builder(SIZE, &dev, &host).alias(false);
        let b = if with_queue { b.queue(Arc::clone(&own)) } else { b };
        let s = Arc::new(Mutex::new(b.build().unwrap()));
        s.lock().unwrap().mutable_host_data().unwrap().fill(0, SIZE, 0x11).unwrap();
        let q = Queue::new().unwrap();
        let gate = QueueGate::close(&q);
        let (tx, rx) = mpsc::channel();
        {
            let s = Arc::clone(&s);
            q.callback(move |_| {
                let mut m = s.lock().unwrap();
                let refused = m.host_data().map(drop);
                let head_after = m.head();
                // Caffe's mutable_gpu_data, then a device write (the caller's kernel).
                let wrote = m.mutable_device_data().and_then(|d| fill_now(&d, 0xee));
                let _ = tx.send((refused.map_err(|e| e.to_string()), head_after, wrote.map_err(|e| e.to_string())));
            })
            .unwrap();
        }
        s.lock().unwrap().async_device_push(&q).unwrap();
        assert_eq!(s.lock().unwrap().head(), Head::Synced);
        gate.open();
        let (refused, head_after, wrote) = rx.recv_timeout(limit()).expect("the callback never ran (hang)");
        q.synchronize().unwrap();
        let mut m = s.lock().unwrap();
        let got = m.host_data().unwrap().to_vec().unwrap();
        let head_end = m.head();
        drop(m);
        assert!(
            matches!(&refused, Err(e) if e.contains("deadlock") || e.contains("Deadlock") || e.contains("would")),
            "queue {with_queue}: the callback's wait for its own queue's later push: {refused:?}"
        );
        assert_eq!(
            head_after,
            Head::Synced,
            "queue {with_queue}: the refused call moved the head (forgetting the push in flight); host view now {} \
             (head {head_end:?})",
            summary(&got)
        );
        // The device write: refused the same way (the push still to run would copy the host
        // bytes over it), or, if made, not lost.
        match &wrote {
            Err(e) => assert!(
                e.contains("deadlock") && got.iter().all(|&b| b == 0x11),
                "queue {with_queue}: {e}; host view {}",
                summary(&got)
            ),
            Ok(()) => assert!(
                got.iter().all(|&b| b == 0xee),
                "queue {with_queue}: the device write made after the refusal was lost: the push ran after the \
                 callback and copied the old host bytes over the device buffer; host view now {} (head {head_end:?})",
                summary(&got)
            ),
        }
    }
}

/// Finding 7. Push on q1 (held by a gate), then push on q2: Ok, nothing queued on q2. A copy
/// out of the device view submitted to q2 afterwards runs before q1's push: it reads the old
/// device bytes.
#[test]
fn a_second_push_on_another_queue_orders_that_queue_after_the_first() {
    let (dev, host) = allocators();
    let mut s = SyncedMemory::builder(SIZE, &dev, &host).alias(false).build().unwrap();
    s.mutable_host_data().unwrap().fill(0, SIZE, 0x11).unwrap();
    let dm = s.device_data().unwrap(); // the device holds 0x11
    s.mutable_host_data().unwrap().fill(0, SIZE, 0x22).unwrap(); // AtHost
    let q1 = Queue::new().unwrap();
    let q2 = Queue::new().unwrap();
    let gate = QueueGate::close(&q1);
    s.async_device_push(&q1).unwrap();
    s.async_device_push(&q2).unwrap();
    assert_eq!(s.head(), Head::Synced);
    // "Work submitted to that queue afterwards sees the pushed bytes."
    let out = HostBuffer::new(SIZE).unwrap();
    q2.copy(&out, &dm).unwrap();
    let done = q2.record().unwrap();
    // If q2 is ordered after q1's push, `done` cannot complete while q1's gate is closed.
    // (A bounded wait for something that must not happen: it costs its limit only when the
    // queues are ordered; unordered, q2 runs at once.)
    let early = done.synchronize(Some(Duration::from_secs(2 * common::time_scale() as u64))).is_ok();
    gate.open();
    q1.synchronize().unwrap();
    q2.synchronize().unwrap();
    let mut v = vec![0; SIZE];
    out.read(0, &mut v).unwrap();
    assert!(
        !early && v.iter().all(|&b| b == 0x22),
        "work on q2 after the second push ran before the first push (q1 still held: {early}) and read {}",
        summary(&v)
    );
    drop(s);
}
