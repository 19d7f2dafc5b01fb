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

// Shared-memory zero fill without a pending asynchronous write.
//
// The example-41 GEMM mainloops load operands with cutlass::arch::cp_async_zfill,
// which writes zeros with an *asynchronous* cp.async (source size 0) wherever a
// tile lies outside the problem, including for the pipeline stages issued past
// the last k-iteration.  The backward kernels (and the forward with kPreloadV)
// leave the mainloop without waiting for those groups and reuse the same shared
// memory for the epilogue (SharedStorage unions), so a zero fill can still be in
// flight when the epilogue writes there: compute-sanitizer racecheck reports it
// as a write-write hazard.  These full specialisations keep real copies
// asynchronous and do the zero fill as an ordinary store at the point of issue,
// which the kernels' own barriers then order before any later reuse.
#include "cutlass/arch/memory_sm80.h"

namespace flashgen_detail {
template <int Bytes, cutlass::arch::CacheOperation::Kind Op>
__device__ __forceinline__ void copy_async_or_zero(void* smem_ptr, void const* global_ptr, bool pred_guard) {
  if (pred_guard) {
    cutlass::arch::cp_async<Bytes, Op>(smem_ptr, global_ptr, true);
  } else {
    cutlass::Array<uint8_t, Bytes> zeros;
    zeros.clear();
    *static_cast<cutlass::Array<uint8_t, Bytes>*>(smem_ptr) = zeros;
  }
}
}  // namespace flashgen_detail

#define FLASHGEN_SYNC_ZFILL(BYTES, OP)                                                              \
  template <>                                                                                     \
  struct cp_async_zfill<BYTES, CacheOperation::OP> {                                              \
    __device__ __forceinline__ cp_async_zfill(void* smem_ptr, void const* global_ptr, bool pred_guard = true) { \
      flashgen_detail::copy_async_or_zero<BYTES, cutlass::arch::CacheOperation::OP>(smem_ptr, global_ptr, pred_guard); \
    }                                                                                             \
  };
namespace cutlass {
namespace arch {
FLASHGEN_SYNC_ZFILL(4, Always)
FLASHGEN_SYNC_ZFILL(8, Always)
FLASHGEN_SYNC_ZFILL(16, Always)
FLASHGEN_SYNC_ZFILL(16, Global)
}  // namespace arch
}  // namespace cutlass
#undef FLASHGEN_SYNC_ZFILL

#include "flashgen/wrong_arch.h"
