// flashgen's Ampere-class attention backward: mma.sync, ldmatrix and cp.async only, so the
// same source runs on sm_80 .. sm_89 and, compiled as plain sm_90 code, on Hopper.  It keeps
// the contract of the Hopper backward (sm90_bwd.h): three kernels per instance, launched in
// this order on one stream, and the same workspace (lse_log2, delta, a float32 dQ accumulator
// [rows_padded, kHeadDim] per (batch, head), counters; see workspace_row0):
//   prep     per query row: delta = rowsum(dO * O), the forward's lse in the log2 domain
//            (+inf where no key contributes, so P is 0 there), zeroed dQ accumulator rows and
//            block counters;
//   main     one CTA of kWarps warps (eight; four in the 32-key CTAs that sm86/sm89's 99 KB
//            holds past head dim 128) per kBlockN keys of one (sequence, k/v head): K and V stay
//            in shared memory while Q, dO, lse_log2 and delta of kBlockM queries stream through
//            a cp.async double buffer, block after block, for every query head of the k/v
//            head's group (grouped-query dK and dV are summed in registers, k/v read in place),
//            one barrier per block (two in a 4-warp CTA with one dS^T buffer; see mainloop);
//   convert  dQ = scale * accumulator, in the input dtype and the caller's strides.
// (prep and workspace_row0 are attention_common.h's, shared with sm90_bwd.h; convert is this
// file's own: each kBlockM x kHeadDim tile of the accumulator is laid out in add_dq's order,
// see dq_slot.)
//
// In the main kernel warp w owns kKeysPerWarp keys of the CTA's block (16-key MMA tiles
// w % kKeyWarps, + kKeyWarps, ...; kKeyWarps = kWarps / 2) and query half w / kKeyWarps of every
// query block.  Per query block:
//   S^T  = K Q^T,  dP^T = V dO^T             (the warp's keys x its queries each)
//   P^T  = exp2(S^T * scale_log2 - lse_log2),   dS^T = P^T * (dP^T - delta)
//          (soft-capped: S^T goes through tanh first and dS^T carries tanh's slope 1 - t^2)
//   dV  += P^T dO,  dK += dS^T Q              (P^T, dS^T straight from the accumulators: the
//                                             register layout of a 16x8 MMA pair is the A
//                                             operand of one 16x16; dO^T, Q^T by ldmatrix.trans;
//                                             with kSplitColumns the other query half's P^T and
//                                             dS^T from shared memory)
//   dQ   = dS K                               (dS^T through shared memory; each warp 16 or 32
//                                             query rows x kDqCols head-dim columns), added into the
//                                             accumulator with red.global.add (float4 on sm_90)
// Computing S transposed keeps a warp's dK and dV rows its own, so its P^T and dS^T are A
// operands where they are computed.  With two query halves each warp's dK and dV are partial
// sums over its half, and the two halves meet once at the end, through shared memory; or, where
// a warp's dK and dV over all columns would not fit in registers (kSplitColumns), the two warps
// of the same keys split the columns, and each reads the other's P^T and dS^T from dS^T's
// shared-memory buffer, P^T first (see mainloop).  With `deterministic` the key-block CTAs of one
// (head, query block) add their dQ in key-block order behind a counter, as sm90_bwd's do.
//
// kBias instances add a bias [batch, heads, queries, keys] (natural-log units) to the scaled scores
// before the exp2, as the forward did, and, where dbias_ptr is set, write dS (the gradient of the
// biased score) into dbias.  No shared memory of their own: step t's bias tile lands in dS^T buffer
// t % 2, each warp copying (cp.async, right after the barrier of step t - 1, when add_dq of step t - 2
// is past every warp) exactly the 16-byte slots its own P^T and dS^T stores of step t write later:
// 8 queries x 8 keys of the bias, one query's 8 keys per slot, sit in the 8 slots (one key's 8
// queries each) of the same 8 x 8 block of dS^T, so ldmatrix.trans at dS^T's own addresses reads
// the bias in S^T's register layout, and no warp's write reaches a bias value another has yet to read.
// dbias leaves from add_dq, which reads dS back from the buffer anyway.  No packed batches.
//
// Rows and keys past the ends, and head-dim columns past head_dim (a multiple of 8), are
// zero-filled by cp.async and never stored.  Keys past num_keys and outside the band get P = 0;
// queries past num_queries have lse_log2 = +inf (prep), so P = 0 there too.  dK and dV of a
// key block that no query sees are written as zeros.
//
// kDropout instances redraw the forward's keep mask (flashgen/dropout.h) for each step: dV +=
// (P^T o mask) dO (scaled by 1 / (1 - p) at its store) and dS^T = P^T o (dP^T o mask / (1 - p) -
// delta), where delta = rowsum(dO * O) already holds because O is the dropped output.  A thread
// holds 4 elements of each Philox call it meets (S^T has keys as rows), the lane 4 apart another
// 4 and a warp of the neighbouring 16 keys the other 8; each of the two lanes draws one of the two
// calls they share and they swap them by a shuffle (draw()), so a call is drawn twice per CTA
// where the forward draws it once, and no shared memory or barrier is added.
#pragma once

#include <cuda/atomic>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "flashgen/attention_common.h"
#include "flashgen/dropout.h"
#include "flashgen/sm80_common.h"

namespace flashgen {
namespace sm80 {

// What the runtime passes by value to all three kernels.  Strides are in elements; the inputs'
// pointers and strides are multiples of 8 elements (16-byte cp.async chunks), and so is head_dim.
// Workspace rows are padded per (batch, head) to rows_padded, a multiple of kBlockM.
struct BwdParams {
  void const* q_ptr;
  void const* k_ptr;
  void const* v_ptr;
  void const* out_ptr;        // O, for delta
  void const* dout_ptr;       // dO
  float const* lse_ptr;       // the forward's lse, natural log, [B or sequences, H, rows]
  float* lse_log2_ptr;        // workspace [B, H, rows_padded]
  float* delta_ptr;           // workspace [B, H, rows_padded]
  float* dq_accum_ptr;        // workspace [B, H, rows_padded / kBlockM] tiles of kBlockM x kHeadDim
                              //   in add order (dq_slot), zeroed by prep
  int* dq_counter_ptr;        // deterministic order: [B, H, rows_padded / kBlockM], zeroed by prep
  void* dq_ptr;
  void* dk_ptr;
  void* dv_ptr;
  int const* seqstart_q;      // packed (varlen) batches: [sequences + 1] row offsets into batch 0; else nullptr
  int const* seqstart_k;
  long long q_stride_b;
  long long k_stride_b;
  long long v_stride_b;
  long long out_stride_b;
  long long dout_stride_b;
  long long dq_stride_b;
  long long dkv_stride_b;     // dk and dv share their layout [B, N, Hk, D]
  int q_stride_m;
  int q_stride_h;
  int k_stride_m;
  int k_stride_h;             // of a k/v head: query head h reads k/v head h / head_group
  int v_stride_m;
  int v_stride_h;
  int out_stride_m;
  int out_stride_h;
  int dout_stride_m;
  int dout_stride_h;
  int dq_stride_m;
  int dq_stride_h;
  int dkv_stride_n;
  int dkv_stride_h;
  int lse_stride_b;           // floats
  int lse_stride_h;
  int num_queries;            // fixed-length batches (packed: the longest sequence's; each its own from seqstart)
  int num_keys;
  int num_heads;              // query heads
  int head_dim;               // <= kHeadDim, a multiple of 8
  int head_group;             // query heads per k/v head
  int band_lo;                // key j is visible to query i iff i + band_lo <= j <= i + band_hi
  int band_hi;                //   (+-kUnbounded: no limit on that side)
  int band_from_end;          // packed: each sequence's band sits on its own bottom-right diagonal (sequence())
  int rows_padded;            // workspace rows per (batch, head); see workspace_row0
  int deterministic;
  float scale;
  float scale_log2;           // scale * log2(e)
  float softcap_in;           // scale / softcap (0: no soft-capping; see FwdParams)
  float softcap_out;          // softcap / scale
  // kBias: dbias [batch, heads, num_queries, keys] (rows of dbias_row_stride elements, a multiple of 8,
  // packed otherwise): dS of every (query, key) the CTAs visit, written where dbias_ptr is not null
  // (never with soft-capping: the buffer dbias is read from holds dS times tanh's slope).
  void* dbias_ptr;
  long long dbias_row_stride;
  // kBias: the bias [batch, heads, queries, keys], keys contiguous, as FwdParams has it (strides 0
  // where it broadcasts, multiples of 8 elements)
  void const* bias_ptr;
  long long bias_stride_b;
  long long bias_stride_h;
  int bias_stride_m;
  // kDropout: the forward's (FwdParams): Philox key, counter offset, keep threshold, 1 / (1 - p)
  unsigned long long dropout_seed;
  unsigned long long dropout_offset;
  uint32_t dropout_keep;
  float dropout_scale;
};

// Whether a tile of `cols` columns is whole swizzle atoms of `atom` columns, or lies within one.
constexpr bool whole_atoms(int cols, int atom) { return cols % atom == 0 || atom % cols == 0; }

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, bool kBias_, bool kDropout_>
struct BwdKernel {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kWarps = kWarps_;    // 8, or 4 for 32-key CTAs (sm86/sm89's tile past head dim 128)
  static constexpr bool kBias = kBias_;     // an additive bias and dbias, compiled in
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMinBlocksPerSm = 1;  // dK and dV in registers: over 128 of them a thread
  static constexpr int kAuxThreads = 128;    // prep and convert
  static constexpr bool kDropout = kDropout_;  // compiled in: the Philox rounds exist only in these instances

  // S^T, dP^T, dK, dV: kKeysPerWarp keys per warp (16-key MMA tiles w % kKeyWarps, + kKeyWarps),
  // kWarps / 2 key warps, each query block split between the two warps of the same keys.  Per warp and
  // step, S^T and dP^T read (keys + queries) x head dim / 256 ldmatrix.x4 each, dV and dK
  // queries x columns / 256 each (P^T and dS^T are registers): at 128 x 64 and head dim 64 a
  // 32 x 32 tile of S^T reads 16 + 16 + 8 + 8 where 16 keys x 64 queries read 16 + 16 + 16 + 16
  // (K and V then held in registers, which 32 keys leave no room for).
  static constexpr int kKeysPerWarp = kBlockN == 128 ? 32 : 16;
  static constexpr int kKeyWarps = kBlockN / kKeysPerWarp;
  static constexpr int kQueryWarps = kWarps / kKeyWarps;
  // dK and dV of kKeysPerWarp keys over all columns take 2 x kKeysPerWarp x kHeadDim / 32
  // registers a thread, S^T and dP^T of a warp's half of the queries 2 x kKeysPerWarp x kBlockM
  // / 64.  Where the four come to over 192 (32 keys at head dim 128, or at head dim 64 with
  // 128-query steps) the two warps of the same keys split the columns instead of the queries,
  // kDkvCols each, and each takes the other's P^T and dS^T from shared memory: 32 + 32 + 20 + 20
  // ldmatrix (4 of the other's P^T or dS^T, 16 of dO^T or Q^T) where 16 keys x 64 queries read
  // 40 + 40 + 32 + 32.
  static constexpr bool kSplitColumns = 2 * kKeysPerWarp * (kHeadDim + kBlockM / 2) / 32 > 192;
  static constexpr int kDkvCols = kSplitColumns ? kHeadDim / kQueryWarps : kHeadDim;
  static constexpr int kQueryChunk = kBlockM / kQueryWarps;  // queries of one warp per step
  static constexpr int kKeyThreads = 32 * kKeyWarps;         // the threads of one query chunk
  // Columns of the shared-memory swizzle atoms of Q, dO, K and V: 64 (128-byte rows), or 32 where
  // a warp's share of the columns is not whole 64-column atoms (head dim 192: halves of 96), as
  // the column tiles of dK, dV and dQ below must be (or lie within one).
  static constexpr int kAtomCols = whole_atoms(kDkvCols, 64) ? 64 : 32;
  // dQ (kBlockM queries x kHeadDim columns): kDqRowWarps warps along the queries, each 16 rows of
  // every 16 * kDqRowWarps, and the head dim split among the warps that share rows.  A warp's
  // ldmatrix count per step is proportional to its rows plus its columns, so the squarest split
  // of the tile wins: at 64 x 128, 32 x 32 per warp (32 LDSM a step) rather than 16 x 64 (40).
  static constexpr int kDqRowWarpsMax = kBlockM / 16 < kWarps ? kBlockM / 16 : kWarps;
  static constexpr int kDqRowWarps =  // halve the row warps where rows + columns shrink (the columns double)
      kDqRowWarpsMax > 1 && 2 * kBlockM / kDqRowWarpsMax + kHeadDim * kDqRowWarpsMax / 2 / kWarps <
                                kBlockM / kDqRowWarpsMax + kHeadDim * kDqRowWarpsMax / kWarps &&
                                whole_atoms(kHeadDim * kDqRowWarpsMax / 2 / kWarps, kAtomCols)  // (not 48 columns at 192)
          ? kDqRowWarpsMax / 2
          : kDqRowWarpsMax;
  static constexpr int kDqColWarps = kWarps / kDqRowWarps;
  static constexpr int kDqCols = kHeadDim / kDqColWarps;
  // Where a thread's accumulators -- S^T and dP^T, dK and dV, and add_dq's dQ tile -- come to over
  // 192 (S^T and dP^T's 64 beside 128 of dK and dV; or add_dq's 64 beside them in a 4-warp CTA
  // at head dim 256), all fit in 255 registers only (kTightRegisters) with B loaded an ldmatrix
  // at a time (gemm_ss_fine, gemm_rs_fine) and the per-thread offsets of add_dq and of the dS^T
  // stores recomputed each step rather than kept live (opaque thread indices: some 60 integer
  // instructions a step).
  static constexpr int kAccumulators = 2 * kKeysPerWarp * (kDkvCols + kQueryChunk) / 32 +
                                       kBlockM * kDqCols / (32 * kDqRowWarps);
  static constexpr bool kTightRegisters = kAccumulators > 192;

  static_assert(sizeof(Element) == 2, "f16 or bf16");
  static_assert(kHeadDim % 64 == 0 && whole_atoms(kDkvCols, kAtomCols) && whole_atoms(kDqCols, kAtomCols),
                "column tiles of whole swizzle atoms (or within one)");
  static_assert(kKeyWarps * kKeysPerWarp == kBlockN && kQueryWarps == 2,
                "whole key tiles, two query chunks: 8 warps take 64 or 128 keys, 4 warps 32");
  static_assert(kQueryChunk % 16 == 0 && kBlockM % 32 == 0, "a query chunk is whole 16-query MMA steps");
  static_assert(kBlockM % (kDqRowWarps * 16) == 0 && kDqCols % 16 == 0, "dQ tiles whole 16 x 16 ldmatrix tiles");
  static_assert(!kDropout || kBlockN % 32 == 0, "a Philox call spans 32 keys, 16 of each of two warps");
  static_assert(!(kBias && kDropout), "a bias and dropout are not built together (spec/sm80_bwd.py)");

  // Q, dO, K and V: 8 x kAtomCols-element atoms, 16-byte chunks XOR-ed by the row (by row / 2 in
  // 64-byte rows), so the 8 rows one ldmatrix (plain or transposed) reads fall in 8 different bank
  // groups.
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<kAtomCols == 64 ? 3 : 2, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kAtomCols>>, cute::Stride<cute::Int<kAtomCols>, cute::_1>>{}));
  template <int kRows>
  using RowTile = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>>{}));
  // The same bytes as (head dim, rows): a B operand whose K mode is the rows, read by ldmatrix.trans.
  template <int kRows>
  using ColTile = decltype(cute::composition(
      RowTile<kRows>{},
      cute::Layout<cute::Shape<cute::Int<kHeadDim>, cute::Int<kRows>>, cute::Stride<cute::Int<kRows>, cute::_1>>{}));
  using SmemLayoutQ = RowTile<kBlockM>;    // Q and dO: B of S^T and dP^T
  using SmemLayoutQt = ColTile<kBlockM>;   // Q and dO: B of dK and dV
  using SmemLayoutKV = RowTile<kBlockN>;   // K and V: A of S^T and dP^T
  using SmemLayoutKt = ColTile<kBlockN>;   // K: B of dQ
  // dS^T (keys, queries), queries contiguous as the accumulators hold them (32-bit stores of
  // query pairs); the atom is as wide as the query block allows (32 or 64 queries).
  static constexpr int kDsAtomCols = kBlockM < 64 ? kBlockM : 64;
  using DsAtom = decltype(cute::composition(
      cute::Swizzle<kDsAtomCols == 64 ? 3 : 2, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kDsAtomCols>>, cute::Stride<cute::Int<kDsAtomCols>, cute::_1>>{}));
  using SmemLayoutDsT = decltype(cute::tile_to_shape(DsAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}));
  // dS as the A operand of dQ = dS K: (queries, keys), read by ldmatrix.trans.
  using SmemLayoutDs = decltype(cute::composition(
      SmemLayoutDsT{},
      cute::Layout<cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>, cute::Stride<cute::Int<kBlockN>, cute::_1>>{}));

  using MmaOp = std::conditional_t<std::is_same<Element, cutlass::half_t>::value, cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // Warps stacked along M only (16 rows each), a 16-wide N tile so that one ldmatrix x4 fills
  // the B operand of two MMAs; the warps that share rows work on sub-tiles of their own.
  template <int kRowWarps>
  using TiledMma = decltype(cute::make_tiled_mma(MmaOp{}, cute::Layout<cute::Shape<cute::Int<kRowWarps>, cute::_1, cute::_1>>{},
                                                 cute::Tile<cute::Int<16 * kRowWarps>, cute::_16, cute::_16>{}));
  using TiledMmaKeys = TiledMma<kKeyWarps>;  // S^T, dP^T (keys x queries), dK, dV (keys x head dim)
  using TiledMmaDq = TiledMma<kDqRowWarps>;  // dQ (queries x head-dim columns)
  using LoadOperand = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using LoadOperandT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using StoreAccumulator = cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Element>;  // a column pair per store

  static constexpr int kQTile = kBlockM * kHeadDim;
  template <int kDsBuffers_>
  struct Storage {
    alignas(128) Element k[kBlockN * kHeadDim];
    alignas(128) Element v[kBlockN * kHeadDim];
    alignas(128) Element qdo[2][2][kQTile];  // [buffer][Q, dO]; at the end, the partial dK / dV sums
    alignas(128) Element ds[kDsBuffers_][kBlockM * kBlockN];  // [buffer]: see mainloop's pipeline
    alignas(16) float lse_log2[2][kBlockM];
    alignas(16) float delta[2][kBlockM];
  };
  // dS^T is double-buffered (one barrier a step), except in a 4-warp CTA -- the tile of 99 KB
  // parts -- that a second buffer would take past 99 KB (head dim 256: 100.5 KB with one, 102
  // with two): there a second barrier a step keeps add_dq's reads of it before the next writes.
  static constexpr int kSm86SharedBytes = 99 * 1024;
  static constexpr int kDsBuffers = kWarps == 4 && sizeof(Storage<2>) > kSm86SharedBytes ? 1 : 2;
  using SharedStorage = Storage<kDsBuffers>;
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));
  static_assert(!kBias || kDsBuffers == 2, "a step's bias lands in the dS^T buffer the step before did not write");

  // kBias: a warp's bias chunks (16 bytes: one query's 8 keys) per step, kBiasChunksPerLane a lane.
  static constexpr int kBiasChunksPerWarp = kQueryChunk * kKeysPerWarp / 8;
  static constexpr int kBiasChunksPerLane = kBiasChunksPerWarp / 32;
  static_assert(kBiasChunksPerLane * 32 == kBiasChunksPerWarp, "whole chunks per lane");

  // kBias: (query, first key) within the step's tile of chunk c of warp `warp`'s bias: the warp's
  // query chunk, its 16-key tiles (w % kKeyWarps, + kKeyWarps), a query's chunks next to each other
  // (16 keys of a tile: 32 contiguous bytes).  It lands in the dS^T slot bias_slot() names.
  static CUTE_HOST_DEVICE cute::tuple<int, int> bias_chunk(int warp, int c) {
    constexpr int kChunksPerRow = kKeysPerWarp / 8;
    int const g = c % kChunksPerRow;
    return cute::make_tuple(warp / kKeyWarps * kQueryChunk + c / kChunksPerRow,
                            16 * (warp % kKeyWarps + g / 2 * kKeyWarps) + 8 * (g % 2));
  }
  // The dS^T slot (key, first of 8 queries) that holds the bias of `query`, keys key8 .. key8 + 7:
  // the same 8 x 8 block, transposed at the granularity of slots.
  static CUTE_HOST_DEVICE cute::tuple<int, int> bias_slot(int query, int key8) {
    return cute::make_tuple(key8 + query % 8, query - query % 8);
  }
  // The dS^T slot (key, first of 8 queries) whose address lane `lane` of warp `warp` gives the
  // ldmatrix.x4.trans that reads the bias of the warp's key tile m and queries 16 j .. 16 j + 15 of
  // its chunk: matrix lane / 8 holds keys +0 (even) or +8 (odd) of the tile, queries +0 (matrices
  // 0, 1) or +8 (2, 3), so its register pairs are those of S^T's accumulator (h, i % 2) of MMA
  // column 2 j + i / 2 (tests/test_sm80_bias_layout.py checks this against CuTe's partition).
  static CUTE_HOST_DEVICE cute::tuple<int, int> bias_read(int warp, int lane, int m, int j) {
    return cute::make_tuple(16 * (warp % kKeyWarps + m * kKeyWarps) + lane % 8 + 8 * (lane / 8 % 2),
                            warp / kKeyWarps * kQueryChunk + 16 * j + 8 * (lane / 16));
  }

  using LoaderQ = TileLoader<Element, kHeadDim, kThreads, SmemLayoutQ>;
  using LoaderKV = TileLoader<Element, kHeadDim, kThreads, SmemLayoutKV>;

  // The query blocks a key block meets (all, or those the band reaches); none past a packed
  // sequence's keys.
  struct Steps {
    int m_begin;
    int m_blocks;  // per query head
  };
  static __device__ Steps steps(Sequence const& seq, int n_block) {
    if (n_block * kBlockN >= seq.num_keys) {
      return {0, 0};
    }
    BlockRange const r = band_blocks<kBlockN, kBlockM>(n_block, seq.num_queries, -seq.band_hi, -seq.band_lo);
    return {r.begin, max(0, r.end - r.begin)};
  }

  // The key blocks that meet query block m_block (steps() the other way round): they add into
  // its dQ, in this order when deterministic.
  static __device__ BlockRange dq_key_blocks(Sequence const& seq, int m_block) {
    return band_blocks<kBlockM, kBlockN>(m_block, seq.num_keys, seq.band_lo, seq.band_hi);
  }

  // The CTA's key block, k/v head and batch or sequence.  Under a band bounded above (causal,
  // windows) the first key blocks meet the most query blocks.  Where the grid is also a few waves
  // (at most 4 CTAs an SM: few, long CTAs, as grouped-query heads make, whose CTA walks every query
  // head of its group) of 8 or more (k/v head, sequence) pairs, CTAs take key blocks slowest --
  // every pair's key block 0, then every pair's key block 1, ... -- so the longest start first.
  // Otherwise x is the key block: with many CTAs, consecutive ones of a pair share Q and dO in L2,
  // which the other order gives up, and with fewer pairs in-order dispatch already starts each
  // pair's long CTAs early.  Same-run A/Bs (bf16, 1k-16k tokens, 1-8 query heads a k/v head):
  // +11-31% at 1k-4k causal with 4 and 8 (256-512 CTAs) on an H100 (+13-39% on an H200); lost
  // 7-15% at head dim 64 with 4096 CTAs, 2-4% at 16k with 2-4 pairs: these limits leave those to x.  Either way a key
  // block's CTA comes after those of the earlier key blocks of its pair: the deterministic dQ
  // order waits only for CTAs launched earlier.
  struct Tile {
    int n_block, head_kv, z;
  };
  static __device__ Tile tile(BwdParams const& p) {
    unsigned sms;  // %nsmid: at least the SM count (identifiers may leave gaps)
    asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
    int const pairs = gridDim.y * gridDim.z;
    if (p.band_hi >= kUnbounded || pairs < 8 || gridDim.x * pairs > 4 * sms) {
      return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
    }
    int const linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int const pair = linear % pairs;
    return {linear / pairs, pair % int(gridDim.y), pair / int(gridDim.y)};
  }

  // grid (ceil(N / kBlockN), k/v heads, batch or sequences), kThreads threads, kSharedBytes of
  // dynamic shared memory; tile() maps a CTA to its work.
  static __device__ void run(BwdParams const& p, char* smem_raw) {
    using namespace cute;
    SharedStorage& s = *reinterpret_cast<SharedStorage*>(smem_raw);
    Tile const t = tile(p);
    int const n_block = t.n_block;
    int const head_kv = t.head_kv;
    Sequence const seq = sequence(p, t.z);
    if (n_block * kBlockN >= seq.num_keys) {  // past a packed sequence's keys: no dK / dV rows here
      return;
    }
    TiledMmaKeys mma;
    Tensor acc_dk = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kDkvCols>>{});
    Tensor acc_dv = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kDkvCols>>{});
    clear(acc_dk);
    clear(acc_dv);
    Steps const st = steps(seq, n_block);
    if (st.m_blocks > 0) {
      mainloop(p, s, seq, n_block, head_kv, st, acc_dk, acc_dv);
    }
    epilogue(p, s, seq, n_block, head_kv, acc_dk, acc_dv);
  }

  // The pipeline, one __syncthreads per step t (buffer b = t % 2 of Q/dO, lse/delta and dS^T):
  //
  //   compute   S^T, dP^T from Q/dO[b]; P^T, dS^T with lse/delta[b]; dS^T -> ds[b];
  //             dV, dK from Q/dO[b] (kSplitColumns: and from ds[b], P^T there before dS^T,
  //             under barriers of the two warps that share keys; see below)
  //   wait      cp.async.wait_group 0: this thread's part of step t + 1 (issued a step ago) landed
  //   barrier   (1) all of ds[b] is written, and every thread's part of step t + 1 is visible;
  //             (2) every warp is past its last read of Q/dO[b] and lse/delta[b] (this step's
  //                 GEMMs) and of ds[1 - b] (add_dq of step t - 1)
  //   issue     step t + 2 into Q/dO[b], lse/delta[b]                (free by (2))
  //   add_dq    reads ds[b] and K; then straight on to step t + 1, which reads Q/dO[1 - b] (landed
  //             by (1)) and writes ds[1 - b] (free by (2))
  //
  // So no cp.async ever writes a buffer that a warp may still read, and a step's tiles are
  // requested a whole step (and an add_dq) before they are read.  With one barrier a step,
  // warps that finish their dQ adds early go on to the next step's MMAs while the others
  // still issue atomics; dS^T is double-buffered for that (two barriers a step needed one).
  // With one dS^T buffer (kDsBuffers, 4-warp CTAs at head dim 256) "ds[1 - b]" is ds[b] again, so
  // a second barrier, after this step's S^T and dP^T GEMMs and before its first write to ds,
  // waits for every warp's add_dq of step t - 1.
  template <class Acc>
  static __device__ void mainloop(BwdParams const& p, SharedStorage& s, Sequence const& seq, int n_block,
                                  int head_kv, Steps st, Acc& acc_dk, Acc& acc_dv) {
    using namespace cute;
    int const tid = threadIdx.x;
    int const key0 = n_block * kBlockN;
    int const total = p.head_group * st.m_blocks;

    // Step t is query head head_kv * head_group + t / m_blocks, query block m_begin + t % m_blocks;
    // a cursor walks them in that order without a division per step.
    struct Cursor {
      int head;
      int m_block;
    };
    int const m_end = st.m_begin + st.m_blocks;
    auto advance = [m_end, &st](Cursor& c) {
      if (++c.m_block == m_end) {
        c.m_block = st.m_begin;
        ++c.head;
      }
    };

    // K and V once; then step t's Q, dO, lse_log2 and delta into buffer t % 2, one commit group
    // per step (empty past the last, so the waits count alike).
    LoaderKV::template load<kBlockN>(
        s.k,
        static_cast<Element const*>(p.k_ptr) + seq.batch * p.k_stride_b + (seq.k0 + key0) * (long long)p.k_stride_m +
            head_kv * (long long)p.k_stride_h,
        p.k_stride_m, seq.num_keys - key0, p.head_dim);
    LoaderKV::template load<kBlockN>(
        s.v,
        static_cast<Element const*>(p.v_ptr) + seq.batch * p.v_stride_b + (seq.k0 + key0) * (long long)p.v_stride_m +
            head_kv * (long long)p.v_stride_h,
        p.v_stride_m, seq.num_keys - key0, p.head_dim);
    bool const whole_columns = p.head_dim == kHeadDim;
    auto issue = [&](int t, Cursor const& c) {
      if (t < total) {
        int const buf = t % 2;
        int const query0 = c.m_block * kBlockM;
        long long const row = seq.q0 + query0;
        Element const* q = static_cast<Element const*>(p.q_ptr) + seq.batch * p.q_stride_b + row * p.q_stride_m +
                           c.head * (long long)p.q_stride_h;
        Element const* dout = static_cast<Element const*>(p.dout_ptr) + seq.batch * p.dout_stride_b +
                              row * p.dout_stride_m + c.head * (long long)p.dout_stride_h;
        if (whole_columns && query0 + kBlockM <= seq.num_queries) {  // no zero-fill: no check per chunk
          LoaderQ::template load_whole<kBlockM>(s.qdo[buf][0], q, p.q_stride_m);
          LoaderQ::template load_whole<kBlockM>(s.qdo[buf][1], dout, p.dout_stride_m);
        } else {
          LoaderQ::template load<kBlockM>(s.qdo[buf][0], q, p.q_stride_m, seq.num_queries - query0, p.head_dim);
          LoaderQ::template load<kBlockM>(s.qdo[buf][1], dout, p.dout_stride_m, seq.num_queries - query0,
                                          p.head_dim);
        }
        // a whole block of lse_log2 and delta: prep wrote every row of the blocks visited
        constexpr int kChunks = kBlockM / 4;  // 16-byte chunks of each
        int const copy_tid = opaque<kTightRegisters>(threadIdx.x);  // (see fresh_tid below)
        if (copy_tid < 2 * kChunks) {
          bool const is_delta = copy_tid >= kChunks;
          long long const at = workspace_row0<kBlockM>(p, seq, c.head) + query0 + copy_tid % kChunks * 4;
          cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>::copy(
              *reinterpret_cast<cute::uint128_t const*>((is_delta ? p.delta_ptr : p.lse_log2_ptr) + at),
              *reinterpret_cast<cute::uint128_t*>((is_delta ? s.delta[buf] : s.lse_log2[buf]) +
                                                  copy_tid % kChunks * 4));
        }
      }
      cp_async_fence();
    };
    // kBias: step t's bias into dS^T buffer t % 2, this warp's slots only (bias_chunk), one commit
    // group (empty past the last step): issued after the barrier of step t - 1 (see the pipeline),
    // before step t + 1's tiles, so that step t waits for it alone (cp_async_wait<1>).
    auto issue_bias = [&](int t, Cursor const& c) {
      if constexpr (kBias) {
        if (t < total) {
          int const lane_tid = opaque<kTightRegisters>(threadIdx.x);  // (see fresh_tid below)
          int const warp = lane_tid / 32, lane = lane_tid % 32;
          Element const* bias = static_cast<Element const*>(p.bias_ptr) + seq.batch * p.bias_stride_b +
                                c.head * p.bias_stride_h + key0;
          CUTE_UNROLL
          for (int i = 0; i < kBiasChunksPerLane; ++i) {
            auto const [q, key8] = bias_chunk(warp, lane + 32 * i);
            auto const [slot_key, slot_query] = bias_slot(q, key8);
            int const query = c.m_block * kBlockM + q;
            bool const ok = query < seq.num_queries && key0 + key8 < seq.num_keys;
            cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
                *reinterpret_cast<cute::uint128_t const*>(ok ? bias + query * (long long)p.bias_stride_m + key8 : bias),
                *reinterpret_cast<cute::uint128_t*>(s.ds[t % 2] + SmemLayoutDsT{}(slot_key, slot_query)), ok);
          }
        }
        cp_async_fence();
      }
    };
    Cursor at{head_kv * p.head_group, st.m_begin};  // step t
    Cursor ahead = at;                              // the next step to issue
    issue(0, ahead);  // one group with K and V
    issue_bias(0, ahead);
    advance(ahead);
    issue(1, ahead);
    advance(ahead);

    TiledMmaKeys mma;
    int const mma_tid = tid % kKeyThreads;
    int const part = tid / kKeyThreads;  // this warp's query chunk of every block
    auto thr = mma.get_thread_slice(mma_tid);
    auto copy_a = make_tiled_copy_A(LoadOperand{}, mma);
    auto copy_b = make_tiled_copy_B(LoadOperand{}, mma);
    auto copy_bt = make_tiled_copy_B(LoadOperandT{}, mma);
    auto copy_c = make_tiled_copy_C(StoreAccumulator{}, mma);
    auto load_a = copy_a.get_thread_slice(mma_tid);
    auto load_b = copy_b.get_thread_slice(mma_tid);
    auto load_bt = copy_bt.get_thread_slice(mma_tid);

    // Query chunk `chunk` (kQueryChunk queries from chunk * kQueryChunk) of a Q or dO tile, as
    // (queries, head dim) and as (this warp's kDkvCols columns, queries), and of dS^T (keys, queries).
    int const cols = kSplitColumns ? part : 0;
    auto chunk_rows = [&](Element* tile, int chunk) {
      return local_tile(make_tensor(make_smem_ptr(tile), SmemLayoutQ{}), Shape<Int<kQueryChunk>, Int<kHeadDim>>{},
                        make_coord(chunk, 0));
    };
    auto chunk_cols = [&](Element* tile, int chunk) {
      return local_tile(make_tensor(make_smem_ptr(tile), SmemLayoutQt{}), Shape<Int<kDkvCols>, Int<kQueryChunk>>{},
                        make_coord(cols, chunk));
    };
    auto chunk_ds = [&](int buf, int chunk) {
      return local_tile(make_tensor(make_smem_ptr(s.ds[buf]), SmemLayoutDsT{}), Shape<Int<kBlockN>, Int<kQueryChunk>>{},
                        make_coord(0, chunk));
    };
    Tensor sK = make_tensor(make_smem_ptr(s.k), SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(s.v), SmemLayoutKV{});
    Tensor tSsK = load_a.partition_S(sK);
    Tensor tSsV = load_a.partition_S(sV);
    Tensor tSrK = thr.partition_fragment_A(sK);  // K, then V: (MMA, keys / (16 kKeyWarps), head dim / 16)
    Tensor tSrK_view = load_a.retile_D(tSrK);
    Tensor tSrQ = thr.partition_fragment_B(chunk_rows(s.qdo[0][0], 0));  // Q, then dO
    Tensor tSrQ_view = load_b.retile_D(tSrQ);
    Tensor tKrQt = thr.partition_fragment_B(chunk_cols(s.qdo[0][0], 0));  // dO^T, then Q^T: (MMA, kDkvCols / 8, queries / 16)
    Tensor tKrQt_view = load_bt.retile_D(tKrQt);

    Tensor tSrS = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kQueryChunk>>{});   // S^T, then P^T
    Tensor tSrDp = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kQueryChunk>>{});  // dP^T, then dS^T
    Tensor S = make_tensor(tSrS.data(), rows_cols_layout(tSrS.layout()));  // (this thread's keys, its queries)
    Tensor dP = make_tensor(tSrDp.data(), rows_cols_layout(tSrDp.layout()));

    bool const softcap = p.softcap_in != 0.f;
    float const dropout_scale = kDropout ? p.dropout_scale : 1.f;  // (a constant 1 that folds away otherwise)
    cp_async_wait<1>();  // step 0 (and K, V) landed; step 1 may still be in flight
    __syncthreads();
    for (int t = 0; t < total; ++t) {
      int const buf = t % 2;
      int const ds_buf = t % kDsBuffers;

      int const query0 = at.m_block * kBlockM + part * kQueryChunk;  // the chunk's first query
      // Where registers are tight, the step's per-thread shared-memory offsets and element
      // coordinates (ldmatrix of Q, dO, their transposes and the other warp's P^T and dS^T,
      // the stores, tScS below) derive from an opaque thread index, one per use, so they are
      // recomputed each step: kept through the loop, ptxas spilled them (4-20 bytes).
      auto fresh_tid = [&] { return opaque<kTightRegisters>(mma_tid); };
      auto const load_q = copy_b.get_thread_slice(fresh_tid());
      // each accumulator element's (key, query) within (block, chunk): where the mask applies
      Tensor tScS = rows_cols(mma.get_thread_slice(fresh_tid())
                                  .partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kQueryChunk>>{})));
      Keep const keep = draw(p, seq, at.head, tScS, key0, query0);  // (kDropout; unused otherwise)
      clear(tSrS);
      gemm_ss_or_fine<kTightRegisters>(mma, tSrS, copy_a, tSsK, tSrK, tSrK_view, copy_b,
                                       load_q.partition_S(chunk_rows(s.qdo[buf][0], part)), tSrQ, tSrQ_view);
      clear(tSrDp);
      auto gemm_dp = [&] {
        gemm_ss_or_fine<kTightRegisters>(mma, tSrDp, copy_a, tSsV, tSrK, tSrK_view, copy_b,
                                         load_q.partition_S(chunk_rows(s.qdo[buf][1], part)), tSrQ, tSrQ_view);
      };

      // P^T and dS^T in place of S^T and dP^T.  lse_log2 and delta are per query: per column.
      // Soft-capping is decided once per chunk, not per element.
      float const* lse_log2 = s.lse_log2[buf] + part * kQueryChunk;
      float const* delta = s.delta[buf] + part * kQueryChunk;
      // each element's exponent: -lse_log2 of its query (offset), plus (kBias) its bias in log2
      // units, from ds[buf] once this lane's copies and then its warp's are in
      if constexpr (kBias) {
        cp_async_wait<1>();  // this step's bias; step t + 1's tiles may be in flight
        __syncwarp();
      }
      auto for_each_offset = [&](auto&& fn) {  // fn(r, c, offset) for each element (r, c) of S
        if constexpr (kBias) {
          for_each_bias(s.ds[buf], opaque<kTightRegisters>(tid), [&](int r, int c, float bias) {
            fn(r, c, fmaf(bias, kLog2e, -lse_log2[get<1>(tScS(0, c))]));
          });
        } else {
          CUTE_UNROLL
          for (int c = 0; c < size<1>(S); ++c) {
            float const row_lse = lse_log2[get<1>(tScS(0, c))];
            CUTE_UNROLL
            for (int r = 0; r < size<0>(S); ++r) {
              fn(r, c, -row_lse);
            }
          }
        }
      };
      if (softcap) {  // d(softcap_out * t) / dS = scale (1 - t^2); scale comes at the end
        gemm_dp();
        for_each_offset([&](int r, int c, float offset) {
          float const th = tanh_approx(S(r, c) * p.softcap_in);
          float const prob = exp2_approx(fmaf(th * p.softcap_out, p.scale_log2, offset));
          bool const dropped = !kept(keep, r, c);
          S(r, c) = dropped ? 0.f : prob;
          dP(r, c) = prob * ((dropped ? 0.f : dP(r, c) * dropout_scale) - delta[get<1>(tScS(0, c))]) *
                     (1.f - th * th);
        });
      } else {
        // P^T before dP^T's GEMM and in the same basic block, so that the exp2s (MUFU, a
        // quarter-rate pipe: 8 cycles a warp instruction) issue between its MMAs instead of
        // after them, while the tensor cores would otherwise wait.  Same registers: P^T
        // replaces S^T in place, as before.
        for_each_offset([&](int r, int c, float offset) { S(r, c) = exp2_approx(fmaf(S(r, c), p.scale_log2, offset)); });
        gemm_dp();
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          float const row_delta = delta[get<1>(tScS(0, c))];
          CUTE_UNROLL
          for (int r = 0; r < size<0>(S); ++r) {
            bool const dropped = !kept(keep, r, c);
            dP(r, c) = S(r, c) * ((dropped ? 0.f : dP(r, c) * dropout_scale) - row_delta);
            S(r, c) = dropped ? 0.f : S(r, c);
          }
        }
      }
      // Keys past num_keys or outside the band: P = dS = 0 (a select per element, in a loop of
      // its own so that the exp2 loop stays free of branches).
      if (key0 + kBlockN > seq.num_keys || key0 + kBlockN - 1 > query0 + seq.band_hi ||
          key0 < query0 + kQueryChunk - 1 + seq.band_lo) {
        CUTE_UNROLL
        for (int r = 0; r < size<0>(S); ++r) {
          int const key = key0 + get<0>(tScS(r, 0));
          CUTE_UNROLL
          for (int c = 0; c < size<1>(S); ++c) {
            int const query = query0 + get<1>(tScS(0, c));
            bool const hidden = (key >= seq.num_keys) | (key > query + seq.band_hi) | (key < query + seq.band_lo);
            S(r, c) = hidden ? 0.f : S(r, c);
            dP(r, c) = hidden ? 0.f : dP(r, c);
          }
        }
      }
      Tensor rP = sm80::convert<Element>(tSrS);  // (qualified: convert() is also the last kernel)
      Tensor rDs = sm80::convert<Element>(tSrDp);
      // dS^T into ds[buf], for dQ (and P^T before it with kSplitColumns)
      auto const store_c = copy_c.get_thread_slice(fresh_tid());
      auto store = [&](auto const& r) {
        copy(copy_c, store_c.retile_S(r), store_c.partition_D(chunk_ds(ds_buf, part)));
      };

      // dV += P^T dO, dK += dS^T Q: P^T and dS^T as A operands where the accumulators are.
      auto const rP_a = make_tensor(rP.data(), accumulator_as_a(rP.layout()));
      auto const rDs_a = make_tensor(rDs.data(), accumulator_as_a(rDs.layout()));
      auto const load_qt = copy_bt.get_thread_slice(fresh_tid());
      auto own_chunk = [&](auto& acc, auto const& a, Element* tile) {
        gemm_rs_or_fine<kTightRegisters>(mma, acc, a, copy_bt, load_qt.partition_S(chunk_cols(tile, part)), tKrQt,
                                         tKrQt_view);
      };
      if constexpr (kDsBuffers == 1) {
        __syncthreads();  // every warp's add_dq of step t - 1 is past its reads of ds (see the pipeline)
      } else if constexpr (kBias) {
        __syncwarp();  // every lane's reads of the bias in ds[buf] are done: the stores below replace it
      }
      if constexpr (kSplitColumns) {
        // The other query chunk's P^T and dS^T come from the warp of the same keys and that
        // chunk, through this step's dS^T buffer (free: add_dq read it two steps ago, before
        // the last barrier; with one buffer, before the barrier above), P^T first, then dS^T in its place; a named barrier of the two
        // warps orders each write before the other's read, and the other's read of P^T
        // before dS^T replaces it.  The own chunk's MMAs go between write and barrier.
        int const other = 1 - part;
        auto pair_sync = [&] { named_barrier_sync(1 + fresh_tid() / 32, 64); };  // (0: __syncthreads)
        Tensor tKrPt = thr.partition_fragment_A(chunk_ds(ds_buf, other));  // the other's P^T, then dS^T
        Tensor tKrPt_view = load_a.retile_D(tKrPt);
        auto other_chunk = [&](auto& acc, Element* tile) {
          auto const load_pt = copy_a.get_thread_slice(fresh_tid());
          gemm_ss_or_fine<kTightRegisters>(mma, acc, copy_a, load_pt.partition_S(chunk_ds(ds_buf, other)), tKrPt,
                                           tKrPt_view, copy_bt, load_qt.partition_S(chunk_cols(tile, other)),
                                           tKrQt, tKrQt_view);
        };
        store(rP);
        own_chunk(acc_dv, rP_a, s.qdo[buf][1]);
        pair_sync();  // the other's P^T is in
        other_chunk(acc_dv, s.qdo[buf][1]);
        pair_sync();  // and read: dS^T may replace it
        store(rDs);
        own_chunk(acc_dk, rDs_a, s.qdo[buf][0]);
        pair_sync();  // the other's dS^T is in
        other_chunk(acc_dk, s.qdo[buf][0]);
      } else {
        store(rDs);
        own_chunk(acc_dv, rP_a, s.qdo[buf][1]);
        own_chunk(acc_dk, rDs_a, s.qdo[buf][0]);
      }

      cp_async_wait<0>();  // step t + 1, this thread's part
      __syncthreads();     // see the pipeline above
      if constexpr (kBias) {
        Cursor next = at;
        advance(next);
        issue_bias(t + 1, next);  // into ds[1 - buf]: every warp is past add_dq of step t - 1
      }
      issue(t + 2, ahead);
      advance(ahead);
      add_dq(p, s, s.ds[ds_buf], seq, at.head, at.m_block, n_block);
      advance(at);
    }
  }

  // kBias: fn(r, c, bias) for every element (r, c) of thread `tid`'s S^T (its rows-and-columns
  // view), `bias` read from `tile` (a dS^T buffer holding the step's bias, see bias_slot): an
  // ldmatrix.x4.trans per key tile and 16 queries (bias_read), register i's pair into
  // accumulator (h, i % 2) of MMA column 2 j + i / 2: row i % 2 + 2 m, column h + 2 (2 j + i / 2).
  template <class Fn>
  static __device__ void for_each_bias(Element const* tile, int tid, Fn&& fn) {
    CUTE_UNROLL
    for (int m = 0; m < kKeysPerWarp / 16; ++m) {
      CUTE_UNROLL
      for (int j = 0; j < kQueryChunk / 16; ++j) {
        auto const [key, query] = bias_read(tid / 32, tid % 32, m, j);
        uint32_t pairs[4];
        load_matrix_x4<true>(tile + SmemLayoutDsT{}(key, query), pairs);
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h) {
            fn(i % 2 + 2 * m, h + 2 * (2 * j + i / 2), unpack_half<Element>(pairs[i], h));
          }
        }
      }
    }
  }

  // kDropout: the keep bits of this thread's elements of S^T (tScS: their (key, query) within the key
  // block from key0 and the query chunk from query0), for kept(); nothing otherwise.  Register (r, c)
  // of the accumulator view is key kbase(r / 2) + 8 (r % 2) and query qbase(c / 4) + 8 (c / 2 % 2) +
  // c % 2, where qbase(c / 4), the thread's query in its 16-query MMA tile, is even and below 8, and
  // lane l ^ 4 holds the same queries and key kbase ^ 1 (tests/test_sm80_dropout_cpu.py checks this
  // against CuTe's layout for every thread).  So the elements of (r / 2, c / 4) with query offset y
  // = c % 2 are 4 bytes of the Philox call of key kbase and query qbase + y -- bytes 8 (c / 2 % 2) +
  // 2 (r % 2) + shift, shift = 4 (kbase / 16 % 2) + kbase % 2 (dropout.h) -- and lane l ^ 4 needs the
  // same two calls: the lane of even kbase draws the call of y = 0, the other that of y = 1, and
  // each takes the other's by a shuffle.  Word (r / 2, c / 4) holds call y in bits 16 y .., shifted
  // right by shift: kept() tests bit 16 (c % 2) + 8 (c / 2 % 2) + 2 (r % 2).
  static constexpr int kKeepWords = kDropout ? kKeysPerWarp / 16 * (kQueryChunk / 16) : 1;
  using Keep = cute::array<uint32_t, kKeepWords>;
  template <class TensorC>
  static __device__ Keep draw(BwdParams const& p, Sequence const& seq, int head, TensorC const& tScS, int key0,
                              int query0) {
    using namespace cute;
    constexpr int kQueryTiles = kQueryChunk / 16;
    static_assert(decltype(size<0>(tScS))::value == 2 * (kKeysPerWarp / 16) &&
                  decltype(size<1>(tScS))::value == 4 * kQueryTiles, "two keys a 16-key tile, four queries a 16");
    Keep keep{};  // (unread without kDropout)
    if constexpr (kDropout) {
      DropoutStream const stream(p, seq.index, head);
      CUTE_UNROLL
      for (int m = 0; m < kKeysPerWarp / 16; ++m) {
        int const key = get<0>(tScS(2 * m, 0));
        int const y = key % 2;  // this lane's call of the two
        int const shift = 4 * (key / 16 % 2) + key % 2;
        CUTE_UNROLL
        for (int g = 0; g < kQueryTiles; ++g) {
          uint32_t const mine = stream.keep_bits(query0 + get<1>(tScS(0, 4 * g)) + y, key0 + key);
          uint32_t const theirs = __shfl_xor_sync(0xffffffffu, mine, 4);
          keep[m * kQueryTiles + g] = (y ? theirs | mine << 16 : mine | theirs << 16) >> shift;
        }
      }
    }
    return keep;
  }

  // Whether element (r, c) of the accumulator view is kept (draw()'s words; always, without kDropout).
  static __device__ __forceinline__ bool kept(Keep const& keep, int r, int c) {
    if constexpr (kDropout) {
      return (keep[r / 2 * (kQueryChunk / 16) + c / 4] >> (16 * (c % 2) + 8 * (c / 2 % 2) + 2 * (r % 2))) & 1u;
    } else {
      return true;
    }
  }

  // The dQ accumulator's tile of one query block holds the elements of add_dq's accumulators in
  // the order the threads add them: element e of thread t at slot dq_slot(t, e), kAccumVector
  // elements of one thread next to each other, then the next thread's.  So a warp's reductions
  // cover whole 128-byte lines: in (row, column) order, as the MMA leaves them, each reduction of
  // a warp touched 8 rows, and the queued reductions held the next step's loads back (ncu, head
  // dim 128: 2.3x FlashAttention-2's L1 global requests, and a third more stalled cycles).
  // Reductions of four floats exist from sm_90 on (red.global.add.v4.f32); before, one float each.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr int kAccumVector = 4;
#else
  static constexpr int kAccumVector = 1;
#endif
  static_assert(kBlockM * kHeadDim / kThreads % 4 == 0, "add_dq's elements a thread: whole groups of four");
  static CUTE_HOST_DEVICE constexpr int dq_slot(int tid, int e) {
    return (e / kAccumVector * kThreads + tid) * kAccumVector + e % kAccumVector;
  }

  // dQ = dS K of one step into the accumulator: warp w computes query rows 16 (w % kDqRowWarps)
  // .. +15 of every 16 * kDqRowWarps, head-dim columns of part w / kDqRowWarps, and adds them
  // with atomics into its slots of the tile (dq_slot).  When deterministic,
  // after the key blocks before this one: the query block's counter counts the CTAs that are in.
  static __device__ void add_dq(BwdParams const& p, SharedStorage& s, Element* ds, Sequence const& seq, int head,
                                int m_block, int n_block) {
    using namespace cute;
    // kTightRegisters: the thread index through an opaque (volatile) copy.  Every address below
    // depends on it and is the same at every step, so ptxas kept them all (K^T's nine ldmatrix
    // addresses, the atomics' pointer, ...) live through the main loop and its register peak, or
    // spilled them; so they are a few integer instructions a step.
    int const tid = opaque<kTightRegisters>(threadIdx.x);
    int const dq_tid = tid % (32 * kDqRowWarps);
    int const part = tid / (32 * kDqRowWarps);
    TiledMmaDq mma;
    auto thr = mma.get_thread_slice(dq_tid);
    auto copy_a = make_tiled_copy_A(LoadOperandT{}, mma);
    auto copy_b = make_tiled_copy_B(LoadOperandT{}, mma);
    auto load_a = copy_a.get_thread_slice(dq_tid);
    auto load_b = copy_b.get_thread_slice(dq_tid);
    Tensor sDs = make_tensor(make_smem_ptr(ds), SmemLayoutDs{});
    Tensor sKt = local_tile(make_tensor(make_smem_ptr(s.k), SmemLayoutKt{}), Shape<Int<kDqCols>, Int<kBlockN>>{},
                            make_coord(part, 0));
    Tensor tQrDs = thr.partition_fragment_A(sDs);  // (MMA, 1, keys / 16)
    Tensor tQrDs_view = load_a.retile_D(tQrDs);
    Tensor tQrKt = thr.partition_fragment_B(sKt);  // (MMA, kDqCols / 8, keys / 16)
    Tensor tQrKt_view = load_b.retile_D(tQrKt);
    Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kDqCols>>{});
    clear(acc);
    gemm_ss(mma, acc, copy_a, load_a.partition_S(sDs), tQrDs, tQrDs_view, copy_b, load_b.partition_S(sKt), tQrKt,
            tQrKt_view);
    if constexpr (kBias) {
      if (p.dbias_ptr != nullptr) {
        store_dbias(p, seq, head, m_block, n_block, part, thr, copy_a, load_a.partition_S(sDs), tQrDs, tQrDs_view);
      }
    }

    long long const block_row0 = workspace_row0<kBlockM>(p, seq, head) + m_block * kBlockM;
    // (the counter's address only where it is used: out of the non-deterministic steps' path)
    auto counter = [&] {
      return cuda::atomic_ref<int, cuda::thread_scope_device>(p.dq_counter_ptr[block_row0 / kBlockM]);
    };
    if (p.deterministic) {
      if (tid == 0) {
        int const earlier = n_block - dq_key_blocks(seq, m_block).begin;  // CTAs before this one
        while (counter().load(cuda::memory_order_acquire) < earlier) {
        }
      }
      __syncthreads();
    }
    // Each thread's elements go to slots of its own (dq_slot): kAccumVector of them per reduction,
    // a warp's reductions whole 128-byte lines.  Past num_queries and head_dim the products are
    // zeros (zero-filled Q rows have P = 0, zero-filled K columns add nothing), and their slots lie
    // in the tile: no check per element.  One pointer per thread and immediate offsets: an address
    // computed per add into the same registers made each add wait for the previous one to read them.
    float* thread_accum = p.dq_accum_ptr + block_row0 * kHeadDim + dq_slot(tid, 0);
    asm("" : "+l"(thread_accum));  // opaque to the compiler, which would otherwise rebuild each address
    __builtin_assume(__isGlobal(thread_accum));
    CUTE_UNROLL
    for (int e = 0; e < size(acc); e += kAccumVector) {
      float* to = thread_accum + e * kThreads;  // dq_slot(tid, e), e a multiple of kAccumVector
      // (red, not atomicAdd: here that became an ATOMG, which waits for a reply that no one reads)
      if constexpr (kAccumVector == 4) {
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(to), "f"(acc(e)), "f"(acc(e + 1)),
                     "f"(acc(e + 2)), "f"(acc(e + 3))
                     : "memory");
      } else {
        asm volatile("red.global.add.f32 [%0], %1;" ::"l"(to), "f"(acc(e)) : "memory");
      }
    }
    if (p.deterministic) {
      __threadfence();  // this CTA's adds, before the release below
      __syncthreads();
      if (tid == 0) {
        counter().fetch_add(1, cuda::memory_order_release);
      }
    }
  }

  // kBias: this step's dS (queries x keys, the buffer add_dq reads) into dbias: the warps of each
  // row part split its 16-key slices (slice kk for part kk % kDqColWarps), each reloading a slice's A
  // fragment into the registers the dQ product is done with, and storing its key pairs (4 bytes;
  // elements 2i and 2i + 1 are neighbouring keys) of the rows and keys inside the sequence.
  template <class Thr, class CopyA, class SrcA, class RegA, class ViewA>
  static __device__ void store_dbias(BwdParams const& p, Sequence const& seq, int head, int m_block, int n_block,
                                     int part, Thr const& thr, CopyA const& copy_a, SrcA const& src_a, RegA& reg_a,
                                     ViewA& view_a) {
    using namespace cute;
    Tensor coord = thr.partition_A(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));  // (query, key)
    int const query0 = m_block * kBlockM, key0 = n_block * kBlockN;
    Element* dbias = static_cast<Element*>(p.dbias_ptr) +
                     ((long long)seq.batch * p.num_heads + head) * p.num_queries * p.dbias_row_stride + key0;
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(reg_a); ++kk) {
      if (kk % kDqColWarps == part) {
        copy(copy_a, src_a(_, _, kk), view_a(_, _, kk));
        CUTE_UNROLL
        for (int mm = 0; mm < size<1>(reg_a); ++mm) {
          CUTE_UNROLL
          for (int e = 0; e < size<0>(reg_a); e += 2) {
            int const query = query0 + get<0>(coord(e, mm, kk));
            int const key = get<1>(coord(e, mm, kk));
            if (query < seq.num_queries && key0 + key < seq.num_keys) {
              cutlass::Array<Element, 2> pair;
              pair[0] = reg_a(e, mm, kk);
              pair[1] = reg_a(e + 1, mm, kk);
              *reinterpret_cast<cutlass::Array<Element, 2>*>(dbias + query * p.dbias_row_stride + key) = pair;
            }
          }
        }
      }
    }
  }

  // dK (times scale) and dV to memory.  With whole columns, query chunk 1's warps' partial sums
  // go through the Q/dO buffers (a fragment's element e of thread t at e * kKeyThreads + t:
  // conflict-free) into chunk 0's, which store; with kSplitColumns each stores its own columns.
  template <class Acc>
  static __device__ void epilogue(BwdParams const& p, SharedStorage& s, Sequence const& seq, int n_block,
                                  int head_kv, Acc& acc_dk, Acc& acc_dv) {
    using namespace cute;
    int const tid = threadIdx.x;
    if constexpr (!kSplitColumns) {
      static_assert(decltype(size(acc_dk))::value * kKeyThreads * sizeof(float) <= sizeof(s.qdo), "one sum at a time");
      float* partial = reinterpret_cast<float*>(&s.qdo[0][0][0]) + tid % kKeyThreads;
      auto gather = [&](Acc& acc) {
        __syncthreads();  // every warp is past its last read of the buffers (Q, dO or the last sum)
        if (tid >= kKeyThreads) {
          CUTE_UNROLL
          for (int e = 0; e < size(acc); ++e) {
            partial[e * kKeyThreads] = acc(e);
          }
        }
        __syncthreads();
        if (tid < kKeyThreads) {
          CUTE_UNROLL
          for (int e = 0; e < size(acc); ++e) {
            acc(e) += partial[e * kKeyThreads];
          }
        }
      };
      gather(acc_dk);
      gather(acc_dv);
      if (tid >= kKeyThreads) {
        return;
      }
    }
    TiledMmaKeys mma;
    auto thr = mma.get_thread_slice(tid % kKeyThreads);
    // (key, column) of each accumulator element; elements 2i and 2i + 1 are neighbouring columns
    Tensor tDcD = thr.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kDkvCols>>{}));
    int const col0 = kSplitColumns ? tid / kKeyThreads * kDkvCols : 0;
    int const key0 = n_block * kBlockN;
    long long const offset = seq.batch * p.dkv_stride_b + (seq.k0 + key0) * (long long)p.dkv_stride_n +
                             head_kv * (long long)p.dkv_stride_h;
    auto store = [&](Acc const& acc, void* ptr, float scale) {
      Element* base = static_cast<Element*>(ptr) + offset;
      CUTE_UNROLL
      for (int e = 0; e < size(acc); e += 2) {
        int const key = get<0>(tDcD(e));
        int const col = col0 + get<1>(tDcD(e));
        if (key0 + key < seq.num_keys && col < p.head_dim) {
          cutlass::Array<Element, 2> pair;
          pair[0] = static_cast<Element>(acc(e) * scale);
          pair[1] = static_cast<Element>(acc(e + 1) * scale);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(base + key * (long long)p.dkv_stride_n + col) = pair;
        }
      }
    };
    store(acc_dk, p.dk_ptr, p.scale);
    store(acc_dv, p.dv_ptr, kDropout ? p.dropout_scale : 1.f);  // dV of the kept P, scaled by 1 / (1 - p)
  }

  // grid (ceil(M / kBlockM), heads, batch or sequences), kAuxThreads threads
  static __device__ void prep(BwdParams const& p) { backward_prep<Element, kHeadDim, kBlockM, kAuxThreads>(p); }

  // grid as prep: dQ from the query block's accumulator tile, through shared memory.  Gather:
  // convert thread i takes add_dq threads i, i + kAuxThreads, ...; for each, group after group of
  // kConvertGroup elements (a float4 from sm_90 on, else a pair: element e at slot e * kThreads + t),
  // so a warp reads whole lines; scaled pairs of neighbouring columns go to their (row, column) of
  // the tile, where add_dq's MMA layout places them.  Then rows to dq in 16-byte chunks.  (Pairs
  // stored straight to dq, a warp's 8 rows apart, and each element's place computed at run time
  // took 3.6x the time of the row-major accumulator's convert: 187 against 52 us at 512 tokens.)
  static constexpr int kConvertGroup = kAccumVector > 2 ? kAccumVector : 2;
  static constexpr int kConvertStride = kHeadDim + 8;  // padded tile rows: a warp's 8 rows x 4 pairs, 32 banks
  static_assert(kThreads % kAuxThreads == 0, "whole add_dq threads per convert thread");
  static __device__ void convert(BwdParams const& p) {
    using namespace cute;
    __shared__ alignas(16) Element tile[kBlockM * kConvertStride];
    int const m_block = blockIdx.x;
    int const head = blockIdx.y;
    Sequence const seq = sequence(p, blockIdx.z);
    if (m_block * kBlockM >= seq.num_queries) {  // past a packed sequence: these rows are another's, or none
      return;
    }
    float const* accum = p.dq_accum_ptr + (workspace_row0<kBlockM>(p, seq, head) + m_block * kBlockM) * kHeadDim;
    constexpr int kElements = kBlockM * kHeadDim / kThreads;  // of one add_dq thread
    CUTE_UNROLL
    for (int k = 0; k < kThreads / kAuxThreads; ++k) {
      int const tid = threadIdx.x + k * kAuxThreads;
      TiledMmaDq mma;
      Tensor tQcQ = mma.get_thread_slice(tid % (32 * kDqRowWarps))
                        .partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kDqCols>>{}));
      Element* thread_tile = tile + tid / (32 * kDqRowWarps) * kDqCols;
      CUTE_UNROLL
      for (int e = 0; e < kElements; e += kConvertGroup) {
        float values[kConvertGroup];
        if constexpr (kAccumVector == 4) {
          *reinterpret_cast<float4*>(values) = *reinterpret_cast<float4 const*>(accum + dq_slot(tid, e));
        } else {
          CUTE_UNROLL
          for (int j = 0; j < kConvertGroup; ++j) {
            values[j] = accum[dq_slot(tid, e + j)];
          }
        }
        CUTE_UNROLL
        for (int j = 0; j < kConvertGroup; j += 2) {
          cutlass::Array<Element, 2> pair;
          pair[0] = static_cast<Element>(values[j] * p.scale);
          pair[1] = static_cast<Element>(values[j + 1] * p.scale);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(
              thread_tile + get<0>(tQcQ(e + j)) * kConvertStride + get<1>(tQcQ(e + j))) = pair;
        }
      }
    }
    __syncthreads();
    Element* dq = static_cast<Element*>(p.dq_ptr) + seq.batch * p.dq_stride_b + seq.q0 * (long long)p.dq_stride_m +
                  head * (long long)p.dq_stride_h;
    constexpr int kChunks = kHeadDim / 8;
    for (int i = threadIdx.x; i < kBlockM * kChunks; i += kAuxThreads) {
      int const r = i / kChunks, col = i % kChunks * 8;
      int const row = m_block * kBlockM + r;
      if (row < seq.num_queries && col < p.head_dim) {  // head_dim is a multiple of 8
        *reinterpret_cast<uint4*>(dq + row * (long long)p.dq_stride_m + col) =
            *reinterpret_cast<uint4 const*>(tile + r * kConvertStride + col);
      }
    }
  }
};

}  // namespace sm80
}  // namespace flashgen
