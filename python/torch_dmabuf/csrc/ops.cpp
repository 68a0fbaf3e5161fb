// The native kernels of the backend: factories, views, copies, set_/resize_ and the
// convolutions PrivateUse1 dispatches to. Everything else goes through fallback.cpp.
#include "dmabuf.h"
#include "fallback.h"

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/copy_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

namespace torch_dmabuf {
namespace {

void check_target(const c10::Device& device, std::optional<bool> pin_memory, std::optional<c10::Layout> layout) {
  TORCH_CHECK(device.type() == kDmabuf, "expected a dmabuf device, got ", device);
  if (device.has_index()) {
    check_device(device.index());
  }
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "dmabuf tensors are strided only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory),
              "pin_memory=True makes pinned host memory: create the tensor on the CPU and call pin_memory()");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  auto d = c10::device_or_default(device);
  check_target(d, pin_memory, layout);
  const c10::DeviceGuard guard(d);
  return at::detail::empty_generic(size, allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  auto d = c10::device_or_default(device);
  check_target(d, pin_memory, layout);
  const c10::DeviceGuard guard(d);
  return at::detail::empty_strided_generic(size, stride, allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

// Before PyTorch's CPU resize path grows a tensor's storage (a new block of the tensor's
// device, the old bytes copied with a CPU memcpy, the old block freed): the device's queued
// work on the old block must have run, or the memcpy reads stale bytes and the queued work
// writes into a freed block.
void before_growth(const at::Tensor& self, int64_t needed) {
  if (self.storage().nbytes() < static_cast<size_t>(needed)) {
    check(dmabuf_rt_device_synchronize(self.device().index()), "dmabuf_rt_device_synchronize");
  }
}

int64_t contiguous_bytes(c10::IntArrayRef size, const at::Tensor& self) {
  return static_cast<int64_t>(
      at::detail::computeStorageNbytesContiguous(size, self.itemsize(), self.storage_offset()));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(self.device());
  auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  before_growth(self, contiguous_bytes(sizes, self));
  return at::native::resize_(self, sizes, memory_format);
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_storage_offset(at::Tensor& self, at::Storage storage, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  // set_ may grow the storage: on the storage's device, after its queued work.
  const c10::DeviceGuard guard(storage.device());
  if (storage.nbytes() > 0 || !size.empty()) {
    auto needed = stride.empty() ? at::detail::computeStorageNbytesContiguous(size, self.itemsize(), offset)
                                 : at::detail::computeStorageNbytes(size, stride, self.itemsize(), offset);
    if (storage.nbytes() < needed && storage.device().type() == kDmabuf) {
      check(dmabuf_rt_device_synchronize(storage.device().index()), "dmabuf_rt_device_synchronize");
    }
  }
  return at::cpu::set_(self, std::move(storage), offset, size, stride);
}

bool plain(const at::Tensor& t) {
  return t.is_contiguous();
}

// Device memory (or host memory) of a tensor, or nullptr for an empty one.
const void* bytes(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : static_cast<const char*>(t.storage().data()) + t.storage_offset() * t.itemsize();
}

// The stream a copy runs on: the current stream of `device` if the caller allows it to
// return before the copy has run (non_blocking), else the synchronous default stream.
dmabuf_rt_stream copy_stream(c10::DeviceIndex device, bool non_blocking) {
  return non_blocking ? handle(current_stream(device)) : 0;
}

// A copy queued on the destination device's current stream that reads the source device's
// memory: it waits first for the source device's current stream, as CUDA's peer copies do.
void order_after_source_stream(c10::DeviceIndex src, c10::DeviceIndex dst) {
  auto from = current_stream(src);
  auto to = current_stream(dst);
  if (from.id() == 0 || to.id() == 0) {
    return;  // the default stream is synchronous, and a blocking copy waits for both devices
  }
  dmabuf_rt_event ev = 0;
  check(dmabuf_rt_event_create(&ev), "dmabuf_rt_event_create");
  auto recorded = dmabuf_rt_event_record(ev, handle(from));
  auto waited = recorded == DMABUF_RT_OK ? dmabuf_rt_stream_wait_event(handle(to), ev) : recorded;
  (void)dmabuf_rt_event_destroy(ev);  // the waiting stream keeps what it waits for
  check(waited, "ordering a peer copy after the source device's stream");
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.defined() && dst.defined(), "copy_ of an undefined tensor");
  TORCH_CHECK(self.numel() == dst.numel() || self.numel() == 1 || dst.sizes() == self.sizes() ||
                  at::infer_size(dst.sizes(), self.sizes()) == dst.sizes(),
              "copy_: cannot copy a tensor of shape ", self.sizes(), " into one of shape ", dst.sizes());
  if (dst.numel() == 0) {
    return dst;
  }
  const bool src_dev = self.device().type() == kDmabuf;
  const bool dst_dev = dst.device().type() == kDmabuf;
  TORCH_CHECK(src_dev || self.is_cpu(), "copies to dmabuf come from the CPU or dmabuf, not ", self.device());
  TORCH_CHECK(dst_dev || dst.is_cpu(), "copies from dmabuf go to the CPU or dmabuf, not ", dst.device());
  const size_t n = dst.nbytes();
  if (src_dev && dst_dev) {
    // As the CPU's copy_: a destination that overlaps itself or its source is refused.
    at::assert_no_internal_overlap(dst);
    at::assert_no_partial_overlap(dst, self);
  }
  const bool lazy = self.is_conj() || self.is_neg() || dst.is_conj() || dst.is_neg();
  const bool same_layout = !lazy && self.scalar_type() == dst.scalar_type() && self.sizes() == dst.sizes() &&
                           plain(self) && plain(dst);
  if (same_layout) {
    // One memcpy through the C API (range-checked, inside the dma-buf sync bracket; queued
    // on the current stream when non_blocking).
    if (src_dev && dst_dev) {
      auto kind = self.device() == dst.device() ? DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE : DMABUF_RT_MEMCPY_PEER_TO_PEER;
      if (non_blocking && self.device() != dst.device()) {
        order_after_source_stream(self.device().index(), dst.device().index());
      }
      check(dmabuf_rt_memcpy(dst.device().index(), const_cast<void*>(bytes(dst)), self.device().index(),
                             bytes(self), n, kind, copy_stream(dst.device().index(), non_blocking)),
            "device-to-device copy");
    } else if (dst_dev) {
      // From pageable memory the copy reads the host side before it returns anyway.
      check(dmabuf_rt_memcpy(dst.device().index(), const_cast<void*>(bytes(dst)), -1, bytes(self), n,
                             DMABUF_RT_MEMCPY_HOST_TO_DEVICE, copy_stream(dst.device().index(), non_blocking)),
            "host-to-device copy");
    } else {
      // Device to host: queued only into pinned memory, which outlives the copy.
      bool queue = non_blocking && is_pinned(bytes(dst));
      check(dmabuf_rt_memcpy(-1, const_cast<void*>(bytes(dst)), self.device().index(), bytes(self), n,
                             DMABUF_RT_MEMCPY_DEVICE_TO_HOST, copy_stream(self.device().index(), queue)),
            "device-to-host copy");
    }
    return dst;
  }
  if (dst_dev && !src_dev) {
    // Host to device with another layout or dtype: convert on the host, then one copy.
    auto staged = at::empty(dst.sizes(), dst.options().device(c10::kCPU));
    staged.copy_(self);
    if (plain(dst)) {
      return copy_from(staged, dst, false);
    }
    CpuAccess access({dst}, /*write=*/true);
    access.cpu(dst).copy_(staged);
    return dst;
  }
  // The source is on a device: read it in place on the CPU (after the streams that may
  // write it), strided and converted as the CPU's copy_ does.
  std::vector<at::Tensor> on_dev;
  if (src_dev) {
    on_dev.push_back(self);
  }
  if (dst_dev) {
    on_dev.push_back(dst);
  }
  CpuAccess access(on_dev, /*write=*/true);
  auto src_cpu = src_dev ? access.cpu(self) : self;
  auto dst_cpu = dst_dev ? access.cpu(dst) : dst;
  dst_cpu.copy_(src_cpu);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  {
    const c10::DeviceGuard guard(dst.device());
    before_growth(dst, contiguous_bytes(self.sizes(), dst));
    at::native::resize_(dst, self.sizes(), std::nullopt);
  }
  return copy_from(self, dst, false);
}

// Convolutions on PrivateUse1 dispatch to the *_overrideable ops, which have no CPU kernel:
// run the CPU convolution on the CPU views of the operands and bring the results over.
at::Tensor conv(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                c10::IntArrayRef output_padding, int64_t groups) {
  std::vector<at::Tensor> args{input, weight};
  if (bias.has_value() && bias->defined()) {
    args.push_back(*bias);
  }
  auto device = check_same_device("convolution", args);
  at::Tensor out;
  {
    CpuAccess access(args, /*write=*/false);
    std::optional<at::Tensor> b;
    if (args.size() == 3) {
      b = access.cpu(args[2]);
    }
    out = at::convolution(access.cpu(input), access.cpu(weight), b, stride, padding, dilation, transposed,
                          output_padding, groups);
  }
  return out.to(c10::Device(kDmabuf, device));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                             const at::Tensor& weight, c10::IntArrayRef stride,
                                                             c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                                             bool transposed, c10::IntArrayRef output_padding,
                                                             int64_t groups, std::array<bool, 3> mask) {
  auto device = check_same_device("convolution_backward", {grad_output, input, weight});
  std::tuple<at::Tensor, at::Tensor, at::Tensor> r;
  {
    CpuAccess access({grad_output, input, weight}, /*write=*/false);
    int64_t out_channels = transposed ? weight.size(1) * groups : weight.size(0);
    std::vector<int64_t> bias_sizes{out_channels};
    r = at::convolution_backward(access.cpu(grad_output), access.cpu(input), access.cpu(weight),
                                 c10::IntArrayRef(bias_sizes), stride, padding, dilation, transposed, output_padding,
                                 groups, mask);
  }
  auto dev = c10::Device(kDmabuf, device);
  auto back = [&](const at::Tensor& t) { return t.defined() ? t.to(dev) : t; };
  return {back(std::get<0>(r)), back(std::get<1>(r)), back(std::get<2>(r))};
}

// Dropout draws its mask inside the CPU kernel from the CPU's global generator, which
// torch.dmabuf.manual_seed does not reach: draw it with bernoulli_, which the fallback runs
// with the device's generator.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  const double keep = 1.0 - p;
  auto noise = at::empty_like(input).bernoulli_(keep);
  auto output = input.mul(noise).mul_(keep == 0 ? 0.0 : 1.0 / keep);
  return {output, noise.to(at::kBool)};
}

// tensor.record_stream(s): the allocator's recordStream on the tensor's block.
void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == kDmabuf, "record_stream: expected a dmabuf stream, got one of ", stream.device());
  allocator()->recordStream(self.storage().data_ptr(), stream);
}

} // namespace
} // namespace torch_dmabuf

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace torch_dmabuf;
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("convolution_overrideable", conv);
  m.impl("convolution_backward_overrideable", conv_backward);
  m.impl("record_stream", record_stream);
  m.impl("native_dropout", native_dropout);
}
