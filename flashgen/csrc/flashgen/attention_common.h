// Arch-neutral pieces of flashgen's attention kernels (the Hopper families, sm90_*.h, and
// the Ampere ones, sm80_*.h): fast math on accumulator rows, the sequences of a packed
// batch, the key (or query) blocks a band mask leaves, and the two backwards' workspace rows
// and prep kernel.  They read only Params fields the families declare alike (seqstart_q/k,
// num_queries/keys, band_lo/hi, band_from_end; the backwards' out/dout/lse fields), so one
// definition keeps the families' masks and workspaces identical.
#pragma once

#include <cmath>

namespace flashgen {

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Band masks (the sm90 families' kBand instances; every sm80_fwd instance): key j is
// visible to query i iff i + band_lo <= j <= i + band_hi.  A causal mask is the band (-kUnbounded, diagonal
// offset); a sliding window bounds both sides.  The runtime clamps both to +-kUnbounded
// (and keeps packed batches under 2^28 tokens, so a sequence's shift below stays clear).
constexpr int kUnbounded = 1 << 30;

__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((b - 1 - a) / b); }

// One sequence of a call.  A fixed-length batch: sequence b is batch b of the tensors, whole.
// A packed (varlen) batch, seqstart_q/k != nullptr: sequence b is rows seqstart[b] ..
// seqstart[b + 1] - 1 of batch 0, and with band_from_end its band sits on its own
// bottom-right diagonal (shifted by its num_keys - num_queries).  Rows and keys below are
// the sequence's own (0 .. num_queries - 1); q0 and k0 place them in the tensors.
struct Sequence {
  int index;        // b: lse's first index, the launch grid's z
  int batch;        // the tensors' batch index
  int q0;           // first query row, first key row in the tensors
  int k0;
  int num_queries;
  int num_keys;
  int band_lo;      // key j is visible to query i iff i + band_lo <= j <= i + band_hi
  int band_hi;
};

template <class Params>
__device__ __forceinline__ Sequence sequence(Params const& p, int b) {
  if (p.seqstart_q == nullptr) {
    return {b, b, 0, 0, p.num_queries, p.num_keys, p.band_lo, p.band_hi};
  }
  int const q0 = p.seqstart_q[b];
  int const k0 = p.seqstart_k[b];
  int const num_queries = p.seqstart_q[b + 1] - q0;
  int const num_keys = p.seqstart_k[b + 1] - k0;
  int const shift = p.band_from_end ? num_keys - num_queries : 0;  // |shift| < 2^28: see kUnbounded
  return {b, 0, q0, k0, num_queries, num_keys, p.band_lo + shift, p.band_hi + shift};
}

struct BlockRange {
  int begin;
  int end;  // may be <= begin: no block
};

// The blocks of kCols columns (keys) that the kRows rows (queries) of row block `block`
// meet under a band, within [0, ceil(cols / kCols)).  With rows and columns swapped
// (band_lo <-> -band_hi), the query blocks a key block meets.
template <int kRows, int kCols>
__device__ __forceinline__ BlockRange band_blocks(int block, int cols, int band_lo, int band_hi) {
  int const begin = max(0, floor_div(block * kRows + band_lo, kCols));
  int const end = min((cols + kCols - 1) / kCols, floor_div((block + 1) * kRows - 1 + band_hi, kCols) + 1);
  return {begin, end};
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// op over the N values (N a power of two) pairwise: log2(N) dependent steps instead of N - 1.
// The values are overwritten.
template <int N, class Op>
__device__ __forceinline__ float tree_reduce(float (&values)[N], Op op) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "a power of two");
#pragma unroll
  for (int width = N / 2; width > 0; width /= 2) {
#pragma unroll
    for (int i = 0; i < width; ++i) {
      values[i] = op(values[i], values[i + width]);
    }
  }
  return values[0];
}

// What both backwards (sm90_bwd.h, sm80_bwd.h) share: their workspace and their first kernel.
// lse_log2, delta and the float32 dQ accumulator are [B, H, rows_padded] (the accumulator times
// kHeadDim), a sequence's rows from workspace_row0.  Packed sequences share batch 0's rows; each
// starts on a kBlockM boundary past the blocks of the ones before it.
template <int kBlockM, class Params>
__device__ __forceinline__ long long workspace_row0(Params const& p, Sequence const& seq, int head) {
  long long const row0 = (long long)(seq.batch * p.num_heads + head) * p.rows_padded;
  return p.seqstart_q == nullptr ? row0 : row0 + (seq.q0 + seq.index * kBlockM) / kBlockM * kBlockM;
}

// The prep kernel, per query row: delta = rowsum(dO * O), the forward's lse in the log2 domain
// (+inf for padding rows and rows without keys, so P is 0 there), zeroed dQ accumulator rows
// and block counters.  grid (ceil(M / kBlockM), heads, batch or sequences), kAuxThreads threads.
template <class Element, int kHeadDim, int kBlockM, int kAuxThreads, class Params>
__device__ void backward_prep(Params const& p) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte pieces of a row
  // the lanes of a row: a power of two dividing kChunks (a shuffle tree), each lane kChunks /
  // kLanes pieces (one, except at head dims like 192: 24 pieces over 8 lanes)
  constexpr int kLanes = (kChunks & -kChunks) < 32 ? (kChunks & -kChunks) : 32;
  constexpr int kRowsPerPass = kAuxThreads / kLanes;
  static_assert(kBlockM % kRowsPerPass == 0, "whole passes");
  int const m_block = blockIdx.x;
  int const head = blockIdx.y;
  Sequence const seq = sequence(p, blockIdx.z);
  if (m_block * kBlockM >= seq.num_queries) {  // past a packed sequence: no workspace rows here
    return;
  }
  int const lane = threadIdx.x % kLanes;
  long long const head_row0 = workspace_row0<kBlockM>(p, seq, head);
  long long const out_row0 = seq.batch * p.out_stride_b + seq.q0 * (long long)p.out_stride_m +
                             head * (long long)p.out_stride_h;
  long long const dout_row0 = seq.batch * p.dout_stride_b + seq.q0 * (long long)p.dout_stride_m +
                              head * (long long)p.dout_stride_h;
  for (int r = threadIdx.x / kLanes; r < kBlockM; r += kRowsPerPass) {
    int const row = m_block * kBlockM + r;
    float dot = 0.f;
#pragma unroll
    for (int chunk = lane; chunk < kChunks; chunk += kLanes) {
      if (row < seq.num_queries && chunk * 8 < p.head_dim) {
        uint4 const o = *reinterpret_cast<uint4 const*>(static_cast<Element const*>(p.out_ptr) + out_row0 +
                                                        row * (long long)p.out_stride_m + chunk * 8);
        uint4 const d = *reinterpret_cast<uint4 const*>(static_cast<Element const*>(p.dout_ptr) + dout_row0 +
                                                        row * (long long)p.dout_stride_m + chunk * 8);
        Element const* oe = reinterpret_cast<Element const*>(&o);
        Element const* de = reinterpret_cast<Element const*>(&d);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dot += float(oe[i]) * float(de[i]);
        }
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
      dot += __shfl_xor_sync(0xffffffff, dot, offset);
    }
    if (lane == 0) {
      float lse = INFINITY;  // padding rows: P = 0
      if (row < seq.num_queries) {
        lse = p.lse_ptr[seq.index * (long long)p.lse_stride_b + head * (long long)p.lse_stride_h + row];
        lse = lse == -INFINITY ? INFINITY : lse * 1.44269504088896341f;  // a row without keys: no gradient
      }
      p.lse_log2_ptr[head_row0 + row] = lse;
      p.delta_ptr[head_row0 + row] = dot;
    }
    float4* accum = reinterpret_cast<float4*>(p.dq_accum_ptr + (head_row0 + row) * kHeadDim);
    for (int c = lane; c < kHeadDim / 4; c += kLanes) {
      accum[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  if (threadIdx.x == 0) {
    p.dq_counter_ptr[head_row0 / kBlockM + m_block] = 0;
  }
}

}  // namespace flashgen
