// flashgen's Hopper attention forward (sm_90a): TMA loads, wgmma, one producer warpgroup.
//
// One CTA computes a block of kBlockM queries of one (sequence, head).  Warps
// 0 .. 4*kConsumerWarpGroups-1 are consumer warpgroups, each owning 64 query
// rows; the warpgroup after them is the producer: lane 0 of its first warp
// issues every TMA load (Q once, then K and V tiles through a kStages-deep
// ring of shared-memory buffers), and it hands its registers to the consumers.
// Each buffer has a "full" mbarrier (TMA transaction count) and an "empty" one
// (one arrival per consumer warp).
//
// Per key block a consumer warpgroup computes S = Q K^T with wgmma (both
// operands in shared memory), updates the running row max and sum (softmax in
// the log2 domain), rescales its output accumulator and adds P V with wgmma
// (P from registers: the S accumulator layout is the A-operand register layout,
// so P is converted in place).  The S of one block and the P V of the block
// before are issued together, so the softmax runs while a GEMM is in flight,
// and the consumer warpgroups take turns issuing (one's softmax under the
// others' GEMMs).  Out-of-range rows and keys come from TMA as zeros; keys past
// num_keys and, in kBand instances, outside the band (causal diagonal, sliding
// window) are masked to -inf, and key blocks wholly outside it are never
// loaded.  With soft-capping the scores pass through
// softcap * tanh(score / softcap) first.  kBias instances then add an additive
// bias (natural-log units, like the scaled scores): the producer loads each key
// block's bias tile by TMA into a ring beside the K/V ring (same stage, barriers
// of its own), and the softmax reads it from there (sm90_common.h: kBiasBox).
// A score mod (the last template parameter, sm90_common.h: NoScoreMod) takes the place of both:
// each score becomes mod(scale * q.k, b, h, q_idx, kv_idx), in natural-log units, before the mask.
// kSparse instances visit the key blocks a flashgen.block_mask lists for the
// (batch, head, query block) instead of a range: its partial blocks first, then
// its full ones, the producer and the consumers walking the same lists.  In a
// partial block the consumer hides the keys whose bit in the mask's partial_bits
// is 0 (prefetched from global memory with the block's index before its GEMM);
// full blocks are not masked at all (but for the keys past num_keys).
//
// The output goes out through shared memory in kStagedO instances for tiles of few key blocks
// (stmatrix in, then whole rows out in 16-byte stores), else straight from registers;
// the log-sum-exp (natural log, of the scaled scores) goes to lse[sequence, head, row] like the
// example-41 forward, so either backward family can consume it.  Packed (varlen) batches run one grid
// z-slice per sequence (sm90_common.h: Sequence); a tile reaching past its
// sequence reads the next one's rows, which the key mask and the row bounds of
// the stores keep out of the results.
// kDropout instances drop elements of P after the softmax (flashgen/dropout.h: which ones, by
// Philox from the seed and the element's place): the row sums, so the normalisation and the lse,
// are of the whole P, the P V product sees only the kept elements, and the stores scale O by
// 1 / (1 - p).  A block's keep bits are drawn while its S GEMM runs.
#pragma once

#include <cuda.h>  // CUtensorMap

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

// What the runtime passes by value (as a __grid_constant__ parameter, which the
// tensor maps require).  The tensor maps describe q, k, v as 4-D tensors
// (head_dim, seq, heads, batch), strides in bytes, boxes of
// (kBoxCols, kBlockM or kBlockN, 1, 1) with the swizzle the kernel's shared
// layouts use (see FwdKernel::kSwizzleBytes).
struct FwdParams {
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  void* out_ptr;
  float* lse_ptr;
  long long out_stride_b;  // elements
  int out_stride_m;
  int out_stride_h;
  int lse_stride_b;       // floats
  int lse_stride_h;
  int lse_rows;           // rows in [num_queries, lse_rows) get +inf (padding, as example 41 writes it)
  int const* seqstart_q;  // packed (varlen) batches: [sequences + 1] row offsets into batch 0; else nullptr
  int const* seqstart_k;
  int num_queries;        // fixed-length batches (packed: each sequence's come from seqstart; this is the longest)
  int num_keys;
  int num_heads;          // query heads
  int num_sequences;      // batch, or packed sequences
  int head_dim;           // <= kHeadDim, a multiple of 8: columns past it are zeros from TMA, never stored
  int head_group;         // query heads per key/value head (1: MHA; H: MQA)
  int band_lo;            // kBand: key j is visible to query i iff i + band_lo <= j <= i + band_hi
  int band_hi;
  int band_from_end;      // packed: each sequence's band sits on its own bottom-right diagonal (sequence())
  float scale_log2;       // softmax scale * log2(e)
  float softcap_in;       // scale / softcap (0: no soft-capping): scores become
  float softcap_out;      //   softcap_out * tanh(softcap_in * q.k), softcap_out = softcap / scale
  // kBias: the bias added to the scaled, soft-capped scores, as a tensor map of [batch, heads,
  // queries, keys] (see kBiasBox); a step is 0 where the bias broadcasts that dim, else 1
  int bias_batch_step;
  int bias_head_step;
  int bias_row_step;
  CUtensorMap bias_map;
  // kSparse: a flashgen.block_mask (runtime/block_masks.py) of kBlockM x kBlockN blocks.  Its row
  // for (batch, head, query block) is batch * sparse_batch_step + head * sparse_head_step + block
  // (a step is 0 where the mask broadcasts); each list row holds sparse_key_blocks entries.
  int const* sparse_partial_counts;  // kv_num_blocks [rows]: partial key blocks
  int const* sparse_partial_blocks;  // kv_indices [rows, key blocks]
  int const* sparse_full_counts;     // full_kv_num_blocks [rows]
  int const* sparse_full_blocks;     // full_kv_indices [rows, key blocks]
  int const* sparse_tiles;           // partial_index [rows, key blocks]: a partial block's tile of bits
  uint32_t const* sparse_bits;       // partial_bits [tiles, kBlockM, kBlockN / 32]: bit j of word w: key 32w + j
  int sparse_batch_step;
  int sparse_head_step;
  int sparse_key_blocks;
  // kDropout (flashgen/dropout.h): the Philox key, the counter offset, the keep threshold (of 256)
  // and 1 / (1 - p)
  unsigned long long dropout_seed;
  unsigned long long dropout_offset;
  uint32_t dropout_keep;
  float dropout_scale;
  // A score mod's captured tensors (sm90_common.h: kModTensors), in its declaration's order
  void const* mod_ptr[kModTensors];
  long long mod_stride[kModTensors][kModDims];
};

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kBand_, bool kBias_,
          bool kSparse_, bool kStagedO_, bool kDropout_, class ScoreMod_>
struct FwdKernel {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kBand = kBand_;
  // An additive bias is compiled in, not a run-time branch: its ring of tiles takes shared memory
  // and its loads a place in the softmax that the plain instances must not pay for.
  static constexpr bool kBias = kBias_;
  // A block mask's lists replace the range of key blocks, compiled in so that the plain instances
  // keep their loop: the list lookups and the bit tests exist only here.
  static constexpr bool kSparse = kSparse_;
  static_assert(!kSparse || (kBlockM == 128 && kBlockN == 128 && !kBand && !kBias),
                "sparse tiles are the mask's 128 x 128 blocks (one uint4 of bits per row), without band or bias");
  // Dropout is compiled in too: the Philox rounds and the keep bits exist only in these instances.
  static constexpr bool kDropout = kDropout_;
  static_assert(!kDropout || (!kSparse && !kBias), "dropout without block-mask lists or bias (spec/sm90_fwd.py)");
  // A score mod rewrites every scaled score before the mask (sm90_common.h: NoScoreMod); soft-capping,
  // a bias, block-mask lists and dropout are not built beside one (spec/sm90_fwd.py).
  using ScoreMod = ScoreMod_;
  static constexpr bool kScoreMod = ScoreMod::kEnabled;
  static_assert(!kScoreMod || (!kBias && !kSparse && !kDropout),
                "a score mod is built without bias, block-mask lists and dropout");
  // Where the scores the softmax sees are in natural-log units (the scale applied before the max, as
  // a bias or a mod needs): the max, the exponents and the lse then take log2(e) as their scale.
  static constexpr bool kNaturalScores = kBias || kScoreMod;

  static_assert(sizeof(Element) == 2, "f16 or bf16");
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0 && kHeadDim % 32 == 0, "wgmma tile shapes");
  static constexpr int kConsumerWarpGroups = kBlockM / 64;
  static constexpr int kConsumerWarps = 4 * kConsumerWarpGroups;
  static constexpr int kProducerWarp = kConsumerWarps;
  // The producer is a whole warpgroup that hands its registers to the consumers (setmaxnreg):
  // a consumer holds block t's S, block t - 1's P and O at once (S is computed while the
  // previous P V runs), which head dim 128 alone puts at 160 registers, and with nine warps
  // (a producer warp) one scheduler holds three of them and a thread gets at most 168.
  static constexpr int kThreads = 32 * kConsumerWarps + 128;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = kConsumerWarpGroups == 2 ? 240 : 160;
  static_assert((kConsumerWarpGroups * kConsumerRegisters + kProducerRegisters) * 128 <=
                    launch_registers(kThreads) * kThreads,
                "setmaxnreg moves the registers the block launched with");
  static constexpr int kMinBlocksPerSm = 1;  // the register file is sized for one block per SM
  // named barriers: 0 the CTA's, 1 .. kConsumerWarpGroups TurnTaking's, then one per warpgroup (store_staged)
  static constexpr int kEpilogueBarrier = 1 + kConsumerWarpGroups;

  // Independent partial maxima and sums per row in the softmax (a power of two dividing a
  // thread's kBlockN / 4 values of a row).  Four where a consumer has 240 registers (H200, queued
  // A/B, session 30: +2-6% at head dim 128 from 2k keys on, within +-2% below); one, the plain
  // chain, on the 160-register 192-row tiles, where four lost 3-6% at head dim 64.
  static constexpr int kChains = kConsumerWarpGroups == 2 ? 4 : 1;
  static_assert((kBlockN / 4) % kChains == 0, "whole chains");

  // A TMA box row is one swizzle span: 128 bytes where the head dim allows, else 64.
  static constexpr int kSwizzleBytes = kHeadDim % 64 == 0 ? 128 : 64;
  static constexpr int kBoxCols = kSwizzleBytes / sizeof(Element);
  static constexpr int kBoxesPerRow = kHeadDim / kBoxCols;

  using AtomK = std::conditional_t<kSwizzleBytes == 128, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                   cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using AtomMN = std::conditional_t<kSwizzleBytes == 128, cute::GMMA::Layout_MN_SW128_Atom<Element>,
                                    cute::GMMA::Layout_MN_SW64_Atom<Element>>;
  // Each layout is a stack of TMA boxes (kBoxCols wide, all rows of the tile),
  // box after box along the head dim, then stage after stage.
  using SmemLayoutQ = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      AtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // V seen as the B operand of O = P V: (head dim, keys), head dim contiguous.
  using SmemLayoutV = decltype(cute::tile_to_shape(
      AtomMN{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));

  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      cute::Layout<cute::Shape<cute::Int<kConsumerWarpGroups>, cute::_1, cute::_1>>{}));
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::Int<kConsumerWarpGroups>, cute::_1, cute::_1>>{}));

  // kBias: a bias tile per K/V stage, key box after key box (kBiasBox: each 64 keys wide, kBlockM
  // rows), filled with the stage's K tile and released once the softmax has read it.  Plain
  // instances derive from the empty NoBias instead, which takes no room.
  struct BiasRing {
    alignas(1024) Element bias[kStages * kBlockM * kBlockN];
    uint64_t bias_full[kStages];
    uint64_t bias_empty[kStages];
  };
  struct NoBias {};
  // kStagedO: O through shared memory (store_staged) for tiles of at most kStagedMaxBlocks key blocks:
  // per thread 8 stmatrix and 8 coalesced 16-byte stores of whole rows in place of 32 scattered
  // 4-byte stores.  Same-run A/B on an H200 against the register stores: +3-7% from 512 to 2k
  // tokens, causal and not.  Compiled in, not only branched on: with the path in the kernel, calls
  // of more key blocks (which take the register stores) ran 2-4% slower at 4k-16k unmasked, its
  // code alone slowing the main loop; so the spec builds a twin without it (staged_o) and the
  // runtime sends a call of more than kServedKeyBlocks key blocks there.  A band (causal) instance
  // keeps both stores and no limit: its tiles near the diagonal visit few blocks.  At head dim 64,
  // staging gained nothing and lost 4% from 4k on.
  static constexpr int kRingBytes = int(sizeof(Element)) * kHeadDim * (kBlockM + 2 * kStages * kBlockN);
  static constexpr int kOBytes = int(sizeof(Element)) * kBlockM * kHeadDim;
  static constexpr bool kStagedO = kStagedO_;
  static_assert(!kStagedO || (!kBias && !kSparse && !kDropout_ && kRingBytes + kOBytes + 2048 <= 227 * 1024),
                "the staged O tile fits only beside Q and two K/V stages, without a bias ring, block-mask lists "
                "or dropout's keep bits (spec/sm90_fwd.py)");
  static constexpr int kStagedMaxBlocks = 16;
  // the most key blocks of a call the runtime may send here (0: any)
  static constexpr int kServedKeyBlocks = kStagedO && !kBand ? kStagedMaxBlocks : 0;
  struct OTile {
    alignas(1024) Element o[kBlockM * kHeadDim];
  };
  struct NoOTile {};
  struct SharedStorage : std::conditional_t<kBias, BiasRing, NoBias>, std::conditional_t<kStagedO, OTile, NoOTile> {
    alignas(1024) Element q[kBlockM * kHeadDim];
    alignas(1024) Element k[kStages * kBlockN * kHeadDim];
    alignas(1024) Element v[kStages * kBlockN * kHeadDim];
    alignas(8) uint64_t q_full;
    uint64_t q_empty;
    uint64_t k_full[kStages];
    uint64_t v_full[kStages];
    uint64_t k_empty[kStages];
    uint64_t v_empty[kStages];
  };
  // Dynamic shared memory is only guaranteed 16-byte aligned; the swizzled
  // layouts need 1024, so the kernel rounds its base up inside this slack.
  static constexpr int kSharedBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSharedBytes <= 227 * 1024,
                "the Q tile and K/V (and bias) rings exceed the shared memory of a Hopper block");

  // The key blocks a tile visits, in the order the producer loads them: block(t) for t in
  // [0, end - begin).  A range (begin + t), or kSparse the mask's lists (begin 0): its first
  // `partial` blocks are its partial ones, whose bits are tiles first_tile, first_tile + 1, ...
  // (block_masks.py numbers them so), then the full ones.
  struct KeyBlocks : BlockRange {
    int partial;
    int first_tile;
    int const* partial_list;
    int const* full_list;

    __device__ int block(int t) const {
      if constexpr (kSparse) {
        return t < partial ? __ldg(partial_list + t) : __ldg(full_list + t - partial);
      } else {
        return begin + t;
      }
    }
  };

  // Key blocks this query block visits: all, those the band reaches, or those the block mask
  // lists; none past the sequence's queries (a packed batch's grid is sized for its longest sequence).
  static __device__ KeyBlocks key_blocks(FwdParams const& p, Sequence const& seq, int m_block, int head) {
    KeyBlocks blocks{};
    if (m_block * kBlockM >= seq.num_queries) {
      return blocks;
    }
    if constexpr (kSparse) {
      long long const row = (long long)seq.batch * p.sparse_batch_step + head * p.sparse_head_step + m_block;
      blocks.partial = __ldg(p.sparse_partial_counts + row);
      blocks.end = blocks.partial + __ldg(p.sparse_full_counts + row);
      blocks.partial_list = p.sparse_partial_blocks + row * p.sparse_key_blocks;
      blocks.full_list = p.sparse_full_blocks + row * p.sparse_key_blocks;
      if (blocks.partial > 0) {
        blocks.first_tile = __ldg(p.sparse_tiles + row * p.sparse_key_blocks + __ldg(blocks.partial_list));
      }
    } else if (kBand) {
      static_cast<BlockRange&>(blocks) = band_blocks<kBlockM, kBlockN>(m_block, seq.num_keys, seq.band_lo,
                                                                        seq.band_hi);
    } else {
      blocks.end = (seq.num_keys + kBlockN - 1) / kBlockN;
    }
    return blocks;
  }

  // One tile (rows x kHeadDim) of a tensor map, box by box along the head dim, into `smem`;
  // `full` completes when all its bytes have landed.
  static __device__ void load_tile(CUtensorMap const* map, uint64_t* full, Element* smem, int rows, int row0,
                                   int head, int batch) {
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, rows * kHeadDim * int(sizeof(Element)));
    tma_load_tile<kBoxCols, kBoxesPerRow>(map, full, smem, rows, row0, head, batch);
  }

  // The grid is persistent (one CTA per SM), and while the consumers finish one tile (query
  // block, head, sequence) -- last softmax, P V, the stores -- the producer already loads the
  // next one's Q and K/V.  CTAs take work units round-robin, query blocks fastest, then heads,
  // so the CTAs running at once share their heads' K and V in L2; where a bias is the same for every
  // batch (kBias, bias_batch_step 0), sequences come before heads, so that the CTAs running at once
  // also share the head's bias tiles, read from memory once rather than once a batch.  A unit is one tile, or with
  // a band (causal) mask a pair: query block j with query block tiles_m - 1 - j of the same
  // (head, sequence), the longer first, so that every unit is the same work.  (Measured on an
  // H200 against one CTA per tile: ordering all tiles by causal length balanced as well but lost
  // the sharing, -5 to -16% without a mask; a rotation that kept the sharing but not the balance
  // lost 30% with a causal mask at 16k tokens; pairs without a mask and an odd tile count left
  // half the CTAs with half the work.)
  struct Tile {
    int m_block;
    int head;
    int sequence;
  };
  struct Schedule {
    static constexpr bool kPairs = kBand;
    int tiles_m;
    int units_m;  // units per (head, sequence)
    int heads;
    int sequences;
    bool sequences_first;  // (head, sequence) pairs sequence-fastest: the batches share a bias
    long long total_units;
    long long unit;  // this CTA's current unit, and (kPairs) which of its tiles comes next
    int second;

    __device__ explicit Schedule(FwdParams const& p)
        : tiles_m((p.num_queries + kBlockM - 1) / kBlockM), units_m(kPairs ? (tiles_m + 1) / 2 : tiles_m),
          heads(p.num_heads), sequences(p.num_sequences), sequences_first(kBias && p.bias_batch_step == 0),
          total_units((long long)units_m * p.num_heads * p.num_sequences), unit(blockIdx.x), second(0) {}

    // This CTA's next tile; false after its last.
    __device__ bool next(Tile& t) {
      while (unit < total_units) {
        int const j = int(unit % units_m);
        int const head_seq = int(unit / units_m);
        int const m_block = second ? j : tiles_m - 1 - j;
        bool const exists = !second || j != tiles_m - 1 - j;  // the middle block of an odd count is alone
        if (second || !kPairs) {
          unit += gridDim.x;
          second = 0;
        } else {
          second = 1;
        }
        if (exists) {
          t = sequences_first ? Tile{m_block, head_seq / sequences, head_seq % sequences}
                              : Tile{m_block, head_seq % heads, head_seq / heads};
          return true;
        }
      }
      return false;
    }
  };

  static __device__ void produce(FwdParams const& p, SharedStorage& s) {
    using Barrier = cutlass::arch::ClusterBarrier;
    Schedule schedule(p);
    Tile tile;
    int q_loads = 0;  // tiles with work so far: the Q buffer's uses
    int g = 0;        // key blocks so far: the K/V ring's position
    while (schedule.next(tile)) {
      Sequence const seq = sequence(p, tile.sequence);
      KeyBlocks const blocks = key_blocks(p, seq, tile.m_block, tile.head);
      if (blocks.end <= blocks.begin) {
        continue;
      }
      if (q_loads > 0) {
        Barrier::wait(&s.q_empty, (q_loads - 1) & 1);
      }
      ++q_loads;
      int const head_kv = tile.head / p.head_group;
      load_tile(&p.q_map, &s.q_full, s.q, kBlockM, seq.q0 + tile.m_block * kBlockM, tile.head, seq.batch);
      for (int t = 0; t < blocks.end - blocks.begin; ++t, ++g) {
        int const key0 = seq.k0 + blocks.block(t) * kBlockN;
        int const stage = g % kStages;
        int const round_of_ring = g / kStages;  // buffers are reused from the ring's second round on
        if (round_of_ring > 0) {
          Barrier::wait(&s.k_empty[stage], (round_of_ring - 1) & 1);
        }
        load_tile(&p.k_map, &s.k_full[stage], s.k + stage * kBlockN * kHeadDim, kBlockN, key0, head_kv, seq.batch);
        if constexpr (kBias) {  // needed right after K (by the softmax), before V
          if (round_of_ring > 0) {
            Barrier::wait(&s.bias_empty[stage], (round_of_ring - 1) & 1);
          }
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.bias_full[stage],
                                                                         kBlockM * kBlockN * int(sizeof(Element)));
          tma_load_bias<kBlockM / kBiasBox, kBlockN / kBiasBox, 1, kBlockM / kBiasBox>(
              p, &s.bias_full[stage], s.bias + stage * kBlockM * kBlockN, seq.q0 + tile.m_block * kBlockM, key0,
              tile.head, seq.batch);
        }
        if (round_of_ring > 0) {
          Barrier::wait(&s.v_empty[stage], (round_of_ring - 1) & 1);
        }
        load_tile(&p.v_map, &s.v_full[stage], s.v + stage * kBlockN * kHeadDim, kBlockN, key0, head_kv, seq.batch);
      }
    }
  }

  // One tile with work: its key blocks are ring positions g0 .. g0 + blocks - 1, and its Q is the
  // buffer's q_use-th load.
  static __device__ void consume(FwdParams const& p, SharedStorage& s, Sequence const& seq, int m_block, int head,
                                 KeyBlocks const& blocks, TurnTaking<kConsumerWarpGroups> const& turns, int g0,
                                 int q_use) {
    using namespace cute;
    using Barrier = cutlass::arch::ClusterBarrier;
    int const tid = threadIdx.x;  // 0 .. 128 * kConsumerWarpGroups - 1
    int const lane = tid % 32;

    TiledMmaS mma_s;
    TiledMmaO mma_o;
    auto thr_s = mma_s.get_thread_slice(tid);
    auto thr_o = mma_o.get_thread_slice(tid);
    Tensor sQ = make_tensor(make_smem_ptr(s.q), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(s.k), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(s.v), SmemLayoutV{});
    Tensor tSrQ = thr_s.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K) descriptors
    Tensor tSrK = thr_s.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = thr_o.partition_fragment_B(sV);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    static_assert(size(tSrS) == kBlockN / 2 && size(tOrO) == kHeadDim / 2, "one 64-row wgmma tile per warpgroup");
    // P as the A operand of O = P V: the S accumulator's registers in the same order,
    // grouped per 16 keys (2 x 2 x 2 values: key + 1, row + 8, key + 8).
    Tensor tOrP = make_tensor<Element>(
        Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>{});
    clear(tOrO);

    // Register r of an accumulator row pair holds row (r / 2) % 2 * 8 + row0, column
    // (r / 4) * 8 + 2 * (lane % 4) + r % 2 of the warpgroup's 64-row tile.
    int const row0 = m_block * kBlockM + 64 * (tid / 128) + 16 * ((tid / 32) % 4) + lane / 4;
    int const col0 = 2 * (lane % 4);
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};

    // kDropout: block t's keep bytes, drawn (draw(t)) while its S GEMM runs.  Registers 16g .. 16g + 15
    // are one Philox call's 16 elements (dropout.h): register r is row row0 + 8x, key 32g + col0 +
    // 8z + y of the block for r % 16 = y + 2x + 4z, the call's byte 8x + 2z + y, in byte 2 (z % 2) + y
    // of keep[4g + 2x + z / 2] (keep_bytes: bit 7 set where kept).  A pair of P values (y = 0, 1) is
    // one 32-bit register after to_p's conversion and the two bytes next to each other: one prmt and
    // one and per pair (keep_pair_mask).
    static_assert(!kDropout || kBlockN % 32 == 0, "a Philox call spans 32 keys");
    constexpr int kKeepWords = kDropout ? kBlockN / 8 : 1;
    uint32_t keep[kKeepWords];
    auto draw = [&](int t) {
      if constexpr (kDropout) {
        DropoutStream const stream(p, seq.index, head);
        int const key0 = (blocks.begin + t) * kBlockN;
        CUTE_UNROLL
        for (int g = 0; g < kBlockN / 32; ++g) {
          uint4 const w = stream.keep_words(row0, key0 + 32 * g + col0);
          keep[4 * g] = w.x;
          keep[4 * g + 1] = w.y;
          keep[4 * g + 2] = w.z;
          keep[4 * g + 3] = w.w;
        }
      }
    };

    // kBias: where this lane's ldmatrix row sits in a bias tile (sm90_common.h: kBiasBox).  One
    // ldmatrix.x4 reads the register pairs of key groups j and j + 1 (8 keys each, j even) for
    // rows +0 and +8: lane l addresses row l % 8 (+ 8 for odd l / 8) of the warp's 16, in key
    // group j + l / 16, whose swizzled chunk is (j % 8) ^ (l / 16) ^ (row % 8) of key box j / 8.
    // A query-broadcast bias (row step 0) has its one row in row 0.
    int bias_row_bytes = 0;
    int bias_chunk_xor = 0;  // 16 * ((l / 16) ^ (row % 8)): the bytes XORed into 16 * (j % 8)
    if constexpr (kBias) {
      int const warp_row0 = 64 * (tid / 128) + 16 * ((tid / 32) % 4);
      int const row = (warp_row0 + 8 * ((lane / 8) % 2) + lane % 8) * p.bias_row_step;
      bias_row_bytes = row * 128;
      bias_chunk_xor = 16 * ((lane / 16) ^ (row % 8));
    }

    // kSparse: block t's key block and, in a partial block, this thread's two rows of its bits (16
    // bytes each), fetched before its S GEMM is issued so that the loads run under it.
    int key_block = 0;
    uint4 row_bits[2];
    int const tile_row = 64 * (tid / 128) + 16 * ((tid / 32) % 4) + lane / 4;
    auto fetch = [&](int t) {
      if constexpr (kSparse) {
        key_block = blocks.block(t);
        if (t < blocks.partial) {
          uint4 const* tile = reinterpret_cast<uint4 const*>(p.sparse_bits) + (blocks.first_tile + t) * (long long)kBlockM;
          row_bits[0] = __ldg(tile + tile_row);
          row_bits[1] = __ldg(tile + tile_row + 8);
        }
      }
    };

    // Block t's S = Q K^T is issued together with block t - 1's O += P V; its softmax runs
    // while that P V is still on the tensor cores (exponentials kept in S's registers until
    // P V has read P), and the warpgroups take turns issuing (TurnTaking).  Block 0 is peeled
    // off the loop: a branch between the two GEMMs makes ptxas serialise them.
    int const num_blocks = blocks.end - blocks.begin;
    auto stage_of = [&](int t) { return (g0 + t) % kStages; };
    auto phase_of = [&](int t) { return ((g0 + t) / kStages) & 1; };
    auto release = [&](uint64_t* empty) {
      __syncwarp();
      if (lane == 0) {
        Barrier::arrive(empty);
      }
    };
    // Scores become log2-domain exponents times exp_scale in softmax(), one FMA each with the
    // running max.  Without a bias that is the whole scale (scale_log2), the max taken on q.k; kBias
    // adds the bias to the scaled score first (natural-log units, one FMA with the bias), so its
    // max is in natural units and exp_scale is log2(e) (two instructions fewer per score than
    // moving score and bias into log2 units before the max).
    // kScoreMod likewise: the mod takes the scaled score (flex's convention: q.k * scale, then the mod).
    float const exp_scale = kNaturalScores ? kLog2e : p.scale_log2;
    float const bias_score_scale = p.scale_log2 * (1.f / kLog2e);  // kBias, kScoreMod: the softmax scale
    auto to_log2 = [&](float score) { return score * exp_scale; };
    // Block t's scores in tSrS become exp2(scaled score - running max) in place (soft-capped and
    // masked first); the row sums follow, and `correction` is what O must be scaled by.
    auto softmax = [&](int t, float (&correction)[2]) {
      if (!kScoreMod && p.softcap_in != 0.f) {  // (a call with a mod has no soft-capping: the runtime refuses it)
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {
          tSrS(r) = p.softcap_out * tanh_approx(tSrS(r) * p.softcap_in);
        }
      }
      if constexpr (kScoreMod) {  // mod(S * scale): natural-log units (see exp_scale)
        // Rows and keys past the sequence's (masked or never stored below) are clamped to its last, so
        // that a captured tensor indexed by them is read in bounds.
        int const key0 = (blocks.begin + t) * kBlockN;
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {
          int const row = min(row0 + ((r / 2) % 2) * 8, seq.num_queries - 1);
          int const key = min(key0 + (r / 4) * 8 + col0 + r % 2, seq.num_keys - 1);
          tSrS(r) = ScoreMod::apply(p, tSrS(r) * bias_score_scale, seq.index, head, row, key);
        }
      }
      if constexpr (kBias) {  // S * scale + bias: natural-log units (see exp_scale)
        int const stage = stage_of(t);
        Barrier::wait(&s.bias_full[stage], phase_of(t));
        char const* tile = reinterpret_cast<char const*>(s.bias + stage * kBlockM * kBlockN) + bias_row_bytes;
        CUTE_UNROLL
        for (int j = 0; j < kBlockN / 8; j += 2) {
          uint32_t pairs[4];  // pair 2j + i: registers 4j + 2i and + 1
          load_matrix_x4<false>(tile + (j / 8) * kBlockM * 128 + ((16 * (j % 8)) ^ bias_chunk_xor), pairs);
          CUTE_UNROLL
          for (int r = 4 * j; r < 4 * j + 8; ++r) {
            tSrS(r) = fmaf(tSrS(r), bias_score_scale, unpack_half<Element>(pairs[r / 2 - 2 * j], r % 2));
          }
        }
        release(&s.bias_empty[stage]);
      }
      if constexpr (kSparse) {
        if (t < blocks.partial) {  // key (r / 4) * 8 + col0 + r % 2 is bit (r / 4 % 4) * 8 + r % 2 of word r / 16
          uint32_t const words[2][4] = {
              {row_bits[0].x >> col0, row_bits[0].y >> col0, row_bits[0].z >> col0, row_bits[0].w >> col0},
              {row_bits[1].x >> col0, row_bits[1].y >> col0, row_bits[1].z >> col0, row_bits[1].w >> col0}};
          CUTE_UNROLL
          for (int r = 0; r < size(tSrS); ++r) {
            if (((words[(r / 2) % 2][r / 16] >> ((r / 4) % 4 * 8 + r % 2)) & 1u) == 0) {
              tSrS(r) = -INFINITY;
            }
          }
        }
      }
      int const key0 = (kSparse ? key_block : blocks.begin + t) * kBlockN;
      int const block_row0 = m_block * kBlockM;
      bool const partial = key0 + kBlockN > seq.num_keys;
      bool const edge = kBand && (key0 + kBlockN - 1 > block_row0 + seq.band_hi ||
                                  key0 < block_row0 + kBlockM - 1 + seq.band_lo);
      if (partial || edge) {
        CUTE_UNROLL
        for (int r = 0; r < size(tSrS); ++r) {
          int const row = row0 + ((r / 2) % 2) * 8;
          int const key = key0 + (r / 4) * 8 + col0 + r % 2;
          if (key >= seq.num_keys || (kBand && (key > row + seq.band_hi || key < row + seq.band_lo))) {
            tSrS(r) = -INFINITY;
          }
        }
      }
      // The row max and row sum over this thread's kBlockN / 4 values of a row go through kChains
      // independent partial results: one chain of dependent FMNMX / FADD stalls a warp on each
      // one's latency (ncu: 1.5 "wait" stalls per issue in the short causal forward, cuDNN's 0.9).
      float scaled_max[2];
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        float part[kChains];
        CUTE_UNROLL
        for (int c = 0; c < kChains; ++c) {
          part[c] = row_max[h];
        }
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS) / 2; ++i) {  // register 4 (i / 2) + 2h + i % 2 holds row h's i-th value
          part[i % kChains] = fmaxf(part[i % kChains], tSrS(4 * (i / 2) + 2 * h + i % 2));
        }
        float m = tree_reduce(part, [](float a, float b) { return fmaxf(a, b); });
        m = quad_max(m);
        // a row that has seen no key yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN
        scaled_max[h] = m == -INFINITY ? 0.f : to_log2(m);
        correction[h] = exp2_approx(to_log2(row_max[h]) - scaled_max[h]);
        row_max[h] = m;
        row_sum[h] *= correction[h];
      }
      // One chain continues the running sum (the 192-row tiles' SASS stays main's); four start from
      // zero, so none waits for the correction of the running sum (seeding chain 0 with it instead,
      // session 29, gained nothing).
      float sums[2][kChains] = {{kChains == 1 ? row_sum[0] : 0.f}, {kChains == 1 ? row_sum[1] : 0.f}};
      CUTE_UNROLL
      for (int r = 0; r < size(tSrS); ++r) {
        int const h = (r / 2) % 2;
        tSrS(r) = exp2_approx(fmaf(tSrS(r), exp_scale, -scaled_max[h]));
        sums[h][(2 * (r / 4) + r % 2) % kChains] += tSrS(r);
      }
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        float const fresh = tree_reduce(sums[h], [](float a, float b) { return a + b; });
        row_sum[h] = kChains == 1 ? fresh : row_sum[h] + fresh;
      }
    };
    auto to_p = [&]() {
      CUTE_UNROLL
      for (int r = 0; r < size(tSrS); ++r) {
        tOrP(r) = static_cast<Element>(tSrS(r));
      }
      if constexpr (kDropout) {  // after the sum (softmax): it is of the whole row
        Tensor pairs = recast<uint32_t>(tOrP);
        CUTE_UNROLL
        for (int i = 0; i < size(pairs); ++i) {
          int const r = 2 * i;
          pairs(i) &= keep_pair_mask(keep[4 * (r / 16) + 2 * (r / 2 % 2) + r / 8 % 2], r / 4 % 2);
        }
      }
    };

    float correction[2];
    fetch(0);
    Barrier::wait(&s.q_full, q_use & 1);
    Barrier::wait(&s.k_full[stage_of(0)], phase_of(0));
    turns.wait();
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    warpgroup_gemm_issue<true>(mma_s, tSrQ, tSrK(_, _, _, stage_of(0)), tSrS);
    turns.pass();
    draw(0);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    release(&s.k_empty[stage_of(0)]);
    if (num_blocks == 1) {
      release(&s.q_empty);  // the last S: the producer may load the next tile's Q
    }
    softmax(0, correction);  // O is still zero: nothing to rescale
    to_p();
    for (int t = 1; t < num_blocks; ++t) {
      int const stage = stage_of(t);
      int const prev_stage = stage_of(t - 1);
      fetch(t);
      Barrier::wait(&s.k_full[stage], phase_of(t));
      Barrier::wait(&s.v_full[prev_stage], phase_of(t - 1));
      turns.wait();
      warpgroup_fence_operand(tSrS);
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      warpgroup_arrive();
      warpgroup_gemm_issue<true>(mma_s, tSrQ, tSrK(_, _, _, stage), tSrS);
      warpgroup_gemm_issue<false>(mma_o, tOrP, tOrV(_, _, _, prev_stage), tOrO);
      turns.pass();
      draw(t);
      warpgroup_wait<1>();  // S; P V may still run
      warpgroup_fence_operand(tSrS);
      release(&s.k_empty[stage]);
      if (t == num_blocks - 1) {
        release(&s.q_empty);
      }
      softmax(t, correction);
      warpgroup_wait<0>();  // P V has read P and written O
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      release(&s.v_empty[prev_stage]);
      CUTE_UNROLL
      for (int r = 0; r < size(tOrO); ++r) {
        tOrO(r) *= correction[(r / 2) % 2];
      }
      to_p();
    }
    int const last_stage = stage_of(num_blocks - 1);
    Barrier::wait(&s.v_full[last_stage], phase_of(num_blocks - 1));
    turns.wait();
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(tOrP);
    warpgroup_arrive();
    warpgroup_gemm_issue<false>(mma_o, tOrP, tOrV(_, _, _, last_stage), tOrO);
    turns.pass();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(tOrP);
    release(&s.v_empty[last_stage]);
    if constexpr (kStagedO) {
      if (num_blocks <= kStagedMaxBlocks) {
        store_staged(p, s, seq, tOrO, row_max, row_sum, row0, head);
        return;
      }
    }
    store(p, seq, tOrO, row_max, row_sum, row0, col0, head);
  }

  // The row's 1 / sum (0 for a row that saw no key: output 0) and, by one lane of its quad, its
  // lse; rows past the sequence get lse +inf up to lse_rows (the padding), as example 41 writes it.
  static __device__ float finish_row(FwdParams const& p, Sequence const& seq, float row_max, float row_sum,
                                     int row, int head) {
    float* lse = p.lse_ptr + seq.index * (long long)p.lse_stride_b + head * (long long)p.lse_stride_h;
    float const sum = quad_sum(row_sum);
    if (threadIdx.x % 4 == 0) {
      if (row < seq.num_queries) {
        float const max_log2 = row_max * (kNaturalScores ? kLog2e : p.scale_log2);  // see consume()'s exp_scale
        lse[row] = sum > 0.f ? (max_log2 + __log2f(sum)) * 0.69314718055994531f : -INFINITY;
      } else if (row < p.lse_rows) {
        lse[row] = INFINITY;
      }
    }
    return sum > 0.f ? (kDropout ? p.dropout_scale : 1.f) / sum : 0.f;  // kDropout: O of the kept P, scaled
  }

  // kStagedO: the warpgroup's 64 rows of O into its part of the O tile by stmatrix, then out row by
  // row, each thread 16 bytes at a time (a warp writes two whole rows at head dim 128).  The tile's
  // 16-byte chunks are XOR-swizzled by row % 8, so that both an 8 x 8 stmatrix tile (8 rows, one
  // chunk) and a quarter warp's row reads (8 chunks of one row) hit 8 distinct bank groups.  Two
  // named barriers per tile keep the warpgroup's warps together: none writes the tile while another
  // still reads the last tile's rows, none reads before all have written.
  template <class Accumulator>
  static __device__ void store_staged(FwdParams const& p, SharedStorage& s, Sequence const& seq,
                                      Accumulator const& acc, float const (&row_max)[2], float (&row_sum)[2],
                                      int row0, int head) {
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
    int const tid = threadIdx.x;
    int const lane = tid % 32;
    int const group = tid / 128;
    Element* tile = s.o + group * 64 * kHeadDim;
    auto at = [](int row, int chunk) { return row * kHeadDim + 8 * (chunk ^ (row % 8)); };
    float const inv[2] = {finish_row(p, seq, row_max[0], row_sum[0], row0, head),
                          finish_row(p, seq, row_max[1], row_sum[1], row0 + 8, head)};
    int const barrier = kEpilogueBarrier + group;
    asm volatile("bar.sync %0, 128;" ::"r"(barrier) : "memory");
    // Register r holds row (r / 2) % 2 * 8 + lane / 4 of the warp's 16, column (r / 4) * 8 + 2 * (lane % 4)
    // + r % 2: stmatrix tile j of group q is rows + 8 * (j % 2), columns 8 * (2q + j / 2), pair 8q + 2j.
    int const warp_row = 16 * ((tid / 32) % 4);
    int const m = lane / 8;  // the tile whose row lane % 8 this lane addresses
    CUTE_UNROLL
    for (int q = 0; q < kHeadDim / 16; ++q) {
      uint32_t values[4];
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) {
        cutlass::Array<Element, 2> pair;
        pair[0] = static_cast<Element>(acc(8 * q + 2 * j) * inv[j % 2]);
        pair[1] = static_cast<Element>(acc(8 * q + 2 * j + 1) * inv[j % 2]);
        values[j] = reinterpret_cast<uint32_t const&>(pair);
      }
      store_matrix_x4(tile + at(warp_row + 8 * (m % 2) + lane % 8, 2 * q + m / 2), values);
    }
    asm volatile("bar.sync %0, 128;" ::"r"(barrier) : "memory");
    int const first_row = row0 - warp_row - lane / 4;  // the warpgroup's first row in the sequence
    Element* out = static_cast<Element*>(p.out_ptr) + seq.batch * p.out_stride_b +
                   seq.q0 * (long long)p.out_stride_m + head * (long long)p.out_stride_h;
    CUTE_UNROLL
    for (int i = tid % 128; i < 64 * kChunks; i += 128) {
      int const row = i / kChunks;
      int const chunk = i % kChunks;
      if (first_row + row < seq.num_queries && chunk * 8 < p.head_dim) {
        uint4 const v = *reinterpret_cast<uint4 const*>(tile + at(row, chunk));
        *reinterpret_cast<uint4*>(out + (first_row + row) * (long long)p.out_stride_m + chunk * 8) = v;
      }
    }
  }

  template <class Accumulator>
  static __device__ void store(FwdParams const& p, Sequence const& seq, Accumulator const& acc,
                               float const (&row_max)[2], float (&row_sum)[2], int row0, int col0, int head) {
    using namespace cute;
    int const lane = threadIdx.x % 32;
    Element* out = static_cast<Element*>(p.out_ptr) + seq.batch * p.out_stride_b +
                   seq.q0 * (long long)p.out_stride_m + head * (long long)p.out_stride_h;
    float* lse = p.lse_ptr + seq.index * (long long)p.lse_stride_b + head * (long long)p.lse_stride_h;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      int const row = row0 + 8 * h;
      float const sum = quad_sum(row_sum[h]);
      // no visible key: output 0; kDropout: O of the kept P, scaled by 1 / (1 - p)
      float const inv = sum > 0.f ? (kDropout ? p.dropout_scale : 1.f) / sum : 0.f;
      if (row < seq.num_queries) {
        Element* out_row = out + row * (long long)p.out_stride_m;
        CUTE_UNROLL
        for (int r = 2 * h; r < size(acc); r += 4) {
          int const col = (r / 4) * 8 + col0;
          if (col >= p.head_dim) {  // a head dim below the tier: the zero columns TMA added
            continue;
          }
          cutlass::Array<Element, 2> pair;
          pair[0] = static_cast<Element>(acc(r) * inv);
          pair[1] = static_cast<Element>(acc(r + 1) * inv);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(out_row + col) = pair;
        }
        if (lane % 4 == 0) {
          float const max_log2 = row_max[h] * (kNaturalScores ? kLog2e : p.scale_log2);  // see consume()'s exp_scale
          lse[row] = sum > 0.f ? (max_log2 + __log2f(sum)) * 0.69314718055994531f : -INFINITY;
        }
      } else if (row < p.lse_rows && lane % 4 == 0) {
        lse[row] = INFINITY;
      }
    }
  }

  // grid (min(tiles, SMs), 1, 1): see Schedule (a CTA left without a work unit exits at once)
  static __device__ void run(FwdParams const& p, char* smem_raw) {
    SharedStorage& s = shared_storage<SharedStorage>(smem_raw);
    int const warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
      using Barrier = cutlass::arch::ClusterBarrier;
      Barrier::init(&s.q_full, 1);
      Barrier::init(&s.q_empty, kConsumerWarps);
      CUTE_UNROLL
      for (int i = 0; i < kStages; ++i) {
        Barrier::init(&s.k_full[i], 1);
        Barrier::init(&s.v_full[i], 1);
        Barrier::init(&s.k_empty[i], kConsumerWarps);
        Barrier::init(&s.v_empty[i], kConsumerWarps);
        if constexpr (kBias) {
          Barrier::init(&s.bias_full[i], 1);
          Barrier::init(&s.bias_empty[i], kConsumerWarps);
        }
      }
      cutlass::arch::fence_barrier_init();
    }
    __syncthreads();

    if (warp >= kProducerWarp) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
      if (threadIdx.x == 32 * kProducerWarp) {
        produce(p, s);
      }
      return;
    }
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    Schedule schedule(p);
    TurnTaking<kConsumerWarpGroups> const turns(threadIdx.x / 128);
    Tile tile;
    int q_use = 0;
    int g = 0;
    while (schedule.next(tile)) {
      Sequence const seq = sequence(p, tile.sequence);
      KeyBlocks const blocks = key_blocks(p, seq, tile.m_block, tile.head);
      if (blocks.end > blocks.begin) {
        consume(p, s, seq, tile.m_block, tile.head, blocks, turns, g, q_use);
        ++q_use;
        g += blocks.end - blocks.begin;
      } else {  // no key visible to any row of the block (or no row: lse padding only)
        auto zeros = cute::make_tensor<float>(cute::Int<kHeadDim / 2>{});
        cute::clear(zeros);
        float row_max[2] = {-INFINITY, -INFINITY};
        float row_sum[2] = {0.f, 0.f};
        int const lane = threadIdx.x % 32;
        store(p, seq, zeros, row_max, row_sum,
              tile.m_block * kBlockM + 64 * (threadIdx.x / 128) + 16 * (warp % 4) + lane / 4, 2 * (lane % 4),
              tile.head);
      }
    }
    turns.finish();
  }
};

}  // namespace sm90
}  // namespace flashgen
