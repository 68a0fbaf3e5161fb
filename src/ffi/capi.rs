//! The library's own C API (see `include/dmabuf_rt.h`).

use std::ffi::c_char;

/// The calling thread's last error message (NULL if none): valid until the thread's next
/// failing call.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_last_error() -> *const c_char {
    super::last_error()
}
