// The PrivateUse1 hooks (device queries, pinned memory, generators) and the generators.
#include "dmabuf.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>

#include <mutex>
#include <vector>

namespace torch_dmabuf {
namespace {

// A device's generator: a CPU generator's engine (the CPU kernels of the fallback draw from
// it), labelled with the dmabuf device.
class DmabufGenerator final : public at::CPUGeneratorImpl {
 public:
  explicit DmabufGenerator(c10::DeviceIndex index) {
    device_ = c10::Device(kDmabuf, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
  static c10::DeviceType device_type() {
    return kDmabuf;
  }
};

struct DmabufHooks final : public at::PrivateUse1HooksInterface {
  void init() const override {
    (void)device_count();
  }
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    try {
      return device_count() > 0;
    } catch (...) {
      return false;
    }
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_device(device);
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = current_device();
    set_device(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    auto old = current_device();
    if (device >= 0 && device < device_count()) {
      set_device(device);
    }
    return old;
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned(data);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_allocator();
  }
  at::Device getDeviceFromPtr(void* data) const override {
    int device = 0;
    check(dmabuf_rt_pointer_device(data, &device), "getDeviceFromPtr");
    return at::Device(kDmabuf, static_cast<c10::DeviceIndex>(device));
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    return default_generator(device);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return new_generator(device);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    auto old = impl->nbytes();
    c10::DataPtr fresh;
    {
      c10::DeviceGuard guard(impl->device());
      fresh = impl->allocator()->allocate(newsize);
    }
    auto keep = std::min(old, newsize);
    if (keep > 0) {
      impl->allocator()->copy_data(fresh.mutable_get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

std::once_flag made;
std::vector<at::Generator> generators;

} // namespace

const at::Generator& default_generator(c10::DeviceIndex device) {
  std::call_once(made, [] {
    for (int d = 0; d < device_count(); d++) {
      generators.push_back(at::make_generator<DmabufGenerator>(static_cast<c10::DeviceIndex>(d)));
    }
  });
  if (device < 0) {
    device = current_device();
  }
  check_device(device);
  return generators[device];
}

at::Generator new_generator(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_device(device);
  return at::make_generator<DmabufGenerator>(device);
}

namespace {
const bool registered = [] {
  at::RegisterPrivateUse1HooksInterface(new DmabufHooks());
  return true;
}();
} // namespace

} // namespace torch_dmabuf
