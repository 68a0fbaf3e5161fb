//! The C ABI: the library's own C API ([`capi`], declared in `include/dmabuf_rt.h`) and the
//! PaddlePaddle custom-runtime plugin ([`paddle`]). Both are thin layers over
//! [`runtime`] (a list of [`crate::Device`]s configured from `DMABUF_RT_*`): they check every
//! pointer and handle, call the runtime, and turn errors into status codes. A failure's reason
//! is logged (target `dmabuf_rt::ffi`; without a host logger, a small built-in one writes
//! `dmabuf-rt: <function>: <why>` on stderr) and kept for the calling thread
//! (`dmabuf_rt_last_error`). A panic never crosses the
//! boundary: it becomes an error status.

#![allow(unsafe_code)]

pub mod capi;
mod lent;
mod logger;
pub mod paddle;
pub mod runtime;

use std::cell::RefCell;
use std::ffi::CString;

use crate::error::{Error, Result};

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Records and logs why `func` failed.
pub(crate) fn report(func: &str, e: &Error) {
    let msg = format!("{func}: {e}");
    log::warn!(target: "dmabuf_rt::ffi", "{msg}");
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // The thread-local may be gone while the thread exits (a framework finalizing): then
    // only the log line remains.
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = Some(c));
}

/// The calling thread's last error message, if any, as a C string owned by the thread (valid
/// until its next failing call).
pub(crate) fn last_error() -> *const std::ffi::c_char {
    LAST_ERROR.try_with(|l| l.borrow().as_ref().map_or(std::ptr::null(), |c| c.as_ptr())).unwrap_or(std::ptr::null())
}

/// Runs `f` for the C function `func`: a panic becomes an error, and an error is reported.
pub(crate) fn run<T>(func: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    logger::install();
    let r = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let why = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::OperationFailed { reason: format!("internal error (panic): {why}").into() })
        }
    };
    if let Err(e) = &r {
        report(func, e);
    }
    r
}

/// An error for a null pointer argument.
pub(crate) fn null(what: &'static str) -> Error {
    Error::UnknownPointer { what, ptr: 0, expected: "a non-null pointer", why: String::new() }
}

/// Checks an out-pointer: not NULL and aligned for `T`.
pub(crate) fn out<T>(p: *mut T, what: &'static str) -> Result<*mut T> {
    if p.is_null() {
        return Err(null(what));
    }
    if !p.is_aligned() {
        return Err(Error::UnknownPointer {
            what,
            ptr: p as usize,
            expected: "aligned for its type",
            why: String::new(),
        });
    }
    Ok(p)
}

/// Stores `v` through an out-pointer checked by [`out`].
///
/// # Safety
/// `p` must be valid for a write of `T` (the C caller's contract for out-pointers).
pub(crate) unsafe fn store<T>(p: *mut T, v: T) {
    // SAFETY: `p` is non-null and aligned (checked by `out`), and valid for writes by the
    // caller's contract.
    unsafe { p.write(v) }
}
