// CPU access to device tensors, and the boxed fallback that runs CPU kernels for every op
// the backend has no kernel of its own for.
#pragma once

#include "dmabuf.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace torch_dmabuf {

// Checks that every defined tensor of `tensors` is on one dmabuf device (a 0-dim CPU tensor
// is a scalar and allowed anywhere) and returns that device; throws a RuntimeError naming
// the two devices otherwise.
c10::DeviceIndex check_same_device(const char* op, const std::vector<at::Tensor>& tensors);

// CPU access to device tensors for the length of a scope: first the work that may touch them
// finishes (the current stream of each device involved; on the default stream, the whole
// device), then each storage enters the dma-buf CPU-access bracket, which ends with the
// scope. `cpu(t)` is a CPU tensor over the same pages (same storage offset, sizes and
// strides): CPU kernels read and write device memory in place.
class CpuAccess {
 public:
  CpuAccess(const std::vector<at::Tensor>& tensors, bool write);
  ~CpuAccess();
  CpuAccess(const CpuAccess&) = delete;
  CpuAccess& operator=(const CpuAccess&) = delete;

  // The CPU view of a device tensor given to the constructor (or sharing its storage).
  at::Tensor cpu(const at::Tensor& t);
  // The device storage behind a CPU storage this made, if any.
  std::optional<at::Storage> device_storage(const at::Storage& cpu) const;
  // After a kernel: a CPU storage that the kernel resized (an out= argument) now holds a
  // new block of the device; it becomes the device storage's memory, without a copy.
  void adopt_resized();

 private:
  struct Entry {
    at::Storage device;
    at::Storage host;
    void* ptr;     // the block in the access bracket
    size_t bytes;  // its bytes
    bool bracket;
  };
  Entry& entry(const at::Storage& device);
  std::vector<Entry> entries_;
  bool write_;
};

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

} // namespace torch_dmabuf
