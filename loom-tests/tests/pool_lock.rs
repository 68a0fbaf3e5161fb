//! loom model checks of the caching allocator's biased lock
//! (`dmabuf_rt::caching::pool_lock_model`, the crate's `PoolLock` under `--cfg loom`).
//!
//! Under loom one acquisition of the mutex while nobody owns the lock makes its taker the owner
//! (`BIAS_AFTER` is 1), and the membarrier of a revocation is a `SeqCst` fence on each side of
//! Dekker's pair (see `barrier_available` in `pool_lock.rs`). Every hold, fast or not, adds one
//! to a `loom::cell::UnsafeCell`: loom reports two holds whose accesses are not ordered (two
//! holders at once, or a revoker that does not see the owner's writes), and the final count
//! checks that no hold was lost or counted twice.
#![cfg(loom)]

use dmabuf_rt::caching::pool_lock_model::{Guard, Lock};
use dmabuf_rt_loom_tests::model;
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

type Counted = Lock<UnsafeCell<u32>>;

/// The critical section: one more hold.
fn bump(g: &Guard<'_, UnsafeCell<u32>>) {
    // SAFETY: the guard is the only holder (what the model checks: loom reports an access
    // that another hold's is not ordered with).
    g.with_mut(|v| unsafe { *v += 1 });
}

/// A hold by [`Lock::fast`] if this thread owns the lock, else by [`Lock::lock`] (as the
/// allocator takes it); 1.
fn fast_or_lock(l: &Counted) -> u32 {
    match l.fast() {
        Some(g) => bump(&g),
        None => bump(&l.lock()),
    }
    1
}

/// One more hold if `g` is one: 1 then, else 0.
fn held(g: Option<Guard<'_, UnsafeCell<u32>>>) -> u32 {
    match g {
        Some(g) => {
            bump(&g);
            1
        }
        None => 0,
    }
}

/// A fast hold if this thread owns the lock: 1 if it got one.
fn fast_only(l: &Counted) -> u32 {
    held(l.fast())
}

/// The holds counted, read under the lock.
fn count(l: &Counted) -> u32 {
    let g = l.lock();
    // SAFETY: as in `bump`.
    g.with(|v| unsafe { *v })
}

/// A new lock that the calling thread owns.
fn owned_here() -> Arc<Counted> {
    let l = Arc::new(Lock::new(UnsafeCell::new(0)));
    bump(&l.lock());
    assert!(l.is_biased(), "one acquisition did not make an owner (BIAS_AFTER under loom)");
    l
}

/// The owner takes its fast holds while another thread takes the lock by the mutex (which
/// revokes the bias, and then owns the lock in turn, its own next hold a fast one) and the
/// former owner takes it back: each revocation waits out the owner's hold, or the owner's
/// check sees the revocation.
#[test]
fn an_owners_fast_holds_and_a_revoking_lock_never_overlap() {
    model(|| {
        let l = owned_here();
        let l2 = Arc::clone(&l);
        let other = thread::spawn(move || {
            bump(&l2.lock());
            1 + fast_or_lock(&l2)
        });
        let mine = fast_or_lock(&l) + fast_or_lock(&l);
        let theirs = other.join().unwrap();
        assert_eq!(count(&l), 1 + mine + theirs);
    });
}

/// The interleaving that broke the lock when the owner's mark was one flag of the lock: the
/// owner A reads itself the owner in `fast` and stops before it marks its hold; B's `lock`
/// takes the bias back and makes B the owner, and B enters its fast hold; A goes on, finds it
/// is no longer the owner and leaves (it cleared the shared flag, B's mark too); C's `lock`
/// then takes the bias from B, and must wait for B's hold.
#[test]
fn a_former_owner_stopped_inside_fast_does_not_unmark_the_next_owners_hold() {
    model(|| {
        let l = owned_here();
        let (lb, lc) = (Arc::clone(&l), Arc::clone(&l));
        let b = thread::spawn(move || {
            bump(&lb.lock());
            1 + fast_only(&lb)
        });
        let c = thread::spawn(move || {
            bump(&lc.lock());
            1
        });
        let a = fast_only(&l);
        let (b, c) = (b.join().unwrap(), c.join().unwrap());
        assert_eq!(count(&l), 1 + a + b + c);
    });
}

/// `try_lock` (which never revokes) and `try_lock_taking_back` (which revokes unless the
/// owner is inside a fast hold) against the owner's fast holds.
#[test]
fn try_lock_and_try_lock_taking_back_never_join_a_fast_hold() {
    model(|| {
        let l = owned_here();
        let l2 = Arc::clone(&l);
        let other = thread::spawn(move || {
            let tried = held(l2.try_lock());
            tried + held(l2.try_lock_taking_back())
        });
        let mine = fast_only(&l) + fast_only(&l);
        let theirs = other.join().unwrap();
        assert_eq!(count(&l), 1 + mine + theirs);
    });
}

/// One thread owns two locks and has one mark for both: a revoker of the second lock that
/// finds the mark naming the first does not wait for it, and the owner's next fast hold of the
/// second, taken after the first's, must see the revocation.
#[test]
fn a_revoker_of_one_lock_passes_the_owners_hold_of_another() {
    model(|| {
        let (first, second) = (owned_here(), owned_here());
        let other = {
            let second = Arc::clone(&second);
            thread::spawn(move || bump(&second.lock()))
        };
        let mine = fast_only(&first) + fast_only(&second);
        other.join().unwrap();
        assert_eq!(count(&first) + count(&second), 2 + mine + 1);
    });
}
