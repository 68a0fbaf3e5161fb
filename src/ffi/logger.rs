//! The C ABI's logger: C and Paddle hosts have no Rust logger, so on the first call through
//! the C ABI the library installs this one, which writes the library's records to stderr as
//! `dmabuf-rt: <message>` (a refused call: `dmabuf-rt: <function>: <why>`).
//!
//! It is not installed when the host process already installed a logger (a Rust program
//! linking the library, or another Rust library in the process that did), nor when
//! `DMABUF_RT_LOG=off`. `DMABUF_RT_LOG` (`off`, `error`, `warn`, `info`, `debug`, `trace`;
//! default `warn`) sets the level, read once, at that first call.

use std::io::Write;
use std::sync::Once;

use log::{Level, LevelFilter, Log, Metadata, Record};

/// The environment variable that sets the level.
pub(crate) const LOG_ENV: &str = "DMABUF_RT_LOG";

/// Writes the library's own records (targets under `dmabuf_rt`) to stderr, one line each.
#[derive(Debug)]
struct StderrLogger;

static LOGGER: StderrLogger = StderrLogger;
static INSTALL: Once = Once::new();

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level() && is_ours(metadata.target())
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        // One write per line, so that lines from several threads do not interleave.
        let line = match record.level() {
            Level::Error | Level::Warn => format!("dmabuf-rt: {}\n", record.args()),
            level => {
                format!("dmabuf-rt: {} {}: {}\n", level.as_str().to_ascii_lowercase(), record.target(), record.args())
            }
        };
        let _ = std::io::stderr().write_all(line.as_bytes());
    }

    fn flush(&self) {
        let _ = std::io::stderr().flush();
    }
}

/// Whether a record's target is this library (not one of its dependencies).
fn is_ours(target: &str) -> bool {
    target == "dmabuf_rt" || target.starts_with("dmabuf_rt::")
}

/// Installs the logger once per process, unless `DMABUF_RT_LOG=off` or the host has its own.
/// Cheap after the first call (one atomic load): every C function calls it.
pub(crate) fn install() {
    INSTALL.call_once(|| {
        let level = level_from(std::env::var(LOG_ENV).ok().as_deref());
        if level == LevelFilter::Off {
            return;
        }
        // An error means the host installed a logger first: its logger and its level stand.
        if log::set_logger(&LOGGER).is_ok() {
            log::set_max_level(level);
        }
    });
}

/// The level `DMABUF_RT_LOG` asks for: `off`, `error`, `warn`, `info`, `debug` or `trace`
/// (any case); unset, empty or anything else is `warn`.
fn level_from(value: Option<&str>) -> LevelFilter {
    match value.map(str::trim) {
        Some(v) if !v.is_empty() => v.parse().unwrap_or(LevelFilter::Warn),
        _ => LevelFilter::Warn,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_come_from_dmabuf_rt_log() {
        assert_eq!(level_from(None), LevelFilter::Warn);
        assert_eq!(level_from(Some("")), LevelFilter::Warn);
        assert_eq!(level_from(Some("off")), LevelFilter::Off);
        assert_eq!(level_from(Some("OFF")), LevelFilter::Off);
        assert_eq!(level_from(Some("error")), LevelFilter::Error);
        assert_eq!(level_from(Some(" info ")), LevelFilter::Info);
        assert_eq!(level_from(Some("debug")), LevelFilter::Debug);
        assert_eq!(level_from(Some("trace")), LevelFilter::Trace);
        assert_eq!(level_from(Some("loud")), LevelFilter::Warn);
    }

    #[test]
    fn only_the_library_s_own_records() {
        assert!(is_ours("dmabuf_rt"));
        assert!(is_ours("dmabuf_rt::ffi"));
        assert!(!is_ours("dmabuf_rtx"));
        assert!(!is_ours("io_uring"));
    }
}
