/* Minimal fake CUDA driver (libcuda.so.1) for running PyTorch's caching
 * allocator on a machine without a GPU.  Device memory is never backed:
 * only capacity is accounted, addresses come from PROT_NONE reservations. */
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long g_total = 0, g_used = 0, g_peak = 0;
static unsigned long long g_nmalloc = 0, g_nfree = 0;

unsigned long long stub_total_mem(void) {
  if (!g_total) {
    const char *e = getenv("STUB_CUDA_TOTAL_MEM");
    g_total = e ? strtoull(e, NULL, 0) : (24ULL << 30);
  }
  return g_total;
}
/* returns 0 on success, -1 if it would exceed the fake capacity */
int stub_mem_charge(unsigned long long sz) {
  int rc = 0;
  unsigned long long total = stub_total_mem();
  pthread_mutex_lock(&g_mu);
  if (g_used + sz > total) rc = -1;
  else { g_used += sz; g_nmalloc++; if (g_used > g_peak) g_peak = g_used; }
  pthread_mutex_unlock(&g_mu);
  return rc;
}
void stub_mem_uncharge(unsigned long long sz) {
  pthread_mutex_lock(&g_mu); g_used -= sz; g_nfree++; pthread_mutex_unlock(&g_mu);
}
unsigned long long stub_mem_used(void) { return g_used; }
/* stats for the harness: used, peak, #device allocs, #device frees */
void stub_mem_stats(unsigned long long out[4]) {
  pthread_mutex_lock(&g_mu);
  out[0] = g_used; out[1] = g_peak; out[2] = g_nmalloc; out[3] = g_nfree;
  pthread_mutex_unlock(&g_mu);
}
void stub_mem_reset_peak(void) {
  pthread_mutex_lock(&g_mu); g_peak = g_used; g_nmalloc = g_nfree = 0; pthread_mutex_unlock(&g_mu);
}

/* ---- tiny handle table for cuMemCreate ---- */
#define MAXH (1 << 16)
static unsigned long long h_size[MAXH];
static unsigned long long h_next = 1;

CUresult cuInit(unsigned int f) { (void)f; return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *v) { *v = 13020; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *c) { *c = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int o) { if (o != 0) return CUDA_ERROR_INVALID_DEVICE; *d = 0; return CUDA_SUCCESS; }
CUresult cuDeviceGetName(char *n, int len, CUdevice d) { (void)d; snprintf(n, len, "StubGPU (no device)"); return CUDA_SUCCESS; }
CUresult cuDeviceTotalMem(size_t *b, CUdevice d) { (void)d; *b = stub_total_mem(); return CUDA_SUCCESS; }
CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute a, CUdevice d) {
  (void)d;
  switch (a) {
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 132; break;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
  case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *pi = 1; break;
  case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: *pi = 1; break;
  case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *pi = 1; break;
  default: *pi = 0;
  }
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char **s) { *s = e == CUDA_SUCCESS ? "no error" : e == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory (stub)" : "stub driver error"; return CUDA_SUCCESS; }
CUresult cuGetErrorName(CUresult e, const char **s) { *s = e == CUDA_SUCCESS ? "CUDA_SUCCESS" : "CUDA_ERROR_STUB"; return CUDA_SUCCESS; }

static int dummy_ctx;
CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active) { (void)d; *flags = 0; *active = 1; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; *c = (CUcontext)&dummy_ctx; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)&dummy_ctx; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { (void)c; return CUDA_SUCCESS; }
CUresult cuCtxPushCurrent(CUcontext c) { (void)c; return CUDA_SUCCESS; }
CUresult cuCtxPopCurrent(CUcontext *c) { if (c) *c = (CUcontext)&dummy_ctx; return CUDA_SUCCESS; }

/* ---- virtual memory management (expandable segments) ---- */
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, CUmemAllocationGranularity_flags o) {
  (void)p; (void)o; *g = 2u << 20; return CUDA_SUCCESS;
}
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long f) {
  (void)align; (void)addr; (void)f;
  void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = (CUdeviceptr)(uintptr_t)p; return CUDA_SUCCESS;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { munmap((void *)(uintptr_t)ptr, size); return CUDA_SUCCESS; }
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p, unsigned long long f) {
  (void)p; (void)f;
  if (stub_mem_charge(size)) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&g_mu);
  unsigned long long id = 0;
  for (unsigned long long i = 0; i < MAXH; i++) { unsigned long long k = (h_next + i) % MAXH; if (k && !h_size[k]) { id = k; break; } }
  if (id) { h_size[id] = size; h_next = id + 1; }
  pthread_mutex_unlock(&g_mu);
  if (!id) { stub_mem_uncharge(size); return CUDA_ERROR_OUT_OF_MEMORY; }
  *h = id; return CUDA_SUCCESS;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  if (h == 0 || h >= MAXH || !h_size[h]) return CUDA_ERROR_INVALID_VALUE;
  unsigned long long s = h_size[h]; h_size[h] = 0; stub_mem_uncharge(s); return CUDA_SUCCESS;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long f) { (void)ptr; (void)size; (void)off; (void)h; (void)f; return CUDA_SUCCESS; }
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { (void)ptr; (void)size; return CUDA_SUCCESS; }
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *d, size_t n) { (void)ptr; (void)size; (void)d; (void)n; return CUDA_SUCCESS; }
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) { (void)addr; *h = 0; return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *p, CUmemGenericAllocationHandle h) { (void)h; memset(p, 0, sizeof *p); p->type = CU_MEM_ALLOCATION_TYPE_PINNED; p->location.type = CU_MEM_LOCATION_TYPE_DEVICE; return CUDA_SUCCESS; }
CUresult cuMemExportToShareableHandle(void *sh, CUmemGenericAllocationHandle h, CUmemAllocationHandleType t, unsigned long long f) { (void)sh; (void)h; (void)t; (void)f; return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *sh, CUmemAllocationHandleType t) { (void)h; (void)sh; (void)t; return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p) { if (base) *base = p; if (size) *size = 0; return CUDA_SUCCESS; }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s) { (void)d; (void)v; (void)n; (void)s; return CUDA_SUCCESS; }
CUresult cuStreamWriteValue32(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f) { (void)s; (void)a; (void)v; (void)f; return CUDA_SUCCESS; }
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p) { (void)a; (void)p; if (data) memset(data, 0, sizeof(int)); return CUDA_SUCCESS; }
/* for the harness: change the fake device capacity at run time (0 = back to default) */
void stub_set_total_mem(unsigned long long b) { g_total = b; if (!b) stub_total_mem(); }
