// The device guard: devices, streams (our queues) and events (our events) for PrivateUse1.
#include "dmabuf.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace torch_dmabuf {
namespace {

dmabuf_rt_event event_of(void* e) {
  return static_cast<dmabuf_rt_event>(reinterpret_cast<uintptr_t>(e));
}

struct DmabufGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kDmabuf;
  }

  c10::Device exchangeDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDmabuf, "expected a dmabuf device, got ", d);
    auto old = current_device();
    if (d.index() != old) {
      set_device(d.index());
    }
    return c10::Device(kDmabuf, old);
  }

  c10::Device getDevice() const override {
    return c10::Device(kDmabuf, current_device());
  }

  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDmabuf, "expected a dmabuf device, got ", d);
    set_device(d.index());
  }

  void uncheckedSetDevice(c10::Device d) const noexcept override {
    (void)dmabuf_rt_set_device(d.index());
  }

  c10::Stream getStream(c10::Device d) const override {
    return current_stream(d.index());
  }

  c10::Stream getDefaultStream(c10::Device d) const override {
    return default_stream(d.index());
  }

  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return pooled_stream(d.index());
  }

  c10::Stream getNewStream(c10::Device d, int) const override {
    return pooled_stream(d.index());
  }

  c10::Stream exchangeStream(c10::Stream s) const override {
    return exchange_stream(s);
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return static_cast<c10::DeviceIndex>(device_count());
    } catch (...) {
      return 0;
    }
  }

  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    if (event != nullptr) {
      (void)dmabuf_rt_event_destroy(event_of(event));
    }
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "event device index ",
                static_cast<int>(device_index), " does not match the recording stream's device ",
                static_cast<int>(stream.device_index()));
    if (*event == nullptr) {
      dmabuf_rt_event e = 0;
      check(dmabuf_rt_event_create(&e), "dmabuf_rt_event_create");
      *event = reinterpret_cast<void*>(static_cast<uintptr_t>(e));
    }
    // On the default stream (synchronous) a record completes at once, on the stream's
    // device: make that device current for the call.
    auto old = current_device();
    set_device(stream.device_index());
    auto status = dmabuf_rt_event_record(event_of(*event), handle(stream));
    set_device(old);
    check(status, "dmabuf_rt_event_record");
  }

  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) {
      return;
    }
    if (stream.id() == 0) {
      // The default stream runs its work in the calling thread: waiting on the host is
      // waiting before its later work.
      check(dmabuf_rt_event_synchronize(event_of(event)), "dmabuf_rt_event_synchronize");
    } else {
      check(dmabuf_rt_stream_wait_event(handle(stream), event_of(event)), "dmabuf_rt_stream_wait_event");
    }
  }

  bool queryEvent(void* event) const override {
    if (event == nullptr) {
      return true;
    }
    bool done = false;
    check(dmabuf_rt_event_query(event_of(event), &done), "dmabuf_rt_event_query");
    return done;
  }

  void synchronizeEvent(void* event) const override {
    if (event != nullptr) {
      check(dmabuf_rt_event_synchronize(event_of(event)), "dmabuf_rt_event_synchronize");
    }
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start != nullptr && end != nullptr,
                "elapsed_time needs both events recorded (an event never recorded has no time)");
    float ms = 0;
    check(dmabuf_rt_event_elapsed_time(&ms, event_of(start), event_of(end)), "elapsed_time");
    return ms;
  }

  bool queryStream(const c10::Stream& stream) const override {
    if (stream.id() == 0) {
      return true;
    }
    bool done = false;
    check(dmabuf_rt_stream_query(handle(stream), &done), "dmabuf_rt_stream_query");
    return done;
  }

  void synchronizeStream(const c10::Stream& stream) const override {
    synchronize_stream(stream);
  }

  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    auto d = device_index < 0 ? current_device() : device_index;
    check_device(d);
    check(dmabuf_rt_device_synchronize(d), "dmabuf_rt_device_synchronize");
  }

  void recordDataPtrOnStream(const c10::DataPtr& ptr, const c10::Stream& stream) const override {
    allocator()->recordStream(ptr, stream);
  }
};

} // namespace
} // namespace torch_dmabuf

C10_REGISTER_GUARD_IMPL(PrivateUse1, torch_dmabuf::DmabufGuardImpl);
