// flashgen's Ampere-class attention forward: mma.sync, ldmatrix and cp.async only, so the
// same source runs on sm_80 .. sm_89 and, compiled as plain sm_90 code, on Hopper.
//
// One CTA of four warps computes kBlockM queries of one (sequence, head); each warp owns
// kBlockM / 4 of the rows (one or two 16-row MMA tiles), so a row's softmax never leaves
// its warp and a key or value fragment read from shared memory serves both row tiles.
// Q is copied into shared memory once and read back with ldmatrix for every key block:
// held in registers it would cost 64 of them at head dim 128, which the S and O
// accumulators need.
//
// K and V tiles (kBlockN keys each) stream through one ring of kStages shared-memory
// slots in the order K0, V0, K1, V1, ...: tile t + kStages is issued (cp.async, one
// commit group per tile) as soon as the barrier after tile t's last reader has passed, so
// K tiles load under the previous blocks' P V and V tiles under this block's S = Q K^T
// and softmax.  Ring slots hold single tiles rather than K/V pairs so that
// an odd count (three: 80 KB at head dim 128) fits two CTAs into an A100's or H100's
// shared memory: a CTA of four warps waits at two barriers per block, and the other CTA's
// warps keep the tensor cores busy meanwhile.
//
// Per key block (last block first, so the blocks that need a mask come before the rest):
// S is scaled into the log2 domain (soft-capped first when asked), masked where the block
// crosses num_keys or the band's edges, and the running row max and sum are updated; the
// exponentials, converted to 16 bits in place, are already the A operand of O += P V (the
// accumulator's register layout of a 16x8 MMA pair is the operand layout of one 16x16).
// At the end O is divided by the row sums, staged through the Q buffer and written with
// 16-byte stores; the lse goes out like the example-41 forward's (natural log of the
// scaled scores, [sequence, head, rows padded to 32], +inf in the padding) so the mem-eff
// backward can consume it.
//
// Rows and keys past the ends, and head-dim columns past head_dim (a head dim below the
// tier, a multiple of 8), are zero-filled by cp.async and never stored; rows that see no
// key get output 0 and lse -inf.  Packed (varlen) batches run one grid z-slice per
// sequence (attention_common.h: Sequence).
//
// kBias instances add a bias [batch, heads, queries, keys] (natural-log units, like the scaled
// scores) to the scaled, soft-capped scores before the mask and the softmax.  A key block's bias
// tile (kBlockM rows x kBlockN keys) is copied by cp.async in its K tile's commit group, into a
// ring of its own (kBiasSlots), and read back with ldmatrix straight into S's register layout;
// the plain instances carry neither the ring nor the reads.  No packed batches (the runtime
// refuses a bias with cu_seqlens).
// kDropout instances drop elements of P after the softmax by flashgen's rule (dropout.h, the one
// sm90_fwd.h and both backwards draw by): the row sums, so the normalisation and the lse, are of
// the whole P, P V sees the kept elements only, and the epilogue scales O by 1 / (1 - p).  A
// warp's 16 x 32 block of S is one Philox call per thread: lane l holds rows l / 4 (+ 8) and keys
// 2 (l % 4) (+ 1, + 8, ..., + 25), the 16 elements of the call whose first element is its first
// (see drop()), so no call is drawn twice and no bit leaves its thread.
#pragma once

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

// What the runtime passes by value.  Strides are in elements; the inputs' pointers and
// strides are multiples of 8 elements (16-byte cp.async chunks), and so is head_dim.
struct FwdParams {
  void const* q_ptr;
  void const* k_ptr;
  void const* v_ptr;
  void* out_ptr;
  float* lse_ptr;
  int const* seqstart_q;   // packed (varlen) batches: [sequences + 1] row offsets into batch 0; else nullptr
  int const* seqstart_k;
  long long q_stride_b;
  long long k_stride_b;
  long long v_stride_b;
  long long out_stride_b;
  int q_stride_m;
  int q_stride_h;
  int k_stride_m;
  int k_stride_h;          // of a k/v head: query head h reads k/v head h / head_group
  int v_stride_m;
  int v_stride_h;
  int out_stride_m;
  int out_stride_h;
  int lse_stride_b;        // floats
  int lse_stride_h;
  int lse_rows;            // rows in [num_queries, lse_rows) get +inf (padding, as example 41 writes it)
  int num_queries;         // fixed-length batches (packed: the longest sequence's; each its own from seqstart)
  int num_keys;
  int num_heads;           // query heads
  int num_sequences;       // batch, or packed sequences
  int head_dim;            // <= kHeadDim: columns past it are zero-filled, never stored
  int head_group;          // query heads per key/value head (1: MHA; H: MQA)
  int band_lo;             // key j is visible to query i iff i + band_lo <= j <= i + band_hi
  int band_hi;             //   (+-kUnbounded: no limit on that side)
  int band_from_end;       // packed: each sequence's band sits on its own bottom-right diagonal (sequence())
  float scale_log2;        // softmax scale * log2(e)
  float softcap_in;        // scale / softcap (0: no soft-capping): scores become
  float softcap_out;       //   softcap_out * tanh(softcap_in * q.k), softcap_out = softcap / scale
  // kBias: [batch, heads, queries, keys], keys contiguous; a stride is 0 where the bias broadcasts
  // that dim.  Pointer and strides are multiples of 8 elements (16-byte chunks: a row's last chunk
  // reads up to 7 elements past the last key, inside the row's padding; they are masked).
  void const* bias_ptr;
  long long bias_stride_b;
  long long bias_stride_h;
  int bias_stride_m;
  // kDropout (flashgen/dropout.h), as sm90's FwdParams ends: the Philox key, the counter offset, the
  // keep threshold (of 256) and 1 / (1 - p)
  unsigned long long dropout_seed;
  unsigned long long dropout_offset;
  uint32_t dropout_keep;
  float dropout_scale;
};

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kBias_, bool kDropout_>
struct FwdKernel {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;  // ring slots, each one K or one V tile
  static constexpr bool kBias = kBias_;      // an additive bias, compiled in (its ring takes shared memory)
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMinBlocksPerSm = 1;  // occupancy follows from shared memory; registers stay uncapped
  static constexpr float kMaxSlack = 8.f;    // log2 units a row max may rise before O is rescaled (see mainloop)
  static constexpr bool kDropout = kDropout_;  // compiled in: the Philox rounds exist only in these instances
  // 128-key tiles load K an ldmatrix at a time for S = Q K^T (sm80_common.h: gemm_fine): a whole
  // k-slice of K beside the next is 64 registers, and with S's 128 accumulators the loop spilled.
  static constexpr bool kFineS = kBlockN == 128;

  static_assert(sizeof(Element) == 2, "f16 or bf16");
  static_assert(kBlockM == 16 * kWarps || kBlockM == 32 * kWarps, "one or two 16-row MMA tiles per warp");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 64 == 0, "ldmatrix x4 covers 16 x 16; swizzle atoms are 64 wide");
  static_assert(kStages >= 2, "the ring holds at least the K and the V tile of one block");
  static_assert(!kDropout || kBlockN % 32 == 0, "a Philox call spans 32 keys");
  static_assert(!(kBias && kDropout), "a bias and dropout are not built together (spec/sm80_fwd.py)");

  // Shared memory: 8 x 64-element atoms (128-byte rows) with the 16-byte chunks of each row
  // XOR-ed by the row index, so the 8 rows an ldmatrix (or the 8 chunks a row's cp.asyncs)
  // touch fall in 8 different bank groups.
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<3, 3, 3>{}, cute::Layout<cute::Shape<cute::_8, cute::_64>, cute::Stride<cute::_64, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutTile = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // A V tile seen as the B operand of O = P V: (head dim, keys), read with transposing ldmatrix.
  using SmemLayoutTileT = decltype(cute::composition(
      SmemLayoutTile{},
      cute::Layout<cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>, cute::Stride<cute::Int<kBlockN>, cute::_1>>{}));
  static constexpr int kTileElements = kBlockN * kHeadDim;

  using MmaOp = std::conditional_t<std::is_same<Element, cutlass::half_t>::value, cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // Warps stacked along M; a 16-wide N tile so that one ldmatrix x4 fills the B operand of two MMAs.
  using TiledMma = decltype(cute::make_tiled_mma(MmaOp{}, cute::Layout<cute::Shape<cute::Int<kWarps>, cute::_1, cute::_1>>{},
                                                 cute::Tile<cute::Int<16 * kWarps>, cute::_16, cute::_16>{}));
  using LoadOperand = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using LoadOperandT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using StoreAccumulator = cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Element>;  // a column pair per store

  // kBias: key block i's bias tile lands in slot i % kBiasSlots with its K tile, which is issued
  // once every warp is past the softmax of block i - kBiasSlots (see mainloop's ring): after the
  // second barrier of block i - kStages / 2 (kStages even) or the first of block i - (kStages - 1)
  // / 2 (odd), so ceil(kStages / 2) slots.  Rows of kBlockN keys in the K/V tiles' swizzled atoms
  // (32 columns wide for 32-key tiles), so the 8 rows an ldmatrix reads fall in 8 bank groups.
  static constexpr int kBiasSlots = (kStages + 1) / 2;
  static constexpr int kBiasAtomCols = kBlockN % 64 == 0 ? 64 : 32;
  static_assert(kBlockN % 32 == 0, "bias rows of whole 32- or 64-key atoms");
  using SmemLayoutBias = decltype(cute::tile_to_shape(
      cute::composition(cute::Swizzle<kBiasAtomCols == 64 ? 3 : 2, 3, 3>{},
                        cute::Layout<cute::Shape<cute::_8, cute::Int<kBiasAtomCols>>,
                                     cute::Stride<cute::Int<kBiasAtomCols>, cute::_1>>{}),
      cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  static constexpr int kBiasTileElements = kBlockM * kBlockN;
  struct BiasRing {
    alignas(128) Element bias[kBiasSlots * kBiasTileElements];
  };
  struct NoBias {};  // the plain instances: an empty base, no bytes

  struct SharedStorage : std::conditional_t<kBias, BiasRing, NoBias> {
    alignas(128) Element q[kBlockM * kHeadDim];  // Q, then the output tile on its way out
    alignas(128) Element ring[kStages * kTileElements];
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  // Q and the output share SmemLayoutQ; K and V tiles SmemLayoutTile (the same atoms, so the same pass stride).
  using LoaderQ = TileLoader<Element, kHeadDim, kThreads, SmemLayoutQ>;
  using LoaderKV = TileLoader<Element, kHeadDim, kThreads, SmemLayoutTile>;
  using LoaderBias = TileLoader<Element, kBlockN, kThreads, SmemLayoutBias>;

  // kBias: the (row, key) of the tile whose 16 bytes (8 keys) lane `lane` of warp `warp` addresses
  // in the ldmatrix.x4 that reads the bias of MMA row tile m, key columns 16 j .. 16 j + 15: matrix
  // lane / 8 is rows +0 (even) or +8 (odd) of the warp's 16 in that tile, keys +0 (matrices 0, 1)
  // or +8 (2, 3), so its register pairs are those of accumulator (h, i % 2) of MMA columns 2 j +
  // i / 2 (see add_bias; tests/test_sm80_bias_layout.py checks this against CuTe's partition).
  static CUTE_HOST_DEVICE cute::tuple<int, int> bias_row_key(int warp, int lane, int m, int j) {
    return cute::make_tuple(16 * kWarps * m + 16 * warp + lane % 8 + 8 * (lane / 8 % 2), 16 * j + 8 * (lane / 16));
  }

  // Key blocks this query block visits: those the band reaches (all without one); none
  // when the block holds no query of its sequence (a packed batch's grid is sized for its
  // longest sequence).
  static __device__ BlockRange key_blocks(Sequence const& seq, int m_block) {
    if (m_block * kBlockM >= seq.num_queries) {
      return {0, 0};
    }
    return band_blocks<kBlockM, kBlockN>(m_block, seq.num_keys, seq.band_lo, seq.band_hi);
  }

  // grid (ceil(M / kBlockM), heads, batch or sequences), kThreads threads, kSharedBytes of
  // dynamic shared memory.  Query blocks run last-first: under a causal mask the long ones
  // start in the first wave and the short ones fill the tail.
  static __device__ void run(FwdParams const& p, char* smem_raw) {
    using namespace cute;
    SharedStorage& s = *reinterpret_cast<SharedStorage*>(smem_raw);
    int const m_block = gridDim.x - 1 - blockIdx.x;
    int const head = blockIdx.y;
    Sequence const seq = sequence(p, blockIdx.z);
    BlockRange const blocks = key_blocks(seq, m_block);

    TiledMma mma;
    Tensor tOrO = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_N) fp32
    constexpr int kRows = 2 * size<1>(tOrO);  // accumulator rows per thread: two per 16-row tile
    float row_max[kRows];  // log2 domain: scores * scale * log2(e)
    float row_sum[kRows];  // this thread's columns only; the quad's sum is taken at the end
    clear(tOrO);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
    if (blocks.end > blocks.begin) {
      mainloop(p, s, seq, m_block, head, blocks, tOrO, row_max, row_sum);
    }
    epilogue(p, s, seq, m_block, head, tOrO, row_max, row_sum);
  }

  template <class AccO, int kRows>
  static __device__ void mainloop(FwdParams const& p, SharedStorage& s, Sequence const& seq, int m_block, int head,
                                  BlockRange blocks, AccO& tOrO, float (&row_max)[kRows], float (&row_sum)[kRows]) {
    using namespace cute;
    int const tid = threadIdx.x;
    int const head_kv = head / p.head_group;
    int const num_blocks = blocks.end - blocks.begin;
    int const row0 = m_block * kBlockM;  // the tile's first query, within its sequence
    Element const* q = static_cast<Element const*>(p.q_ptr) + seq.batch * p.q_stride_b +
                       (seq.q0 + row0) * (long long)p.q_stride_m + head * (long long)p.q_stride_h;
    Element const* k = static_cast<Element const*>(p.k_ptr) + seq.batch * p.k_stride_b +
                       seq.k0 * (long long)p.k_stride_m + head_kv * (long long)p.k_stride_h;
    Element const* v = static_cast<Element const*>(p.v_ptr) + seq.batch * p.v_stride_b +
                       seq.k0 * (long long)p.v_stride_m + head_kv * (long long)p.v_stride_h;
    // kBias: the tile's first row (no packed batches: the batch is the sequence)
    Element const* bias = nullptr;
    if constexpr (kBias) {
      bias = static_cast<Element const*>(p.bias_ptr) + seq.batch * p.bias_stride_b + head * p.bias_stride_h +
             row0 * (long long)p.bias_stride_m;
    }
    // Ring tile t: the K (t even) or V (t odd) tile of the (t / 2)-th block visited, last block first.
    auto block_of = [&](int t) { return blocks.end - 1 - t / 2; };
    auto issue = [&](int t) {  // one commit group per tile, empty past the last, so the waits count alike
      if (t < 2 * num_blocks) {
        bool const is_v = t % 2;
        int const key0 = block_of(t) * kBlockN;
        int const stride = is_v ? p.v_stride_m : p.k_stride_m;
        LoaderKV::template load<kBlockN>(s.ring + (t % kStages) * kTileElements,
                                         (is_v ? v : k) + key0 * (long long)stride, stride, seq.num_keys - key0,
                                         p.head_dim);
        if constexpr (kBias) {  // with the K tile: needed by the same softmax
          if (!is_v) {
            LoaderBias::template load<kBlockM>(s.bias + (t / 2) % kBiasSlots * kBiasTileElements, bias + key0,
                                               p.bias_stride_m, seq.num_queries - row0, seq.num_keys - key0);
          }
        }
      }
      cp_async_fence();
    };

    Tensor sQ = make_tensor(make_smem_ptr(s.q), SmemLayoutQ{});
    LoaderQ::template load<kBlockM>(s.q, q, p.q_stride_m, seq.num_queries - row0, p.head_dim);
    cp_async_fence();
    CUTE_UNROLL
    for (int t = 0; t < kStages - 1; ++t) {
      issue(t);
    }

    // Operand fragments and the ldmatrix views that fill them.
    TiledMma mma;
    auto thr = mma.get_thread_slice(tid);
    auto copy_a = make_tiled_copy_A(LoadOperand{}, mma);
    auto copy_b = make_tiled_copy_B(LoadOperand{}, mma);
    auto copy_bt = make_tiled_copy_B(LoadOperandT{}, mma);
    auto load_a = copy_a.get_thread_slice(tid);
    auto load_b = copy_b.get_thread_slice(tid);
    auto load_bt = copy_bt.get_thread_slice(tid);
    auto tile_k = [&](int slot) { return make_tensor(make_smem_ptr(s.ring + slot * kTileElements), SmemLayoutTile{}); };
    auto tile_vt = [&](int slot) {
      return make_tensor(make_smem_ptr(s.ring + slot * kTileElements), SmemLayoutTileT{});
    };
    Tensor tSrQ = thr.partition_fragment_A(sQ);           // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr.partition_fragment_B(tile_k(0));    // (MMA, MMA_N, MMA_K)
    Tensor tOrVt = thr.partition_fragment_B(tile_vt(0));  // (MMA, MMA_N = head dim, MMA_K = keys)
    Tensor tSsQ = load_a.partition_S(sQ);
    Tensor tSrQ_view = load_a.retile_D(tSrQ);
    Tensor tSrK_view = load_b.retile_D(tSrK);
    Tensor tOrVt_view = load_bt.retile_D(tOrVt);
    Tensor tSrS = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    // each accumulator element's (row, key) within the tile: where the mask applies
    Tensor tScS = rows_cols(thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
    Tensor S = make_tensor(tSrS.data(), rows_cols_layout(tSrS.layout()));
    Tensor O = make_tensor(tOrO.data(), rows_cols_layout(tOrO.layout()));
    static_assert(decltype(size<0>(S))::value == kRows, "accumulator rows");

    bool const softcap = p.softcap_in != 0.f;
    float const multiplier = softcap ? p.softcap_out * p.scale_log2 : p.scale_log2;
    // kBias: the bias joins the scores in natural-log units, S * multiplier / log2(e) + bias (one FMA
    // each, the max then taken on the biased scores whatever the scale's sign), and the exponent's
    // FMA multiplies by log2(e).
    bool const fold = !kBias && multiplier > 0.f;
    float const exponent_scale = kBias ? kLog2e : fold ? multiplier : 1.f;  // what the exponent's FMA multiplies by
    float const natural_scale = multiplier * (1.f / kLog2e);
    int const warp = tid / 32, lane = tid % 32;
    auto const stream = dropout_stream(p, seq, head);

    for (int i = 0; i < num_blocks; ++i) {
      int const n_block = blocks.end - 1 - i;
      // K_i landed (and Q with the first); every warp is done with V_{i-1}'s slot: refill it.
      cp_async_wait<kStages - 2>();
      __syncthreads();
      issue(2 * i + kStages - 1);

      // S = Q K^T
      clear(tSrS);
      gemm_ss_or_fine<kFineS>(mma, tSrS, copy_a, tSsQ, tSrQ, tSrQ_view, copy_b,
                              load_b.partition_S(tile_k((2 * i) % kStages)), tSrK, tSrK_view);

      // Scores reach the log2 domain through `multiplier` (scale_log2, or softcap_out *
      // scale_log2 on tanh's output): folded into the exponent's FMA when positive, so the
      // max is taken on the unscaled scores; a negative one (a negative scale) would turn the
      // max into the min, so those scores are scaled first and the FMA multiplies by 1.
      if (softcap) {
        CUTE_UNROLL
        for (int e = 0; e < size(tSrS); ++e) {
          tSrS(e) = tanh_approx(tSrS(e) * p.softcap_in);
        }
      }
      if constexpr (kBias) {
        add_bias(s.bias + i % kBiasSlots * kBiasTileElements, tSrS, natural_scale, warp, lane);
      } else if (!fold) {
        CUTE_UNROLL
        for (int e = 0; e < size(tSrS); ++e) {
          tSrS(e) *= multiplier;
        }
      }
      int const key0 = n_block * kBlockN;
      if (key0 + kBlockN > seq.num_keys || key0 + kBlockN - 1 > row0 + seq.band_hi ||
          key0 < row0 + kBlockM - 1 + seq.band_lo) {
        CUTE_UNROLL
        for (int r = 0; r < size<0>(S); ++r) {
          int const row = row0 + get<0>(tScS(r, 0));
          CUTE_UNROLL
          for (int c = 0; c < size<1>(S); ++c) {
            int const key = key0 + get<1>(tScS(0, c));
            if (key >= seq.num_keys || key > row + seq.band_hi || key < row + seq.band_lo) {
              S(r, c) = -INFINITY;
            }
          }
        }
      }

      // online softmax.  A row's running max moves only when its new max passes it by more
      // than kMaxSlack (log2 units), and then for the whole warp at once: until then P =
      // exp2(S - stale max) stays below 2^kMaxSlack, which fp32 sums and f16/bf16 hold at
      // full relative precision, and O and the row sums keep their scale.  After the first
      // blocks the max rarely moves that far, so the O rescale (kHeadDim / 2 multiplies a
      // row) is skipped for most blocks.
      float block_max[kRows];
      bool move = false;
      CUTE_UNROLL
      for (int r = 0; r < size<0>(S); ++r) {
        float m = -INFINITY;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          m = fmaxf(m, S(r, c));
        }
        block_max[r] = fmaxf(row_max[r], quad_max(m) * exponent_scale);
        move |= block_max[r] > row_max[r] + kMaxSlack;  // a row's first key moves it (-inf + slack is -inf)
      }
      if (__any_sync(0xffffffff, move)) {
        CUTE_UNROLL
        for (int r = 0; r < size<0>(S); ++r) {
          float const correction = exp2_approx(row_max[r] - (block_max[r] == -INFINITY ? 0.f : block_max[r]));
          row_max[r] = block_max[r];
          row_sum[r] *= correction;
          CUTE_UNROLL
          for (int c = 0; c < size<1>(O); ++c) {
            O(r, c) *= correction;
          }
        }
      }
      CUTE_UNROLL
      for (int r = 0; r < size<0>(S); ++r) {
        float const base = row_max[r] == -INFINITY ? 0.f : row_max[r];  // no key yet: exp2(-inf - 0) = 0, not NaN
        float sum = row_sum[r];
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          S(r, c) = exp2_approx(fmaf(S(r, c), exponent_scale, -base));
          sum += S(r, c);
        }
        row_sum[r] = sum;
      }
      if constexpr (kDropout) {  // after the sums: the softmax is of the whole row
        drop(stream, S, tScS, row0, key0);
      }
      Tensor rP = convert<Element>(tSrS);
      Tensor tOrP = make_tensor(rP.data(), accumulator_as_a(rP.layout()));

      // V_i landed; every warp is done with K_i's slot: refill it.
      cp_async_wait<kStages - 2>();
      __syncthreads();
      issue(2 * i + kStages);

      // O += P V
      gemm_rs(mma, tOrO, tOrP, copy_bt, load_bt.partition_S(tile_vt((2 * i + 1) % kStages)), tOrVt, tOrVt_view);
    }
  }

  // kBias: S = S * scale + bias in place, `tile` the block's bias: an ldmatrix.x4 per MMA row tile
  // and pair of 8-key columns (bias_row_key), its register i's pair into accumulator (h, i % 2).
  template <class AccS>
  static __device__ void add_bias(Element const* tile, AccS& tSrS, float scale, int warp, int lane) {
    using namespace cute;
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tSrS); ++m) {
      CUTE_UNROLL
      for (int j = 0; j < size<2>(tSrS) / 2; ++j) {
        auto const [row, key] = bias_row_key(warp, lane, m, j);
        uint32_t pairs[4];
        load_matrix_x4<false>(tile + SmemLayoutBias{}(row, key), pairs);
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h) {
            float& x = tSrS(make_coord(make_coord(h, i % 2), m, 2 * j + i / 2));
            x = fmaf(x, scale, unpack_half<Element>(pairs[i], h));
          }
        }
      }
    }
  }

  // kDropout: the stream of (sequence, head); a plain instance reads none of the dropout fields.
  struct NoDropout {};
  static __device__ auto dropout_stream(FwdParams const& p, Sequence const& seq, int head) {
    if constexpr (kDropout) {
      return DropoutStream(p, seq.index, head);
    } else {
      return NoDropout{};
    }
  }

  // Zero the dropped elements of P (S, this thread's rows x keys of the key block from key0; tScS
  // their coordinates in the tile).  Register (r, c) of the accumulator view is row base(r / 2) +
  // 8 (r % 2) and key base(c / 8) + 8 (c / 2 % 4) + c % 2, where base(r / 2) is the thread's row in
  // its 16-row MMA tile, below 8, and base(c / 8) the thread's key 2 (lane % 4) in its 32-key group
  // (tests/test_sm80_dropout_cpu.py checks this against CuTe's layout for every thread): the 16
  // registers of (r / 2, c / 8) are one Philox call of the rule, register (r, c) its byte
  // 8 (r % 2) + 2 (c / 2 % 4) + c % 2.
  template <class TensorS, class TensorC>
  static __device__ void drop(DropoutStream const& stream, TensorS& S, TensorC const& tScS, int row0, int key0) {
    using namespace cute;
    CUTE_UNROLL
    for (int m = 0; m < size<0>(S) / 2; ++m) {
      int const row = row0 + get<0>(tScS(2 * m, 0));
      CUTE_UNROLL
      for (int g = 0; g < size<1>(S) / 8; ++g) {
        uint32_t const bits = stream.keep_bits(row, key0 + get<1>(tScS(0, 8 * g)));
        CUTE_UNROLL
        for (int e = 0; e < 16; ++e) {
          int const r = 2 * m + e / 8, c = 8 * g + e % 8;
          S(r, c) = (bits >> (8 * (e / 8) + e % 8)) & 1u ? S(r, c) : 0.f;
        }
      }
    }
  }

  // Divide O by the row sums, write lse (and its padding), stage O through the Q buffer and
  // store it with 16-byte writes.  Every warp is past its last read of Q by now (the loop's
  // last barrier follows its last S).
  template <class AccO, int kRows>
  static __device__ void epilogue(FwdParams const& p, SharedStorage& s, Sequence const& seq, int m_block, int head,
                                  AccO& tOrO, float const (&row_max)[kRows], float const (&row_sum)[kRows]) {
    using namespace cute;
    int const tid = threadIdx.x;
    int const row0 = m_block * kBlockM;
    TiledMma mma;
    auto thr = mma.get_thread_slice(tid);
    Tensor O = make_tensor(tOrO.data(), rows_cols_layout(tOrO.layout()));
    Tensor tOcO = rows_cols(thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    float* lse = p.lse_ptr + seq.index * (long long)p.lse_stride_b + head * (long long)p.lse_stride_h;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float const sum = quad_sum(row_sum[r]);
      // no visible key: output 0; kDropout: O of the kept P, scaled by 1 / (1 - p)
      float const inv = sum > 0.f ? (kDropout ? p.dropout_scale : 1.f) / sum : 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) {
        O(r, c) *= inv;
      }
      int const row = row0 + get<0>(tOcO(r, 0));
      if (tid % 4 == 0) {
        if (row < seq.num_queries) {
          lse[row] = sum > 0.f ? (row_max[r] + __log2f(sum)) * 0.69314718055994531f : -INFINITY;
        } else if (row < p.lse_rows) {
          lse[row] = INFINITY;
        }
      }
    }

    Tensor sO = make_tensor(make_smem_ptr(s.q), SmemLayoutQ{});
    Tensor rO = convert<Element>(tOrO);
    auto copy_c = make_tiled_copy_C(StoreAccumulator{}, mma);
    auto store_c = copy_c.get_thread_slice(tid);
    copy(copy_c, store_c.retile_S(rO), store_c.partition_D(sO));
    __syncthreads();
    Element* out = static_cast<Element*>(p.out_ptr) + seq.batch * p.out_stride_b +
                   (seq.q0 + row0) * (long long)p.out_stride_m + head * (long long)p.out_stride_h;
    LoaderQ::template store<kBlockM>(s.q, out, p.out_stride_m, seq.num_queries - row0, p.head_dim);
  }
};

}  // namespace sm80
}  // namespace flashgen
