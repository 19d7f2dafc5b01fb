// flashgen's Hopper attention backward (sm_90a): TMA loads, wgmma, one producer warpgroup.
//
// Three kernels per instance, launched in this order on one stream:
//   prep     per query row: delta = rowsum(dO * O), the forward's lse in the
//            log2 domain (+inf where no key contributes, so P is 0 there), and
//            zeroes of the row's fp32 dQ accumulator and of its block's counters;
//   main     one CTA per block of kBlockN keys of one (batch, k/v head): K and V
//            stay in shared memory while Q, dO, lse and delta stream through a
//            kStages-deep ring, block after block of kBlockM queries, for every
//            query head of the k/v head's group (grouped-query attention sums
//            dK and dV in registers, nothing is repeated in memory);
//   convert  dQ = scale * accumulator, in the input dtype and the caller's strides.
//            (Writing dQ from the main kernel's last CTA per query block instead
//            saved a launch but cost 10-20% with causal masks: the longest key
//            block finishes last and then converts nearly every block alone.)
//
// In the main kernel each consumer warpgroup owns 64 keys; the last warpgroup loads.  Per query block:
//   S^T  = K Q^T,  dP^T = V dO^T            (wgmma, both operands in shared memory)
//   P^T  = exp2(S^T * scale_log2 - lse_log2),   dS^T = P^T * (dP^T - delta)
//          (with soft-capping S^T is capped first and dS^T carries tanh's derivative)
//   dV  += P^T dO,  dK += dS^T Q             (wgmma, P^T / dS^T from registers; at head dim 256
//                                            from shared memory, each warpgroup having made
//                                            S^T and dP^T of half of the step's queries)
//   dQ   = dS K                              (dS^T through shared memory), issued in the next
//                                            step (kDqLag) once both warpgroups' halves of dS
//                                            are in (mbarriers: the warpgroups never wait for
//                                            each other within a step), and added into an fp32
//                                            accumulator by a TMA bulk reduce-add that leaves
//                                            a step later still, beside S^T / dP^T
//   issued dV, dQ, dK from head dim 128 on: the dQ part goes to shared memory while dK runs
// kBias instances add a bias (natural-log units) to the scaled scores before the exp2, as
// the forward did, and, when the caller wants dbias, write dS (before soft-capping's slope:
// the gradient of the biased score) for every (query, key) the CTA visits.  Their dS buffer
// holds keys contiguous, as dbias lies in memory: a step's bias tile comes by TMA into the
// bytes of the dS buffer that step later writes, and its dS leaves from there as dbias by a TMA
// store (with soft-capping, which scales dS, dbias is staged beside it; see consume()).
// A score mod (the last template parameter, sm90_common.h: NoScoreMod) recomputes the forward's
// modded score: P^T = exp2(mod(S^T * scale) * log2(e) - lse_log2), and dS^T carries the mod's
// derivative (grad) in the scaled score before the dK / dQ products.
// Transposing S rather than dQ keeps every per-row softmax quantity a column
// broadcast (one smem read per column) and dK/dV in registers for the whole
// CTA.  The dQ product is split between the warpgroups by query rows when a
// block has 128 of them, else by head-dim columns (with 80 queries a step, as
// dQ^T = K^T dS^T: wgmma's M is 64 rows), so every dQ element gets one add per
// CTA.  With `deterministic` the CTAs of one (head, query block)
// add in key-block order (they wait for the part's counter to reach their key
// block), so results repeat bit for bit.
// kSparse instances serve a flashgen.block_mask of 128 x 128 blocks (runtime/block_masks.py): the
// CTA of a key block visits, for each query head of its group, only the query blocks the mask's
// transposed lists give for (batch, head, key block) -- partial ones first, then full ones -- each
// in 128 / kBlockM steps (SparseWalk; producer and consumers walk the same lists).  A partial
// block's element mask comes with the step's Q and dO: its rows of the mask's partial_bits, into
// the stage's bits buffer, and zeroes P^T (so dS^T too) where a bit is 0 (consume()).
// kDropout instances redraw the forward's keep mask (flashgen/dropout.h) for each step, each Philox
// call once per warpgroup, under the last GEMM issued in the previous step: dV += (P^T o mask) dO (scaled by
// 1 / (1 - p) at its store) and dS^T = P^T o (dP^T o mask / (1 - p) - delta), where
// delta = rowsum(dO * O) already holds because O is the dropped output.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda/atomic>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "flashgen/dropout.h"
#include "flashgen/sm90_common.h"

namespace flashgen {
namespace sm90 {

// What the runtime passes by value to all three kernels (__grid_constant__).
// q/do maps: (head_dim, queries, heads, batch), boxes (kBoxCols, kBlockM);
// k/v maps: (head_dim, keys, k/v heads, batch), boxes (kBoxCols, kBlockN).
// Workspace rows are padded per head to rows_padded, a multiple of kBlockM.
struct BwdParams {
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  CUtensorMap do_map;
  void const* out_ptr;        // O [B, M, H, D], for delta
  void const* dout_ptr;       // dO, the tensor do_map describes
  float const* lse_ptr;       // the forward's lse, natural log
  float* lse_log2_ptr;        // workspace [B, H, rows_padded]
  float* delta_ptr;           // workspace [B, H, rows_padded]
  float* dq_accum_ptr;        // workspace [B, H, rows_padded, kHeadDim], zeroed by prep
  int* dq_counter_ptr;        // deterministic order: [B, H, rows_padded / kBlockM], zeroed by prep
  void* dq_ptr;
  void* dk_ptr;
  void* dv_ptr;
  int const* seqstart_q;      // packed (varlen) batches: [sequences + 1] row offsets into batch 0; else nullptr
  int const* seqstart_k;
  long long out_stride_b;     // elements
  long long dout_stride_b;
  long long dq_stride_b;
  long long dkv_stride_b;     // dk and dv share their layout [B, N, Hk, D]
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
  int num_queries;
  int num_keys;
  int num_heads;              // query heads
  int head_dim;               // <= kHeadDim, a multiple of 8
  int head_group;             // query heads per k/v head
  int band_lo;                // kBand: key j is visible to query i iff i + band_lo <= j <= i + band_hi
  int band_hi;
  int band_from_end;          // packed: each sequence's band sits on its own bottom-right diagonal (sequence())
  int rows_padded;            // workspace rows per (batch, head); see workspace_row0
  int deterministic;
  float scale;
  float scale_log2;           // scale * log2(e)
  float softcap_in;           // kSoftcap: scale / softcap (see FwdParams)
  float softcap_out;          // softcap / scale
  // kBias: dbias [batch, heads, num_queries, keys] (rows of dbias_row_stride elements, a multiple
  // of 8, packed otherwise; nullptr: not wanted), written for every visited element through
  // dbias_map (its tensor map, boxes as bias_map's, as wide as the row pitch: the masked keys' zero
  // dS fills the padding), and the bias as a tensor map as in FwdParams (steps 0 where it broadcasts)
  void* dbias_ptr;
  long long dbias_row_stride;
  // kBias, where the caller's bias has extent 1 in the batch or head dim: dbias_sum(), after the main
  // kernel, adds dbias's planes over dbias_sum_batch batches and dbias_sum_heads heads (each the whole
  // dim or 1) into dbias_sum_ptr [batch / dbias_sum_batch, heads / dbias_sum_heads, num_queries, keys]
  // (rows of dbias_row_stride elements)
  void* dbias_sum_ptr;
  int dbias_sum_batch;
  int dbias_sum_heads;
  // kBias, nonzero: dbias_map describes the gradient in the caller's bias shape instead, [batch or 1,
  // heads or 1, num_queries, keys] (the bias_*_step dims folded; zeroed by the caller), and the
  // boxes are added into it (a TMA reduce-add in the input dtype) at (head * bias_head_step, batch *
  // bias_batch_step): no per-plane dbias, no dbias_sum(), no hidden zeros to write.
  int dbias_add;
  int bias_batch_step;
  int bias_head_step;
  int bias_row_step;
  CUtensorMap bias_map;
  CUtensorMap dbias_map;
  // kSparse: a flashgen.block_mask's transposed lists (runtime/block_masks.py).  Its (batch, head)
  // plane is batch * sparse_batch_step + head * sparse_head_step (a step is 0 where the mask
  // broadcasts); a key block's list row is plane * sparse_key_blocks + key block, of
  // sparse_query_blocks entries, and a (query block, key block)'s entry in partial_index is
  // (plane * sparse_query_blocks + query block) * sparse_key_blocks + key block.
  int const* sparse_partial_counts;  // q_num_blocks [rows]: partial query blocks
  int const* sparse_partial_blocks;  // q_indices [rows, query blocks]
  int const* sparse_full_counts;     // full_q_num_blocks [rows]
  int const* sparse_full_blocks;     // full_q_indices [rows, query blocks]
  int const* sparse_tiles;           // partial_index [planes, query blocks, key blocks]: tile of bits, or -1
  uint32_t const* sparse_bits;       // partial_bits [tiles, 128 queries, 4]: bit j of word w: key 32w + j
  int sparse_batch_step;
  int sparse_head_step;
  int sparse_query_blocks;
  int sparse_key_blocks;
  // kDropout: the forward's (FwdParams): Philox key, counter offset, keep threshold, 1 / (1 - p)
  unsigned long long dropout_seed;
  unsigned long long dropout_offset;
  uint32_t dropout_keep;
  float dropout_scale;
  // A score mod's captured tensors (sm90_common.h: kModTensors), in its declaration's order
  void const* mod_ptr[kModTensors];
  long long mod_stride[kModTensors][kModDims];
};

// BwdKernel's double-buffered dS tile (queries, keys): queries contiguous, or keys (kKeysContiguous).
template <class Element, int kQueries, int kKeys, bool kKeysContiguous>
constexpr auto ds_smem_layout() {
  auto const shape = cute::Shape<cute::Int<kQueries>, cute::Int<kKeys>, cute::_2>{};
  if constexpr (kKeysContiguous) {
    return cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{}, shape);
  } else {
    return cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{}, shape,
                               cute::Step<cute::_2, cute::_1, cute::_3>{});
  }
}

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kBand_, bool kSoftcap_,
          bool kBias_, bool kSparse_, bool kDropout_, class ScoreMod_>
struct BwdKernel {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = kStages_;
  static constexpr bool kBand = kBand_;
  // Soft-capping is compiled in (not a run-time branch as in the forward): its P / dS path keeps
  // tanh's slope in registers, and a kernel holding both paths spilled ~300 bytes at head dim 64.
  static constexpr bool kSoftcap = kSoftcap_;
  // So is the bias: its loads, barriers and a step's bias values in registers are no cost of the
  // plain path.
  static constexpr bool kBias = kBias_;
  // And so are a block mask's lists: the walk over them and the bit tests exist only here.
  static constexpr bool kSparse = kSparse_;
  // A mask block is 128 queries x 128 keys: a CTA's keys are one block's, and a step of kBlockM
  // queries covers all of a block's rows or (64) half of them, its rows (m_block %
  // kStepsPerMaskBlock) * kBlockM on of the block's bits (produce(), SparseWalk).
  static constexpr int kMaskRows = 128;
  static constexpr int kStepsPerMaskBlock = kMaskRows / kBlockM;
  static_assert(!kSparse || (kBlockN == 128 && kMaskRows % kBlockM == 0 && !kBand && !kSoftcap && !kBias),
                "sparse CTAs are the mask's 128-key blocks (one uint4 of bits per query), without band, "
                "soft-capping or bias");
  // And so is dropout: the Philox rounds and the keep bits exist only in these instances.
  static constexpr bool kDropout = kDropout_;
  // A score mod: P^T from the modded scaled score, dS^T times the mod's derivative (consume()); built
  // without soft-capping, a bias, block-mask lists or dropout (spec/sm90_bwd.py).
  using ScoreMod = ScoreMod_;
  static constexpr bool kScoreMod = ScoreMod::kEnabled;
  static_assert(!kScoreMod || (!kSoftcap && !kBias && !kSparse && !kDropout),
                "a score mod is built without soft-capping, bias, block-mask lists and dropout");

  static_assert(sizeof(Element) == 2, "f16 or bf16");
  // Steps of 80 queries (plain head-dim-128 instances): a wgmma's M is 64 rows, so dQ leaves transposed
  // (kDqTransposed).  Against 64-query steps, the S^T / dP^T GEMMs read a step's K and V from shared
  // memory once per 80 queries instead of 64, and there are a fifth fewer steps.
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  // The fewest queries a sequence of a call the runtime may send here (0: any): below 1024 a CTA's
  // first and last steps weigh more, and 80-query steps ran 2-5% behind 64-query ones at 512
  // tokens (H200, session 24, both before and after the dQ product moved a step late).
  static constexpr int kMinQueries = kDqTransposed ? 1024 : 0;
  static_assert(kBlockN % 64 == 0 && kBlockM % 16 == 0 && kHeadDim % 32 == 0, "wgmma tile shapes");
  // Above head dim 128, dK and dV of 64 keys do not fit one warpgroup's registers: the two
  // warpgroups then share the CTA's 64 keys and split the head dim (kKvCols each).  At head dim
  // 192 each computes S^T and dP^T for all of them -- the same two products twice.  At 256
  // (kShareSdp) each computes them for half of a step's queries (kSdpQueries) and writes its half
  // of P^T and dS^T to shared memory, where both warpgroups' dV / dK products read all of them
  // (ds_full): 9-17% faster there, 4-10% slower at 192 (H200).
  static constexpr bool kSplitCols = kHeadDim > 128;
  static constexpr bool kShareSdp = kSplitCols && kHeadDim == 256;
  static constexpr int kWarpGroups = kSplitCols ? 2 : kBlockN / 64;
  static constexpr int kKvCols = kSplitCols ? kHeadDim / kWarpGroups : kHeadDim;
  static constexpr int kSdpQueries = kShareSdp ? kBlockM / 2 : kBlockM;
  static_assert(!kSplitCols || (kBlockN == 64 && kBlockM == 64), "the split head dim is laid out for 64 x 64 steps");
  static_assert(!(kSplitCols && kBias), "bias is built up to head dim 128 (spec/sm90_bwd.py): one warpgroup per key");
  static_assert(!kDqTransposed || (kBlockM == 80 && kHeadDim == 128 && kBlockN == 128 && !kBias && !kSparse &&
                                    !kSoftcap && !kDropout && !ScoreMod_::kEnabled),
                "80-query steps are laid out for the plain head-dim-128 tile (spec/sm90_bwd.py)");
  static_assert(!kDropout || (!kSplitCols && !kSoftcap && !kBias && !kSparse),
                "dropout up to head dim 128, without soft-capping, bias or block-mask lists (spec/sm90_bwd.py)");
  static constexpr int kConsumerThreads = 128 * kWarpGroups;
  // The producer is a whole warpgroup (one lane of it issues the loads) so that
  // setmaxnreg can hand its registers to the consumers: 240 each instead of the
  // 168 a 384-thread block gets (ptxas budgets whole warpgroups).
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= launch_registers(kThreads) * kThreads,
                "setmaxnreg moves the registers the block launched with");
  static constexpr int kMinBlocksPerSm = 1;
  static constexpr int kAuxThreads = 128;  // prep and convert

  // 128-byte swizzle atoms are 64 columns: a warpgroup's part of a split head dim must be whole
  // atoms (192's 96 columns take the 64-byte swizzle's 32-column atoms)
  static constexpr int kSwizzleBytes = kKvCols % 64 == 0 ? 128 : 64;
  static constexpr int kBoxCols = kSwizzleBytes / sizeof(Element);
  static constexpr int kBoxesPerRow = kHeadDim / kBoxCols;

  // How the warpgroups share dQ = dS K: by 64-row halves of a 128-query block,
  // else by head-dim columns (each part a whole number of swizzle atoms); transposed, each
  // warpgroup's 64 head-dim columns are the M rows of dQ^T = K^T dS^T.
  static constexpr bool kDqSplitRows = kBlockM == 64 * kWarpGroups;
  static constexpr int kDqCols = kDqSplitRows ? kHeadDim : kHeadDim / kWarpGroups;
  static constexpr int kDqRows = kDqSplitRows ? 64 : kBlockM;  // a part's query rows
  static constexpr int kDqMmaN = kDqTransposed ? kBlockM : kDqCols;  // the dQ product's N (its M: 64)
  static_assert(kDqSplitRows || ((kBlockM == 64 || (kDqTransposed && kDqCols == 64)) && kDqCols % kBoxCols == 0),
                "dQ needs 64 query rows per warpgroup or whole swizzle atoms of head-dim columns per warpgroup");
  // dQ leaves through a tile in shared memory (add_dq_tile) where the tile fits beside the rest;
  // the split head dim adds its parts with atomics instead, or (kDqInStage) through the stage.
  static constexpr bool kDqTile = !kSplitCols;
  // At head dim 256 no dQ tile fits beside the rest (224 of 227 KB in use), and the 16-byte atomics
  // held 11% of the stall samples as LSU throttle (ncu, session 40).  Once all of a step's GEMMs are
  // done, warpgroup w's dQ part goes into the stage's Q and dO bytes of head-dim columns w, which
  // only its own dK and dV products read (the other warpgroup's S^T and dP^T reads of them are done
  // by ds_full); its reduce warp sends the part on by bulk reduce-adds and frees the stage (empty)
  // once the TMA unit has read it (reduce_staged_dq).  A part is as many bytes as those columns of
  // Q and dO: 64 x kKvCols floats.  (H200, bf16 d256, groups 1 and 4, 1k-16k, causal and not: the
  // backward 13-25% faster than by atomics.)
  static constexpr bool kDqInStage = kShareSdp;
  // Where the tile is used, warp 1 + w of the producer warpgroup hands warpgroup w's dQ parts to the TMA
  // unit (reduce_dq): the consumers arrive on dq_full once a part is written and wait on dq_free (the
  // last part read) before the next, so no consumer meets the others at a barrier or waits for the
  // TMA unit (ncu, session 26: 15% of the head-dim-128 backward's stall samples sat at the two
  // barriers around a part; FA4 issues its reduce from a warp of its own).  Soft-capping bias
  // instances stage dbias in the part's memory (kDbiasStaged) and keep issuing from its thread 0;
  // so do the 128-query steps with a score mod or soft-capping, at the edge of 240 registers, which
  // the waits pushed over (ALiBi: 0 -> 216 bytes of spills).
  // consume() slices its tiled MMAs at the warpgroup's first thread through a warp-uniform index
  // (sm90_common.h, warpgroup_index): the wgmma descriptors then stay in uniform registers, with
  // no copy into them before every wgmma.  Not at head dim 128, where the short shapes lost 5-7%
  // though the loop shrank 583 -> 522 instructions; head dim 64 gained 1-6% (H200 queued A/B,
  // session 30), 256 1-5% with its step loop 723 -> 606 instructions, 192 level (728 -> 696;
  // session 32).  Not with dropout, soft-capping or a score mod: ptxas then spilled 4-68 bytes.
  static constexpr bool kUniformSlices =
      kHeadDim != 128 && !kDropout && !kSoftcap && !ScoreMod_::kEnabled;
  // dbias is dS itself, except with soft-capping (dS then carries tanh's slope): that dbias is staged
  // in the warpgroup's dQ part, the others leave from the dS buffer (consume()).
  static constexpr bool kDbiasStaged = kBias && kSoftcap;
  static constexpr bool kDqReduceWarps =
      kDqTile && !kDbiasStaged && !(kBlockM == 128 && (kSoftcap || ScoreMod_::kEnabled));
  // Lane 0 of producer warp 1 + w runs warpgroup w's dQ sends: reduce_dq or reduce_staged_dq.
  static constexpr bool kHasReduceWarps = kDqReduceWarps || kDqInStage;
  // Named barriers, each of one warpgroup w's threads (the warpgroups meet only at the mbarriers
  // ds_full and ds_free): 1 + w its dQ part (with kDqReduceWarps only the keep bits' order),
  // kBiasBarrier + w its staged dbias tile, kKeepBarrier + w its keep bits (consume()).
  static constexpr int kBiasBarrier = 1 + kWarpGroups;
  // Iteration t of consume()'s loop issues the dQ product of step t - kDqLag.  One step late, no
  // warpgroup waits for the other's half of dS within a step; but a bias tile loads into the dS
  // buffer the dQ product two steps back frees, and freed a step later it came too late (the bias
  // backward 2-13% slower at head dim 64, H200): bias instances issue a step's dQ in the step.
  // kDqInStage issues it in the step too: the step's stage holds its dQ part, and its dV and dK
  // products wait for both warpgroups' halves of dS (kShareSdp) all the same.
  static constexpr int kDqLag = kBias || kDqInStage ? 0 : 1;
  // The order of a step's dK, dV and dQ products.  kDkLast: dV, dQ, then dK, which runs while
  // the dQ part goes to shared memory, where waiting for all three before that store had left the
  // tensor pipe idle (H200: head dim 128 up to 9% faster, 192 up to 2%, 256 level).  Head dim 64
  // (128-query steps) issues dV and dK together before dQ: dK last was 2-6% slower at 1k-4k tokens.
  static constexpr bool kDkLast = kHeadDim > 64;
  // With reduce warps, a step's dQ part is fenced for the TMA unit and handed to its reduce warp only
  // after the next step's S^T and dP^T GEMMs are issued.  Fenced at once, the fence and the arrive
  // after it waited for the stores to drain (ncu: head dim 128, stored under the dK GEMM, 10% of the
  // stall samples, the dK wait after them none; head dim 64, stored last, 4%).  H200, bf16, head dim 64,
  // three alternated runs: unmasked +1.9-3.3% (1k-16k, groups 1 and 4); the band instances keep the old
  // order (causal with the hand-off deferred: 0.94-1.00).
  static constexpr bool kDeferDqArrive = kDqReduceWarps && (kDkLast || !kBand);
  static constexpr int kKeepBarrier = kBiasBarrier + kWarpGroups;

  using AtomK = std::conditional_t<kSwizzleBytes == 128, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                   cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using AtomMN = std::conditional_t<kSwizzleBytes == 128, cute::GMMA::Layout_MN_SW128_Atom<Element>,
                                    cute::GMMA::Layout_MN_SW64_Atom<Element>>;
  template <int kRows, int kStagesOf>
  using RowMajorTiles = decltype(cute::tile_to_shape(
      AtomK{}, cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>, cute::Int<kStagesOf>>{}));
  // The same bytes seen as (head dim, rows): the B operand where rows are the K mode.
  template <int kRows, int kStagesOf>
  using ColMajorTiles = decltype(cute::tile_to_shape(
      AtomMN{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kRows>, cute::Int<kStagesOf>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using SmemLayoutQ = RowMajorTiles<kBlockM, kStages>;    // Q and dO as B of S^T / dP^T
  using SmemLayoutQt = ColMajorTiles<kBlockM, kStages>;   // Q and dO as B of dK / dV
  using SmemLayoutK = RowMajorTiles<kBlockN, 1>;          // K and V as A of S^T / dP^T
  using SmemLayoutKt = ColMajorTiles<kBlockN, 1>;         // K as B of dQ
  // dS (queries, keys), double-buffered, written from the dS^T registers: queries contiguous (the
  // MN-major A operand of dQ = dS K), or keys contiguous -- transposed, the K-major B operand of
  // dQ^T; with a bias, the K-major A operand, laid out as dbias in memory (consume()).
  static constexpr bool kDsKeysContiguous = kDqTransposed || kBias;
  using SmemLayoutDs = decltype(ds_smem_layout<Element, kBlockM, kBlockN, kDsKeysContiguous>());
  static_assert(!kShareSdp || (kBlockM == 64 && !kDqTransposed), "one swizzle atom of queries per key row (consume())");

  // The S^T / dP^T and dK / dV products are tiled over the warpgroups by keys, or (split head
  // dim) each warpgroup runs its own: then every thread indexes them by its rank in its warpgroup.
  using WarpGroups = cute::Layout<cute::Shape<cute::Int<kSplitCols ? 1 : kWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kSdpQueries>, cute::Int<kHeadDim>>>(),
      WarpGroups{}));
  // dV += P^T dO and dK += dS^T Q: P^T and dS^T from registers, or (kShareSdp) from shared memory
  static constexpr auto kv_op() {
    using Shape = cute::Shape<cute::_64, cute::Int<kKvCols>, cute::Int<kBlockM>>;
    if constexpr (kShareSdp) {
      return cute::GMMA::ss_op_selector<Element, Element, float, Shape, cute::GMMA::Major::K, cute::GMMA::Major::MN>();
    } else {
      return cute::GMMA::rs_op_selector<Element, Element, float, Shape, cute::GMMA::Major::K, cute::GMMA::Major::MN>();
    }
  }
  using TiledMmaKV = decltype(cute::make_tiled_mma(kv_op(), WarpGroups{}));
  // dQ = dS K: A a warpgroup's 64 rows of dS (MN-major, or K-major with keys contiguous), B its
  // columns of K (MN-major); transposed, dQ^T = K^T dS^T: A its 64 columns of K, B all of dS (K-major).
  using TiledMmaDq = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kDqMmaN>, cute::Int<kBlockN>>,
                                 kDsKeysContiguous && !kDqTransposed ? cute::GMMA::Major::K : cute::GMMA::Major::MN,
                                 kDqTransposed ? cute::GMMA::Major::K : cute::GMMA::Major::MN>()));

  // kBias: the bias tile of step t arrives in dS buffer t % 2 (bias_full) once the dQ product two
  // steps back has read that buffer (ds_free).  Plain instances derive from
  // the empty NoBias instead, which takes no room.
  struct BiasBarriers {
    uint64_t bias_full[2];
  };
  struct NoBias {};
  // kSparse: a partial step's rows of the mask's bits, per stage (4 words per query, one per 32
  // keys), filled with the stage's Q and dO.  Plain instances derive from the empty NoSparse.
  struct SparseBits {
    alignas(16) uint32_t bits[kStages][kBlockM * 4];
  };
  struct NoSparse {};
  // kDropout: the next step's keep bits, each warpgroup's Philox calls' 16 bits, two calls a word
  // (consume(): draw).  In registers across the step's GEMMs they spilled ~160 bytes at head dim 64.
  struct KeepBits {
    uint32_t keep[kWarpGroups][2 * kBlockM];
  };
  struct NoKeep {};
  // kShareSdp: a step's P^T, double-buffered like dS (the same ds_full / ds_free barriers).
  struct SplitP {
    alignas(1024) Element p[2 * kBlockM * kBlockN];
  };
  struct NoSplitP {};
  struct SharedStorage : std::conditional_t<kBias, BiasBarriers, NoBias>,
                         std::conditional_t<kSparse, SparseBits, NoSparse>,
                         std::conditional_t<kDropout, KeepBits, NoKeep>,
                         std::conditional_t<kShareSdp, SplitP, NoSplitP> {
    alignas(1024) Element k[kBlockN * kHeadDim];
    alignas(1024) Element v[kBlockN * kHeadDim];
    alignas(1024) Element q[kStages * kBlockM * kHeadDim];
    alignas(1024) Element dout[kStages * kBlockM * kHeadDim];
    alignas(1024) Element ds[2 * kBlockM * kBlockN];
    // a query block's dQ, laid out as the accumulator (dq_to_tile); kDbiasStaged: its parts hold the
    // staged dbias boxes too, which the TMA store reads with the 128-byte swizzle (1024-byte aligned)
    alignas(1024) float dq[kDqTile ? kBlockM * kHeadDim : 4];
    alignas(16) float lse_log2[kStages][kBlockM];
    alignas(16) float delta[kStages][kBlockM];
    alignas(8) uint64_t kv_full;
    uint64_t full[kStages];
    uint64_t empty[kStages];
    uint64_t ds_full[2];  // dS buffer b holds both warpgroups' halves of a step's dS (every consumer thread arrives)
    uint64_t ds_free[2];  // and both warpgroups' dQ products of that step have read it
    // kDqReduceWarps: warpgroup w's dQ part is in the tile (its 128 threads arrive); kDqInStage: one
    // per stage, dq_full[stage * kWarpGroups + w] (a warpgroup may stage a part before its reduce warp
    // has waited for the last, never two)
    uint64_t dq_full[kWarpGroups * (kDqInStage ? kStages : 1)];
    uint64_t dq_free[kWarpGroups];  // and the TMA unit has read it (its reduce warp arrives)
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage)) + 1024;  // +1024: the base is rounded up
  static_assert(kSharedBytes <= 227 * 1024, "K, V, the Q/dO ring and dS exceed the shared memory of a Hopper block");

  // The query blocks a key block meets: all, or those the band reaches.
  struct Steps {
    int m_begin;
    int m_blocks;  // per query head
  };
  static __device__ Steps steps(Sequence const& seq, int n_block) {
    if (n_block * kBlockN >= seq.num_keys) {  // past a packed sequence's keys: nothing, not even dK/dV
      return {0, 0};
    }
    if (kBand) {
      BlockRange const r = band_blocks<kBlockN, kBlockM>(n_block, seq.num_queries, -seq.band_hi, -seq.band_lo);
      return {r.begin, max(0, r.end - r.begin)};
    }
    return {0, (seq.num_queries + kBlockM - 1) / kBlockM};
  }

  // The key blocks that meet query block m_block (steps() the other way round): they add
  // into its dQ, in this order when deterministic.
  static __device__ BlockRange dq_key_blocks(Sequence const& seq, int m_block) {
    if (kBand) {
      return band_blocks<kBlockM, kBlockN>(m_block, seq.num_keys, seq.band_lo, seq.band_hi);
    }
    return {0, (seq.num_keys + kBlockN - 1) / kBlockN};
  }

  // kSparse: the steps of key block n_block, in the order the producer loads them: the query heads
  // of the k/v group in turn, and for each the query blocks the mask lists for (batch, head,
  // n_block), partial ones first, each as its kStepsPerMaskBlock steps of kBlockM queries (those
  // that start before the last query: a 64-query step past it would read workspace rows of the
  // next head).  Producer and consumers each keep one and call more() before every next().
  struct Step {
    int head;
    int m_block;  // in kBlockM steps
    int tile;     // a partial block's tile in sparse_bits, else -1
  };
  // Step t of a walk without block-mask lists.  The producer, the consumers and the reduce warps count
  // steps alike.  By default the query heads of the k/v group in turn, each over the CTA's query blocks.
  // Band calls with 8 or more query heads per k/v head at head dims over 64: the query blocks from the
  // last down, the group's heads within each, from head n_block % group on.  Their grid runs
  // key-block-major across all (k/v head, sequence) pairs (kernel()); heads in turn, a pair's CTAs
  // (whose bands differ in length) drifted apart over its group's Q, dO and dQ, more than L2 holds
  // (bf16 d128 causal 2k, group 8: L2 hits 53%, multi-head 84%).  Query blocks from the last, every
  // CTA of a pair starts on the same block and all move down one block per group of steps (66%, the
  // kernel 8% faster); the rotated first head keeps them off the same dQ tile.  H200 bf16, three
  // runs each: group 8 d256 +13-18%, d128 -1% to +3.5%; group 4 -5% to +6%, and the head-dim-64
  // kernel's code with the branch ran its multi-head calls 3-5% slower: so neither of those.
  static __device__ Step dense_step(BwdParams const& p, Steps st, int head_kv, int n_block, int t) {
    if (kBand && kHeadDim > 64 && p.head_group >= 8) {
      int const g = p.head_group;
      return Step{head_kv * g + (t + n_block) % g, st.m_begin + st.m_blocks - 1 - t / g, -1};
    }
    return Step{head_kv * p.head_group + t / st.m_blocks, st.m_begin + t % st.m_blocks, -1};
  }
  struct SparseWalk {
    BwdParams const& p;
    int n_block;
    int head0;  // the group's first query head
    int plane0;  // batch * sparse_batch_step
    int g = -1;  // the head within the group whose lists are loaded
    int i = 0;   // the next entry of its lists
    int half = 0;  // the next step within that entry's mask block
    int partial = 0;
    int count = 0;  // partial + full entries
    int plane = 0;
    int const* partial_list = nullptr;
    int const* full_list = nullptr;

    __device__ SparseWalk(BwdParams const& p_, int batch, int head_kv, int n_block_)
        : p(p_), n_block(n_block_), head0(head_kv * p_.head_group), plane0(batch * p_.sparse_batch_step) {}

    // Whether a step remains (moving on past heads whose lists are empty).
    __device__ bool more() {
      while (i >= count && g + 1 < p.head_group) {
        ++g;
        i = 0;
        plane = plane0 + (head0 + g) * p.sparse_head_step;
        long long const row = (long long)plane * p.sparse_key_blocks + n_block;
        partial = __ldg(p.sparse_partial_counts + row);
        count = partial + __ldg(p.sparse_full_counts + row);
        partial_list = p.sparse_partial_blocks + row * p.sparse_query_blocks;
        full_list = p.sparse_full_blocks + row * p.sparse_query_blocks;
      }
      return i < count;
    }

    __device__ Step next() {
      int const q_block = i < partial ? __ldg(partial_list + i) : __ldg(full_list + i - partial);
      int tile = -1;
      if (i < partial) {
        tile = __ldg(p.sparse_tiles + ((long long)plane * p.sparse_query_blocks + q_block) * p.sparse_key_blocks +
                     n_block);
      }
      Step const step{head0 + g, q_block * kStepsPerMaskBlock + half, tile};
      ++half;
      if (half == kStepsPerMaskBlock || (q_block * kStepsPerMaskBlock + half) * kBlockM >= p.num_queries) {
        half = 0;
        ++i;
      }
      return step;
    }
  };

  static __device__ void produce(BwdParams const& p, SharedStorage& s, Sequence const& seq, int n_block,
                                 int head_kv, Steps st) {
    using Barrier = cutlass::arch::ClusterBarrier;
    using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
    auto load = [&](CUtensorMap const* map, uint64_t* full, Element* smem, int rows, int row0, int head) {
      tma_load_tile<kBoxCols, kBoxesPerRow>(map, full, smem, rows, row0, head, seq.batch);
    };
    SparseWalk walk(p, seq.batch, head_kv, n_block);
    if constexpr (kSparse) {
      if (!walk.more()) {  // no query block meets this key block: nothing to load (dK, dV are 0)
        return;
      }
    }
    TxBarrier::arrive_and_expect_tx(&s.kv_full, 2 * kBlockN * kHeadDim * int(sizeof(Element)));
    load(&p.k_map, &s.kv_full, s.k, kBlockN, seq.k0 + n_block * kBlockN, head_kv);
    load(&p.v_map, &s.kv_full, s.v, kBlockN, seq.k0 + n_block * kBlockN, head_kv);
    int const total = p.head_group * st.m_blocks;
    for (int t = 0; kSparse ? walk.more() : t < total; ++t) {
      int const stage = t % kStages;
      int const round = t / kStages;
      if (round > 0) {
        Barrier::wait(&s.empty[stage], (round - 1) & 1);
      }
      Step const step = kSparse ? walk.next() : dense_step(p, st, head_kv, n_block, t);
      int const head = step.head;
      int const m_block = step.m_block;
      long long const row = workspace_row0<kBlockM>(p, seq, head) + m_block * kBlockM;
      int const query0 = seq.q0 + m_block * kBlockM;
      int const bits_bytes = kSparse && step.tile >= 0 ? kBlockM * 16 : 0;  // a partial block's rows of bits
      TxBarrier::arrive_and_expect_tx(&s.full[stage],
                                      2 * kBlockM * (kHeadDim * int(sizeof(Element)) + 4) + bits_bytes);
      load(&p.q_map, &s.full[stage], s.q + stage * kBlockM * kHeadDim, kBlockM, query0, head);
      load(&p.do_map, &s.full[stage], s.dout + stage * kBlockM * kHeadDim, kBlockM, query0, head);
      cute::SM90_BULK_COPY_G2S::copy(p.lse_log2_ptr + row, &s.full[stage], s.lse_log2[stage], kBlockM * 4);
      cute::SM90_BULK_COPY_G2S::copy(p.delta_ptr + row, &s.full[stage], s.delta[stage], kBlockM * 4);
      if constexpr (kSparse) {  // the step's kBlockM rows of the tile (16 bytes each), from row m_block's in the block
        if (step.tile >= 0) {
          uint32_t const* rows = p.sparse_bits + ((long long)step.tile * kMaskRows +
                                                  m_block % kStepsPerMaskBlock * kBlockM) * 4;
          cute::SM90_BULK_COPY_G2S::copy(rows, &s.full[stage], s.bits[stage], bits_bytes);
        }
      }
      if constexpr (kBias) {  // into the dS buffer of step t as dS lies there (consume())
        int const buf = t % 2;
        if (t >= 2) {
          Barrier::wait(&s.ds_free[buf], (t / 2 - 1) & 1);
        }
        TxBarrier::arrive_and_expect_tx(&s.bias_full[buf], kBlockM * kBlockN * int(sizeof(Element)));
        tma_load_bias<kBlockM / kBiasBox, kBlockN / kBiasBox, 1, kBlockM / kBiasBox>(
            p, &s.bias_full[buf], s.ds + buf * kBlockM * kBlockN, query0, seq.k0 + n_block * kBlockN, head,
            seq.batch);
      }
    }
  }

  static __device__ void consume(BwdParams const& p, SharedStorage& s, Sequence const& seq, int n_block,
                                 int head_kv, Steps st) {
    using namespace cute;
    using Barrier = cutlass::arch::ClusterBarrier;
    int const tid = threadIdx.x;  // 0 .. kConsumerThreads - 1
    int const wg = kUniformSlices ? warpgroup_index() : tid / 128;
    int const lane = tid % 32;
    int const warp_in_wg = (tid / 32) % 4;

    TiledMmaSdP mma_sdp;
    TiledMmaKV mma_kv;
    TiledMmaDq mma_dq;
    // The operands' shared-memory descriptors depend on the warpgroup alone (the whole warpgroup reads
    // them): sliced at its first thread, through the uniform wg, they stay in uniform registers.
    int const rank = kUniformSlices ? 0 : tid % 128;  // the slices' thread within the warpgroup
    int const mma_tid = kSplitCols ? rank : 128 * wg + rank;
    auto thr_sdp = mma_sdp.get_thread_slice(mma_tid);
    auto thr_kv = mma_kv.get_thread_slice(mma_tid);
    auto thr_dq = mma_dq.get_thread_slice(rank);

    Tensor sK = make_tensor(make_smem_ptr(s.k), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(s.v), SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(s.k), SmemLayoutKt{});
    Tensor sQ = make_tensor(make_smem_ptr(s.q), SmemLayoutQ{});
    Tensor sDo = make_tensor(make_smem_ptr(s.dout), SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(s.q), SmemLayoutQt{});
    Tensor sDoT = make_tensor(make_smem_ptr(s.dout), SmemLayoutQt{});
    Tensor sDs = make_tensor(make_smem_ptr(s.ds), SmemLayoutDs{});

    Tensor tSrK = thr_sdp.partition_fragment_A(sK(_, _, 0));  // (MMA, MMA_M, MMA_K)
    Tensor tPrV = thr_sdp.partition_fragment_A(sV(_, _, 0));
    // This warpgroup's queries of a step (all of them unless kShareSdp) as B of S^T and dP^T.
    auto const sdp_queries = Shape<Int<kSdpQueries>, Int<kHeadDim>, Int<kStages>>{};
    int const query_half = kShareSdp ? wg * kSdpQueries : 0;  // its first query within the step
    Tensor tSrQ = thr_sdp.partition_fragment_B(local_tile(sQ, sdp_queries, make_coord(kShareSdp ? wg : 0, 0, 0)));
    Tensor tPrDo = thr_sdp.partition_fragment_B(local_tile(sDo, sdp_queries, make_coord(kShareSdp ? wg : 0, 0, 0)));
    // This warpgroup's head-dim columns of Q and dO for dK and dV (all of them unless split).
    auto const kv_cols = Shape<Int<kKvCols>, Int<kBlockM>, Int<kStages>>{};
    Tensor tKrQt = thr_kv.partition_fragment_B(local_tile(sQt, kv_cols, make_coord(kSplitCols ? wg : 0, 0, 0)));
    Tensor tVrDoT = thr_kv.partition_fragment_B(local_tile(sDoT, kv_cols, make_coord(kSplitCols ? wg : 0, 0, 0)));
    // This warpgroup's share of dQ = dS K (transposed: of dQ^T = K^T dS^T).
    Tensor sDsPart = local_tile(sDs, Shape<Int<kDqRows>, Int<kBlockN>, _2>{}, make_coord(kDqSplitRows ? wg : 0, 0, 0));
    Tensor sKtPart = local_tile(sKt(_, _, 0), Shape<Int<kDqCols>, Int<kBlockN>>{},
                                make_coord(kDqSplitRows ? 0 : wg, 0));
    auto dq_operands = [&]() {
      if constexpr (kDqTransposed) {
        return cute::make_tuple(thr_dq.partition_fragment_B(sDsPart), thr_dq.partition_fragment_A(sKtPart));
      } else {
        return cute::make_tuple(thr_dq.partition_fragment_A(sDsPart), thr_dq.partition_fragment_B(sKtPart));
      }
    };
    auto dq_fragments = dq_operands();
    auto& tQrDs = get<0>(dq_fragments);  // (MMA, 1, MMA_K, 2)
    auto& tQrKt = get<1>(dq_fragments);  // (MMA, 1, MMA_K)

    Tensor acc_dk = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kKvCols>>{});
    Tensor acc_dv = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kKvCols>>{});
    clear(acc_dk);
    clear(acc_dv);
    // P^T and dS^T as A operands (keys x queries): the accumulator registers in the same
    // order, grouped per 16 queries (2 x 2 x 2 values: query + 1, key + 8, query + 8).  kShareSdp: they
    // are this warpgroup's half of them, bound for shared memory, and the A operands are read there.
    using OperandLayout =
        Layout<Shape<Shape<_2, _2, _2>, _1, Int<kSdpQueries / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;
    Tensor tVrP = make_tensor<Element>(OperandLayout{});
    Tensor tKrDs = make_tensor<Element>(OperandLayout{});

    // Accumulator register r of a 64-row wgmma tile: row (r / 2) % 2 * 8 + this thread's
    // first row, column (r / 4) * 8 + col0 + r % 2.
    int const row_in_tile = 16 * warp_in_wg + lane / 4;
    int const col0 = 2 * (lane % 4);
    int const key_row = (kSplitCols ? 0 : 64 * wg) + row_in_tile;  // within the key block
    int const key0 = n_block * kBlockN;
    int const total = p.head_group * st.m_blocks;

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kSdpQueries>>{});
    Tensor tPrDp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kSdpQueries>>{});
    static_assert(size(tSrS) == kSdpQueries / 2, "one 64-key wgmma tile per warpgroup");
    // Step t's S^T and dP^T, two commit groups (the softmax waits for S^T alone).
    auto issue_sdp = [&](int t) {
      int const stage = t % kStages;
      Barrier::wait(&s.full[stage], (t / kStages) & 1);
      warpgroup_fence_operand(tSrS);
      warpgroup_fence_operand(tPrDp);
      warpgroup_arrive();
      warpgroup_gemm_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
      warpgroup_gemm_issue<true>(mma_sdp, tPrV, tPrDo(_, _, _, stage), tPrDp);
    };

    // kDropout: step t's keep bits, drawn (draw()) in the iteration before, under its last GEMM, when only the dQ, dK and
    // dV accumulators hold registers (drawn under the step's own S^T and dP^T GEMMs, beside their
    // accumulators, they spilled at head dim 64).  A thread holds 4 elements of each of its Philox
    // calls (dropout.h), the other 12 are in three other threads of the warpgroup, so the warpgroup
    // draws each of its 8 x kBlockM / 2 calls once -- key group c = (key / 32) * 4 + (key / 2) % 4
    // of its 64 keys, query group q = (query / 16) * 8 + query % 8 of the step's queries -- and
    // keeps its 16 bits in shared memory, calls (q, c) and (q + 1, c) (q even) in the low and high
    // half of word 4q + c of s.keep[wg]; the threads share the words out in turn.
    // Register r = 8g + 4a + 2b + y is query 16g + 8a + col0 + y and key row_in_tile + 8b: query group
    // 8g + col0 + y, key group 4 (warp_in_wg / 2) + lane / 8, byte 8a + 2b + keep_shift of its call,
    // so group g's 8 registers read one word, and register r's bit is keep_bit(r) of it shifted.
    // The words are written after every thread of the warpgroup has read the last step's (dq_barrier(), before
    // the dQ GEMM) and read after all are written (kKeepBarrier + wg); a warp reads 16 distinct
    // words, on 16 banks.
    uint32_t const* keep_words = nullptr;
    int keep_shift = 0;
    if constexpr (kDropout) {
      keep_words = s.keep[wg] + 8 * (lane % 4) + 4 * (warp_in_wg / 2) + lane / 8;
      keep_shift = 4 * (warp_in_wg % 2) + (lane / 4) % 2;
    }
    auto keep_bit = [](int r) { return 16 * (r % 2) + 8 * (r / 4 % 2) + 2 * (r / 2 % 2); };
    auto draw = [&](Step const& step) {
      if constexpr (kDropout) {
        DropoutStream const stream(p, seq.index, step.head);
        int const query0 = step.m_block * kBlockM;
#pragma unroll 1  // a word at a time: unrolled, the Philox calls' temporaries spilled (head dim 64)
        for (int word = tid % 128; word < 2 * kBlockM; word += 128) {
          int const c = word % 8, q = word / 8 * 2;
          int const query = query0 + 16 * (q / 8) + q % 8;  // the element of the call's byte 0
          int const key = key0 + 64 * wg + 32 * (c / 4) + 2 * (c % 4);
          s.keep[wg][word] = stream.keep_bits(query, key) | stream.keep_bits(query + 1, key) << 16;
        }
        cutlass::arch::NamedBarrier::sync(128, kKeepBarrier + wg);
      }
    };

    int const kv_col0 = col0 + (kSplitCols ? wg * kKvCols : 0);
    auto store_dk_dv = [&]() {
      store_dkv(p, seq, acc_dk, p.dk_ptr, p.scale, key0 + key_row, kv_col0, head_kv);
      store_dkv(p, seq, acc_dv, p.dv_ptr, kDropout ? p.dropout_scale : 1.f, key0 + key_row, kv_col0, head_kv);
    };
    // kSparse: the steps come from the mask's lists; the last two are kept for their dQ
    SparseWalk walk(p, seq.batch, head_kv, n_block);
    if (!(kSparse ? walk.more() : total > 0)) {  // no query block meets these keys: dK = dV = 0 (still clear)
      store_dk_dv();
      return;
    }
    Step sparse_previous{0, -1, -1};  // step t - 1
    Step sparse_tiled{0, -1, -1};     // step t - 2
    auto step_at = [&](int t) { return dense_step(p, st, head_kv, n_block, t); };
    Barrier::wait(&s.kv_full, 0);
    if constexpr (kDropout) {
      draw(step_at(0));
    }

    // kBias: the bias tile of step t comes into dS buffer t % 2 as boxes of 64 query rows x 64 keys
    // (sm90_common.h: kBiasBox), [query][key], 128-byte rows with the 128-byte swizzle: the bytes
    // of SmemLayoutDs (keys contiguous), warpgroup w's 64 keys at box w * kBlockM / 64, its query
    // box i i boxes on.  S^T is [key][query]: ldmatrix.trans moves an 8 x 8 matrix (8 queries, 8
    // keys) as the register pair of one key and two queries.  One x4 moves the pairs of query
    // groups j and j + 1 (j even) for keys +0 and +8 (pairs 2j .. 2j + 3): lane l addresses query
    // 8 * (j + l / 16) + l % 8, in the 16-byte chunk 2 * warp + (l / 8) % 2 of its row (of this
    // warpgroup's 64 keys), swizzled by the row's l % 8.  box_lane_bytes is that for j = 0, with
    // rows 8 * row_step apart (0: every query reads row 0, a query-broadcast bias's only row);
    // query group j is j * 1024 bytes further.  A warp reads the 16 keys whose dS^T it later writes
    // over them (store_keys_by_queries), so no other warp's write can reach a bias value it has
    // yet to read.  Rows past the sequence and keys past its end read as TMA's zeros: their P is
    // 0 (lse is +inf there, the keys are masked).  Register r's value comes with the ldmatrix at
    // r - r % 8, read as the P^T loop reaches it: the scheduler hoists what registers allow.
    auto box_lane_bytes = [&](int row_step) {
      int const row = (8 * (lane / 16) + lane % 8) * row_step;
      return row * 128 + 16 * ((2 * warp_in_wg + (lane / 8) % 2) ^ (row % 8));
    };
    int const wg_box_bytes = wg * (kBlockM / kBiasBox) * kBiasBoxBytes;  // this warpgroup's first box
    int const bias_lane_bytes = kBias ? wg_box_bytes + box_lane_bytes(p.bias_row_step) : 0;
    uint32_t bias_pairs[4];  // pairs r / 2 - (r / 2) % 4 .. + 3
    auto bias_value = [&](int buf, int r) {
      if (r % 8 == 0) {
        char const* tile = reinterpret_cast<char const*>(s.ds + buf * kBlockM * kBlockN) + bias_lane_bytes;
        load_matrix_x4<true>(tile + (r / 4) * 1024 * p.bias_row_step, bias_pairs);
      }
      return unpack_half<Element>(bias_pairs[(r / 2) % 4], r % 2);
    };
    // kDbiasStaged: dS before soft-capping's slope is staged pair by pair as the dS loop makes it,
    // in this warpgroup's part of the dQ tile, free from the read of the last step's dQ part
    // (tile_free) until this step's dQ enters it; laid out as the warpgroup's boxes in the dS buffer.
    // Staged whether the caller wants dbias or not: a test in the loop costs more.
    static_assert(!kDbiasStaged || kBlockM * kBiasBox * 2 <= kDqPartFloats * 4, "a warpgroup's dbias fits its dQ part");
    char* const dbias_tile = reinterpret_cast<char*>(s.dq + wg * kDqPartFloats);
    int const dbias_lane_bytes = kDbiasStaged ? box_lane_bytes(1) : 0;
    uint32_t dbias_pairs[4];
    auto stage_dbias = [&](int r, uint32_t pair) {  // r odd: the pair of registers r - 1 and r
      if constexpr (kDbiasStaged) {
        dbias_pairs[(r / 2) % 4] = pair;
        if (r % 8 == 7) {
          store_matrix_x4<true>(dbias_tile + dbias_lane_bytes + (r / 4 - 1) * 1024, dbias_pairs);
        }
      }
    };
    // The warpgroup's dbias boxes of a step leave by TMA stores from its thread 0, once every
    // consumer thread has written (and fenced) its dS^T, or staged dbias (ds_full); they must be read
    // before the buffer is written over (ds_free: the step after next's bias tile; staged: the dQ
    // part).  The tensor map drops rows past the sequence and keys past its end.
    bool const want_dbias = kBias && p.dbias_ptr != nullptr;
    auto store_dbias = [&](int buf, int head, int query0) {
      if (want_dbias && tid % 128 == 0) {
        char const* tile = kDbiasStaged ? dbias_tile
                                        : reinterpret_cast<char const*>(s.ds + buf * kBlockM * kBlockN) + wg_box_bytes;
        CUTE_UNROLL
        for (int i = 0; i < kBlockM / kBiasBox; ++i) {
          if (p.dbias_add) {
            SM90_TMA_REDUCE_ADD_4D::copy(&p.dbias_map, tile + i * kBiasBoxBytes, key0 + 64 * wg, query0 + kBiasBox * i,
                                         head * p.bias_head_step, seq.batch * p.bias_batch_step);
          } else {
            SM90_TMA_STORE_4D::copy(&p.dbias_map, tile + i * kBiasBoxBytes, key0 + 64 * wg, query0 + kBiasBox * i, head,
                                    seq.batch);
          }
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    };
    auto dbias_read = [&]() {  // this warpgroup's dbias boxes have left shared memory (its thread 0)
      if (want_dbias && tid % 128 == 0) {
        bulk_wait_read();
      }
    };
    // Before dQ part `part` (counted from 0; < 0: none this step) is stored: the last part was read by
    // the time the next is written, and (kDropout) every thread of the warpgroup has read this step's
    // keep bits before draw() writes the next step's.
    auto dq_barrier = [&](int part) {
      if constexpr (kDqReduceWarps) {
        if (part > 0) {
          Barrier::wait(&s.dq_free[wg], (part - 1) & 1);
        }
        if constexpr (kDropout) {
          cutlass::arch::NamedBarrier::sync(128, 1 + wg);
        }
      } else if constexpr (!kDqInStage) {
        if constexpr (kDqTile) {
          tile_free();
        }
        cutlass::arch::NamedBarrier::sync(128, 1 + wg);
      }
    };
    auto issue_dq = [&](int ds_buf, auto& acc_dq) {
      warpgroup_fence_operand(acc_dq);
      warpgroup_arrive();
      if constexpr (kDqTransposed) {
        warpgroup_gemm_issue<true>(mma_dq, tQrKt, tQrDs(_, _, _, ds_buf), acc_dq);
      } else {
        warpgroup_gemm_issue<true>(mma_dq, tQrDs(_, _, _, ds_buf), tQrKt, acc_dq);
      }
    };
    // The part is in the tile: fenced for the TMA unit, then (kDqReduceWarps) handed to the reduce warp.
    auto dq_part_written = [&]() {
      cutlass::arch::fence_view_async_shared();
      if constexpr (kDqReduceWarps) {
        Barrier::arrive(&s.dq_full[wg]);
      }
    };
    // kDeferDqArrive: a part stored in the loop is fenced and handed on in the next iteration, once its
    // S^T and dP^T GEMMs are issued (dq_part_written there)
    auto dq_out = [&](auto const& acc_dq, Step const& of, bool in_loop) {
      if constexpr (kDqTile) {
        dq_to_tile(s, acc_dq);  // leaves under the next step's S^T and dP^T
        if (!(kDeferDqArrive && in_loop)) {
          dq_part_written();
        }
      } else if constexpr (!kDqInStage) {  // (kDqInStage: after the step's last GEMM, in the loop)
        add_dq_atomic(p, seq, acc_dq, of.head, of.m_block, n_block);
      }
    };
    // Iteration t runs step t and the dQ product of step t - kDqLag: one step late, no warpgroup
    // waits for the other's half of dS (ds_full), so the warpgroups need not run in step and one's
    // softmax can run under the other's GEMMs; the last step's dQ then follows the loop.  No GEMM
    // is issued under a branch (ptxas then serialises them all, C7518): iteration 0 issues a dQ
    // product of nothing and throws it away, and the loop issues and waits for all its GEMMs in
    // one iteration (across the back edge ptxas serialised them, C7514).
    int t = 0;
    for (;; ++t) {
      int const stage = t % kStages;
      int const buf = t % 2;
      Step const step = kSparse ? walk.next() : step_at(t);
      // The step of this iteration's dQ product (t >= kDqLag), and that of the dQ part in the tile
      // (t > kDqLag): it leaves now
      Step const dq_step = !kDqLag ? step : kSparse ? sparse_previous : step_at(t - 1);
      Step const tiled = kSparse ? (kDqLag ? sparse_tiled : sparse_previous) : step_at(t - 1 - kDqLag);
      int const dq_buf = (t + 2 - kDqLag) % 2;
      int const head = step.head;
      int const m_block = step.m_block;
      int const query0 = m_block * kBlockM;
      // The GEMMs go first and run while the last dQ part leaves.  (With lse, delta and dS in
      // generic memory accesses, 128-query steps had done better the other way round.)
      issue_sdp(t);
      if (kDqTile && !kDqReduceWarps && t > kDqLag) {
        add_dq_tile(p, seq, s, tiled.head, tiled.m_block, n_block);
      }
      if (kDeferDqArrive && t > kDqLag) {  // the dQ part the last iteration stored
        dq_part_written();
      }
      warpgroup_wait<1>();  // S^T
      warpgroup_fence_operand(tSrS);
      if constexpr (kBias) {  // read under this step's dP^T GEMM
        Barrier::wait(&s.bias_full[buf], (t / 2) & 1);
      }

      // P^T.  Queries past num_queries have lse_log2 = +inf (P = 0); keys past
      // num_keys or outside the band are masked here.
      bool const masked = key0 + kBlockN > seq.num_keys ||
                          (kBand && (key0 + kBlockN - 1 > query0 + seq.band_hi ||
                                     key0 < query0 + kBlockM - 1 + seq.band_lo));
      auto hidden = [&](int r, int col) {  // bitwise ors: a select per element, no branches
        int const key = key0 + key_row + ((r / 2) % 2) * 8;
        int const query = query0 + query_half + col;
        return (key >= seq.num_keys) | (kBand & ((key > query + seq.band_hi) | (key < query + seq.band_lo)));
      };
      // Register r's column value of lse or delta.  A thread's columns come in adjacent pairs
      // (col0 is even) shared by registers 4g .. 4g + 3: one 8-byte load per pair, at r = 4g.
      float2 pair;
      auto column_value = [&](float const* row, int r) {
        if (r % 4 == 0) {
          pair = load_shared_f32x2(row + (r / 4) * 8 + col0);
        }
        return r % 2 ? pair.y : pair.x;
      };
      float const* lse_log2 = s.lse_log2[stage] + query_half;
      float const* delta = s.delta[stage] + query_half;
      auto lse_value = [&](int r) { return column_value(lse_log2, r); };
      auto delta_value = [&](int r) { return column_value(delta, r); };
      // The exponent's offset for register r: -lse_log2 of its query, plus (kBias) its bias in log2 units.
      auto offset = [&](int r) {
        if constexpr (kBias) {
          return fmaf(bias_value(buf, r), kLog2e, -lse_value(r));
        } else {
          return -lse_value(r);
        }
      };
      // kDbiasStaged: this warpgroup's dQ part is free for the dbias tile once its thread 0 has seen the
      // TMA unit read the last step's dQ part (issued at the top of this step: done by now)
      auto free_dq_part = [&]() {
        if constexpr (kDbiasStaged) {
          tile_free();
          cutlass::arch::NamedBarrier::sync(128, kBiasBarrier + wg);
        }
      };
      // The mask is applied in a loop of its own: tested per element inside the exp2 loop,
      // it became 64 branches between the MUFU ops and cost 10-15% at head dim 64.
      if constexpr (kScoreMod) {
        // P^T from mod(S^T * scale) into its A operand, and the mod's derivative in S^T's registers
        // (kept in float) for dS^T; rows and keys past the sequence's are clamped to its last, so that
        // a captured tensor indexed by them is read in bounds (their P is 0: lse +inf, keys masked).
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {
          int const col = (r / 4) * 8 + col0 + r % 2;
          int const key = min(key0 + key_row + ((r / 2) % 2) * 8, seq.num_keys - 1);
          int const query = min(query0 + query_half + col, seq.num_queries - 1);
          float const score = tSrS(r) * p.scale;
          float const prob = exp2_approx(fmaf(ScoreMod::apply(p, score, seq.index, head, query, key), kLog2e,
                                              offset(r)));
          tVrP(r) = static_cast<Element>(masked && hidden(r, col) ? 0.f : prob);
          tSrS(r) = ScoreMod::grad(p, score, seq.index, head, query, key);
        }
        free_dq_part();
        warpgroup_wait<0>();
        warpgroup_fence_operand(tPrDp);
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {  // d/d(scaled score) = d/d(modded score) * grad; scale comes at the end
          float const ds = static_cast<float>(tVrP(r)) * (tPrDp(r) - delta_value(r));
          tKrDs(r) = static_cast<Element>(ds * tSrS(r));
        }
      } else if constexpr (!kSoftcap) {
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {  // P^T in place of S^T
          tSrS(r) = exp2_approx(fmaf(tSrS(r), p.scale_log2, offset(r)));
        }
        if (masked) {
          CUTE_UNROLL
          for (int r = 0; r < size(tSrS); ++r) {
            tSrS(r) = hidden(r, (r / 4) * 8 + col0 + r % 2) ? 0.f : tSrS(r);
          }
        }
        if constexpr (kSparse) {
          if (step.tile >= 0) {
            // A partial block: P^T is 0 (and so dS^T) where the mask's bit is.  Register r holds key
            // key_row + (r / 2) % 2 * 8 and query (r / 4) * 8 + col0 + r % 2 of the step (see col0):
            // both keys of a thread lie in word key_row / 32 of a query's 4 (key_row % 32 is at most
            // 23), at bits key_row % 32 and + 8; the stage's bits hold the step's queries' words in
            // query order (the producer copied the step's rows of the tile), so a thread reads one
            // word per query, kBlockM / 4 of them, the 4 lanes of a key row 32 bytes apart (no bank
            // conflicts; the 8 key rows of a quad's lanes read the same words).
            uint32_t const* words = s.bits[stage] + key_row / 32;
            int const bit = key_row % 32;
            CUTE_UNROLL
            for (int r = 0; r < size(tSrS); ++r) {
              uint32_t const word = words[((r / 4) * 8 + col0 + r % 2) * 4];
              tSrS(r) = (word >> (bit + (r / 2) % 2 * 8)) & 1u ? tSrS(r) : 0.f;
            }
          }
        }
        free_dq_part();
        warpgroup_wait<0>();
        warpgroup_fence_operand(tPrDp);
        uint32_t keep_word = 0;  // kDropout: registers 8g .. 8g + 7's word of keep bits, shifted (see draw)
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {
          float dp = tPrDp(r);
          if constexpr (kDropout) {  // the kept elements' P^T and dP^T / (1 - p); dV's scale comes at its store
            if (r % 8 == 0) {
              keep_word = keep_words[32 * (r / 8)] >> keep_shift;
            }
            bool const kept = (keep_word >> keep_bit(r)) & 1u;
            tVrP(r) = static_cast<Element>(kept ? tSrS(r) : 0.f);
            dp = kept ? dp * p.dropout_scale : 0.f;
          } else {
            tVrP(r) = static_cast<Element>(tSrS(r));
          }
          tKrDs(r) = static_cast<Element>(tSrS(r) * (dp - delta_value(r)));
          if (r % 2 == 1) {
            stage_dbias(r, pack_pair(tKrDs(r - 1), tKrDs(r)));
          }
        }
      } else {
        float previous_ds = 0.f;
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {  // P^T into its A operand, tanh's slope 1 - t^2 into dS^T's
          int const col = (r / 4) * 8 + col0 + r % 2;
          float const t = tanh_approx(tSrS(r) * p.softcap_in);
          float const prob = exp2_approx(fmaf(t * p.softcap_out, p.scale_log2, offset(r)));
          tVrP(r) = static_cast<Element>(masked && hidden(r, col) ? 0.f : prob);
          tKrDs(r) = static_cast<Element>(1.f - t * t);
        }
        free_dq_part();
        warpgroup_wait<0>();
        warpgroup_fence_operand(tPrDp);
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {  // d(softcap_out * t) / dS = scale (1 - t^2); scale comes at the end
          float const ds = static_cast<float>(tVrP(r)) * (tPrDp(r) - delta_value(r));  // d/d(capped score)
          if (r % 2 == 1) {
            stage_dbias(r, pack_pair(static_cast<Element>(previous_ds), static_cast<Element>(ds)));
          }
          previous_ds = ds;
          tKrDs(r) = static_cast<Element>(ds * static_cast<float>(tKrDs(r)));
        }
      }
      // dS^T -> dS in shared memory, for the dQ product (kShareSdp: P^T too, each warpgroup
      // its half of the queries, for both warpgroups' dK and dV products).  The registers are 8 x 8
      // tiles (8 keys, 8 adjacent queries) in the order stmatrix takes them, and a key's 8 queries
      // are one 16-byte chunk of sDs: one stmatrix stores registers r .. r + 7, the tiles of keys +0
      // and +8 for queries r / 4 * 8 and 8 more, lane l addressing row l % 8 of tile l / 8.
      if (!kBias && t >= 2) {  // both warpgroups' dQ products of step t - 2 have read dS buffer `buf`
        Barrier::wait(&s.ds_free[buf], (t / 2 - 1) & 1);  // (kBias: the producer waited, for the bias tile)
      }
      // Keys contiguous, stmatrix.trans stores each tile's columns: lane l addresses query l % 8 of
      // tile l / 8, its 8 keys from key + 0 or + 8.
      auto store_keys_by_queries = [&](auto const& values, auto& to) {
        int const tile = lane / 8;
        int const key = key_row - lane / 4 + (tile % 2) * 8 + (kDsKeysContiguous ? 0 : lane % 8);
        int const query_in_tile = query_half + (kDsKeysContiguous ? lane % 8 : 0);
        CUTE_UNROLL
        for (int r = 0; r < size(values); r += 8) {
          uint32_t pairs[4];
          CUTE_UNROLL
          for (int j = 0; j < 4; ++j) {
            cutlass::Array<Element, 2> pair;
            pair[0] = values(r + 2 * j);
            pair[1] = values(r + 2 * j + 1);
            pairs[j] = reinterpret_cast<uint32_t const&>(pair);
          }
          store_matrix_x4<kDsKeysContiguous>(&to((r / 4 + tile / 2) * 8 + query_in_tile, key, buf), pairs);
        }
      };
      if (!kSplitCols || kShareSdp || wg == 0) {  // (split, not shared: both hold all of dS^T, the first writes it)
        store_keys_by_queries(tKrDs, sDs);
      }
      if constexpr (kShareSdp) {
        Tensor sP = make_tensor(make_smem_ptr(s.p), SmemLayoutDs{});
        store_keys_by_queries(tVrP, sP);
      }
      cutlass::arch::fence_view_async_shared();
      Barrier::arrive(&s.ds_full[buf]);  // every thread: its own writes (split, not shared: the first warpgroup's)

      // dV = P^T dO and dK = dS^T Q from this warpgroup's registers, dQ = dS K of step t - kDqLag
      // once both halves of its dS are in: kDkLast issues dV, dQ, dK, else dV and dK, then dQ.
      // kShareSdp: P^T and dS^T of both warpgroups' queries, from shared memory: the bytes of sP and
      // sDs seen as (keys, queries), queries contiguous, the K-major A operands (a 64-query step is
      // one 128-byte swizzle atom wide, so a key's row of queries lies as in SmemLayoutDs)
      auto kv_gemms = [&](auto const& a_registers, auto const& b, auto& acc, bool ds) {
        if constexpr (kShareSdp) {
          using KeysByQueries = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                        Shape<Int<kBlockN>, Int<kBlockM>, _2>{}));
          Tensor a = thr_kv.partition_fragment_A(make_tensor(make_smem_ptr(ds ? s.ds : s.p), KeysByQueries{}));
          CUTE_UNROLL
          for (int k = 0; k < size<2>(a); ++k) {
            cute::gemm(mma_kv, a(_, _, k, buf), b(_, _, k, stage), acc);
          }
        } else {
          CUTE_UNROLL
          for (int k = 0; k < size<2>(a_registers); ++k) {
            cute::gemm(mma_kv, a_registers(_, _, k), b(_, _, k, stage), acc);
          }
        }
      };
      auto dv_gemms = [&]() { kv_gemms(tVrP, tVrDoT, acc_dv, false); };
      auto dk_gemms = [&]() { kv_gemms(tKrDs, tKrQt, acc_dk, true); };
      auto release_stage = [&]() {  // dK and dV done: this stage's Q and dO can be refilled
        warpgroup_fence_operand(acc_dk);
        warpgroup_fence_operand(tKrDs);
        // every thread arrives: an arrive releases only its own thread's reads (lse, delta); kDqInStage:
        // the reduce warps, once the dQ parts have left the stage
        if constexpr (!kDqInStage) {
          Barrier::arrive(&s.empty[stage]);
        }
      };
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(tVrP);
      if constexpr (!kDkLast) {
        warpgroup_fence_operand(acc_dk);
        warpgroup_fence_operand(tKrDs);
      }
      if constexpr (kShareSdp) {  // both warpgroups' halves of P^T and dS^T are in shared memory
        Barrier::wait(&s.ds_full[buf], (t / 2) & 1);
      }
      warpgroup_arrive();
      dv_gemms();
      if constexpr (!kDkLast) {
        dk_gemms();
      }
      warpgroup_commit_batch();
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<_64, Int<kDqMmaN>>{});
      if constexpr (!kDkLast) {
        dq_barrier(t - kDqLag);
      }
      if (t >= kDqLag) {
        Barrier::wait(&s.ds_full[dq_buf], ((t - kDqLag) / 2) & 1);
      }
      if constexpr (kBias) {  // (kDqLag is 0: this step's dS) as early as it can: its read gates ds_free
        store_dbias(buf, head, query0);
      }
      issue_dq(dq_buf, acc_dq);
      if constexpr (kDkLast) {
        warpgroup_fence_operand(acc_dk);
        warpgroup_fence_operand(tKrDs);
        warpgroup_arrive();
        dk_gemms();
        warpgroup_commit_batch();
        dq_barrier(t - kDqLag);
      }
      warpgroup_wait<1>();  // dV and (kDkLast) dQ or dK
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(tVrP);
      if constexpr (kDkLast) {
        warpgroup_fence_operand(acc_dq);
      } else {
        release_stage();
      }
      bool const more = kSparse ? walk.more() : t + 1 < total;
      if (kDropout && more) {  // the next step's mask, under the last GEMM
        draw(step_at(t + 1));
      }
      if constexpr (!kDkLast) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dq);
      }
      if (t >= kDqLag) {
        if constexpr (kBias && !kDbiasStaged) {  // dbias has left dS buffer dq_buf ...
          dbias_read();
        }
        Barrier::arrive(&s.ds_free[dq_buf]);  // ... which is free for the step after next (its bias tile)
        if constexpr (kDbiasStaged) {  // the staged dbias has left before the dQ part is written over
          dbias_read();
          if (want_dbias) {
            cutlass::arch::NamedBarrier::sync(128, kBiasBarrier + wg);
          }
        }
        dq_out(acc_dq, dq_step, true);
      }
      if constexpr (kDkLast) {
        warpgroup_wait<0>();
        release_stage();
      }
      if constexpr (kDqInStage) {  // the step's GEMMs are done: its dQ part into the stage, for the reduce warp
        dq_to_stage(s, acc_dq, stage);
        cutlass::arch::fence_view_async_shared();
        Barrier::arrive(&s.dq_full[stage * kWarpGroups + wg]);
      }
      if constexpr (kSparse) {
        sparse_tiled = sparse_previous;
        sparse_previous = step;
      }
      if (!more) {
        break;
      }
    }
    Step const last = kSparse ? sparse_previous : step_at(t);
    if constexpr (kDqLag == 1) {
      // The last step's dQ product, and under it the dQ part of the step before and dK, dV out
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<_64, Int<kDqMmaN>>{});
      Barrier::wait(&s.ds_full[t % 2], (t / 2) & 1);
      issue_dq(t % 2, acc_dq);
      if (kDeferDqArrive && t >= kDqLag) {  // the part the loop's last iteration stored
        dq_part_written();
      }
      if (kDqTile && !kDqReduceWarps && t >= 1) {
        Step const before_last = kSparse ? sparse_tiled : step_at(t - 1);
        add_dq_tile(p, seq, s, before_last.head, before_last.m_block, n_block);
      }
      store_dk_dv();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dq);
      dq_barrier(t);
      dq_out(acc_dq, last, false);
    } else {
      if constexpr (kDeferDqArrive) {  // the part the loop's last iteration stored
        dq_part_written();
      }
      store_dk_dv();
    }
    if constexpr (kDqTile && !kDqReduceWarps) {
      add_dq_tile(p, seq, s, last.head, last.m_block, n_block);
      tile_free();  // the shared memory stays until the TMA unit has read the last tile
    }
  }

  // The fp32 dQ accumulator of one query block is laid out as the consumers hold it: part
  // after part (a part is one warpgroup's share, kDqRows rows x kDqCols columns, see
  // kDqSplitRows), and within a part the accumulator registers four at a time, thread after
  // thread (quad q of thread t at floats (q * 128 + t) * 4).  A part then goes to shared memory
  // in conflict-free 16-byte stores (row-major rows of 64 or 128 floats put 8 rows on the same
  // banks) and leaves in one contiguous bulk reduce-add.  convert() maps it back.
  static constexpr int kDqPartFloats = kDqRows * kDqCols;
  static_assert(kWarpGroups * kDqPartFloats == kBlockM * kHeadDim, "the parts tile the query block's dQ");

  // Row and column (in the query block) of the first value of quad q of thread t of part
  // `part`; the quad holds (row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1) --
  // transposed (registers of dQ^T), (row, col), (row + 1, col), (row, col + 8), (row + 1, col + 8).
  static __device__ int2 dq_quad_place(int part, int q, int t) {
    int const lane = t % 32;
    int const m = 16 * (t / 32) + lane / 4;  // the quad's first value in the part's MMA tile
    int const n = 8 * q + 2 * (lane % 4);
    if constexpr (kDqTransposed) {
      return make_int2(n, m + kDqCols * part);  // dQ^T: the tile's rows are columns of dQ
    } else if constexpr (kDqSplitRows) {
      return make_int2(m + 64 * part, n);
    } else {
      return make_int2(m, n + kDqCols * part);
    }
  }

  // dQ parts go into the fp32 accumulator after all parts of the key blocks before this one
  // when deterministic: the query block's counter counts the parts that are in.
  struct DqOrder {
    cuda::atomic_ref<int, cuda::thread_scope_device> counter;
    int earlier;  // key blocks before this one that meet the query block
    __device__ DqOrder(BwdParams const& p, Sequence const& seq, long long block_row0, int m_block, int n_block)
        : counter(p.dq_counter_ptr[block_row0 / kBlockM]), earlier(n_block - dq_key_blocks(seq, m_block).begin) {}
    __device__ void wait_turn() const {
      while (counter.load(cuda::memory_order_acquire) < earlier * kWarpGroups) {
      }
    }
    __device__ void done() const { counter.fetch_add(1, cuda::memory_order_release); }
  };

  // This warpgroup's dQ part into its part of the tile (kDqTile), in the accumulator's layout:
  // conflict-free 16-byte stores.  The caller has made sure the last tile was read (tile_free).
  template <class Accumulator>
  static __device__ void dq_to_tile(SharedStorage& s, Accumulator const& acc) {
    using namespace cute;
    static_assert(decltype(size(acc))::value * 128 == kDqPartFloats, "a part is 64 x kDqCols accumulator values");
    float4* tile = reinterpret_cast<float4*>(s.dq + threadIdx.x / 128 * kDqPartFloats) + threadIdx.x % 128;
    CUTE_UNROLL
    for (int q = 0; q < size(acc) / 4; ++q) {
      tile[q * 128] = make_float4(acc(4 * q), acc(4 * q + 1), acc(4 * q + 2), acc(4 * q + 3));
    }
  }

  // Once the warpgroup's part is in the tile, one of its threads hands it to the TMA unit as
  // one bulk reduce-add into query block m_block's accumulator (per-thread atomics kept the
  // consumers stalled on memory, ncu: long scoreboard and LSU throttle over 40%).
  static __device__ void add_dq_tile(BwdParams const& p, Sequence const& seq, SharedStorage& s, int head, int m_block,
                                     int n_block) {
    int const part = threadIdx.x / 128;
    cutlass::arch::NamedBarrier::sync(128, 1 + part);  // this warpgroup's 128 threads
    if (threadIdx.x % 128 == 0) {
      reduce_dq_part(p, seq, s, head, m_block, n_block, part);
    }
  }

  // Part `part` of the tile as one bulk reduce-add into query block m_block's accumulator (in turn
  // when deterministic); one thread issues it.
  // (kDqInStage: its kPieces equal pieces, each contiguous in shared memory, from pieces[i].)
  template <int kPieces = 1>
  static __device__ void reduce_dq_part(BwdParams const& p, Sequence const& seq, SharedStorage& s, int head,
                                        int m_block, int n_block, int part, float const* const* pieces = nullptr) {
    long long const block_row0 = workspace_row0<kBlockM>(p, seq, head) + m_block * kBlockM;
    DqOrder const order(p, seq, block_row0, m_block, n_block);
    bool const ordered = !kSparse && p.deterministic;  // the runtime never asks a sparse instance
    if (ordered) {
      order.wait_turn();
      fence_proxy_async_global();  // the acquire, before the TMA unit's adds
    }
    constexpr int kPieceFloats = kDqPartFloats / kPieces;
    CUTE_UNROLL
    for (int i = 0; i < kPieces; ++i) {
      bulk_reduce_add(p.dq_accum_ptr + block_row0 * kHeadDim + part * kDqPartFloats + i * kPieceFloats,
                      pieces ? pieces[i] : s.dq + part * kDqPartFloats + i * kPieceFloats,
                      kPieceFloats * int(sizeof(float)));
    }
    if (ordered) {
      bulk_wait_all();             // the adds are done ...
      fence_proxy_async_global();  // ... and ordered before the release
      order.done();
    }
  }

  // kDqReduceWarps: lane 0 of the reduce warp of warpgroup `part` walks the steps as the consumers do
  // and sends each of that warpgroup's dQ parts on once it is in the tile (dq_full), then frees the
  // tile once the TMA unit has read it (dq_free).  It waits for the last read before leaving, so the
  // block's shared memory outlives it.
  static __device__ void reduce_dq(BwdParams const& p, SharedStorage& s, Sequence const& seq, int n_block,
                                   int head_kv, Steps st, int part) {
    using Barrier = cutlass::arch::ClusterBarrier;
    SparseWalk walk(p, seq.batch, head_kv, n_block);
    int const total = p.head_group * st.m_blocks;
    for (int i = 0; kSparse ? walk.more() : i < total; ++i) {
      Step const step = kSparse ? walk.next() : dense_step(p, st, head_kv, n_block, i);
      Barrier::wait(&s.dq_full[part], i & 1);
      reduce_dq_part(p, seq, s, step.head, step.m_block, n_block, part);
      bulk_wait_read();
      Barrier::arrive(&s.dq_free[part]);
    }
  }

  // kDqInStage: half `half` of warpgroup `part`'s dQ part lies in the stage's Q (half 0) or dO (1) bytes
  // of head-dim columns `part`: SmemLayoutQ tiles a stage's (rows, columns) column block by column
  // block of whole swizzle atoms (rows first), so those columns are kBlockM * kKvCols contiguous values.
  static_assert(!kDqInStage || (kKvCols % kBoxCols == 0 && kDqPartFloats * int(sizeof(float)) ==
                                                             2 * kBlockM * kKvCols * int(sizeof(Element))),
                "a dQ part is the bytes of its warpgroup's columns of a stage's Q and dO");
  static __device__ float* staged_dq_half(SharedStorage& s, int stage, int part, int half) {
    Element* const tile = (half == 0 ? s.q : s.dout) + stage * kBlockM * kHeadDim + part * kBlockM * kKvCols;
    return reinterpret_cast<float*>(tile);
  }
  template <class Accumulator>
  static __device__ void dq_to_stage(SharedStorage& s, Accumulator const& acc, int stage) {
    using namespace cute;
    constexpr int kQuads = decltype(size(acc))::value / 4;  // as dq_to_tile lays them out, half in each
    static_assert(kQuads * 4 * 128 == kDqPartFloats && kQuads % 2 == 0, "a part is 64 x kDqCols accumulator values");
    int const part = threadIdx.x / 128;
    CUTE_UNROLL
    for (int q = 0; q < kQuads; ++q) {
      float4* const half = reinterpret_cast<float4*>(staged_dq_half(s, stage, part, q / (kQuads / 2)));
      half[(q % (kQuads / 2)) * 128 + threadIdx.x % 128] =
          make_float4(acc(4 * q), acc(4 * q + 1), acc(4 * q + 2), acc(4 * q + 3));
    }
  }

  // kDqInStage: lane 0 of warpgroup `part`'s reduce warp walks the steps as the consumers do, sends each
  // of the warpgroup's dQ parts on from the stage once it is there (dq_full), and frees the stage
  // (empty, one arrive per reduce warp) once the TMA unit has read it.  The last read is waited for
  // before it leaves, so the block's shared memory outlives it.
  static __device__ void reduce_staged_dq(BwdParams const& p, SharedStorage& s, Sequence const& seq, int n_block,
                                          int head_kv, Steps st, int part) {
    using Barrier = cutlass::arch::ClusterBarrier;
    int const total = p.head_group * st.m_blocks;
    for (int i = 0; i < total; ++i) {
      int const stage = i % kStages;
      Step const step = dense_step(p, st, head_kv, n_block, i);
      Barrier::wait(&s.dq_full[stage * kWarpGroups + part], (i / kStages) & 1);
      float const* const halves[2] = {staged_dq_half(s, stage, part, 0), staged_dq_half(s, stage, part, 1)};
      reduce_dq_part<2>(p, seq, s, step.head, step.m_block, n_block, part, halves);
      bulk_wait_read();
      Barrier::arrive(&s.empty[stage]);
    }
  }

  // Where the tile does not fit (split head dim): this warpgroup's dQ part by 16-byte atomics.
  template <class Accumulator>
  static __device__ void add_dq_atomic(BwdParams const& p, Sequence const& seq, Accumulator const& acc, int head,
                                       int m_block, int n_block) {
    using namespace cute;
    static_assert(decltype(size(acc))::value * 128 == kDqPartFloats, "a part is 64 x kDqCols accumulator values");
    int const part = threadIdx.x / 128;
    int const barrier = 1 + part;  // named barrier of this warpgroup's 128 threads
    long long const block_row0 = workspace_row0<kBlockM>(p, seq, head) + m_block * kBlockM;
    DqOrder const order(p, seq, block_row0, m_block, n_block);
    if (p.deterministic) {
      if (threadIdx.x % 128 == 0) {
        order.wait_turn();
      }
      cutlass::arch::NamedBarrier::sync(128, barrier);
    }
    float4* quads = reinterpret_cast<float4*>(p.dq_accum_ptr + block_row0 * kHeadDim + part * kDqPartFloats) +
                    threadIdx.x % 128;
    CUTE_UNROLL
    for (int q = 0; q < size(acc) / 4; ++q) {
      atomicAdd(quads + q * 128, make_float4(acc(4 * q), acc(4 * q + 1), acc(4 * q + 2), acc(4 * q + 3)));
    }
    if (p.deterministic) {
      __threadfence();
      cutlass::arch::NamedBarrier::sync(128, barrier);
      if (threadIdx.x % 128 == 0) {
        order.done();
      }
    }
  }

  // Before a warpgroup writes its next dQ part: its thread 0, which issued the last reduce-add,
  // waits until the TMA unit has read it; the caller's next barrier tells the others.
  static __device__ void tile_free() {
    if (threadIdx.x % 128 == 0) {
      bulk_wait_read();
    }
  }

  template <class Accumulator>
  static __device__ void store_dkv(BwdParams const& p, Sequence const& seq, Accumulator const& acc, void* ptr,
                                   float scale, int key_row0, int col0, int head_kv) {
    using namespace cute;
    Element* base = static_cast<Element*>(ptr) + seq.batch * p.dkv_stride_b + seq.k0 * (long long)p.dkv_stride_n +
                    head_kv * (long long)p.dkv_stride_h;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      int const key = key_row0 + 8 * h;
      if (key >= seq.num_keys) {
        continue;
      }
      Element* row = base + key * (long long)p.dkv_stride_n;
      CUTE_UNROLL
      for (int r = 2 * h; r < size(acc); r += 4) {
        int const col = (r / 4) * 8 + col0;
        if (col < p.head_dim) {
          cutlass::Array<Element, 2> pair;
          pair[0] = static_cast<Element>(acc(r) * scale);
          pair[1] = static_cast<Element>(acc(r + 1) * scale);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(row + col) = pair;
        }
      }
    }
  }

  // grid (ceil(N / kBlockN), k/v heads, batch or sequences), kThreads threads, kSharedBytes dynamic shared memory
  static __device__ void run(BwdParams const& p, char* smem_raw) {
    SharedStorage& s = shared_storage<SharedStorage>(smem_raw);
    // Key blocks in order (the deterministic dQ order).  Grouped-query band calls take the grid
    // key block by key block across all (k/v head, sequence) pairs, so every pair's long first
    // blocks start first and the short last ones fill the tail: a CTA walks all query heads of
    // its group, and with key blocks innermost a late pair's longest CTA started near the end
    // (H200, causal, 4 and 8 query heads per k/v head: +6% to +32%).  Multi-head calls keep key
    // blocks innermost: the CTAs running together then share their pair's Q and dO in L2
    // (key-block-major cost them 3-12%).
    // Where a bias is the same for every batch (kBias, bias_batch_step 0), the batches come innermost,
    // then key blocks, then k/v heads: a key block's CTAs of all batches start together and read each
    // bias tile, and add into each dbias tile, within a step or two of each other, while L2 holds
    // it.  (Batches between key blocks and heads put them a quarter of a CTA's life apart: ncu, d64
    // 4 x 4k, 4.25 GB of DRAM reads for a 1.07 GB bias, the dbias written back twice; batches
    // innermost: 2.81 GB read, 1.45 written, and 4 x 4k 4-18% faster at head dims 64 and 128, H200.)
    bool const by_key_block = kBand && p.head_group > 1;
    bool const batches_first = kBias && p.bias_batch_step == 0 && !by_key_block;
    int const linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int const pairs = gridDim.y * gridDim.z;
    int const n_block = by_key_block ? linear / pairs : batches_first ? linear / gridDim.z % gridDim.x : blockIdx.x;
    int const head_kv = by_key_block    ? linear % pairs % gridDim.y
                        : batches_first ? linear / (gridDim.z * gridDim.x)
                                        : blockIdx.y;
    Sequence const seq = sequence(p, by_key_block    ? linear % pairs / gridDim.y
                                     : batches_first ? linear % gridDim.z
                                                     : blockIdx.z);
    Steps const st = steps(seq, n_block);

    if (threadIdx.x == 0) {
      using Barrier = cutlass::arch::ClusterBarrier;
      Barrier::init(&s.kv_full, 1);
      CUTE_UNROLL
      for (int i = 0; i < kStages; ++i) {
        Barrier::init(&s.full[i], 1);
        Barrier::init(&s.empty[i], kDqInStage ? kWarpGroups : kConsumerThreads);  // (kDqInStage: the reduce warps)
      }
      for (int i = 0; i < 2; ++i) {
        Barrier::init(&s.ds_full[i], kConsumerThreads);
        Barrier::init(&s.ds_free[i], kConsumerThreads);
        if constexpr (kBias) {
          Barrier::init(&s.bias_full[i], 1);
        }
      }
      for (int w = 0; w < kWarpGroups; ++w) {
        for (int stage = 0; stage < (kDqInStage ? kStages : 1); ++stage) {
          Barrier::init(&s.dq_full[stage * kWarpGroups + w], 128);
        }
        Barrier::init(&s.dq_free[w], 1);
      }
      cutlass::arch::fence_barrier_init();
    }
    __syncthreads();

    if (threadIdx.x >= kConsumerThreads) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
      if (threadIdx.x == kConsumerThreads && st.m_blocks > 0) {
        produce(p, s, seq, n_block, head_kv, st);
      } else {
        int const warp = (threadIdx.x - kConsumerThreads) / 32;
        if constexpr (kHasReduceWarps) {  // lane 0 of warp 1 + w: warpgroup w's reduce warp
          if (warp >= 1 && warp <= kWarpGroups && threadIdx.x % 32 == 0 && st.m_blocks > 0) {
            if constexpr (kDqInStage) {
              reduce_staged_dq(p, s, seq, n_block, head_kv, st, warp - 1);
            } else {
              reduce_dq(p, s, seq, n_block, head_kv, st, warp - 1);
            }
          }
        }
        if constexpr (kZeroesHiddenDbias) {  // the warps from kFirstZeroWarp on
          int const t = threadIdx.x - kConsumerThreads - 32 * kFirstZeroWarp;
          if (t >= 0 && p.dbias_ptr != nullptr && !p.dbias_add && p.seqstart_q == nullptr) {
            zero_hidden_dbias(p, seq, n_block, head_kv, st, t);
          }
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      consume(p, s, seq, n_block, head_kv, st);
    }
  }

  // grid (ceil(M / kBlockM), heads, batch or sequences), kAuxThreads threads
  static __device__ void prep(BwdParams const& p) { backward_prep<Element, kHeadDim, kBlockM, kAuxThreads>(p); }

  // A band bias instance also writes dbias's zeros outside the band (kZeroesHiddenDbias): the producer
  // warpgroup's warps after its loader and reduce warps, idle there, store zeros into the rows of the
  // CTA's keys that none of its steps visits, while the consumers run their GEMMs.  The caller then
  // need not clear all of dbias first (causal: twice the bytes, before the kernel).
  // Fixed-length batches only: the runtime clears a packed batch's dbias.
  static constexpr bool kZeroesHiddenDbias = kBias && kBand;
  // Bias instances can add dbias into the bias's own shape (BwdParams::dbias_add): the manifest's
  // adds_dbias tells the runtime.
  static constexpr bool kAddsDbias = kBias;
  static constexpr int kFirstZeroWarp = kHasReduceWarps ? 1 + kWarpGroups : 1;
  static constexpr int kZeroThreads = 32 * (4 - kFirstZeroWarp);
  static_assert(!kZeroesHiddenDbias || kZeroThreads > 0, "a producer warp is left for dbias's zeros");
  static __device__ void zero_hidden_dbias(BwdParams const& p, Sequence const& seq, int n_block, int head_kv,
                                           Steps st, int t) {
    constexpr int kChunks = kBlockN / 8;  // 16-byte chunks of a row's kBlockN keys: thread t takes chunk t % kChunks
    static_assert(kZeroThreads % kChunks == 0, "whole rows per pass");
    int const key = n_block * kBlockN + 8 * (t % kChunks);
    if (key >= seq.num_keys) {  // (a chunk that starts before the last key may reach the row padding)
      return;
    }
    int const above = st.m_blocks > 0 ? ::min(st.m_begin * kBlockM, seq.num_queries) : seq.num_queries;
    int const below = st.m_blocks > 0 ? ::min((st.m_begin + st.m_blocks) * kBlockM, seq.num_queries) : above;
    constexpr int kRowsPerPass = kZeroThreads / kChunks;
    long long const pass_elements = kRowsPerPass * p.dbias_row_stride;
    // rows [from, to) of the plane of query head `head`, kRowsPerPass at a time, by a running pointer
    // (the producer warpgroup has 24 registers)
    auto zero_rows = [&](int head, int from, int to) {
      long long const first = ((long long)seq.batch * p.num_heads + head) * p.num_queries + from + t / kChunks;
      Element* at = static_cast<Element*>(p.dbias_ptr) + first * p.dbias_row_stride + key;
#pragma unroll 1
      for (int r = from + t / kChunks; r < to; r += kRowsPerPass, at += pass_elements) {
        *reinterpret_cast<uint4*>(at) = make_uint4(0u, 0u, 0u, 0u);
      }
    };
#pragma unroll 1
    for (int g = 0; g < p.head_group; ++g) {  // rows [0, above) and [below, num_queries) of each query head
      zero_rows(head_kv * p.head_group + g, 0, above);
      zero_rows(head_kv * p.head_group + g, below, seq.num_queries);
    }
  }

  // grid (ceil(num_queries * dbias_row_stride / 8 / kAuxThreads), output planes), kAuxThreads
  // threads: 8 elements of an output plane a thread, added in float over the dbias planes that fold
  // into it (see dbias_sum_ptr) and rounded once.  Rows of 8-element chunks: a chunk holds at least
  // one key, so the main kernel wrote all of it.
  static __device__ void dbias_sum(BwdParams const& p) {
    long long const plane = static_cast<long long>(p.num_queries) * p.dbias_row_stride;
    long long const at = 8 * (static_cast<long long>(blockIdx.x) * kAuxThreads + threadIdx.x);
    if (at >= plane) {
      return;
    }
    int const out_heads = p.num_heads / p.dbias_sum_heads;
    int const batch = blockIdx.y / out_heads, head = blockIdx.y % out_heads;  // the output plane's
    Element const* const in = static_cast<Element const*>(p.dbias_ptr) + at;
    float sum[8] = {};
#pragma unroll 1
    for (int b = 0; b < p.dbias_sum_batch; ++b) {
#pragma unroll 1
      for (int h = 0; h < p.dbias_sum_heads; ++h) {
        long long const from = (static_cast<long long>(batch + b) * p.num_heads + head + h) * plane;
        uint4 const chunk = *reinterpret_cast<uint4 const*>(in + from);
        Element const* const e = reinterpret_cast<Element const*>(&chunk);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          sum[i] += static_cast<float>(e[i]);
        }
      }
    }
    uint4 chunk;
    Element* const e = reinterpret_cast<Element*>(&chunk);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      e[i] = Element(sum[i]);
    }
    *reinterpret_cast<uint4*>(static_cast<Element*>(p.dbias_sum_ptr) + blockIdx.y * plane + at) = chunk;
  }

  // grid as prep.  A part at a time: its quads are read in order (coalesced) and put in
  // rows in shared memory (see dq_quad_place), then each thread writes 8 columns of a row.
  static __device__ void convert(BwdParams const& p) {
    // padded: a half-warp's float2 stores fall on distinct banks (transposed: a warp's scalar stores)
    constexpr int kStride = kDqCols + (kDqTransposed ? 4 : 8);
    __shared__ alignas(16) float rows[kDqRows * kStride];
    int const m_block = blockIdx.x;
    int const head = blockIdx.y;
    Sequence const seq = sequence(p, blockIdx.z);
    if (m_block * kBlockM >= seq.num_queries) {  // past a packed sequence: these rows are another's, or none
      return;
    }
    float4 const* quads = reinterpret_cast<float4 const*>(
        p.dq_accum_ptr + (workspace_row0<kBlockM>(p, seq, head) + m_block * kBlockM) * kHeadDim);
    Element* dq = static_cast<Element*>(p.dq_ptr) + seq.batch * p.dq_stride_b + seq.q0 * (long long)p.dq_stride_m +
                  head * (long long)p.dq_stride_h;
    CUTE_UNROLL
    for (int part = 0; part < kWarpGroups; ++part) {
      for (int i = threadIdx.x; i < kDqPartFloats / 4; i += kAuxThreads) {
        int2 const place = dq_quad_place(0, i / 128, i % 128);  // within the part
        float4 const a = quads[part * (kDqPartFloats / 4) + i];
        float* const at = &rows[place.x * kStride + place.y];
        if constexpr (kDqTransposed) {
          at[0] = a.x;
          at[kStride] = a.y;
          at[8] = a.z;
          at[kStride + 8] = a.w;
        } else {
          *reinterpret_cast<float2*>(at) = make_float2(a.x, a.y);
          *reinterpret_cast<float2*>(at + 8 * kStride) = make_float2(a.z, a.w);
        }
      }
      __syncthreads();
      int2 const origin = dq_quad_place(part, 0, 0);  // the part's first row and column
      for (int i = threadIdx.x; i < kDqRows * kDqCols / 8; i += kAuxThreads) {
        int const r = i / (kDqCols / 8);
        int const c = i % (kDqCols / 8) * 8;
        int const row = m_block * kBlockM + origin.x + r;
        int const col = origin.y + c;
        if (row < seq.num_queries && col < p.head_dim) {  // head_dim is a multiple of 8
          cutlass::Array<Element, 8> out;
          CUTE_UNROLL
          for (int j = 0; j < 8; ++j) {
            out[j] = static_cast<Element>(rows[r * kStride + c + j] * p.scale);
          }
          *reinterpret_cast<cutlass::Array<Element, 8>*>(dq + row * (long long)p.dq_stride_m + col) = out;
        }
      }
      __syncthreads();
    }
  }
};

}  // namespace sm90
}  // namespace flashgen
