//! The Paddle plugin's C ABI driven the way Paddle drives it, through the function pointers
//! `InitPlugin` fills: good calls work, and bad input (null out-pointers, size 0, foreign and
//! double frees, out-of-range devices, null copy pointers, stale handles, a size mismatch, an
//! allocation over the capacity) gets an error status or Paddle's out-of-memory answer, never a
//! crash, and leaves the allocator working.

#![allow(unsafe_code, reason = "this test drives the C ABI through raw function pointers")]
#![allow(
    clippy::multiple_unsafe_ops_per_block,
    reason = "every call in a block goes through the plugin's function pointers under one contract, stated once"
)]

mod common;

use std::ffi::{CStr, c_void};
use std::ptr::null_mut;
use std::sync::Once;

use dmabuf_rt::ffi::paddle::{
    C_ERROR, C_FAILED, C_SUCCESS, CDeviceInterface, CDeviceSt, CustomRuntimeParams, CustomRuntimeVersion, InitPlugin,
    PARAMS_SIZE,
};

const CAPACITY: usize = 256 << 20;

fn setup() {
    static ENV: Once = Once::new();
    ENV.call_once(|| {
        // SAFETY: runs first in every test, before anything in this process reads the
        // environment or starts a thread that could (the Once orders the tests' threads).
        unsafe {
            std::env::set_var("DMABUF_RT_DEVICES", "shmem,shmem");
            std::env::set_var("DMABUF_RT_CAPACITY", "256M");
        }
    });
}

/// The tests share one process-wide runtime and check its stats: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Paddle's side: a zeroed interface and params, filled by `InitPlugin`.
fn plugin() -> Box<CDeviceInterface> {
    setup();
    let (iface, params) = common::capi::paddle_plugin();
    assert_eq!((params.version.major, params.version.minor, params.version.patch), (0, 1, 1));
    // SAFETY: InitPlugin points it at a static NUL-terminated string.
    assert_eq!(unsafe { CStr::from_ptr(params.device_type) }.to_str().unwrap(), "dmabuf");
    assert!(params.pir_default_passes.is_null(), "must stay NULL: Paddle reads it as a C++ vector");
    iface
}

#[test]
fn init_plugin_fills_what_paddle_requires_and_refuses_bad_params() {
    let _serial = serial();
    let i = plugin();
    for (name, set) in [
        ("set_device", i.set_device.is_some()),
        ("get_device", i.get_device.is_some()),
        ("create_event", i.create_event.is_some()),
        ("record_event", i.record_event.is_some()),
        ("destroy_event", i.destroy_event.is_some()),
        ("synchronize_event", i.synchronize_event.is_some()),
        ("device_memory_allocate", i.device_memory_allocate.is_some()),
        ("device_memory_deallocate", i.device_memory_deallocate.is_some()),
        ("get_device_count", i.get_device_count.is_some()),
        ("get_device_list", i.get_device_list.is_some()),
        ("memory_copy_h2d", i.memory_copy_h2d.is_some()),
        ("memory_copy_d2h", i.memory_copy_d2h.is_some()),
        ("synchronize_device", i.synchronize_device.is_some()),
    ] {
        assert!(set, "{name} is NULL");
    }
    // A NULL params, or an interface from an older Paddle, is left untouched.
    // SAFETY: NULL is allowed.
    unsafe { InitPlugin(null_mut()) };
    // SAFETY: zeroed interface, valid params.
    let mut small: Box<CDeviceInterface> = Box::new(unsafe { std::mem::zeroed() });
    small.size = 512;
    let mut params = CustomRuntimeParams {
        size: PARAMS_SIZE,
        interface: &mut *small,
        version: CustomRuntimeVersion { major: 0, minor: 0, patch: 0 },
        device_type: std::ptr::null(),
        sub_device_type: std::ptr::null(),
        pir_default_passes: null_mut(),
        reserved: [0; 32],
    };
    // SAFETY: valid pointers.
    unsafe { InitPlugin(&mut params) };
    assert!(small.set_device.is_none() && params.device_type.is_null());
}

#[test]
fn memory_copies_streams_and_events_work_like_paddle_uses_them() {
    let _serial = serial();
    let i = plugin();
    let mut dev0 = CDeviceSt { id: 0 };
    let mut dev1 = CDeviceSt { id: 1 };
    // SAFETY: (the whole block) the function pointers are the plugin's; every pointer passed is
    // valid for what the interface says it is used for.
    unsafe {
        let mut n = 0usize;
        assert_eq!(i.get_device_count.unwrap()(&mut n), C_SUCCESS);
        assert_eq!(n, 2);
        let mut list = [9usize; 2];
        assert_eq!(i.get_device_list.unwrap()(list.as_mut_ptr()), C_SUCCESS);
        assert_eq!(list, [0, 1]);
        assert_eq!(i.set_device.unwrap()(&mut dev1), C_SUCCESS);
        let mut got = CDeviceSt { id: -1 };
        assert_eq!(i.get_device.unwrap()(&mut got), C_SUCCESS);
        assert_eq!(got.id, 1);

        let len = 3 << 20;
        let src: Vec<u8> = (0..len).map(|b| (b * 7 % 251) as u8).collect();
        let (mut a, mut b): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut a, len), C_SUCCESS);
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev1, &mut b, len), C_SUCCESS);
        assert!(!a.is_null() && !b.is_null());
        assert_eq!(a as usize % 512, 0, "tensor pointers are 512-aligned");
        // h2d into the middle of the block (Paddle sub-allocates), p2p, then d2h.
        let mid = a.cast::<u8>().add(4096).cast::<c_void>();
        assert_eq!(i.memory_copy_h2d.unwrap()(&mut dev0, mid, src.as_ptr().cast(), len - 4096), C_SUCCESS);
        assert_eq!(i.memory_copy_p2p.unwrap()(&mut dev1, &mut dev0, b, a, len), C_SUCCESS);
        let mut out = vec![0u8; len];
        assert_eq!(i.memory_copy_d2h.unwrap()(&mut dev1, out.as_mut_ptr().cast(), b, len), C_SUCCESS);
        assert_eq!(&out[4096..], &src[..len - 4096]);

        // The same on a stream, with an event and a callback.
        let mut s = null_mut();
        assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s), C_SUCCESS);
        assert_eq!(i.device_memory_set.unwrap()(&mut dev0, a, 0x5a, len), C_SUCCESS);
        let mut out2 = vec![0u8; len];
        assert_eq!(i.async_memory_copy_h2d.unwrap()(&mut dev0, s, a, src.as_ptr().cast(), len), C_SUCCESS);
        assert_eq!(i.async_memory_copy_d2d.unwrap()(&mut dev0, s, a, a, 0), C_SUCCESS);
        assert_eq!(i.async_memory_copy_d2h.unwrap()(&mut dev0, s, out2.as_mut_ptr().cast(), a, len), C_SUCCESS);
        unsafe extern "C" fn count(_: *mut CDeviceSt, _: *mut c_void, user: *mut c_void, st: *mut i32) {
            // SAFETY: the test passes a live AtomicUsize and the plugin a valid status.
            unsafe {
                (*user.cast::<std::sync::atomic::AtomicUsize>()).fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                assert_eq!(*st, C_SUCCESS);
            }
        }
        let calls = std::sync::atomic::AtomicUsize::new(0);
        assert_eq!(
            i.stream_add_callback.unwrap()(
                &mut dev0,
                s,
                Some(count),
                (&calls as *const std::sync::atomic::AtomicUsize).cast_mut().cast()
            ),
            C_SUCCESS
        );
        let mut e = null_mut();
        assert_eq!(i.create_event.unwrap()(&mut dev0, &mut e), C_SUCCESS);
        assert_eq!(i.record_event.unwrap()(&mut dev0, s, e), C_SUCCESS);
        assert_eq!(i.synchronize_event.unwrap()(&mut dev0, e), C_SUCCESS);
        assert_eq!(i.query_event.unwrap()(&mut dev0, e), C_SUCCESS);
        assert_eq!(i.synchronize_stream.unwrap()(&mut dev0, s), C_SUCCESS);
        assert_eq!(i.query_stream.unwrap()(&mut dev0, s), C_SUCCESS);
        assert_eq!(out2, src);
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(i.destroy_event.unwrap()(&mut dev0, e), C_SUCCESS);
        assert_eq!(i.destroy_stream.unwrap()(&mut dev0, s), C_SUCCESS);

        let (mut total, mut free) = (0usize, 0usize);
        assert_eq!(i.device_memory_stats.unwrap()(&mut dev0, &mut total, &mut free), C_SUCCESS);
        assert_eq!(total, CAPACITY);
        assert!(free < total);
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, a, len), C_SUCCESS);
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev1, b, len), C_SUCCESS);

        let (mut h, mut u) = (null_mut(), null_mut());
        assert_eq!(i.host_memory_allocate.unwrap()(&mut dev0, &mut h, 1000), C_SUCCESS);
        assert_eq!(i.unified_memory_allocate.unwrap()(&mut dev0, &mut u, 1000), C_SUCCESS);
        assert_eq!(i.memory_copy_h2d.unwrap()(&mut dev0, u, h, 0), C_SUCCESS);
        assert_eq!(i.host_memory_deallocate.unwrap()(&mut dev0, h, 1000), C_SUCCESS);
        assert_eq!(i.unified_memory_deallocate.unwrap()(&mut dev0, u, 1000), C_SUCCESS);
    }
}

#[test]
fn bad_input_gets_an_error_status_and_the_allocator_keeps_working() {
    let _serial = serial();
    let i = plugin();
    let mut dev0 = CDeviceSt { id: 0 };
    let mut bad_dev = CDeviceSt { id: 7 };
    let mut neg_dev = CDeviceSt { id: -1 };
    // SAFETY: (the whole block) the plugin's function pointers; the bad pointers are the point,
    // and the plugin must check them before use.
    unsafe {
        let mut p: *mut c_void = null_mut();
        let mut local = [0u8; 64];
        // Null out-pointers.
        assert_eq!(i.get_device_count.unwrap()(null_mut()), C_ERROR);
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, null_mut(), 4096), C_ERROR);
        assert_eq!(i.create_stream.unwrap()(&mut dev0, null_mut()), C_ERROR);
        assert_eq!(i.create_event.unwrap()(&mut dev0, null_mut()), C_ERROR);
        assert_eq!(i.get_device.unwrap()(null_mut()), C_ERROR);
        // Size 0.
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut p, 0), C_ERROR);
        // Out-of-range and negative devices.
        assert_eq!(i.set_device.unwrap()(&mut bad_dev), C_ERROR);
        assert_eq!(i.set_device.unwrap()(&mut neg_dev), C_ERROR);
        assert_eq!(i.device_memory_allocate.unwrap()(&mut bad_dev, &mut p, 4096), C_ERROR);
        // Every size hint names a device: an out-of-range one is refused (issue 9, defect 12:
        // they answered for any id), and the out-value is left alone.
        let hints = [
            ("min_chunk", i.device_min_chunk_size),
            ("max_chunk", i.device_max_chunk_size),
            ("max_alloc", i.device_max_alloc_size),
            ("extra_padding", i.device_extra_padding_size),
            ("init_alloc", i.device_init_alloc_size),
            ("realloc", i.device_realloc_size),
        ];
        for (name, f) in hints {
            let mut v = 12345usize;
            assert_eq!(f.unwrap()(&mut bad_dev, &mut v), C_ERROR, "{name} for device 7");
            assert_eq!(f.unwrap()(&mut neg_dev, &mut v), C_ERROR, "{name} for device -1");
            assert_eq!(v, 12345, "{name} wrote its out-value on a refusal");
            assert_eq!(f.unwrap()(&mut dev0, &mut v), C_SUCCESS, "{name} for device 0");
        }
        // Frees of pointers we never gave, twice, or with the wrong size.
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, local.as_mut_ptr().cast(), 64), C_ERROR);
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, null_mut(), 64), C_ERROR);
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut p, 4096), C_SUCCESS);
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, p, 4000), C_ERROR, "size mismatch");
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, p, 4096), C_SUCCESS);
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, p, 4096), C_ERROR, "double free");
        assert_eq!(i.host_memory_deallocate.unwrap()(&mut dev0, local.as_mut_ptr().cast(), 64), C_ERROR);
        assert_eq!(i.unified_memory_deallocate.unwrap()(&mut dev0, local.as_mut_ptr().cast(), 64), C_ERROR);
        // Copies with null or foreign device pointers.
        assert_eq!(i.memory_copy_h2d.unwrap()(&mut dev0, null_mut(), local.as_ptr().cast(), 64), C_ERROR);
        assert_eq!(i.memory_copy_d2h.unwrap()(&mut dev0, local.as_mut_ptr().cast(), std::ptr::null(), 64), C_ERROR);
        assert_eq!(
            i.memory_copy_d2d.unwrap()(&mut dev0, local.as_mut_ptr().cast(), local.as_ptr().cast(), 64),
            C_ERROR,
            "not device memory"
        );
        // Stale and foreign stream and event handles.
        let mut s = null_mut();
        assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s), C_SUCCESS);
        assert_eq!(i.destroy_stream.unwrap()(&mut dev0, s), C_SUCCESS);
        assert_eq!(i.destroy_stream.unwrap()(&mut dev0, s), C_ERROR);
        assert_eq!(i.synchronize_stream.unwrap()(&mut dev0, s), C_ERROR);
        assert_eq!(i.query_stream.unwrap()(&mut dev0, local.as_mut_ptr().cast()), C_ERROR);
        let mut e = null_mut();
        assert_eq!(i.create_event.unwrap()(&mut dev0, &mut e), C_SUCCESS);
        assert_eq!(i.destroy_event.unwrap()(&mut dev0, e), C_SUCCESS);
        assert_eq!(i.record_event.unwrap()(&mut dev0, null_mut(), e), C_ERROR);
        assert_eq!(i.synchronize_event.unwrap()(&mut dev0, e), C_ERROR);
        assert_eq!(i.stream_add_callback.unwrap()(&mut dev0, null_mut(), None, null_mut()), C_ERROR);
        // Over the capacity: Paddle's out-of-memory answer (success, NULL), not a failure.
        p = local.as_mut_ptr().cast();
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut p, CAPACITY + 1), C_SUCCESS);
        assert!(p.is_null());
        // Still working, and nothing leaked.
        let mut q = null_mut();
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut q, 1 << 20), C_SUCCESS);
        assert!(!q.is_null());
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, q, 1 << 20), C_SUCCESS);
        let st = dmabuf_rt::ffi::runtime::Runtime::get().unwrap().device(0).unwrap().allocator().stats();
        assert_eq!(st.allocated_bytes[0].current, 0);
        assert!(st.num_ooms >= 1);
    }
    let _ = C_FAILED;
}

#[test]
fn a_synchronous_copy_waits_for_a_peer_copy_another_devices_stream_queued_into_its_memory() {
    let _serial = serial();
    use std::sync::atomic::{AtomicBool, Ordering};
    static GATE: AtomicBool = AtomicBool::new(false);
    unsafe extern "C" fn hold(_: *mut CDeviceSt, _: *mut c_void, _: *mut c_void, _: *mut i32) {
        while !GATE.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    let i = plugin();
    let (mut dev0, mut dev1) = (CDeviceSt { id: 0 }, CDeviceSt { id: 1 });
    let len = 1 << 20;
    // SAFETY: (the whole block) the plugin's function pointers with valid arguments.
    unsafe {
        let (mut on0, mut on1, mut s1) = (null_mut(), null_mut(), null_mut());
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut on0, len), C_SUCCESS);
        assert_eq!(i.device_memory_allocate.unwrap()(&mut dev1, &mut on1, len), C_SUCCESS);
        assert_eq!(i.device_memory_set.unwrap()(&mut dev0, on0, 0x11, len), C_SUCCESS);
        assert_eq!(i.device_memory_set.unwrap()(&mut dev1, on1, 0x77, len), C_SUCCESS);
        // A stream of device 1, held back, then a peer copy into device 0's memory on it.
        assert_eq!(i.create_stream.unwrap()(&mut dev1, &mut s1), C_SUCCESS);
        assert_eq!(i.stream_add_callback.unwrap()(&mut dev1, s1, Some(hold), null_mut()), C_SUCCESS);
        assert_eq!(i.async_memory_copy_p2p.unwrap()(&mut dev0, &mut dev1, s1, on0, on1, len), C_SUCCESS);
        let opener = std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(100));
            GATE.store(true, Ordering::SeqCst);
        });
        // A synchronous read of device 0 must see the peer copy, not the old bytes.
        let mut out = vec![0u8; len];
        assert_eq!(i.memory_copy_d2h.unwrap()(&mut dev0, out.as_mut_ptr().cast(), on0, len), C_SUCCESS);
        assert!(out.iter().all(|&b| b == 0x77), "read device 0 before the peer copy into it ran");
        opener.join().unwrap();
        assert_eq!(i.destroy_stream.unwrap()(&mut dev1, s1), C_SUCCESS);
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, on0, len), C_SUCCESS);
        assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev1, on1, len), C_SUCCESS);
    }
}
