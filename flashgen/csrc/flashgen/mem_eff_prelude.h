// Included first by every generated example-41 instance (flashgen/generator/templates/mem_eff.cu.j2).
#pragma once

#include <cstddef>
#include <cstdio>
#include <type_traits>

// Dropout: the example-41 kernels seed their Philox generator only under
// HAS_PYTORCH.  flashgen defines it and puts aten_shim/ (its own two-piece
// replacement for what that switch pulls in) on the include path.
#define HAS_PYTORCH 1

// The kernels include <curand_kernel.h> but only use Philox.  Left alone, its
// curand_precalc.h puts curand's XORWOW skip-ahead tables (2 x 100 KB of
// __device__ data) into every cubin.  Headers from curand 10.4.5 on skip them
// under CURAND_TABLE_INCLUDE_FILTER, but older ones (10.4.0, which CUDA 13.0's
// toolkit ships, through 10.4.4) have no such switch and define them always,
// `static __device__`: a device-only build then keeps them silently, and a host
// compile rejects them as a redefinition of an `extern __device__` declaration.
// So the prelude takes curand_precalc.h's place, for every header version
// alike: it claims the header's include guard and gives curand_kernel.h what
// it uses from there.
#if defined(CURAND_XORWOW_PRECALCULATED_H_)
#error "flashgen/mem_eff_prelude.h must be included before <curand_kernel.h>"
#endif
#define CURAND_XORWOW_PRECALCULATED_H_
#define CURAND_TABLE_INCLUDE_FILTER 1  // the official switch too, for a header that renames its guard
#define PRECALC_NUM_MATRICES (32)
#define PRECALC_MATRIX_SIZE (800)
#define PRECALC_BLOCK_SIZE (2)
#define PRECALC_BLOCK_MASK ((1<<PRECALC_BLOCK_SIZE)-1)
#define XORWOW_SEQUENCE_SPACING (67)
// The device tables are no variables at all: an `extern __device__` array is
// "treated as a static definition" without -rdc (warning #20044-D) and would
// still reserve 200 KB of zeroed .nv.global per loaded cubin.  The (never
// instantiated) XORWOW helpers only index them; should a kernel ever use
// XORWOW, the call to this undefined function fails its build.
__device__ unsigned int (*flashgen_curand_xorwow_tables_are_not_compiled_in())[PRECALC_MATRIX_SIZE];
#define precalc_xorwow_matrix (flashgen_curand_xorwow_tables_are_not_compiled_in())
#define precalc_xorwow_offset_matrix (flashgen_curand_xorwow_tables_are_not_compiled_in())
#if !defined(__CUDACC_RTC__)
// Host copies (host-side skip-ahead): declared, never defined; unused, so never linked.
extern unsigned int precalc_xorwow_matrix_host[PRECALC_NUM_MATRICES][PRECALC_MATRIX_SIZE];
extern unsigned int precalc_xorwow_offset_matrix_host[PRECALC_NUM_MATRICES][PRECALC_MATRIX_SIZE];
#endif

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
