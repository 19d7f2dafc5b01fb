// Dropout in flashgen's own kernels: Philox-4x32-10 and the one rule that maps an element of P
// to its random bits, so that the forward and the backward, whatever their tiles, keep the same
// elements.  The runtime's side (threshold, scale, the (seed, offset) a call passes) and a NumPy
// copy of this rule are in flashgen/runtime/families/sm90_dropout.py; tests/philox_reference.py
// checks both against Random123's known answers.
//
// Element (b, h, i, j) -- sequence b (the batch index, or the packed sequence), query head h,
// query row i and key j counted within the sequence -- takes its 16 bits from one Philox-4x32-10
// call keyed by the 64-bit seed (k0 its low word, k1 its high one) at the counter
//   c0 = (j / 16) * 4 + (j / 2) % 4     the key without its bits 0 and 3
//   c1 = (i / 16) * 8 + i % 8           the row without its bit 3
//   c2 + 2^32 c3 = offset + b * H + h   (64-bit sum; H = query heads)
// as lane l = 4 * (i / 8 % 2) + 2 * (j / 8 % 2) + j % 2 of its 8 16-bit values (value l is the
// low half of word l / 2 for even l, the high half for odd l).  The element is kept iff its
// value < keep (the runtime passes round((1 - p) * 65536)); kept elements are scaled by 1 / (1 - p).
// (Rows that see no key -- bottom-right causal, more queries than keys -- are left out by the
// runtime in both directions, so i counts from the first row that sees one.)
//
// One call thus covers rows {i, i + 8} x keys {j, j + 1, j + 8, j + 9} (i % 16 < 8, j % 16 < 8,
// j even): the eight values one thread holds of a 16 x 16 block of a wgmma (or mma.sync)
// accumulator of S -- the forward draws one call per 8 elements.  The backward holds S^T (keys as
// rows), so its thread's 8 elements of a block lie in two calls, 4 from each.  Tiles are 16-aligned
// in rows and keys within a sequence, which is all the rule asks of them.  Calls whose offsets
// differ by at least B * H draw disjoint counters (example 41's contract, offsets B * H * M * N
// apart, more than satisfies that).
#pragma once

#include <cstdint>

namespace flashgen {

// Philox-4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
// ten rounds of two 32 x 32 -> 64-bit products and a key schedule bumped by Weyl constants.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key increments
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t const hi0 = __umulhi(kM0, c.x), lo0 = kM0 * c.x;
    uint32_t const hi1 = __umulhi(kM1, c.z), lo1 = kM1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// One (sequence, query head)'s dropout stream: the seed, the counter's high words and the threshold.
struct DropoutStream {
  uint32_t k0, k1;
  uint32_t c2, c3;
  uint32_t keep;

  template <class Params>
  __device__ DropoutStream(Params const& p, int sequence, int head) {
    uint64_t const stream = p.dropout_offset + uint64_t(sequence) * uint32_t(p.num_heads) + uint32_t(head);
    k0 = uint32_t(p.dropout_seed);
    k1 = uint32_t(p.dropout_seed >> 32);
    c2 = uint32_t(stream);
    c3 = uint32_t(stream >> 32);
    keep = p.dropout_keep;
  }

  // The keep bits of the call that covers element (i, j) (any of its eight): bit l for lane l.
  __device__ __forceinline__ uint32_t keep_bits(int i, int j) const {
    uint32_t const c0 = uint32_t(j >> 4) * 4 + ((j >> 1) & 3);
    uint32_t const c1 = uint32_t(i >> 4) * 8 + (i & 7);
    uint4 const r = philox4x32_10(make_uint4(c0, c1, c2, c3), k0, k1);
    uint32_t const words[4] = {r.x, r.y, r.z, r.w};
    uint32_t bits = 0;
#pragma unroll
    for (int l = 0; l < 8; ++l) {
      uint32_t const value = l % 2 ? words[l / 2] >> 16 : words[l / 2] & 0xffffu;
      bits |= uint32_t(value < keep) << l;
    }
    return bits;
  }
};

}  // namespace flashgen
