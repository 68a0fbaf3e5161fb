#![allow(unsafe_code)]
//! Hostile review of issue 13 through the C ABI: `dmabuf_rt_record_stream`, then the free,
//! then the stream's destroy (and the other orders), from four threads sharing streams that
//! other threads destroy and replace. Every free must complete once the devices synchronize.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

fn stats(device: i32) -> dmabuf_rt_stats {
    let mut s = dmabuf_rt_stats::default();
    // SAFETY: `s` is a valid out-pointer.
    assert_eq!(unsafe { dmabuf_rt_device_stats(device, &mut s) }, DMABUF_RT_OK);
    s
}

fn new_stream(device: i32) -> dmabuf_rt_stream {
    let mut s = 0;
    // SAFETY: `s` is a valid out-pointer.
    assert_eq!(unsafe { dmabuf_rt_stream_create(device, &mut s) }, DMABUF_RT_OK);
    s
}

fn alloc(device: i32, size: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: `p` is a valid out-pointer.
    assert_eq!(unsafe { dmabuf_rt_device_alloc(device, size, &mut p) }, DMABUF_RT_OK);
    p
}

static RECORDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[test]
fn record_stream_free_and_destroy_in_every_order_from_four_threads() {
    // SAFETY: this binary has one test; nothing reads the environment concurrently.
    unsafe { std::env::set_var("DMABUF_RT_DEVICES", "shmem,shmem") };
    // SAFETY: as above.
    unsafe { std::env::set_var("DMABUF_RT_CAPACITY", "256M") };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let streams: Arc<Mutex<Vec<dmabuf_rt_stream>>> =
            Arc::new(Mutex::new((0..4).map(|i| new_stream(i % 2)).collect()));
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let streams = Arc::clone(&streams);
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t;
                    let mut rnd = move |n: u64| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x % n
                    };
                    for _ in 0..600 {
                        let size = [512usize, 4096, 65536][rnd(3) as usize];
                        let (p, q) = (alloc(0, size), alloc(1, size));
                        let slot = rnd(4) as usize;
                        let s = streams.lock().unwrap()[slot];
                        // Work on the stream that reads p and writes q (the stream may be
                        // destroyed by another thread meanwhile: then the calls are refused).
                        // SAFETY: both are live device allocations of `size` bytes.
                        let c = unsafe { dmabuf_rt_memcpy(1, q, 0, p, size, DMABUF_RT_MEMCPY_PEER_TO_PEER, s) };
                        if c == DMABUF_RT_OK && dmabuf_rt_record_stream(0, p, s) == DMABUF_RT_OK {
                            RECORDED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        let _ = dmabuf_rt_record_stream(1, q, s);
                        match rnd(3) {
                            0 => {
                                assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
                                assert_eq!(dmabuf_rt_device_free(1, q), DMABUF_RT_OK);
                            }
                            1 => {
                                // Replace the stream: destroy it between the record and the free.
                                let fresh = new_stream((t % 2) as i32);
                                let old = std::mem::replace(&mut streams.lock().unwrap()[slot], fresh);
                                let _ = dmabuf_rt_stream_destroy(old);
                                assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
                                assert_eq!(dmabuf_rt_device_free(1, q), DMABUF_RT_OK);
                            }
                            _ => {
                                assert_eq!(dmabuf_rt_device_free(1, q), DMABUF_RT_OK);
                                let fresh = new_stream((t % 2) as i32);
                                let old = std::mem::replace(&mut streams.lock().unwrap()[slot], fresh);
                                assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
                                let _ = dmabuf_rt_stream_destroy(old);
                            }
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        for s in std::mem::take(&mut *streams.lock().unwrap()) {
            assert_eq!(dmabuf_rt_stream_destroy(s), DMABUF_RT_OK);
        }
        for d in 0..2 {
            assert_eq!(dmabuf_rt_device_synchronize(d), DMABUF_RT_OK);
            let s = stats(d);
            assert_eq!(s.allocations, 0, "device {d}: live allocations left");
            assert_eq!(s.num_allocs, s.num_frees, "device {d}: frees that never completed");
        }
        assert!(RECORDED.load(std::sync::atomic::Ordering::Relaxed) > 1000, "most copies and records went through");
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(180)).expect("hung");
}
