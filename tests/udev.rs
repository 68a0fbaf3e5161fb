//! The udev rules grant the `render` group (and the seat's user) access, never the world.

/// The rules as shipped (embedded at build time, so the check also runs where the source tree
/// is absent, e.g. in the kernel lane).
const RULES: &str = include_str!("../udev/60-dmabuf-rt.rules");

fn rules() -> Vec<&'static str> {
    RULES.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect()
}

fn key<'a>(rule: &'a str, k: &str) -> Option<&'a str> {
    rule.split(',').map(str::trim).find_map(|kv| kv.strip_prefix(k)?.strip_prefix('=')?.trim_matches('"').into())
}

#[test]
fn every_rule_grants_render_group_and_seat_but_not_the_world() {
    let rules = rules();
    for r in &rules {
        assert_eq!(key(r, "GROUP"), Some("render"), "{r}");
        let mode = u32::from_str_radix(key(r, "MODE").unwrap_or_else(|| panic!("no MODE: {r}")), 8).unwrap();
        assert_eq!(mode & 0o007, 0, "world access in {r}");
        assert_eq!(mode & 0o060, 0o060, "group lacks rw in {r}");
        assert!(r.contains("TAG+=\"uaccess\""), "{r}");
    }
}

#[test]
fn rules_cover_the_heaps_and_udmabuf() {
    let rules = rules();
    assert_eq!(rules.len(), 2, "{rules:?}");
    assert!(rules.iter().any(|r| r.contains("SUBSYSTEM==\"dma_heap\"")));
    assert!(rules.iter().any(|r| r.contains("KERNEL==\"udmabuf\"")));
}
