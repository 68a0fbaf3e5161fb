//! Unit tests of the pool: each step is followed by `check_invariants`.

use super::*;
use crate::source::SparseSource;

fn pool(conf: &str) -> Pool {
    Pool::new(Box::new(SparseSource), Config::parse(conf).unwrap(), 1 << 30)
}

fn got(o: Result<Outcome>) -> Handed {
    match o.unwrap() {
        Outcome::Got(h) => h,
        Outcome::WaitForPending => panic!("nothing is pending"),
    }
}

/// Issue 9, defect 9: `Allocation`'s segment pointer is sound only if a segment never goes
/// back to its source while one of its blocks is handed out. `release_block` checks that
/// in every build (it was a `debug_assert!`), so a bug elsewhere leaks instead of freeing
/// memory in use.
#[test]
fn release_block_refuses_blocks_in_use_split_or_cached() {
    let mut p = pool("expandable_segments:False");
    let whole = got(p.allocate(4 << 20, 0, false, false)).id;
    assert!(p.blocks[whole as usize].allocated);
    assert!(!p.release_block(whole), "released an allocated block's segment");
    let part = got(p.allocate(4096, 0, false, false)).id;
    assert!(p.blocks[part as usize].is_split());
    let rest = p.blocks[part as usize].next.unwrap();
    assert!(!p.release_block(rest), "released the segment under an allocated neighbour");
    p.apply(FreeMsg::Free(part));
    assert!(p.blocks[part as usize].in_quick);
    assert!(!p.release_block(part), "released a quick-cached block");
    assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 2);
    p.check_invariants().unwrap();
    p.apply(FreeMsg::Free(whole));
    p.release_cached(None);
    assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 0);
    p.check_invariants().unwrap();
}

/// Issue 9, defect 7: a gone queue's segments go back as soon as their blocks are free.
#[test]
fn a_gone_queues_segments_go_when_their_last_block_is_freed() {
    for conf in ["expandable_segments:False", "expandable_segments:True"] {
        let mut p = pool(conf);
        let a = got(p.allocate(4096, 7, false, false)).id;
        let b = got(p.allocate(3 << 20, 7, false, false)).id;
        let other = got(p.allocate(4096, 8, false, false)).id;
        p.queue_gone(7);
        p.check_invariants().unwrap();
        assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 3, "{conf}: blocks are live");
        p.apply(FreeMsg::Free(a));
        assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 2, "{conf}");
        p.apply(FreeMsg::Free(b));
        assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 1, "{conf}");
        assert!(p.gone.is_empty() && p.expandable.keys().all(|k| k.0 != 7), "{conf}");
        p.check_invariants().unwrap();
        p.apply(FreeMsg::Free(other));
        p.check_invariants().unwrap();
    }
}
