// Dropout in flashgen's own kernels: Philox-4x32-10 and the one rule that maps an element of P
// to its random byte, so that the forward and the backward, whatever their tiles, keep the same
// elements.  The runtime's side (threshold, scale, the (seed, offset) a call passes) is in
// flashgen/runtime/dropout.py; tests/philox_reference.py is a NumPy copy of this rule,
// checked against Random123's known answers.
//
// Element (b, h, i, j) -- sequence b (the batch index, or the packed sequence), query head h,
// query row i and key j counted within the sequence -- takes its 8 bits from one Philox-4x32-10
// call keyed by the 64-bit seed (k0 its low word, k1 its high one) at the counter
//   c0 = (j / 32) * 4 + (j / 2) % 4     the key without its bits 0, 3 and 4
//   c1 = (i / 16) * 8 + i % 8           the row without its bit 3
//   c2 + 2^32 c3 = offset + b * H + h   (64-bit sum; H = query heads)
// as byte l = 8 * (i / 8 % 2) + 2 * (j / 8 % 4) + j % 2 of the call's 16 (byte l: bits
// 8 (l % 4) .. 8 (l % 4) + 7 of word l / 4).  The element is kept iff its byte < keep, where the
// runtime passes keep = round((1 - p) * 256), 0 .. 256 (256: keep every element, so keep and the
// comparison are wider than a byte); p is thus quantised to 1/256, as in FlashAttention-2.  Kept
// elements are scaled by 1 / (1 - p), of the p asked for.  (Rows that see no key -- bottom-right
// causal, more queries than keys -- are left out by the runtime in both directions, so i counts
// from the first row that sees one.)
//
// One call thus covers rows {i, i + 8} x keys {j, j + 1, j + 8, j + 9, j + 16, j + 17, j + 24,
// j + 25} (i % 16 < 8, j % 32 < 8, j even): the 16 values one thread holds of a 16 x 32 block of a
// wgmma accumulator of S -- the forward draws one call per 16 elements.  The backward holds S^T
// (keys as rows): a thread has 4 elements of each of its calls, the other 12 lie in three other
// threads of its warpgroup, so the warpgroup draws each call once and shares the bits through
// shared memory (sm90_bwd.h).  Tiles are 16-aligned in rows and 32-aligned in keys within a
// sequence, which is all the rule asks of them.  Calls whose offsets differ by at least B * H draw
// disjoint counters (example 41's contract, offsets B * H * M * N apart, more than satisfies that).
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
  // The threshold keep (0 .. 256: a byte is kept iff below it) as two parts for keep_bytes, in every
  // byte: its bit 7 (0x80 where keep >= 128), and the rest, keep - 128 * bit 7 (0 .. 128: 256 gives
  // 128, above every 7-bit value)
  uint32_t keep_high, keep_low;

  template <class Params>
  __device__ DropoutStream(Params const& p, int sequence, int head) {
    uint64_t const stream = p.dropout_offset + uint64_t(sequence) * uint32_t(p.num_heads) + uint32_t(head);
    k0 = uint32_t(p.dropout_seed);
    k1 = uint32_t(p.dropout_seed >> 32);
    c2 = uint32_t(stream);
    c3 = uint32_t(stream >> 32);
    uint32_t const keep = p.dropout_keep;
    keep_high = keep >= 128 ? 0x80808080u : 0u;
    keep_low = (keep - (keep >= 128 ? 128u : 0u)) * 0x01010101u;
  }

  // The four bytes of a Philox word compared with keep at once: bit 7 of each byte of the result is 1
  // iff that byte is below keep (the other bits are not defined).  d = (w | 0x80) - low per byte
  // never borrows from the next byte, and its bit 7 says whether the byte's low 7 bits reach low;
  // below keep is then: bit 7 clear where keep's is set, or equal bits 7 and low 7 bits below low.
  __device__ __forceinline__ uint32_t keep_bytes(uint32_t w) const {
    uint32_t const d = (w | 0x80808080u) - keep_low;
    return (~w & keep_high) | (~(w ^ keep_high) & ~d);
  }

  // keep_bytes of the four words of the call that covers element (i, j): word l / 4 holds byte l.
  __device__ __forceinline__ uint4 keep_words(int i, int j) const {
    uint4 const r = philox4x32_10(counter(i, j), k0, k1);
    return make_uint4(keep_bytes(r.x), keep_bytes(r.y), keep_bytes(r.z), keep_bytes(r.w));
  }

  __device__ __forceinline__ uint4 counter(int i, int j) const {
    uint32_t const c0 = uint32_t(j >> 5) * 4 + ((j >> 1) & 3);
    uint32_t const c1 = uint32_t(i >> 4) * 8 + (i & 7);
    return make_uint4(c0, c1, c2, c3);
  }

  // The keep bits of the call that covers element (i, j) (any of its 16): bit l for byte l.
  __device__ __forceinline__ uint32_t keep_bits(int i, int j) const {
    uint4 const w = keep_words(i, j);
    return keep_nibble(w.x) | keep_nibble(w.y) << 4 | keep_nibble(w.z) << 8 | keep_nibble(w.w) << 12;
  }

  // Bits 7, 15, 23 and 31 of keep_bytes' word as bits 0 .. 3: times 2^0 + 2^7 + 2^14 + 2^21 they land
  // on bits 28 .. 31, and no two of the sixteen shifted copies share a bit below 32 (no carries).
  static __device__ __forceinline__ uint32_t keep_nibble(uint32_t bytes) {
    return ((bytes & 0x80808080u) * 0x00204081u) >> 28;
  }
};

// A mask of two adjacent 16-bit values from keep_bytes' word: bytes 2h and 2h + 1 (h = 0 or 1) each
// replicate their bit 7 over 16 bits, so that `pair & mask` keeps or zeroes each half (prmt's sign
// mode: a selector nibble with bit 3 set copies the sign of the byte it names).
__device__ __forceinline__ uint32_t keep_pair_mask(uint32_t keep_word, int h) {
  uint32_t mask;
  uint32_t const selector = h ? 0xBBAAu : 0x9988u;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(mask) : "r"(keep_word), "r"(selector));
  return mask;
}

}  // namespace flashgen
