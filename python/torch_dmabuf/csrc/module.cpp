// torch_dmabuf._C: what the Python package needs beyond PyTorch's generic APIs.
#include "dmabuf.h"

#include <torch/extension.h>

#include <cstring>
#include <vector>

namespace {

std::string snapshot_json(int device) {
  torch_dmabuf::check_device(device);
  char* json = nullptr;
  torch_dmabuf::check(dmabuf_rt_snapshot_json(device, &json), "dmabuf_rt_snapshot_json");
  std::string out(json);
  (void)dmabuf_rt_string_free(json);
  return out;
}

void record_history(int device, bool all) {
  torch_dmabuf::check_device(device);
  torch_dmabuf::check(dmabuf_rt_record_history(device, all), "dmabuf_rt_record_history");
}

std::string device_name(int device) {
  torch_dmabuf::check_device(device);
  char buf[256] = {0};
  torch_dmabuf::check(dmabuf_rt_device_name(device, buf, sizeof buf), "dmabuf_rt_device_name");
  return buf;
}

// The deleter of a storage opened from another process's IPC handle: closes it (a deleter
// cannot throw: a failure is logged by the C API and left alone).
void close_imported(void* ptr) {
  int device = 0;
  if (ptr != nullptr && dmabuf_rt_pointer_device(ptr, &device) == DMABUF_RT_OK) {
    (void)dmabuf_rt_ipc_close_mem_handle(device, ptr);
  }
}

bool is_imported(const at::Tensor& t) {
  return t.storage().data_ptr().get_deleter() == &close_imported;
}

// The IPC handle of the block that holds `t`'s storage (the storage's start is the block's):
// the block is held until the process that opens the handle lets go. The work queued on the
// current stream so far travels with the handle as a fence, which the opening process waits
// for (as CUDA IPC sends an event of the current stream); on the default stream (0) the
// device is synchronized first instead. (torch.multiprocessing.Queue pickles on its feeder
// thread, whose current stream is the default; a Pipe pickles on the sending thread.)
py::bytes ipc_get_handle(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == torch_dmabuf::kDmabuf, "ipc_get_handle: not a dmabuf tensor");
  TORCH_CHECK(!is_imported(t),
              "a dmabuf tensor received from another process cannot be shared onward (as for CUDA tensors "
              "received through IPC): clone() it first");
  void* ptr = t.storage().data_ptr().get();
  TORCH_CHECK(ptr != nullptr, "ipc_get_handle: a storage with no memory (0 bytes)");
  dmabuf_rt_ipc_mem_handle h;
  auto device = t.device().index();
  auto stream = torch_dmabuf::handle(torch_dmabuf::current_stream(device));
  torch_dmabuf::check(dmabuf_rt_ipc_get_mem_handle_on_stream(device, ptr, stream, &h),
                      "dmabuf_rt_ipc_get_mem_handle_on_stream");
  return py::bytes(reinterpret_cast<const char*>(h.bytes), sizeof h.bytes);
}

// A tensor over the block another process shared: `nbytes` of storage opened from `handle` on
// `device`, seen with `sizes`, `strides` and `offset` (elements) as `dtype`. The storage
// closes the handle when its last user lets go.
at::Tensor ipc_open(py::bytes handle, int64_t device, int64_t nbytes, std::vector<int64_t> sizes,
                    std::vector<int64_t> strides, int64_t offset, at::ScalarType dtype) {
  torch_dmabuf::check_device(device);
  std::string b = handle;
  TORCH_CHECK(b.size() == 64, "ipc_open: a handle is 64 bytes, not ", b.size());
  dmabuf_rt_ipc_mem_handle h;
  std::memcpy(h.bytes, b.data(), 64);
  void* ptr = nullptr;
  torch_dmabuf::check(dmabuf_rt_ipc_open_mem_handle(static_cast<int>(device), &h, &ptr), "dmabuf_rt_ipc_open_mem_handle");
  auto dev = c10::Device(torch_dmabuf::kDmabuf, static_cast<c10::DeviceIndex>(device));
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                       c10::DataPtr(ptr, ptr, &close_imported, dev), nullptr, /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                    c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return t;
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_dmabuf's native part: the PrivateUse1 backend over dmabuf-rt";
  m.def("_device_count", [] { return torch_dmabuf::device_count(); });
  m.def("_check_device", [](int64_t d) { torch_dmabuf::check_device(d); });
  m.def("_device_name", &device_name);
  m.def("_snapshot_json", &snapshot_json);
  m.def("_record_history", &record_history);
  m.def("_set_zero_copy_fallback", &torch_dmabuf::set_zero_copy_fallback);
  m.def("_zero_copy_fallback", &torch_dmabuf::zero_copy_fallback);
  m.def("_host_empty_cache", [] { torch_dmabuf::check(dmabuf_rt_host_empty_cache(), "dmabuf_rt_host_empty_cache"); });
  m.def("_default_generator", [](int64_t d) { return torch_dmabuf::default_generator(static_cast<c10::DeviceIndex>(d)); });
  m.def("_version", [] { return std::string(dmabuf_rt_version()); });
  m.def("_ipc_get_handle", &ipc_get_handle);
  m.def("_ipc_open", &ipc_open);
  m.def("_is_imported", &is_imported);
}
