//! `include/dmabuf_rt.h` is what cbindgen generates from `src/ffi/capi/` (its `mod.rs` and the files it declares) with `cbindgen.toml`,
//! byte for byte. `DMABUF_RT_BLESS=1 cargo test --test header` rewrites it.
//!
//! The inputs are compiled in (`include_str!`), and cbindgen reads them from a temporary
//! directory, so this test also runs where the source tree is absent (the kernel lane's
//! guest). Only the C API's files are parsed: the C API is declared there alone, and cbindgen need not
//! understand the rest of the crate.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The C API's files, as they lie under `src/ffi/capi/`.
const CAPI: &[(&str, &str)] = &[
    ("mod.rs", include_str!("../src/ffi/capi/mod.rs")),
    ("device.rs", include_str!("../src/ffi/capi/device.rs")),
    ("ipc.rs", include_str!("../src/ffi/capi/ipc.rs")),
    ("stats.rs", include_str!("../src/ffi/capi/stats.rs")),
    ("stream.rs", include_str!("../src/ffi/capi/stream.rs")),
    ("synced.rs", include_str!("../src/ffi/capi/synced.rs")),
];
const CONFIG: &str = include_str!("../cbindgen.toml");
const HEADER: &str = include_str!("../include/dmabuf_rt.h");
const HEADER_PATH: &str = "include/dmabuf_rt.h";
const BLESS_ENV: &str = "DMABUF_RT_BLESS";

fn generate() -> String {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("dmabuf-rt-header-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    let (src, cfg) = (dir.join("mod.rs"), dir.join("cbindgen.toml"));
    for (name, text) in CAPI {
        std::fs::write(dir.join(name), text).unwrap_or_else(|e| panic!("write {name}: {e}"));
    }
    std::fs::write(&cfg, CONFIG).expect("write cbindgen.toml");
    let config = cbindgen::Config::from_file(&cfg).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(&src)
        .generate()
        .expect("cbindgen cannot parse the C API");
    let mut out = Vec::new();
    bindings.write(&mut out);
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8(out).expect("cbindgen wrote UTF-8")
}

/// The first line where `a` and `b` differ, for the failure message.
fn first_difference(a: &str, b: &str) -> String {
    for (i, (x, y)) in a.lines().zip(b.lines()).enumerate() {
        if x != y {
            return format!("line {}:\n  checked in: {x}\n  generated:  {y}", i + 1);
        }
    }
    format!("the checked-in header has {} lines, the generated one {}", a.lines().count(), b.lines().count())
}

#[test]
fn header_is_current() {
    let generated = generate();
    if std::env::var(BLESS_ENV).as_deref() == Ok("1") {
        let path: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join(HEADER_PATH);
        std::fs::write(&path, &generated).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        eprintln!("wrote {}", path.display());
        return;
    }
    assert!(
        generated == HEADER,
        "{HEADER_PATH} is not what cbindgen generates from src/ffi/capi/ ({}).\n\
         Regenerate it with:\n    {BLESS_ENV}=1 cargo test --test header\nand commit it.",
        first_difference(HEADER, &generated)
    );
}

#[test]
fn header_declares_the_whole_api() {
    // Every exported function of the C API's files appears in the header (a guard against a
    // cbindgen setting, or a file left out of `CAPI`, that silently drops items).
    let exported: Vec<&str> = CAPI
        .iter()
        .flat_map(|(_, text)| text.lines())
        .filter_map(|l| l.split("extern \"C\" fn ").nth(1))
        .filter_map(|rest| rest.split('(').next())
        .filter(|name| name.starts_with("dmabuf_rt_"))
        .collect();
    assert!(exported.len() >= 30, "found only {} exported functions in src/ffi/capi/", exported.len());
    let header = generate();
    for name in exported {
        let declared = [" ", "*"].iter().any(|before| header.contains(&format!("{before}{name}(")));
        assert!(declared, "{name} is missing from the generated header");
    }
}

#[test]
fn header_compiles_as_c11_and_cxx() {
    // A C name clash (a function and a type of one name are fine in Rust, not in C) or a type
    // cbindgen cannot express shows here, before examples/c/run. Without a compiler (the
    // kernel lane's guest) there is nothing to check.
    let dir = std::env::temp_dir().join(format!("dmabuf-rt-header-cc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    // What cbindgen generates (equal to the checked-in header unless blessing).
    std::fs::write(dir.join("dmabuf_rt.h"), generate()).expect("write header");
    std::fs::write(dir.join("t.c"), "#include \"dmabuf_rt.h\"\nint main(void) { return dmabuf_rt_version() == 0; }\n")
        .expect("write t.c");
    for (cc, args) in [
        ("cc", &["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-fsyntax-only", "-x", "c", "t.c"][..]),
        ("c++", &["-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-x", "c++", "t.c"][..]),
    ] {
        match std::process::Command::new(cc).args(args).current_dir(&dir).output() {
            // Straight to stderr, past libtest's capture, as the other tests' skips.
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "SKIP header_compiles_as_c11_and_cxx: no `{cc}`: {e}");
            }
            Ok(o) => assert!(
                o.status.success(),
                "{HEADER_PATH} does not compile with `{cc} {}`:\n{}",
                args.join(" "),
                String::from_utf8_lossy(&o.stderr)
            ),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
