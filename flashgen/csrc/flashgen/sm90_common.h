// Pieces both Hopper kernels (sm90_fwd.h, sm90_bwd.h) use: one warpgroup-wide
// wgmma GEMM, a tile's TMA loads, bulk reduce-adds.  The arch-neutral pieces (fast
// math on accumulator rows, sequences of packed batches, band-mask block ranges)
// are in attention_common.h, shared with the Ampere forward.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>

#include "flashgen/attention_common.h"

namespace flashgen {
namespace sm90 {

constexpr float kLog2e = 1.44269504088896341f;  // log2(e): natural-log units to the kernels' log2 ones

// The registers a thread of a `threads`-thread block holds at launch (one block per SM, ptxas's
// bound, in whole 8-register steps): all that setmaxnreg can move between warpgroups.  An increase
// past what the others gave back waits forever (a hang, not an error), so the splits are asserted.
constexpr int launch_registers(int threads) { return (65536 / threads < 255 ? 65536 / threads : 255) / 8 * 8; }

// Score mods (flashgen/spec/score_mods.py): a kernel's last template parameter is a functor type
// whose static apply(p, score, b, h, q_idx, kv_idx) makes the new score from the scaled one and
// grad(...) its derivative in score, reading up to kModTensors captured tensors of up to kModDims
// dims through the Params' mod_ptr / mod_stride (elements).  The generated functors set kEnabled;
// plain instances take NoScoreMod, whose code paths are compiled out.
constexpr int kModTensors = 4;
constexpr int kModDims = 4;
struct NoScoreMod {
  static constexpr bool kEnabled = false;
};

// Two 16-bit values (half or bfloat16) in one register, low half first, by bit operations: a
// reinterpret_cast of a local array element put the whole array in local memory (spills).
template <class Element>
__device__ __forceinline__ float unpack_half(uint32_t bits, int half) {
  return static_cast<float>(Element::bitcast(static_cast<uint16_t>(bits >> (16 * half))));
}
template <class Element>
__device__ __forceinline__ uint32_t pack_pair(Element low, Element high) {
  return uint32_t(low.raw()) | (uint32_t(high.raw()) << 16);
}

// This thread's warpgroup, as a value the compiler knows to be the same across the warp (read from
// lane 0): the wgmma operand descriptors computed from it then live in uniform registers.  From
// threadIdx.x / 128 they were per-thread values, copied into uniform registers (R2UR) before every
// wgmma, 4-5 instructions each: a fifth of the head-dim-128 backward's loop.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0); }

// The wgmma instructions of one warpgroup-wide GEMM over the K modes of a and b, accumulating
// into c (or overwriting it when kZeroInit), as one commit group, not waited for.  The caller
// fences the register operands and issues warpgroup_arrive() before (once for all the GEMMs
// it issues together: a register move between two of them would serialise the wgmmas), and
// waits (warpgroup_wait<N>) and fences them again before touching them.
template <bool kZeroInit, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void warpgroup_gemm_issue(TiledMma& mma, TensorA const& a, TensorB const& b,
                                                     TensorC& c) {
  using namespace cute;
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// One warpgroup-wide wgmma GEMM (warpgroup_gemm_issue), fenced and waited for.  kARegisters:
// a is a register fragment (fenced like c), not shared-memory descriptors.
template <bool kZeroInit, bool kARegisters, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TensorA const& a, TensorB const& b, TensorC& c) {
  using namespace cute;
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) {
    warpgroup_fence_operand(const_cast<TensorA&>(a));
  }
  warpgroup_arrive();
  warpgroup_gemm_issue<kZeroInit>(mma, a, b, c);
  warpgroup_wait<0>();
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) {
    warpgroup_fence_operand(const_cast<TensorA&>(a));
  }
}

// Consumer warpgroups take turns issuing their GEMMs (ping-pong), so one warpgroup's softmax
// runs while the others' GEMMs keep the tensor cores busy: left alone, the warpgroups of a
// CTA drift into step (they wait for the same tiles) and all do their softmax at once.
// Warpgroup w waits on named barrier kFirstBarrier + w for its turn and, once its GEMMs are
// issued, passes the turn to w + 1 (the last back to 0).  Each barrier counts the 128 threads
// that wait plus the 128 that pass.  Every warpgroup takes the same number of turns; the last
// one gives warpgroup 0 its first turn on construction, and warpgroup 0 takes that last pass
// back in finish(), so no arrival is left over when the CTA exits.
template <int kWarpGroups, int kFirstBarrier = 1>
struct TurnTaking {
  static constexpr bool kEnabled = kWarpGroups > 1;
  int const group;

  __device__ explicit TurnTaking(int warp_group) : group(warp_group) {
    if (kEnabled && group == kWarpGroups - 1) {
      pass();
    }
  }
  __device__ void wait() const {
    if constexpr (kEnabled) {
      asm volatile("bar.sync %0, 256;" ::"r"(kFirstBarrier + group) : "memory");
    }
  }
  __device__ void pass() const {
    if constexpr (kEnabled) {
      asm volatile("bar.arrive %0, 256;" ::"r"(kFirstBarrier + (group + 1) % kWarpGroups) : "memory");
    }
  }
  // After the last turn: warpgroup 0 consumes the pass no turn of its own is left to take.
  __device__ void finish() const {
    if (group == 0) {
      wait();
    }
  }
};

// The kernel's SharedStorage at the first 1024-byte boundary of dynamic shared memory (the
// 128-byte swizzles want it).  The offset is added to the __shared__ array's pointer rather
// than rounding its address as an integer: through an integer the compiler loses that the
// storage is shared memory, and every plain access to it (lse, delta, the dS and dQ tiles)
// became a generic LD/ST, slower than LDS/STS and queued with the global-memory traffic.
template <class Storage>
__device__ __forceinline__ Storage& shared_storage(char* smem_raw) {
  uint32_t const misalignment = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) % 1024;
  return *reinterpret_cast<Storage*>(smem_raw + (1024 - misalignment) % 1024);
}

// Four 8 x 8 tiles of 16-bit values into shared memory (stmatrix): this thread holds the pair
// (row lane / 4, columns 2 * (lane % 4) and + 1) of tile j in values[j] -- or, kTransposed,
// the pair (rows 2 * (lane % 4) and + 1, column lane / 4) -- and addresses row lane % 8 of tile
// lane / 8 (16 contiguous bytes) at `smem` -- an address cute computed, whose swizzled pointers
// are integers to the compiler, hence the explicit shared state space.
template <bool kTransposed = false>
__device__ __forceinline__ void store_matrix_x4(void* smem, uint32_t const (&values)[4]) {
  uint32_t const address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (kTransposed) {
    asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address),
                 "r"(values[0]), "r"(values[1]), "r"(values[2]), "r"(values[3])
                 : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address),
                 "r"(values[0]), "r"(values[1]), "r"(values[2]), "r"(values[3])
                 : "memory");
  }
}

// Two adjacent floats from shared memory in one 8-byte load (the compiler split the same load
// written in C++ into two 4-byte ones).
__device__ __forceinline__ float2 load_shared_f32x2(float const* smem) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
               : "=f"(v.x), "=f"(v.y)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))));
  return v;
}

// One bulk reduce-add of `bytes` (a multiple of 16) of fp32 from shared into global memory: the
// TMA unit does the adds.  It joins the issuing thread's bulk group (bulk_wait_read/_all).
__device__ __forceinline__ void bulk_reduce_add(float* gmem, float const* smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :
               : "l"(gmem), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// This thread's bulk operations have read their shared memory (it may be rewritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// This thread's bulk operations are complete, writes included.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Orders this thread's generic-proxy accesses to global memory with its async-proxy (TMA) ones.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

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

// The kBias instances stage the additive bias through shared memory.  The producer's TMA loads
// a (query rows x keys) tile of it as boxes of kBiasBox keys x kBiasBox query rows: 128-byte
// rows of keys with the 128-byte swizzle (16-byte chunk c of row r lands at chunk c ^ (r % 8)
// of its row, boxes 1024-byte aligned).  The consumers read their accumulator-layout pairs from
// it with ldmatrix, each 8 x 8 matrix being 16 bytes of eight consecutive rows, which the
// swizzle puts in eight different chunk columns: all 32 banks, no conflict.  The tensor map
// (the runtime's sm90_common.bias_fields) is [batch, heads, queries, keys], with extent 1 in
// each dim the bias broadcasts; such a dim is read at coordinate 0 (its Params step is 0), and
// a query-broadcast bias has one row, which the consumers read for every query (TMA fills the
// box's other rows with zeros).  Rows and keys past the tensor's end are zeros too.
constexpr int kBiasBox = 64;
constexpr int kBiasBoxBytes = kBiasBox * kBiasBox * 2;

// One bias tile: query rows row0 .. row0 + 64 * kRowBoxes - 1, keys key0 .. key0 + 64 * kKeyBoxes
// - 1, into `smem` (1024-byte aligned), box (i, j) -- the i-th 64 rows, the j-th 64 keys -- at
// box number i * kRowBoxStride + j * kKeyBoxStride.  Its bytes count toward `full`; the caller
// expects them.
template <int kRowBoxes, int kKeyBoxes, int kRowBoxStride, int kKeyBoxStride, class Params, class Element>
__device__ __forceinline__ void tma_load_bias(Params const& p, uint64_t* full, Element* smem, int row0, int key0,
                                              int head, int batch) {
  constexpr uint64_t kHint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  static_assert(sizeof(Element) == 2, "a box row is one 128-byte swizzle span of 16-bit values");
  CUTE_UNROLL
  for (int i = 0; i < kRowBoxes; ++i) {
    CUTE_UNROLL
    for (int j = 0; j < kKeyBoxes; ++j) {
      Element* box = smem + (i * kRowBoxStride + j * kKeyBoxStride) * kBiasBox * kBiasBox;
      cute::SM90_TMA_LOAD_4D::copy(&p.bias_map, full, kHint, box, key0 + j * kBiasBox,
                                   (row0 + i * kBiasBox) * p.bias_row_step, head * p.bias_head_step,
                                   batch * p.bias_batch_step);
    }
  }
}

// Four 8 x 8 matrices of 16-bit values from shared memory (ldmatrix), lane l addressing row
// l % 8 of matrix l / 8 (16 contiguous bytes).  values[i] gets matrix i's (row l / 4, columns
// 2 * (l % 4) and + 1) -- a wgmma accumulator's register pair -- or, kTransposed, its (rows
// 2 * (l % 4) and + 1, column l / 4), low half first.
template <bool kTransposed>
__device__ __forceinline__ void load_matrix_x4(void const* smem, uint32_t (&values)[4]) {
  uint32_t const address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (kTransposed) {
    asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(values[0]), "=r"(values[1]), "=r"(values[2]), "=r"(values[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(values[0]), "=r"(values[1]), "=r"(values[2]), "=r"(values[3])
                 : "r"(address));
  }
}

}  // namespace sm90
}  // namespace flashgen
