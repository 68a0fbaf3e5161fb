//! The command line's inputs and outputs: traces and snapshots read with a bound, standard
//! output written with its errors reported, SVG files replaced whole or not at all, and an
//! output that is its own input refused.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The largest input (trace or snapshot) read: 1 GiB. Larger ones, and endless ones, are
/// refused instead of read until memory runs out.
pub(crate) const MAX_INPUT: u64 = 1 << 30;

/// Reads the JSON text at `path` (`-`: standard input), at most [`MAX_INPUT`] bytes. A byte
/// that JSON text never holds (a control character other than tab, line feed and carriage
/// return) is refused as soon as it is read, so a device like `/dev/zero` is refused at its
/// first byte. Errors name the input.
pub(crate) fn read_input(path: &Path) -> Result<String, String> {
    let name = if path == Path::new("-") { "standard input".to_string() } else { path.display().to_string() };
    let mut buf = Vec::new();
    if path == Path::new("-") {
        read_bounded(std::io::stdin().lock(), &mut buf)
    } else {
        let f = std::fs::File::open(path).map_err(|e| format!("{name}: {e}"))?;
        // A regular file's size is known: one larger than the bound is refused unread.
        match f.metadata() {
            Ok(m) if m.is_file() && m.len() > MAX_INPUT => Err(too_large()),
            Ok(m) if m.is_file() => {
                buf.reserve(usize::try_from(m.len()).unwrap_or(0));
                read_bounded(f, &mut buf)
            }
            _ => read_bounded(f, &mut buf),
        }
    }
    .map_err(|e| format!("{name}: {e}"))?;
    String::from_utf8(buf).map_err(|e| format!("{name}: not UTF-8 text (at byte {})", e.utf8_error().valid_up_to()))
}

fn too_large() -> String {
    format!("larger than {MAX_INPUT} bytes (1 GiB), the most this tool reads")
}

/// Reads `r` to its end into `buf`, refusing more than [`MAX_INPUT`] bytes and any byte JSON
/// text cannot hold.
fn read_bounded(r: impl Read, buf: &mut Vec<u8>) -> Result<(), String> {
    let mut r = r.take(MAX_INPUT + 1);
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        let n = match r.read(&mut chunk) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        };
        let got = &chunk[..n];
        if let Some(k) = got.iter().position(|&b| b < 0x20 && !matches!(b, b'\t' | b'\n' | b'\r')) {
            return Err(format!(
                "byte {} is the control character {:#04x}, which JSON text never holds",
                buf.len() + k,
                got[k]
            ));
        }
        if (buf.len() + n) as u64 > MAX_INPUT {
            return Err(too_large());
        }
        buf.extend_from_slice(got);
    }
}

/// Writes `bytes` to standard output and flushes it; a write that fails (a full device, a
/// closed pipe) is an error naming standard output.
pub(crate) fn write_stdout(bytes: &[u8]) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes).and_then(|()| out.flush()).map_err(|e| format!("standard output: {e}"))
}

/// Writes `bytes` as the file `path`, whole or not at all: into a temporary file in the same
/// directory, synced, then renamed over `path`. On an error the temporary is removed, and a
/// file that was at `path` is as it was.
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let name = path.display();
    let file_name = path.file_name().ok_or_else(|| format!("{name}: not a file name"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp_name = OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = dir.join(tmp_name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| format!("{name}: cannot create the temporary {}: {e}", tmp.display()))?;
    let written = f.write_all(bytes).and_then(|()| f.sync_all()).and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("{name}: {e}")
    })
}

/// Refuses an output that is the same file as the input (by device and inode): the input
/// would be replaced by its picture. An output that does not exist yet, and `-` on either
/// side, are fine.
pub(crate) fn refuse_same_file(input: &Path, output: &Path) -> Result<(), String> {
    if input == Path::new("-") || output == Path::new("-") {
        return Ok(());
    }
    match (std::fs::metadata(input), std::fs::metadata(output)) {
        (Ok(i), Ok(o)) if (i.dev(), i.ino()) == (o.dev(), o.ino()) => Err(format!(
            "the output {} is the input {} itself: refusing to replace it",
            output.display(),
            input.display()
        )),
        _ => Ok(()),
    }
}

/// The value after flag `flag` as text: missing, or not UTF-8, is an error naming the flag
/// (`want` says what it takes).
pub(crate) fn text_value<'a>(value: Option<&'a OsString>, flag: &str, want: &str) -> Result<&'a str, String> {
    let v = value.ok_or_else(|| format!("{flag} takes {want}"))?;
    v.to_str().ok_or_else(|| format!("{flag} takes {want}, not {v:?} (not UTF-8)"))
}

/// `args` as UTF-8 strings, for the commands that take only text.
pub(crate) fn utf8_args(args: &[OsString]) -> Result<Vec<String>, String> {
    args.iter().map(|a| a.to_str().map(str::to_string).ok_or_else(|| format!("argument {a:?} is not UTF-8"))).collect()
}
