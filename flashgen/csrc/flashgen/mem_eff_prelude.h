// Included first by every generated example-41 instance (flashgen/generator/templates/mem_eff.cu.j2).
#pragma once

#include <cstddef>
#include <cstdio>
#include <type_traits>

// Dropout: the example-41 kernels seed their Philox generator only under
// HAS_PYTORCH.  flashgen defines it and puts aten_shim/ (its own two-piece
// replacement for what that switch pulls in) on the include path.
#define HAS_PYTORCH 1

// The kernels include <curand_kernel.h> but only use Philox.  Without this,
// every cubin carries curand's XORWOW skip-ahead tables (~200 KB of
// __device__ data).  The filter drops their definitions; the declarations keep
// the (never instantiated) XORWOW helpers compiling.
#define CURAND_TABLE_INCLUDE_FILTER 1
extern __device__ unsigned int precalc_xorwow_matrix[32][800];
extern __device__ unsigned int precalc_xorwow_offset_matrix[32][800];

// Called instead of the kernel body when an instance is compiled for a target
// outside its arch tag's range (for example an sm75-tag kernel built for sm_80).
__device__ __noinline__ inline void flashgen_wrong_arch(const char* kernel, int lo, int hi) {
#if defined(__CUDA_ARCH__)
  if (threadIdx.x == 0 && threadIdx.y == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    printf("flashgen: %s supports compute capability %d.%d to below %d.%d, but was compiled for sm_%d; "
           "it refuses to run\n", kernel, lo / 10, lo % 10, hi / 10, hi % 10, __CUDA_ARCH__ / 10);
  }
  __trap();
#endif
}
