//! Prints the size and the offset of every field our Paddle plugin fills, as `name offset`
//! lines, for `tests/paddle/run` to compare with the same lines printed by a C++ program
//! compiled against the paddlepaddle wheel's own `device_ext.h`.
//!
//! Run: `cargo run --example paddle_layout`

use std::mem::{offset_of, size_of};

use dmabuf_rt::ffi::paddle::{CDeviceInterface as I, CustomRuntimeParams as P, CustomRuntimeVersion as V};

macro_rules! fields {
    ($t:ident, $name:literal: $($f:ident),* $(,)?) => {
        $(println!("{}.{} {}", $name, stringify!($f), offset_of!($t, $f));)*
    };
}

fn main() {
    println!("sizeof(C_DeviceInterface) {}", size_of::<I>());
    println!("sizeof(CustomRuntimeParams) {}", size_of::<P>());
    println!("sizeof(CustomRuntimeVersion) {}", size_of::<V>());
    fields!(I, "C_DeviceInterface":
        size, initialize, finalize, init_device, set_device, get_device, deinit_device, create_stream,
        destroy_stream, query_stream, stream_add_callback, create_event, record_event, destroy_event,
        query_event, synchronize_device, synchronize_stream, synchronize_event, stream_wait_event,
        device_memory_allocate, device_memory_deallocate, device_memory_set, host_memory_allocate,
        host_memory_deallocate, unified_memory_allocate, unified_memory_deallocate, memory_copy_h2d,
        memory_copy_d2h, memory_copy_d2d, memory_copy_p2p, async_memory_copy_h2d, async_memory_copy_d2h,
        async_memory_copy_d2d, async_memory_copy_p2p, get_device_count, get_device_list,
        device_memory_stats, device_min_chunk_size, device_max_chunk_size, device_max_alloc_size,
        device_extra_padding_size, device_init_alloc_size, device_realloc_size,
    );
    println!("C_DeviceInterface.get_compute_capability {}", offset_of!(I, rest));
    fields!(P, "CustomRuntimeParams": size, interface, version, device_type, sub_device_type, pir_default_passes);
    fields!(V, "CustomRuntimeVersion": major, minor, patch);
}
