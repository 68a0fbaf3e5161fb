/* Minimal fake CUDA runtime (SONAME libcudart.so.13) for a GPU-less host.
 * Hand-written entry points are below; every other runtime symbol that the
 * torch libraries import is a generated "return cudaSuccess" stub (gen.py). */
#define _GNU_SOURCE
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

extern unsigned long long stub_total_mem(void);
extern int stub_mem_charge(unsigned long long);
extern void stub_mem_uncharge(unsigned long long);
extern unsigned long long stub_mem_used(void);

static __thread int t_dev = 0;

cudaError_t cudaGetDeviceCount(int *c) { *c = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = t_dev; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { if (d != 0) return cudaErrorInvalidDevice; t_dev = d; return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int *v) { *v = 13020; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13020; return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : e == cudaErrorMemoryAllocation ? "out of memory" : "stub runtime error"; }
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : e == cudaErrorMemoryAllocation ? "cudaErrorMemoryAllocation" : "cudaErrorStub"; }

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d) {
  if (d != 0) return cudaErrorInvalidDevice;
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "StubGPU (no device)");
  p->totalGlobalMem = stub_total_mem();
  p->sharedMemPerBlock = 48 << 10; p->sharedMemPerBlockOptin = 227 << 10;
  p->sharedMemPerMultiprocessor = 228 << 10;
  p->regsPerBlock = 65536; p->regsPerMultiprocessor = 65536;
  p->warpSize = 32; p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024; p->maxThreadsDim[1] = 1024; p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 0x7fffffff; p->maxGridSize[1] = 65535; p->maxGridSize[2] = 65535;
  p->major = 9; p->minor = 0; p->multiProcessorCount = 132;
  p->maxThreadsPerMultiProcessor = 2048; p->l2CacheSize = 50 << 20;
  p->memoryBusWidth = 5120; p->unifiedAddressing = 1; p->concurrentKernels = 1;
  p->managedMemory = 1; p->memoryPoolsSupported = 1; p->streamPrioritiesSupported = 1;
  p->maxBlocksPerMultiProcessor = 32; p->ipcEventSupported = 0;
  p->pciBusID = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int d) {
  (void)d;
  switch (a) {
  case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
  case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
  case cudaDevAttrMultiProcessorCount: *v = 132; break;
  case cudaDevAttrWarpSize: *v = 32; break;
  case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
  case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = 227 << 10; break;
  case cudaDevAttrMaxSharedMemoryPerBlock: *v = 48 << 10; break;
  case cudaDevAttrMaxThreadsPerMultiProcessor: *v = 2048; break;
  case cudaDevAttrL2CacheSize: *v = 50 << 20; break;
  case cudaDevAttrMemoryPoolsSupported: *v = 1; break;
  default: *v = 0;
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) { if (least) *least = 0; if (greatest) *greatest = -5; return cudaSuccess; }
cudaError_t cudaDeviceGetPCIBusId(char *s, int len, int d) { (void)d; snprintf(s, len, "0000:01:00.0"); return cudaSuccess; }

/* ---- device memory: address space only, never backed ---- */
#define HT (1 << 20)
static uintptr_t ht_key[HT];
static size_t ht_val[HT];
static pthread_mutex_t ht_mu = PTHREAD_MUTEX_INITIALIZER;
static size_t ht_slot(uintptr_t k) { return (size_t)((k >> 12) * 0x9E3779B97F4A7C15ull >> 44) & (HT - 1); }
static void ht_put(uintptr_t k, size_t v) {
  pthread_mutex_lock(&ht_mu);
  size_t i = ht_slot(k);
  while (ht_key[i] && ht_key[i] != 1) i = (i + 1) & (HT - 1);
  ht_key[i] = k; ht_val[i] = v;
  pthread_mutex_unlock(&ht_mu);
}
static size_t ht_take(uintptr_t k) {
  size_t v = 0;
  pthread_mutex_lock(&ht_mu);
  for (size_t i = ht_slot(k); ht_key[i]; i = (i + 1) & (HT - 1))
    if (ht_key[i] == k) { v = ht_val[i]; ht_key[i] = 1; /* tombstone */ break; }
  pthread_mutex_unlock(&ht_mu);
  return v;
}

cudaError_t cudaMalloc(void **p, size_t size) {
  if (size == 0) { *p = NULL; return cudaSuccess; }
  size_t r = (size + 4095) & ~(size_t)4095;
  if (stub_mem_charge(size)) { *p = NULL; return cudaErrorMemoryAllocation; }
  void *m = mmap(NULL, r, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) { stub_mem_uncharge(size); *p = NULL; return cudaErrorMemoryAllocation; }
  ht_put((uintptr_t)m, size);
  *p = m; return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
  if (!p) return cudaSuccess;
  size_t size = ht_take((uintptr_t)p);
  if (!size) return cudaErrorInvalidValue;
  munmap(p, (size + 4095) & ~(size_t)4095);
  stub_mem_uncharge(size);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *f, size_t *t) {
  size_t tot = stub_total_mem(), used = stub_mem_used();
  if (f) *f = tot - used; if (t) *t = tot; return cudaSuccess;
}
/* pinned host memory is real host memory */
cudaError_t cudaHostAlloc(void **p, size_t s, unsigned int f) { (void)f; *p = malloc(s ? s : 1); return *p ? cudaSuccess : cudaErrorMemoryAllocation; }
cudaError_t cudaMallocHost(void **p, size_t s) { return cudaHostAlloc(p, s, 0); }
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }

/* ---- streams / events: opaque handles, all work "already complete" ---- */
static cudaStream_t new_handle(void) { return (cudaStream_t)calloc(1, 64); }
cudaError_t cudaStreamCreate(cudaStream_t *s) { *s = new_handle(); return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int f) { (void)f; *s = new_handle(); return cudaSuccess; }
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned int f, int pr) { (void)f; (void)pr; *s = new_handle(); return cudaSuccess; }
cudaError_t cudaStreamDestroy(cudaStream_t s) { (void)s; return cudaSuccess; }
cudaError_t cudaStreamGetPriority(cudaStream_t s, int *pr) { (void)s; *pr = 0; return cudaSuccess; }
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st) { (void)s; *st = cudaStreamCaptureStatusNone; return cudaSuccess; }
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, enum cudaStreamCaptureStatus *st, unsigned long long *id,
                                     cudaGraph_t *g, const cudaGraphNode_t **deps, const cudaGraphEdgeData **ed, size_t *n) {
  (void)s; if (st) *st = cudaStreamCaptureStatusNone; if (id) *id = 0; if (g) *g = NULL;
  if (deps) *deps = NULL; if (ed) *ed = NULL; if (n) *n = 0; return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = (cudaEvent_t)calloc(1, 64); return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int f) { (void)f; return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) { (void)a; (void)b; *ms = 0.f; return cudaSuccess; }

/* ---- driver entry points are served from the stub libcuda.so.1 ---- */
cudaError_t cudaGetDriverEntryPointByVersion(const char *sym, void **fp, unsigned int ver, unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *st) {
  (void)ver; (void)flags;
  static void *drv;
  if (!drv) drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  void *f = drv ? dlsym(drv, sym) : NULL;
  /* cuda.h maps some names to versioned symbols (cuFoo -> cuFoo_v2) */
  for (int v = 2; !f && drv && v <= 4; v++) {
    char nm[256];
    snprintf(nm, sizeof nm, "%s_v%d", sym, v);
    f = dlsym(drv, nm);
  }
  if (getenv("STUB_CUDA_TRACE")) fprintf(stderr, "[stubcuda] entry point %s -> %p\n", sym, f);
  *fp = f;
  if (st) *st = f ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

/* ---- fat binary registration at library load: accept and ignore ---- */
static void *fatbin_handle[4];
void **__cudaRegisterFatBinary(void *fb) { (void)fb; return fatbin_handle; }
