//! Model checks live in `tests/`; run them with `loom-tests/run`. This library holds what they
//! share.

/// `loom::model`, but with `DMABUF_RT_LOOM_ABORT_ON_PANIC` set (`loom-tests/weakened`) the first
/// panic aborts the process after printing its message. A weakened ordering can make the code free a
/// node twice for real: unwinding from loom's report ran the drain's drop over the garbage, and
/// the SIGSEGV met the signal handler of loom's coroutines, which allocates and deadlocked in
/// malloc (a CI run hung for 75 minutes).
#[cfg(loom)]
pub fn model<F>(f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    static HOOK: std::sync::Once = std::sync::Once::new();
    if std::env::var_os("DMABUF_RT_LOOM_ABORT_ON_PANIC").is_some() {
        HOOK.call_once(|| {
            std::panic::set_hook(Box::new(|info| {
                // Straight to stderr: the test harness's capture would go with the process.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "loom model failed: {info}");
                std::process::abort();
            }));
        });
    }
    loom::model(f)
}
