//! Streams (a C stream is a [`crate::queue::Queue`]) and events.

use super::*;

// ---- streams ----

/// Creates a stream on `device` and stores its handle in `*stream`.
///
/// # Safety
/// `stream` must be NULL (refused) or valid for writing a `dmabuf_rt_stream`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_stream_create(device: c_int, stream: *mut dmabuf_rt_stream) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_create", || {
        let stream = out(stream, "stream")?;
        let rt = rt()?;
        let h = rt.create_stream(device_id(rt, device)?)?;
        // SAFETY: the caller's contract for `stream`.
        unsafe { store(stream, h as dmabuf_rt_stream) };
        Ok(())
    })
}

/// Destroys a stream after the work submitted to it has run (returning that work's failure,
/// if any). Called from a stream callback (of this stream or another) it returns at once, as
/// `cudaStreamDestroy` does, and the stream finishes its work on its own. The handle is never
/// valid again: a second destroy, or any use, is `DMABUF_RT_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_stream_destroy(stream: dmabuf_rt_stream) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_destroy", || rt()?.destroy_stream(handle(stream)))
}

/// Waits until everything submitted to the stream has run; returns `DMABUF_RT_FAILED` if any
/// of it failed (a failed operation fails the later ones on its stream too).
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_stream_synchronize(stream: dmabuf_rt_stream) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_synchronize", || rt()?.synchronize_stream(handle(stream)))
}

/// Stores in `*done` whether the stream has run everything submitted to it, without waiting;
/// `DMABUF_RT_FAILED` if some of it failed.
///
/// # Safety
/// `done` must be NULL (refused) or valid for writing a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_stream_query(stream: dmabuf_rt_stream, done: *mut bool) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_query", || {
        let done = out(done, "done")?;
        let d = rt()?.query_stream(handle(stream))?;
        // SAFETY: the caller's contract for `done`.
        unsafe { store(done, d) };
        Ok(())
    })
}

/// Queues a call of `callback(stream, status, user_data)` on the stream, after the work
/// submitted before it; `status` is `DMABUF_RT_OK`, or the failure of earlier work on the
/// stream. If this returns `DMABUF_RT_OK` the callback is called exactly once, on the
/// stream's own thread (destroying the stream runs it first); otherwise never. A NULL
/// callback is refused. The callback must not block for long (the stream waits for it) and
/// must not synchronize or destroy its own stream.
///
/// # Safety
/// `callback` must be safe to call from another thread with `user_data`, at any time until it
/// has run; the library only passes `user_data` back, never dereferences it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_stream_add_callback(
    stream: dmabuf_rt_stream,
    callback: dmabuf_rt_callback,
    user_data: *mut c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_add_callback", || {
        let f = callback.ok_or_else(|| null("callback"))?;
        let cb = CCallback { f, stream, user_data };
        rt()?.stream_add_callback(handle(stream), move |r| {
            let status = match &r {
                Ok(()) => S::DMABUF_RT_OK,
                Err(e) => status_of(e),
            };
            cb.call(status);
        })
    })
}

/// Makes the stream wait, before its later work, until the event's latest record (at the
/// time of this call) has completed. An event never recorded is complete.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_stream_wait_event(stream: dmabuf_rt_stream, event: dmabuf_rt_event) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_wait_event", || rt()?.stream_wait_event(handle(stream), handle(event)))
}

// ---- events ----

/// Creates an event (complete until first recorded) and stores its handle in `*event`.
///
/// # Safety
/// `event` must be NULL (refused) or valid for writing a `dmabuf_rt_event`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_event_create(event: *mut dmabuf_rt_event) -> dmabuf_rt_status {
    call("dmabuf_rt_event_create", || {
        let event = out(event, "event")?;
        let h = rt()?.create_event();
        // SAFETY: the caller's contract for `event`.
        unsafe { store(event, h as dmabuf_rt_event) };
        Ok(())
    })
}

/// Records the event at the current end of `stream`: it completes when the stream has run
/// the work submitted before. With `stream` 0 it is recorded on the current device's own
/// stream, which only runs synchronous work, so it completes at once.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_event_record(event: dmabuf_rt_event, stream: dmabuf_rt_stream) -> dmabuf_rt_status {
    call("dmabuf_rt_event_record", || {
        let rt = rt()?;
        let stream = if stream == 0 { None } else { Some(handle(stream)) };
        rt.record_event(rt.current(), stream, handle(event))
    })
}

/// Stores in `*done` whether the event's latest record has completed, without waiting;
/// `DMABUF_RT_FAILED` if the work before it failed.
///
/// # Safety
/// `done` must be NULL (refused) or valid for writing a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_event_query(event: dmabuf_rt_event, done: *mut bool) -> dmabuf_rt_status {
    call("dmabuf_rt_event_query", || {
        let done = out(done, "done")?;
        let d = rt()?.query_event(handle(event))?;
        // SAFETY: the caller's contract for `done`.
        unsafe { store(done, d) };
        Ok(())
    })
}

/// Waits until the event's latest record has completed; `DMABUF_RT_FAILED` if the work
/// before it failed.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_event_synchronize(event: dmabuf_rt_event) -> dmabuf_rt_status {
    call("dmabuf_rt_event_synchronize", || rt()?.synchronize_event(handle(event)))
}

/// Destroys an event (streams already waiting on it still wait). The handle is never valid
/// again: a second destroy, or any use, is `DMABUF_RT_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_event_destroy(event: dmabuf_rt_event) -> dmabuf_rt_status {
    call("dmabuf_rt_event_destroy", || rt()?.destroy_event(handle(event)))
}

/// Stores in `*ms` the milliseconds from the completion of `start`'s latest record to that
/// of `end`'s (as `cudaEventElapsedTime`). Both must have been recorded and have completed:
/// otherwise `DMABUF_RT_INVALID_ARGUMENT`, naming which.
///
/// # Safety
/// `ms` must be NULL (refused) or valid for writing a `float`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_event_elapsed_time(
    ms: *mut f32,
    start: dmabuf_rt_event,
    end: dmabuf_rt_event,
) -> dmabuf_rt_status {
    call("dmabuf_rt_event_elapsed_time", || {
        let ms = out(ms, "ms")?;
        let v = rt()?.event_elapsed_ms(handle(start), handle(end))?;
        // SAFETY: the caller's contract for `ms`.
        unsafe { store(ms, v) };
        Ok(())
    })
}
