// Replays an allocation trace through PyTorch's real CUDACachingAllocator, loaded via
// ctypes. The allocator is reached as c10::GetAllocator(kCUDA) (what torch.empty(...,
// device="cuda") uses: NativeCachingAllocator::allocate -> malloc on the current stream),
// so that no CUDA header is needed here.
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdint>
#include <vector>


extern "C" {

// Ops are pre-resolved: kind[i] 0 = alloc, 1 = free; slot[i] is a dense id of the live
// block (addresses resolved in Python), size[i] the byte size (allocs only).
// mode 0: the real allocator; mode 1: loop only (no allocator call) to measure overhead.
// out[0] = elapsed ns over all repeats, out[1] = OOMs (alloc failed; its free is skipped),
// out[2] = other errors.
int tp_replay(const int8_t* kind, const int64_t* slot, const int64_t* size, int64_t n,
              int64_t nslots, int repeat, int mode, int64_t* out) {
  c10::Allocator* a = c10::GetAllocator(c10::DeviceType::CUDA);
  if (!a) return -1;
  std::vector<void*> live(nslots, nullptr);
  int64_t ooms = 0, errs = 0;
  uintptr_t fake = 4096;
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < repeat; r++) {
    for (int64_t i = 0; i < n; i++) {
      if (kind[i] == 0) {
        void* p = nullptr;
        if (mode == 0) {
          try {
            p = a->raw_allocate(static_cast<size_t>(size[i]));
          } catch (const c10::OutOfMemoryError&) {
            ooms++;
          } catch (const std::exception&) {
            errs++;
          }
        } else {
          p = reinterpret_cast<void*>(fake += 512);
        }
        live[slot[i]] = p;
      } else {
        void* p = live[slot[i]];
        live[slot[i]] = nullptr;
        if (p && mode == 0) a->raw_deallocate(p);
      }
    }
    for (auto& p : live) {  // the trace frees everything; defensive
      if (p && mode == 0) a->raw_deallocate(p);
      p = nullptr;
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  out[0] = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
  out[1] = ooms;
  out[2] = errs;
  return 0;
}
}
