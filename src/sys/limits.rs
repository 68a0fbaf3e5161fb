//! This process's resource limits (`getrlimit`), read where they are needed: the caching
//! allocator sizes its reservations by `RLIMIT_AS`, and `error` tells a mapping refused by that
//! limit from a lack of memory.

/// This process's address-space limit (`RLIMIT_AS`, `ulimit -v`) in bytes, if it has one.
#[cfg(not(miri))]
pub(crate) fn address_space_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::As).current
}

/// This process's address-space limit: none under Miri, which cannot ask.
#[cfg(miri)]
pub(crate) fn address_space_limit() -> Option<u64> {
    None
}
