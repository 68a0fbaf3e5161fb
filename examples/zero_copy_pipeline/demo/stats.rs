//! [`StageStats`]: what a stage reports to the parent when it is done, as one line of text
//! on its control socket. Only std: the fuzzer includes this file by path
//! (`fuzz/fuzz_targets/parsers.rs`).

/// What a stage reports when it is done.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageStats {
    /// Frames the stage handled.
    pub frames: u64,
    /// Frame bytes it wrote into pipes (0 zero-copy).
    pub bytes_copied: u64,
    /// Bytes of messages and frame headers it sent.
    pub control_bytes: u64,
    /// fds it sent.
    pub fds_passed: u64,
    /// Segments its allocator took from the source for the frames (the producer).
    pub buffers: u64,
    /// Frames whose every word it checked (the consumer).
    pub verified: u64,
    /// The producer: from its first frame to the return of the last.
    pub elapsed_ns: u64,
    /// What the producer's source calls itself (or the source asked for, elsewhere).
    pub source_name: String,
}

impl StageStats {
    /// The report line.
    pub fn to_message(&self) -> String {
        format!(
            "done frames={} bytes_copied={} control_bytes={} fds_passed={} buffers={} verified={} elapsed_ns={} \
             source={}",
            self.frames,
            self.bytes_copied,
            self.control_bytes,
            self.fds_passed,
            self.buffers,
            self.verified,
            self.elapsed_ns,
            self.source_name
        )
    }

    /// Parses a report line (`None`: not one).
    pub fn parse(text: &str) -> Option<Self> {
        let rest = text.strip_prefix("done ")?;
        let (nums, source) = rest.split_once(" source=")?;
        let mut s = StageStats { source_name: source.to_string(), ..Default::default() };
        for kv in nums.split_whitespace() {
            let (k, v) = kv.split_once('=')?;
            let v: u64 = v.parse().ok()?;
            match k {
                "frames" => s.frames = v,
                "bytes_copied" => s.bytes_copied = v,
                "control_bytes" => s.control_bytes = v,
                "fds_passed" => s.fds_passed = v,
                "buffers" => s.buffers = v,
                "verified" => s.verified = v,
                "elapsed_ns" => s.elapsed_ns = v,
                _ => return None,
            }
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_round_trip() {
        let stats =
            StageStats { frames: 3, elapsed_ns: 9, source_name: "dma-heap:system".into(), ..Default::default() };
        assert_eq!(StageStats::parse(&stats.to_message()), Some(stats));
        assert_eq!(StageStats::parse("done frames=x source=a"), None);
    }
}
