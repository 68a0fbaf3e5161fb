// torch_dmabuf: PyTorch's PrivateUse1 backend over dmabuf-rt's C API.
//
// The C++ here is glue only: every allocation, free, copy, stream, event and statistic is a
// call into libdmabuf_rt (include/dmabuf_rt.h); no allocator logic is written twice.
#pragma once

#include <dmabuf_rt.h>

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

#include <string>

namespace torch_dmabuf {

constexpr c10::DeviceType kDmabuf = c10::DeviceType::PrivateUse1;

// Throws the C API's failure as PyTorch's exception of the same kind: out of memory as
// torch.OutOfMemoryError, a bad device or argument as RuntimeError (ValueError-like), with
// dmabuf_rt_last_error()'s text, which names the cause.
[[noreturn]] void raise(dmabuf_rt_status status, const char* what);

inline void check(dmabuf_rt_status status, const char* what) {
  if (status != DMABUF_RT_OK) {
    raise(status, what);
  }
}

// Number of devices (DMABUF_RT_DEVICES); throws if the runtime could not start.
int device_count();
// Throws a clear error unless 0 <= index < device_count().
void check_device(int64_t index);
// The calling thread's current device.
c10::DeviceIndex current_device();
void set_device(c10::DeviceIndex index);

// The calling thread's current stream on `device` (id 0: the device's synchronous default
// stream).
c10::Stream current_stream(c10::DeviceIndex device);
// Sets the calling thread's current stream (for the stream's device) and returns the old one.
c10::Stream exchange_stream(c10::Stream stream);
c10::Stream default_stream(c10::DeviceIndex device);
// A stream from the device's pool (created on first use; streams are reused round-robin).
c10::Stream pooled_stream(c10::DeviceIndex device);
// Waits for what `stream` has queued; stream 0 waits for the whole device (the default
// stream is synchronous, and like CUDA's legacy default stream it is ordered after the
// device's other streams).
void synchronize_stream(const c10::Stream& stream);

// The C API's stream handle for a c10 stream (0 for the default stream).
inline dmabuf_rt_stream handle(const c10::Stream& s) {
  return static_cast<dmabuf_rt_stream>(s.id());
}

c10::DeviceAllocator* allocator();
// A device block as a DataPtr of the device (freed through the C API when the last owner
// lets go).
c10::DataPtr device_data_ptr(void* ptr, c10::DeviceIndex device);
// An allocator for CPU storages whose memory is a block of `device` (its DataPtrs say CPU;
// each allocation begins CPU write access to its block): what a CPU kernel that resizes
// the output it was given allocates from, so that the output can become the device
// tensor's storage without a copy.
c10::Allocator* device_backed_cpu_allocator(c10::DeviceIndex device);
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);

// The fallback mode: true for the zero-copy fallback (CPU kernels on the mapped device
// pages), false for the copying one.
bool zero_copy_fallback();
void set_zero_copy_fallback(bool on);

// The per-device default generator (a CPU generator's state, owned by the device).
const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);

} // namespace torch_dmabuf
