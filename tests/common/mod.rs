#![allow(dead_code)]
//! Helpers shared by the integration tests.

#[allow(unused_imports)]
pub use dmabuf_rt::testing::{open_fds, or_skip};

/// The uid/gid the permission tests drop to when running as root.
pub const NOBODY: u32 = 65534;

/// Runs `f` on a thread whose credentials are an unprivileged user's (when the process is
/// root: the thread alone drops its uids, gids, groups and with them its capabilities; other
/// threads keep root). Returns `f`'s result.
pub fn unprivileged<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            if rustix::process::geteuid().is_root() {
                use rustix::process::{Gid, Uid};
                use rustix::thread::{set_thread_groups, set_thread_res_gid, set_thread_res_uid};
                // SAFETY-free: these are raw per-thread syscalls; this thread ends with `f`.
                let gid = Gid::from_raw(NOBODY);
                set_thread_groups(&[]).expect("setgroups");
                set_thread_res_gid(gid, gid, gid).expect("setresgid");
                let uid = Uid::from_raw(NOBODY);
                set_thread_res_uid(uid, uid, uid).expect("setresuid");
            }
            f()
        })
        .join()
        .expect("unprivileged thread panicked")
    })
}

/// How many of each byte value `v` holds, as "65536x 0x11, 4x 0x22" (what a test saw where it
/// wanted one value).
pub fn summary(v: &[u8]) -> String {
    let mut counts = std::collections::BTreeMap::new();
    for b in v {
        *counts.entry(*b).or_insert(0usize) += 1;
    }
    counts.iter().map(|(b, n)| format!("{n}x {b:#04x}")).collect::<Vec<_>>().join(", ")
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8).collect()
}

/// Writes [`pattern`]`(x.len(), seed)` over the whole block (the IPC tests check it on the other
/// side).
pub fn fill_pattern(x: &dmabuf_rt::caching::Allocation, seed: u8) {
    x.cpu_access(dmabuf_rt::segment::Access::Write).unwrap().write(0, &pattern(x.len(), seed)).unwrap();
}

/// A fresh temporary directory under the system temp dir, removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("dmabuf-rt-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Serializes the tests of one binary that count this process's open fds (the count is
/// process-wide, so a test running beside them would disturb it).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub mod arena;
pub mod capi;
pub mod control;
pub mod isolate;
pub mod seccomp;
pub mod tags;
pub mod trace;
pub mod tracked;
pub mod wait;

/// What this process's open fds are, grouped ("3x anon_inode:[io_uring], 2x memfd, ..."), for
/// a leak's message.
pub fn fd_summary() -> String {
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for e in std::fs::read_dir("/proc/self/fd").into_iter().flatten().flatten() {
        let t = std::fs::read_link(e.path()).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        let t = t.split(" (deleted)").next().unwrap_or("").to_owned();
        let t = if t.starts_with("/memfd:") { "memfd".into() } else { t };
        *kinds.entry(t).or_default() += 1;
    }
    kinds.iter().map(|(k, n)| format!("{n}x {k}")).collect::<Vec<_>>().join(", ")
}

/// Whether `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` works here (registered by this
/// call): without it the caching allocator's lock is never biased, and the races against its
/// owner's fast holds have nothing to race.
pub fn membarrier_ok() -> bool {
    use rustix::thread::{MembarrierCommand, membarrier};
    membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
        && membarrier(MembarrierCommand::PrivateExpedited).is_ok()
}

/// How much slower than this machine the tests may run (`DMABUF_RT_STRESS_TIME_SCALE`: the
/// kernel lane's TCG guest and ThreadSanitizer set it); watchdog limits are multiplied by it.
pub fn time_scale() -> u32 {
    std::env::var("DMABUF_RT_STRESS_TIME_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1)
}

/// Holds a queue at the point where it was closed: a callback that waits until the gate is
/// opened. Work queued behind it cannot have run while the gate is closed, however slow the
/// machine (tests order work with gates and events, never with sleeps). Dropping the gate
/// opens it too, so a failed assertion's unwinding never leaves a queue's drop waiting: declare
/// a gate after the queue it holds. The callback waits on a futex (a `Condvar`), which
/// allocates nothing: a channel's blocking receive makes its thread's waiting context on first
/// use, and a test that exhausts the heap while a gate holds a queue was aborted by the gate
/// itself ("memory allocation of 48 bytes failed" on the queue's thread).
pub struct QueueGate {
    open: std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

impl QueueGate {
    pub fn close(q: &dmabuf_rt::queue::Queue) -> QueueGate {
        let open = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let shared = std::sync::Arc::clone(&open);
        q.callback(move |_| {
            let (opened, cv) = &*shared;
            let mut g = opened.lock().unwrap_or_else(|e| e.into_inner());
            while !*g {
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        })
        .unwrap();
        QueueGate { open }
    }

    pub fn open(self) {}
}

impl Drop for QueueGate {
    fn drop(&mut self) {
        let (opened, cv) = &*self.open;
        *opened.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }
}

/// `n` iterations of a race, fewer where the machine is `time_scale()` times slower (the race
/// keeps its full count on the host; the kernel lane's TCG guest runs a share of it).
pub fn scaled(n: usize) -> usize {
    (n / time_scale() as usize).max(n.min(20))
}

/// A small deterministic PRNG (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A caching allocator over sparse shmem with the `DMABUF_RT_ALLOC_CONF`-syntax settings `conf`.
/// [`allocator`] with a pending-wait limit of `limit` (the OOM ladder's waits for deferred
/// frees and queues).
pub fn allocator_waiting(
    conf: &str,
    capacity: usize,
    limit: std::time::Duration,
) -> dmabuf_rt::caching::CachingAllocator {
    dmabuf_rt::caching::CachingAllocator::builder(dmabuf_rt::source::ShmemSource::new().reserve(false))
        .config(dmabuf_rt::caching::Config::parse(conf).unwrap())
        .capacity(capacity as u64)
        .pending_wait_limit(limit)
        .build()
        .unwrap()
}

/// The setup of the last-wait reviews (`hostile_review29`-`31`) on a 64 MiB allocator: a
/// 4 KiB block freed on gated queue `q1` (a deferred free that ends a request's first wait
/// when `gate1` opens), and a live 40 MiB block used on gated queue `q2` (dropped, its free is
/// what a 40 MiB request waits for, until `gate2` opens). Returns (q1, q2, gate1, gate2, the
/// 40 MiB block).
pub fn two_gated_frees(
    a: &dmabuf_rt::caching::CachingAllocator,
) -> (dmabuf_rt::queue::Queue, dmabuf_rt::queue::Queue, QueueGate, QueueGate, dmabuf_rt::caching::Allocation) {
    let q1 = dmabuf_rt::queue::Queue::new().unwrap();
    let gate1 = QueueGate::close(&q1);
    let mut small = a.allocate(4096, None).unwrap();
    small.record_queue(&q1);
    drop(small);
    let (q2, gate2, big) = gated_block(a);
    (q1, q2, gate1, gate2, big)
}

/// A 40 MiB block of `a` used on a new queue held by a gate (its free, once dropped, is a
/// deferred free that completes when the gate opens): (queue, gate, block).
pub fn gated_block(
    a: &dmabuf_rt::caching::CachingAllocator,
) -> (dmabuf_rt::queue::Queue, QueueGate, dmabuf_rt::caching::Allocation) {
    let q = dmabuf_rt::queue::Queue::new().unwrap();
    let gate = QueueGate::close(&q);
    let mut big = a.allocate(40 << 20, None).unwrap();
    big.record_queue(&q);
    (q, gate, big)
}

/// A thread asking `a` for 40 MiB, returned once the request's first wait for deferred frees
/// has begun (its retry is counted just before): the request's result, as text.
pub fn waiting_40_mib_request(a: &dmabuf_rt::caching::CachingAllocator) -> std::thread::JoinHandle<Result<(), String>> {
    let retries = a.stats().num_alloc_retries;
    let waiter = {
        let a = a.clone();
        std::thread::spawn(move || a.allocate(40 << 20, None).map(drop).map_err(|e| e.to_string()))
    };
    while a.stats().num_alloc_retries == retries {
        std::thread::yield_now();
    }
    waiter
}

/// The end of a last-wait review's test: `gate` opens, `q`'s work (and with it the deferred
/// frees it held) completes, a 40 MiB request is served again and the pool is consistent.
pub fn open_and_serve_40_mib(a: &dmabuf_rt::caching::CachingAllocator, gate: QueueGate, q: &dmabuf_rt::queue::Queue) {
    gate.open();
    q.synchronize().unwrap();
    drop(a.allocate(40 << 20, None).unwrap());
    a.check_invariants().unwrap();
}

pub fn allocator(conf: &str, capacity: u64) -> dmabuf_rt::caching::CachingAllocator {
    dmabuf_rt::caching::CachingAllocator::builder(dmabuf_rt::source::ShmemSource::new().reserve(false))
        .config(dmabuf_rt::caching::Config::parse(conf).unwrap())
        .capacity(capacity)
        .build()
        .unwrap()
}

/// Makes the calling thread the pool's owner where `membarrier` works: `allocate` and
/// `allocate_raw` take the mutex each time until then, and 400 acquisitions in a row with no
/// other thread are past `BIAS_AFTER` (64) on a fresh allocator.
pub fn become_owner(a: &dmabuf_rt::caching::CachingAllocator) {
    for _ in 0..200 {
        drop(a.allocate(4 << 10, None).unwrap());
        let p = a.allocate_raw(4 << 10, None).unwrap();
        a.free_raw(p).unwrap();
    }
}
