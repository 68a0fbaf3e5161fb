// Devices, errors and the per-thread current stream.
#include "dmabuf.h"

#include <array>
#include <atomic>
#include <mutex>
#include <vector>

namespace torch_dmabuf {

void raise(dmabuf_rt_status status, const char* what) {
  const char* why = dmabuf_rt_last_error();
  std::string msg = std::string(what) + ": " + (why != nullptr && *why ? why : dmabuf_rt_status_name(status));
  switch (status) {
    case DMABUF_RT_OUT_OF_MEMORY:
      TORCH_CHECK_WITH(OutOfMemoryError, false, "dmabuf out of memory: ", msg);
    case DMABUF_RT_INVALID_ARGUMENT:
    case DMABUF_RT_INVALID_POINTER:
    case DMABUF_RT_INVALID_HANDLE:
      TORCH_CHECK_VALUE(false, msg);
    case DMABUF_RT_NOT_SUPPORTED:
      TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
    default:
      TORCH_CHECK(false, msg);
  }
}

int device_count() {
  static const int count = [] {
    int n = 0;
    check(dmabuf_rt_device_count(&n), "dmabuf_rt_device_count");
    return n;
  }();
  return count;
}

void check_device(int64_t index) {
  int n = device_count();
  TORCH_CHECK_INDEX(index >= 0 && index < n, "dmabuf device ", index, " does not exist: there ", n == 1 ? "is " : "are ",
                    n, " dmabuf device", n == 1 ? "" : "s", " (DMABUF_RT_DEVICES), valid indices 0..", n - 1);
}

c10::DeviceIndex current_device() {
  int d = 0;
  check(dmabuf_rt_get_device(&d), "dmabuf_rt_get_device");
  return static_cast<c10::DeviceIndex>(d);
}

void set_device(c10::DeviceIndex index) {
  check_device(index);
  check(dmabuf_rt_set_device(index), "dmabuf_rt_set_device");
}

namespace {

// Devices are few (DeviceIndex is 8 bits); one slot per possible index.
constexpr size_t kMaxDevices = 128;
thread_local std::array<c10::StreamId, kMaxDevices> tls_current{};  // 0: the default stream

constexpr size_t kPoolSize = 4;
struct StreamPool {
  std::once_flag made;
  std::array<dmabuf_rt_stream, kPoolSize> streams{};
  std::atomic<size_t> next{0};
};
std::array<StreamPool, kMaxDevices> pools;

} // namespace

c10::Stream current_stream(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_device(device);
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDmabuf, device), tls_current[device]);
}

c10::Stream exchange_stream(c10::Stream stream) {
  auto device = stream.device_index();
  check_device(device);
  if (stream.id() != 0) {
    // A forged or destroyed handle is refused here, not by every later op on the device.
    bool done = false;
    auto status = dmabuf_rt_stream_query(handle(stream), &done);
    if (status == DMABUF_RT_INVALID_HANDLE || status == DMABUF_RT_INVALID_ARGUMENT) {
      raise(status, "setting the current stream");
    }
  }
  auto old = current_stream(device);
  tls_current[device] = stream.id();
  return old;
}

c10::Stream default_stream(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_device(device);
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDmabuf, device), 0);
}

c10::Stream pooled_stream(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_device(device);
  auto& pool = pools[device];
  std::call_once(pool.made, [&] {
    for (size_t i = 0; i < pool.streams.size(); i++) {
      auto status = dmabuf_rt_stream_create(device, &pool.streams[i]);
      if (status != DMABUF_RT_OK) {
        // call_once runs again next time: give back what this attempt made.
        for (size_t j = 0; j < i; j++) {
          (void)dmabuf_rt_stream_destroy(pool.streams[j]);
        }
        raise(status, "dmabuf_rt_stream_create");
      }
    }
  });
  auto s = pool.streams[pool.next.fetch_add(1) % kPoolSize];
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDmabuf, device), static_cast<c10::StreamId>(s));
}

void synchronize_stream(const c10::Stream& stream) {
  if (stream.id() == 0) {
    check(dmabuf_rt_device_synchronize(stream.device_index()), "dmabuf_rt_device_synchronize");
  } else {
    check(dmabuf_rt_stream_synchronize(handle(stream)), "dmabuf_rt_stream_synchronize");
  }
}

namespace {
std::atomic<bool> zero_copy{true};
}

bool zero_copy_fallback() {
  return zero_copy.load(std::memory_order_relaxed);
}

void set_zero_copy_fallback(bool on) {
  zero_copy.store(on, std::memory_order_relaxed);
}

} // namespace torch_dmabuf
