// torch_dmabuf._C: what the Python package needs beyond PyTorch's generic APIs.
#include "dmabuf.h"

#include <torch/extension.h>

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
}
