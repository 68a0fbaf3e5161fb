// Seed 002's DeviceAllocator for PrivateUse1, over dmabuf-rt's caching allocator.
#include "dmabuf.h"

#include <atomic>
#include <utility>

namespace torch_dmabuf {
namespace {

void free_block(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  int device = 0;
  // A deleter cannot throw: a pointer no device holds is a bug elsewhere, logged by the C
  // API (on stderr unless DMABUF_RT_LOG=off) and left alone rather than freed wrongly.
  if (dmabuf_rt_pointer_device(ptr, &device) == DMABUF_RT_OK) {
    (void)dmabuf_rt_device_free(device, ptr);
  }
}

// One deleter per device, so that a free needs no lookup of the pointer's device.
template <int D>
void free_on(void* ptr) {
  (void)dmabuf_rt_device_free(D, ptr);
}

template <int... D>
constexpr std::array<c10::DeleterFnPtr, sizeof...(D)> deleters(std::integer_sequence<int, D...>) {
  return {&free_on<D>...};
}
constexpr auto kDeleters = deleters(std::make_integer_sequence<int, 64>{});

void empty_deleter(void*) {}

c10::CachingAllocator::Stat stat(const dmabuf_rt_stat& s) {
  c10::CachingAllocator::Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

c10::CachingAllocator::StatArray stats(const dmabuf_rt_stat_array& a) {
  return {stat(a[0]), stat(a[1]), stat(a[2])};
}

class DmabufAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    auto device = current_device();
    check_device(device);
    if (n == 0) {
      return {nullptr, nullptr, &empty_deleter, c10::Device(kDmabuf, device)};
    }
    void* ptr = nullptr;
    // On the current stream, as CUDA's caching allocator does: a block freed while work queued
    // on its stream still uses it is taken again only by that stream's allocations (after that
    // work, in stream order), never handed to another stream meanwhile. The default stream (0)
    // is synchronous: its work is done when the call that queued it returns.
    auto stream = current_stream(device);
    if (stream.id() == 0) {
      check(dmabuf_rt_device_alloc(device, n, &ptr), "allocating device memory");
    } else {
      check(dmabuf_rt_device_alloc_on_stream(device, n, handle(stream), &ptr), "allocating device memory");
    }
    used_.store(true, std::memory_order_relaxed);
    auto del = device < static_cast<c10::DeviceIndex>(kDeleters.size()) ? kDeleters[device] : &free_block;
    return {ptr, ptr, del, c10::Device(kDmabuf, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_block;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count == 0) {
      return;
    }
    int dst_dev = 0, src_dev = 0;
    check(dmabuf_rt_pointer_device(dest, &dst_dev), "copy_data destination");
    check(dmabuf_rt_pointer_device(src, &src_dev), "copy_data source");
    auto kind = dst_dev == src_dev ? DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE : DMABUF_RT_MEMCPY_PEER_TO_PEER;
    check(dmabuf_rt_memcpy(dst_dev, dest, src_dev, src, count, kind, 0), "copy_data");
  }

  bool initialized() override {
    return used_.load(std::memory_order_relaxed);
  }

  void emptyCache(c10::MempoolId_t) override {
    for (int d = 0; d < device_count(); d++) {
      check(dmabuf_rt_empty_cache(d), "dmabuf_rt_empty_cache");
    }
  }

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    // The default stream is synchronous: its work has finished when the call that queued it
    // returned, so there is nothing to wait for. An empty tensor has no block.
    if (ptr.get() == nullptr || stream.id() == 0) {
      return;
    }
    check(dmabuf_rt_record_stream(ptr.device().index(), ptr.get(), handle(stream)), "recordStream");
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    dmabuf_rt_memory_stats s{};
    check(dmabuf_rt_device_memory_stats(device, &s), "dmabuf_rt_device_memory_stats");
    c10::CachingDeviceAllocator::DeviceStats out;
    out.allocation = stats(s.allocation);
    out.segment = stats(s.segment);
    out.active = stats(s.active);
    out.inactive_split = stats(s.inactive_split);
    out.allocated_bytes = stats(s.allocated_bytes);
    out.reserved_bytes = stats(s.reserved_bytes);
    out.active_bytes = stats(s.active_bytes);
    out.inactive_split_bytes = stats(s.inactive_split_bytes);
    out.requested_bytes = stats(s.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    out.oversize_allocations = stat(s.oversize_allocations);
    out.oversize_segments = stat(s.oversize_segments);
    out.max_split_size = s.max_split_size;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    check(dmabuf_rt_reset_accumulated_stats(device), "dmabuf_rt_reset_accumulated_stats");
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    check(dmabuf_rt_reset_peak_stats(device), "dmabuf_rt_reset_peak_stats");
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device(device);
    uint64_t total = 0, free = 0;
    check(dmabuf_rt_device_memory(device, &total, &free), "dmabuf_rt_device_memory");
    return {static_cast<size_t>(free), static_cast<size_t>(total)};
  }

 private:
  std::atomic<bool> used_{false};
};

DmabufAllocator g_allocator;

// Pinned host memory from the runtime's pinned-host allocator.
void free_host(void* ptr) {
  if (ptr != nullptr) {
    (void)dmabuf_rt_host_free(ptr);
  }
}

class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &empty_deleter, c10::Device(c10::kCPU)};
    }
    void* ptr = nullptr;
    check(dmabuf_rt_host_alloc(n, &ptr), "allocating pinned host memory");
    return {ptr, ptr, &free_host, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_host;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator g_pinned;

class DeviceBackedCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &empty_deleter, c10::Device(c10::kCPU)};
    }
    void* ptr = nullptr;
    check(dmabuf_rt_device_alloc(device_, n, &ptr), "allocating device memory for a CPU kernel's output");
    auto del = kDeleters[device_];
    // The kernel writes it from the CPU: open the access bracket (CpuAccess ends it).
    auto status = dmabuf_rt_cpu_access_begin(device_, ptr, n, true);
    if (status != DMABUF_RT_OK) {
      del(ptr);
      raise(status, "CPU access to a kernel's output");
    }
    return {ptr, ptr, del, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_block;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  c10::DeviceIndex device_ = 0;
};

std::array<DeviceBackedCpuAllocator, 64> g_backed = [] {
  std::array<DeviceBackedCpuAllocator, 64> a;
  for (size_t i = 0; i < a.size(); i++) {
    a[i].device_ = static_cast<c10::DeviceIndex>(i);
  }
  return a;
}();

} // namespace

c10::DataPtr device_data_ptr(void* ptr, c10::DeviceIndex device) {
  TORCH_CHECK(device >= 0 && device < static_cast<c10::DeviceIndex>(kDeleters.size()), "device index ",
              static_cast<int>(device), " out of range");
  return {ptr, ptr, kDeleters[device], c10::Device(kDmabuf, device)};
}

c10::Allocator* device_backed_cpu_allocator(c10::DeviceIndex device) {
  TORCH_CHECK(device >= 0 && device < static_cast<c10::DeviceIndex>(g_backed.size()), "device index ",
              static_cast<int>(device), " out of range");
  return &g_backed[device];
}

c10::DeviceAllocator* allocator() {
  return &g_allocator;
}

c10::Allocator* pinned_allocator() {
  return &g_pinned;
}

bool is_pinned(const void* ptr) {
  bool pinned = false;
  return ptr != nullptr && dmabuf_rt_host_is_pinned(ptr, &pinned) == DMABUF_RT_OK && pinned;
}

} // namespace torch_dmabuf

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, torch_dmabuf::allocator());
