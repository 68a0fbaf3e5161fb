//! What the fuzz targets share: a reader that turns fuzz input into choices, the process's fd
//! count, and the list of checks skipped while developing.

use std::sync::OnceLock;

/// Reads choices from the fuzz input; once it is used up, every read is 0 (so a short input
/// is a short program, never an error).
#[derive(Debug, Clone)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// A value in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n <= 256 { self.u8() as usize % n } else { self.u32() as usize % n }
    }

    /// Up to `n` bytes, taken as they are.
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        head
    }

    /// What is left.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }

    /// Splits what is left into `n` parts at points the input chooses (for per-thread
    /// programs): `n - 1` bytes give the proportions.
    pub fn split(&mut self, n: usize) -> Vec<Input<'a>> {
        let cuts: Vec<u8> = (1..n).map(|_| self.u8()).collect();
        let total = self.data.len();
        let mut points: Vec<usize> = cuts.iter().map(|&c| total * c as usize / 255).collect();
        points.sort_unstable();
        let mut parts = Vec::with_capacity(n);
        let mut start = 0;
        for p in points.into_iter().chain([total]) {
            parts.push(Input::new(&self.data[start..p.max(start)]));
            start = p.max(start);
        }
        self.data = &[];
        parts
    }
}

/// The number of open fds of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// The open fds of this process with what they point at (for failure messages).
pub fn fd_list() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    dir.filter_map(|e| e.ok())
        .map(|e| {
            let target = std::fs::read_link(e.path()).map(|p| p.display().to_string()).unwrap_or_default();
            format!("{}->{target}", e.file_name().to_string_lossy())
        })
        .collect()
}

/// Whether the check `name` is skipped: `DMABUF_RT_FUZZ_SKIP=name,name` turns named checks off,
/// to collect more than one defect while known ones are being fixed. Unset (CI): every check
/// runs. The names are the `skip` arguments in the targets (each check's failure message
/// names it).
pub fn skipped(name: &str) -> bool {
    static SKIP: OnceLock<Vec<String>> = OnceLock::new();
    SKIP.get_or_init(|| {
        std::env::var("DMABUF_RT_FUZZ_SKIP")
            .map(|s| s.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
            .unwrap_or_default()
    })
    .iter()
    .any(|s| s == name)
}

/// Fails the run (a panic, which libFuzzer reports as a crash) unless `cond` holds or the
/// check `name` is skipped.
#[macro_export]
macro_rules! check {
    ($name:expr, $cond:expr, $($msg:tt)+) => {
        if !$cond && !$crate::skipped($name) {
            panic!("check `{}` failed: {}", $name, format_args!($($msg)+));
        }
    };
}

/// A byte pattern that depends on a seed and the position, so a block holding another
/// block's bytes, or its own at the wrong offset, is noticed.
pub fn pattern(seed: u64, offset: usize) -> u8 {
    let x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(offset as u64);
    (x ^ (x >> 29) ^ (x >> 7)) as u8
}

/// `len` bytes of [`pattern`] starting at `offset`.
pub fn pattern_vec(seed: u64, offset: usize, len: usize) -> Vec<u8> {
    (offset..offset + len).map(|i| pattern(seed, i)).collect()
}

/// The first index where `got` and `want` differ, for messages.
pub fn first_diff(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b).or((got.len() != want.len()).then_some(got.len().min(want.len())))
}
