// Arch-neutral pieces of flashgen's attention kernels (the Hopper families, sm90_*.h, and
// the Ampere forward, sm80_fwd.h): fast math on accumulator rows, the sequences of a
// packed batch, and the key (or query) blocks a band mask leaves.  They read only Params
// fields every family declares alike (seqstart_q/k, num_queries/keys, band_lo/hi,
// band_from_end), so one definition keeps the families' masks identical.
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

}  // namespace flashgen
