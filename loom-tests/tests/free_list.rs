//! loom model checks of the caching allocator's lock-free free path
//! (`dmabuf_rt::caching::free_list`), compiled against the real code with `--cfg loom`.
#![cfg(loom)]

use dmabuf_rt::caching::free_list::{FreeList, Node};
use dmabuf_rt_loom_tests::model;
use loom::sync::Arc;
use loom::thread;

/// Two threads free while the allocator drains: every free is seen exactly once (no lost
/// free, nothing handed out twice), and the drainer reads each node's link only after its
/// push is visible.
#[test]
fn concurrent_frees_and_a_drain_lose_nothing_and_duplicate_nothing() {
    model(|| {
        let list = Arc::new(FreeList::new());
        let pushers: Vec<_> = [1u32, 2]
            .into_iter()
            .map(|v| {
                let l = Arc::clone(&list);
                thread::spawn(move || l.push(Node::new(v)))
            })
            .collect();
        let mut got: Vec<u32> = list.take_all().map(|n| n.value).collect();
        for p in pushers {
            p.join().unwrap();
        }
        got.extend(list.take_all().map(|n| n.value));
        got.sort_unstable();
        assert_eq!(got, [1, 2]);
    });
}

/// A node taken and pushed again while another thread pushes (the ABA shape for stacks):
/// still nothing lost or duplicated.
#[test]
fn recycled_nodes_do_not_corrupt_the_list() {
    model(|| {
        let list = Arc::new(FreeList::new());
        list.push(Node::new(1u32));
        let l = Arc::clone(&list);
        let other = thread::spawn(move || l.push(Node::new(2)));
        // Take everything and push the same node back (same address reused).
        let mut again = Vec::new();
        for n in list.take_all() {
            again.push(n);
        }
        for n in again {
            list.push(n);
        }
        other.join().unwrap();
        let mut got: Vec<u32> = list.take_all().map(|n| n.value).collect();
        got.sort_unstable();
        assert_eq!(got, [1, 2]);
    });
}

/// Two drainers race with a pusher: each value reaches exactly one of them.
#[test]
fn two_drainers_split_the_frees_between_them() {
    model(|| {
        let list = Arc::new(FreeList::new());
        list.push(Node::new(1u32));
        let l = Arc::clone(&list);
        let pusher = thread::spawn(move || l.push(Node::new(2)));
        let l = Arc::clone(&list);
        let drainer = thread::spawn(move || l.take_all().map(|n| n.value).collect::<Vec<_>>());
        let mut got: Vec<u32> = list.take_all().map(|n| n.value).collect();
        pusher.join().unwrap();
        got.extend(drainer.join().unwrap());
        got.extend(list.take_all().map(|n| n.value));
        got.sort_unstable();
        assert_eq!(got, [1, 2]);
    });
}

/// A deferred free, as the allocator makes it: the freeing thread counts it and pushes its
/// request; a completion hook on another thread pushes its completion and uncounts it; the
/// allocator drains (oldest first) while that happens, and finally waits for the count to reach
/// zero (the OOM ladder's wait) and drains again. The request is always applied before the
/// completion, and once the count is zero the completion is never missing.
#[test]
fn a_deferred_free_is_applied_in_order_and_seen_once_the_count_is_zero() {
    use dmabuf_rt::caching::free_list::Pending;
    model(|| {
        let list = Arc::new(FreeList::new());
        let pending = Arc::new(Pending::new());
        let (l, p) = (Arc::clone(&list), Arc::clone(&pending));
        let freer = thread::spawn(move || {
            p.begin();
            l.push(Node::new("requested"));
            // The hook runs on another thread once the queues are done.
            let (l2, p2) = (Arc::clone(&l), Arc::clone(&p));
            thread::spawn(move || {
                l2.push(Node::new("completed"));
                p2.end();
            })
        });
        let mut applied = Vec::new();
        list.drain_oldest_first(|n| applied.push(n.value));
        let hook = freer.join().unwrap();
        while !pending.is_zero() {
            thread::yield_now();
        }
        list.drain_oldest_first(|n| applied.push(n.value));
        assert_eq!(applied, ["requested", "completed"]);
        hook.join().unwrap();
    });
}

/// A deferred free on two queues, as the allocator makes it now: the freeing thread counts two
/// waits and pushes its request (`Requested(id, 2)`); one queue had already passed, so its
/// `Passed` is pushed at once; the other queue's marker passes on its executor thread. The
/// allocator drains meanwhile, then sleeps until the count reaches zero (`Pending::wait_zero`,
/// the OOM ladder's wait: no polling) and drains again. The request comes first, both passages
/// are seen, and the sleeper is always woken (a lost wake-up is a deadlock loom reports).
#[test]
fn a_deferred_free_on_two_queues_wakes_the_sleeper_once_both_markers_passed() {
    use dmabuf_rt::caching::free_list::Pending;
    model(|| {
        let list = Arc::new(FreeList::new());
        let pending = Arc::new(Pending::new());
        let (l, p) = (Arc::clone(&list), Arc::clone(&pending));
        let freer = thread::spawn(move || {
            p.begin_n(2);
            l.push(Node::new("requested"));
            let (l2, p2) = (Arc::clone(&l), Arc::clone(&p));
            let marker = thread::spawn(move || {
                l2.push(Node::new("passed"));
                p2.end();
            });
            // The other queue was idle: its passage is pushed by the freeing thread itself.
            l.push(Node::new("passed"));
            p.end();
            marker
        });
        let mut applied = Vec::new();
        list.drain_oldest_first(|n| applied.push(n.value));
        let marker = freer.join().unwrap();
        assert!(pending.wait_zero(std::time::Duration::from_secs(3600)), "woken with waits outstanding");
        list.drain_oldest_first(|n| applied.push(n.value));
        assert_eq!(applied, ["requested", "passed", "passed"]);
        marker.join().unwrap();
    });
}

/// One deferred free is outstanding when the allocator looks (`Pending::mark`); another
/// thread then requests a newer one, which never completes, and completes the first. `wait`,
/// from that mark, must be woken by that completion and see it, though the count never
/// returns to zero (a wait for zero, as before, sleeps to its limit there; a lost wake-up is a
/// deadlock loom reports).
fn woken_by_the_outstanding_completion_while_a_newer_free_waits(
    wait: fn(&dmabuf_rt::caching::free_list::Pending, dmabuf_rt::caching::free_list::PendingMark) -> bool,
) {
    use dmabuf_rt::caching::free_list::Pending;
    use loom::sync::atomic::{AtomicBool, Ordering};
    model(move || {
        let list = Arc::new(FreeList::new());
        let pending = Arc::new(Pending::new());
        pending.begin();
        list.push(Node::new("requested"));
        let looked = Arc::new(AtomicBool::new(false));
        let (l, p, seen) = (Arc::clone(&list), Arc::clone(&pending), Arc::clone(&looked));
        let other = thread::spawn(move || {
            while !seen.load(Ordering::Acquire) {
                thread::yield_now();
            }
            p.begin();
            l.push(Node::new("requested later"));
            l.push(Node::new("passed"));
            p.end();
        });
        let mark = pending.mark();
        looked.store(true, Ordering::Release);
        assert!(wait(&pending, mark), "the wait ran to its limit");
        let mut applied = Vec::new();
        list.drain_oldest_first(|n| applied.push(n.value));
        assert!(applied.contains(&"passed"), "the completion that woke it is not seen: {applied:?}");
        other.join().unwrap();
        assert!(!pending.is_zero(), "the newer free is still outstanding");
    });
}

/// `empty_cache`'s wait (`Pending::wait_outstanding`, here its two halves), for the frees
/// outstanding when it looked.
#[test]
fn a_wait_for_the_outstanding_frees_ends_with_their_completions_while_newer_ones_wait() {
    woken_by_the_outstanding_completion_while_a_newer_free_waits(|p, mark| {
        p.wait_past(mark, std::time::Duration::from_secs(3600))
    });
}

/// The OOM ladder's wait (`Pending::wait_next`), for the next completion (the ladder then
/// tries again).
#[test]
fn the_ladders_wait_ends_with_the_next_completion_while_newer_frees_wait() {
    woken_by_the_outstanding_completion_while_a_newer_free_waits(|p, mark| {
        p.wait_next(mark, std::time::Duration::from_secs(3600))
    });
}

/// A request kept out by another's claim (`Pending::wait_for`) while the claimant withdraws it
/// and wakes the sleepers (`Pending::wake_all`), before or after the sleeper looks: the sleeper
/// must wake and see the change (a lost wake-up is a deadlock loom reports), with no deferred
/// free completing meanwhile.
#[test]
fn a_request_kept_out_by_a_claim_wakes_when_the_claim_goes() {
    use dmabuf_rt::caching::free_list::Pending;
    use loom::sync::atomic::{AtomicUsize, Ordering};
    model(|| {
        let pending = Arc::new(Pending::new());
        pending.begin();
        let changed = Arc::new(AtomicUsize::new(0));
        let (p, c) = (Arc::clone(&pending), Arc::clone(&changed));
        let claimant = thread::spawn(move || {
            c.fetch_add(1, Ordering::AcqRel);
            p.wake_all();
        });
        let seen = 0;
        assert!(
            pending.wait_for(std::time::Duration::from_secs(3600), || changed.load(Ordering::Acquire) != seen),
            "woken without the change"
        );
        claimant.join().unwrap();
        assert!(!pending.is_zero(), "no free completed");
    });
}
