// The parts of the Ampere kernels (sm80_fwd.h, sm80_bwd.h) that are not attention: whole tiles
// moved between global and swizzled shared memory in 16-byte chunks, views of mma.sync
// accumulators (rows and columns; reused as the A operand of the next MMA), and the k-loops
// of a GEMM whose next k-slice's fragments load while this one's MMAs run.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flashgen {
namespace sm80 {

constexpr float kLog2e = 1.44269504088896341f;  // log2(e): a bias's natural-log units to the kernels' log2 ones

// Four 8 x 8 matrices of 16-bit values from shared memory (ldmatrix.x4), lane l giving the address
// of row l % 8 of matrix l / 8 (16 contiguous bytes, 16-byte aligned).  values[i] gets matrix i's
// (row l / 4, columns 2 (l % 4) and + 1), low half first -- an mma.sync accumulator's register pair
// -- or, kTransposed, its (rows 2 (l % 4) and + 1, column l / 4).
template <bool kTransposed, class Element>
__device__ __forceinline__ void load_matrix_x4(Element const* row, uint32_t (&values)[4]) {
  auto const& chunk = *reinterpret_cast<cute::uint128_t const*>(row);
  if constexpr (kTransposed) {
    cute::SM75_U16x8_LDSM_T::copy(chunk, values[0], values[1], values[2], values[3]);
  } else {
    cute::SM75_U32x4_LDSM_N::copy(chunk, values[0], values[1], values[2], values[3]);
  }
}

// Half `half` (0: the low 16 bits) of a register pair as float.
template <class Element>
__device__ __forceinline__ float unpack_half(uint32_t bits, int half) {
  return static_cast<float>(Element::bitcast(static_cast<uint16_t>(bits >> (16 * half))));
}

// Row-major tiles of kHeadDim columns between global memory and a shared-memory layout
// SmemLayout (8-row swizzle period, 64-column atoms), moved by kThreads threads in 16-byte
// chunks.  A pass covers kRowsPerPass rows, a multiple of the swizzle period, and a
// thread's chunks in the next pass (or, when a row has more chunks than kThreads / 8
// threads take, its next chunk in the row, a whole number of atoms on) lie a constant
// distance further in shared memory: one address per tile rather than one per chunk,
// which the ring's refills would otherwise keep in registers.
//
// The threads of a row: as many as divide both the row's chunks and kThreads, at most kThreads / 8
// (a pass of at least one swizzle period), with a thread's chunks of a row a whole number of
// atoms apart.  A 192-column row (24 chunks) takes 8 threads of 3 chunks: 16 or 24 threads would
// leave chunks unread or rows split between passes.
template <int kChunksPerRow, int kThreads, int kChunk>
constexpr int threads_per_row() {
  int n = kChunksPerRow < kThreads / 8 ? kChunksPerRow : kThreads / 8;
  while (kChunksPerRow % n != 0 || kThreads % n != 0 || (n != kChunksPerRow && n * kChunk % 64 != 0)) {
    --n;
  }
  return n;
}

template <class Element, int kHeadDim, int kThreads, class SmemLayout>
struct TileLoader {
  static constexpr int kChunk = 16 / int(sizeof(Element));
  static constexpr int kThreadsPerRow = threads_per_row<kHeadDim / kChunk, kThreads, kChunk>();
  static constexpr int kChunksPerThread = kHeadDim / kChunk / kThreadsPerRow;  // in one row
  static constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  static_assert(kChunksPerThread * kThreadsPerRow * kChunk == kHeadDim, "every chunk of a row");
  static_assert(kThreads % kThreadsPerRow == 0 && kRowsPerPass % 8 == 0, "whole swizzle periods per pass");
  static_assert(kChunksPerThread == 1 || kThreadsPerRow * kChunk % 64 == 0, "whole atoms between a thread's chunks");
  static constexpr int kPassStride = SmemLayout{}(kRowsPerPass, 0) - SmemLayout{}(0, 0);
  static constexpr int kChunkStride = SmemLayout{}(0, kThreadsPerRow * kChunk) - SmemLayout{}(0, 0);
  using Chunk = cute::uint128_t;

  // This thread's first chunk in the tile: (row, column) and its shared-memory offset.
  static __device__ int first_row() { return threadIdx.x / kThreadsPerRow; }
  static __device__ int first_column() { return threadIdx.x % kThreadsPerRow * kChunk; }
  static __device__ int smem_offset() { return SmemLayout{}(first_row(), first_column()); }

  // cp.async kRows rows of `src` (row stride in elements) into `smem` (a tile of SmemLayout),
  // not waited for.  Rows from `rows_valid` and columns from `cols_valid` on are zero-filled:
  // with a source size of 0 nothing is read, so those addresses may lie past the tensor.
  template <int kRows>
  static __device__ void load(Element* smem, Element const* src, int stride, int rows_valid, int cols_valid) {
    static_assert(kRows % kRowsPerPass == 0, "whole passes");
    int const row = first_row();
    int const col = first_column();
    Element* to = smem + smem_offset();
    Element const* from = src + row * (long long)stride + col;
    long long const pass_stride = kRowsPerPass * (long long)stride;
    CUTE_UNROLL
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      CUTE_UNROLL
      for (int c = 0; c < kChunksPerThread; ++c) {
        int const offset = c * kThreadsPerRow * kChunk;
        bool const ok = col + offset < cols_valid && row + pass * kRowsPerPass < rows_valid;
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(
            *reinterpret_cast<Chunk const*>(ok ? from + offset : src),
            *reinterpret_cast<Chunk*>(to + pass * kPassStride + c * kChunkStride), ok);
      }
      from += pass_stride;
    }
  }

  // load() of a tile whose kRows rows and kHeadDim columns all lie inside the tensor: no bound
  // checks, so no compares and selects per chunk.
  template <int kRows>
  static __device__ void load_whole(Element* smem, Element const* src, int stride) {
    static_assert(kRows % kRowsPerPass == 0, "whole passes");
    Element* to = smem + smem_offset();
    Element const* from = src + first_row() * (long long)stride + first_column();
    long long const pass_stride = kRowsPerPass * (long long)stride;
    CUTE_UNROLL
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      CUTE_UNROLL
      for (int c = 0; c < kChunksPerThread; ++c) {
        cute::SM80_CP_ASYNC_CACHEGLOBAL<Chunk>::copy(*reinterpret_cast<Chunk const*>(from + c * kThreadsPerRow * kChunk),
                                                     *reinterpret_cast<Chunk*>(to + pass * kPassStride + c * kChunkStride));
      }
      from += pass_stride;
    }
  }

  // The first `rows_valid` rows and `cols_valid` columns of `smem` (kRows rows of SmemLayout) to `dst`.
  template <int kRows>
  static __device__ void store(Element const* smem, Element* dst, int stride, int rows_valid, int cols_valid) {
    int const row = first_row();
    int const col = first_column();
    Element const* from = smem + smem_offset();
    Element* to = dst + row * (long long)stride + col;
    long long const pass_stride = kRowsPerPass * (long long)stride;
    CUTE_UNROLL
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      CUTE_UNROLL
      for (int c = 0; c < kChunksPerThread; ++c) {
        int const offset = c * kThreadsPerRow * kChunk;
        if (col + offset < cols_valid && row + pass * kRowsPerPass < rows_valid) {
          *reinterpret_cast<Chunk*>(to + offset) =
              *reinterpret_cast<Chunk const*>(from + pass * kPassStride + c * kChunkStride);
        }
      }
      to += pass_stride;
    }
  }
};

// An mma.sync accumulator ((2 columns, 2 row halves), MMA_M, MMA_N) -- the register layout of
// CuTe's SM80 16x8 C fragments -- as (rows, columns): row r of the view is one row of the tile
// (held by this thread's quad), column c one of its columns.
template <class Layout>
__host__ __device__ constexpr auto rows_cols_layout(Layout const& acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3, "((2, 2), MMA_M, MMA_N)");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

template <class Engine, class Layout>
__host__ __device__ auto rows_cols(cute::Tensor<Engine, Layout> const& acc) {
  return cute::make_tensor(acc.data(), rows_cols_layout(acc.layout()));
}

// The accumulator of a tile of S (rows x keys) as the A operand of O += P V: one 16x16 A
// fragment is the accumulators of two neighbouring 16x8 MMAs, so ((2, 2), MMA_M, MMA_N)
// becomes (((2, 2), 2), MMA_M, MMA_N / 2) over the same registers.
template <class Layout>
__host__ __device__ constexpr auto accumulator_as_a(Layout const& acc) {
  using namespace cute;
  static_assert(decltype(size<2>(acc))::value % 2 == 0, "pairs of 8-column MMAs");
  auto const pairs = logical_divide(get<2>(acc), Int<2>{});  // (2, MMA_N / 2)
  return make_layout(make_layout(get<0>(acc), get<0>(pairs)), get<1>(acc), get<1>(pairs));
}

// A register fragment converted element by element (packed cvt instructions where they exist).
template <class To, class Engine, class Layout>
__device__ auto convert(cute::Tensor<Engine, Layout> const& from) {
  using From = typename Engine::value_type;
  constexpr int kSize = decltype(cute::size(from))::value;
  auto to = cute::make_tensor<To>(from.layout());
  cutlass::NumericArrayConverter<To, From, kSize> converter;
  *reinterpret_cast<cutlass::Array<To, kSize>*>(to.data()) =
      converter(*reinterpret_cast<cutlass::Array<From, kSize> const*>(from.data()));
  return to;
}

// bar.sync of barrier `id` (1-15; __syncthreads is 0) for `threads` threads, whole warps: a
// barrier among some warps of the CTA.  (CUTLASS's NamedBarrier emits nothing below sm_90.)
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// acc += A B over the K mode, both operands from shared memory by ldmatrix; the next k-slice's
// fragments load while this one's MMAs run.
template <class Mma, class Acc, class CopyA, class SrcA, class RegA, class ViewA, class CopyB, class SrcB,
          class RegB, class ViewB>
__device__ void gemm_ss(Mma& mma, Acc& acc, CopyA const& copy_a, SrcA const& src_a, RegA& reg_a, ViewA& view_a,
                        CopyB const& copy_b, SrcB const& src_b, RegB& reg_b, ViewB& view_b) {
  using namespace cute;
  copy(copy_a, src_a(_, _, 0), view_a(_, _, 0));
  copy(copy_b, src_b(_, _, 0), view_b(_, _, 0));
  CUTE_UNROLL
  for (int kk = 0; kk < size<2>(reg_a); ++kk) {
    if (kk + 1 < size<2>(reg_a)) {
      copy(copy_a, src_a(_, _, kk + 1), view_a(_, _, kk + 1));
      copy(copy_b, src_b(_, _, kk + 1), view_b(_, _, kk + 1));
    }
    gemm(mma, reg_a(_, _, kk), reg_b(_, _, kk), acc);
  }
}

// acc += A B with A in registers, B from shared memory.
template <class Mma, class Acc, class RegA, class CopyB, class SrcB, class RegB, class ViewB>
__device__ void gemm_rs(Mma& mma, Acc& acc, RegA const& reg_a, CopyB const& copy_b, SrcB const& src_b,
                        RegB& reg_b, ViewB& view_b) {
  using namespace cute;
  copy(copy_b, src_b(_, _, 0), view_b(_, _, 0));
  CUTE_UNROLL
  for (int kk = 0; kk < size<2>(reg_a); ++kk) {
    if (kk + 1 < size<2>(reg_a)) {
      copy(copy_b, src_b(_, _, kk + 1), view_b(_, _, kk + 1));
    }
    gemm(mma, reg_a(_, _, kk), reg_b(_, _, kk), acc);
  }
}

// gemm_ss and gemm_rs with B loaded one ldmatrix at a time, each just ahead of the MMAs that
// read it, where the k-loops above load a whole k-slice ahead: a k-slice of a wide B (64
// queries, or 128 head-dim columns) is 16 or 32 registers, and holding the next one beside the
// current one is more than a 16-row warp tile beside large accumulators can afford.  One
// ldmatrix of B fills kNPerCopy neighbouring MMA columns: view_b(_, j, kk) is reg_b(_, j *
// kNPerCopy + i, kk), i < kNPerCopy, as CuTe's retile of a 16-wide B tile lays them out.  A, if
// from shared memory, loads with B's first piece of each k-slice.
// x through an empty volatile asm where kOpaque: the compiler must take it as a new value each
// time, so that what it derives from it (per-thread offsets the same at every step of a loop)
// is recomputed where used instead of kept in registers through the loop.
template <bool kOpaque>
__device__ __forceinline__ int opaque(int x) {
  if constexpr (kOpaque) {
    asm volatile("" : "+r"(x));
  }
  return x;
}

// Whether every register of copy j of k-slice kk (view(_, j, kk)) is one of reg(_, n, kk) with
// j * kNPerCopy <= n < (j + 1) * kNPerCopy: what the fine k-loops below assume (static layouts).
template <class RegLayout, class ViewLayout>
constexpr bool copies_fill_column_groups() {
  using namespace cute;
  RegLayout reg{};
  ViewLayout view{};
  constexpr int kV = decltype(size<0>(reg))::value, kN = decltype(size<1>(reg))::value;
  constexpr int kK = decltype(size<2>(reg))::value;
  constexpr int kI = decltype(size<0>(view))::value, kCopies = decltype(size<1>(view))::value;
  constexpr int kNPerCopy = kN / kCopies;
  if (decltype(size<2>(view))::value != kK || kNPerCopy * kCopies != kN || kI != kV * kNPerCopy) {
    return false;
  }
  for (int kk = 0; kk < kK; ++kk) {
    for (int j = 0; j < kCopies; ++j) {
      for (int i = 0; i < kI; ++i) {
        int const offset = view(i, j, kk);
        bool found = false;
        for (int n = j * kNPerCopy; n < (j + 1) * kNPerCopy; ++n) {
          for (int v = 0; v < kV; ++v) {
            found = found || int(reg(v, n, kk)) == offset;
          }
        }
        if (!found) {
          return false;
        }
      }
    }
  }
  return true;
}

template <class Mma, class Acc, class RegA, class RegB>
__device__ void mma_columns(Mma& mma, Acc& acc, RegA const& reg_a, RegB const& reg_b, int kk, int n0, int count) {
  using namespace cute;
  CUTE_UNROLL
  for (int n = n0; n < n0 + count; ++n) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(acc); ++m) {
      gemm(mma, acc(_, m, n), reg_a(_, m, kk), reg_b(_, n, kk), acc(_, m, n));
    }
  }
}

// The fine k-loop: B comes in an ldmatrix at a time and each copy's MMA columns are issued as soon
// as it is in, so only one copy of B is live beside the accumulators.  ``load_a(kk)`` brings A's
// k-slice kk into registers just before B's first copy of that slice (a no-op where A is already
// there).
template <class Mma, class Acc, class RegA, class LoadA, class CopyB, class SrcB, class RegB, class ViewB>
__device__ void gemm_fine(Mma& mma, Acc& acc, RegA const& reg_a, LoadA&& load_a, CopyB const& copy_b,
                          SrcB const& src_b, RegB& reg_b, ViewB& view_b) {
  using namespace cute;
  constexpr int kK = decltype(size<2>(reg_a))::value;
  constexpr int kCopies = decltype(size<1>(view_b))::value;  // ldmatrix of B per k-slice
  constexpr int kNPerCopy = decltype(size<1>(reg_b))::value / kCopies;
  static_assert(kNPerCopy * kCopies == decltype(size<1>(reg_b))::value, "whole MMA columns per copy");
  static_assert(copies_fill_column_groups<decltype(reg_b.layout()), decltype(view_b.layout())>(),
                "each ldmatrix of B fills its own kNPerCopy MMA columns");
  load_a(0);
  copy(copy_b, src_b(_, 0, 0), view_b(_, 0, 0));
  CUTE_UNROLL
  for (int kk = 0; kk < kK; ++kk) {
    CUTE_UNROLL
    for (int j = 0; j < kCopies; ++j) {
      if (j + 1 < kCopies) {
        copy(copy_b, src_b(_, j + 1, kk), view_b(_, j + 1, kk));
      } else if (kk + 1 < kK) {
        load_a(kk + 1);
        copy(copy_b, src_b(_, 0, kk + 1), view_b(_, 0, kk + 1));
      }
      mma_columns(mma, acc, reg_a, reg_b, kk, j * kNPerCopy, kNPerCopy);
    }
  }
}

// A and B both from shared memory (A's slices through view_a, which aliases reg_a).
template <class Mma, class Acc, class CopyA, class SrcA, class RegA, class ViewA, class CopyB, class SrcB,
          class RegB, class ViewB>
__device__ void gemm_ss_fine(Mma& mma, Acc& acc, CopyA const& copy_a, SrcA const& src_a, RegA& reg_a, ViewA& view_a,
                             CopyB const& copy_b, SrcB const& src_b, RegB& reg_b, ViewB& view_b) {
  auto load_a = [&](int kk) { cute::copy(copy_a, src_a(cute::_, cute::_, kk), view_a(cute::_, cute::_, kk)); };
  gemm_fine(mma, acc, reg_a, load_a, copy_b, src_b, reg_b, view_b);
}

// A already in registers.
template <class Mma, class Acc, class RegA, class CopyB, class SrcB, class RegB, class ViewB>
__device__ void gemm_rs_fine(Mma& mma, Acc& acc, RegA const& reg_a, CopyB const& copy_b, SrcB const& src_b,
                             RegB& reg_b, ViewB& view_b) {
  gemm_fine(mma, acc, reg_a, [](int) {}, copy_b, src_b, reg_b, view_b);
}

// gemm_ss / gemm_rs, or their fine variants where kFine.
template <bool kFine, class... Args>
__device__ void gemm_ss_or_fine(Args&&... args) {
  if constexpr (kFine) {
    gemm_ss_fine(args...);
  } else {
    gemm_ss(args...);
  }
}

template <bool kFine, class... Args>
__device__ void gemm_rs_or_fine(Args&&... args) {
  if constexpr (kFine) {
    gemm_rs_fine(args...);
  } else {
    gemm_rs(args...);
  }
}

}  // namespace sm80
}  // namespace flashgen
