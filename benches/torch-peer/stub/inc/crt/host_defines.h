/* Minimal host-only replacement for the CUDA toolkit's crt/host_defines.h,
 * which the PyPI cuda-runtime wheel does not ship. Enough for plain C. */
#pragma once
#define __host__
#define __device__
#define __global__
#define __shared__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __align__(n)
#define __thread__ __thread
#define __cudart_builtin__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __CUDA_ALIGN__(n) __align__(n)
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define __specialization_static
#define __annotate_annotation__(x)
#define __nv_pure__
#define __cudart_builtin__
#define __location__(a) __##a##__
#define __attribute_unused__ __attribute__((unused))
