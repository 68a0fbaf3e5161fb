// Prints the sizes and field offsets of Paddle's custom-device structs that dmabuf-rt's plugin
// fills, from the paddlepaddle wheel's own header, in the format of examples/paddle_layout.rs.
#include <cstddef>
#include <cstdio>
#include "paddle/phi/backends/device_ext.h"

#define F(T, f) std::printf("%s.%s %zu\n", #T, #f, offsetof(T, f))

int main() {
  std::printf("sizeof(C_DeviceInterface) %zu\n", sizeof(C_DeviceInterface));
  std::printf("sizeof(CustomRuntimeParams) %zu\n", sizeof(CustomRuntimeParams));
  std::printf("sizeof(CustomRuntimeVersion) %zu\n", sizeof(CustomRuntimeVersion));
  F(C_DeviceInterface, size); F(C_DeviceInterface, initialize); F(C_DeviceInterface, finalize);
  F(C_DeviceInterface, init_device); F(C_DeviceInterface, set_device); F(C_DeviceInterface, get_device);
  F(C_DeviceInterface, deinit_device); F(C_DeviceInterface, create_stream);
  F(C_DeviceInterface, destroy_stream); F(C_DeviceInterface, query_stream);
  F(C_DeviceInterface, stream_add_callback); F(C_DeviceInterface, create_event);
  F(C_DeviceInterface, record_event); F(C_DeviceInterface, destroy_event);
  F(C_DeviceInterface, query_event); F(C_DeviceInterface, synchronize_device);
  F(C_DeviceInterface, synchronize_stream); F(C_DeviceInterface, synchronize_event);
  F(C_DeviceInterface, stream_wait_event); F(C_DeviceInterface, device_memory_allocate);
  F(C_DeviceInterface, device_memory_deallocate); F(C_DeviceInterface, device_memory_set);
  F(C_DeviceInterface, host_memory_allocate); F(C_DeviceInterface, host_memory_deallocate);
  F(C_DeviceInterface, unified_memory_allocate); F(C_DeviceInterface, unified_memory_deallocate);
  F(C_DeviceInterface, memory_copy_h2d); F(C_DeviceInterface, memory_copy_d2h);
  F(C_DeviceInterface, memory_copy_d2d); F(C_DeviceInterface, memory_copy_p2p);
  F(C_DeviceInterface, async_memory_copy_h2d); F(C_DeviceInterface, async_memory_copy_d2h);
  F(C_DeviceInterface, async_memory_copy_d2d); F(C_DeviceInterface, async_memory_copy_p2p);
  F(C_DeviceInterface, get_device_count); F(C_DeviceInterface, get_device_list);
  F(C_DeviceInterface, device_memory_stats); F(C_DeviceInterface, device_min_chunk_size);
  F(C_DeviceInterface, device_max_chunk_size); F(C_DeviceInterface, device_max_alloc_size);
  F(C_DeviceInterface, device_extra_padding_size); F(C_DeviceInterface, device_init_alloc_size);
  F(C_DeviceInterface, device_realloc_size); F(C_DeviceInterface, get_compute_capability);
  F(CustomRuntimeParams, size); F(CustomRuntimeParams, interface); F(CustomRuntimeParams, version);
  F(CustomRuntimeParams, device_type); F(CustomRuntimeParams, sub_device_type);
  F(CustomRuntimeParams, pir_default_passes);
  F(CustomRuntimeVersion, major); F(CustomRuntimeVersion, minor); F(CustomRuntimeVersion, patch);
  std::printf("version %d.%d.%d\n", PADDLE_CUSTOM_RUNTIME_MAJOR_VERSION, PADDLE_CUSTOM_RUNTIME_MINOR_VERSION,
              PADDLE_CUSTOM_RUNTIME_PATCH_VERSION);
  return 0;
}
