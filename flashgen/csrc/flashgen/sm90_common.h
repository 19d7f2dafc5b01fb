// Pieces both Hopper kernels (sm90_fwd.h, sm90_bwd.h) use: fast math on
// accumulator rows, one warpgroup-wide wgmma GEMM, a tile's TMA loads.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>

namespace flashgen {
namespace sm90 {

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// One warpgroup-wide wgmma GEMM over the K modes of a and b, accumulating into c
// (or overwriting it when kZeroInit), waited for before returning.  kARegisters:
// a is a register fragment (fenced like c), not shared-memory descriptors.
template <bool kZeroInit, bool kARegisters, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TensorA const& a, TensorB const& b, TensorC& c) {
  using namespace cute;
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) {
    warpgroup_fence_operand(const_cast<TensorA&>(a));
  }
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) {
    warpgroup_fence_operand(const_cast<TensorA&>(a));
  }
}

// The TMA loads of one tile of `rows` rows of a [batch, seq, heads, head_dim] tensor map
// into `smem`: kBoxes boxes of kBoxCols columns (one swizzle span each), box after box along
// the head dim.  Their bytes count toward the transaction barrier `full`.
template <int kBoxCols, int kBoxes, class Element>
__device__ __forceinline__ void tma_load_tile(CUtensorMap const* map, uint64_t* full, Element* smem, int rows,
                                              int row0, int head, int batch) {
  constexpr uint64_t kHint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  CUTE_UNROLL
  for (int c = 0; c < kBoxes; ++c) {
    cute::SM90_TMA_LOAD_4D::copy(map, full, kHint, smem + c * rows * kBoxCols, c * kBoxCols, row0, head, batch);
  }
}

}  // namespace sm90
}  // namespace flashgen
