// Included by every generated instance (through its family's prelude or header).
#pragma once

#include <cstdio>

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
