"""A NumPy copy of the sm90 dropout rule (flashgen/csrc/flashgen/dropout.h, runtime/dropout.py):
Philox-4x32-10 and the element -> (counter, lane) mapping, for the CPU tests (known answers) and
the GPU tests (the float64 reference's keep mask)."""
from __future__ import annotations

import numpy as np

from flashgen.runtime.dropout import keep_threshold

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
LOW = np.uint64(0xFFFFFFFF)


def philox4x32_10(counters: np.ndarray, key) -> np.ndarray:
    """Philox-4x32-10 of uint32 counters [..., 4] under key (k0, k1): uint32 [..., 4]."""
    c = [counters[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0, p1 = M0 * c[0], M1 * c[2]
            c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & LOW, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
                 p0 & LOW]
            k0, k1 = k0 + W0, k1 + W1
    return np.stack(c, axis=-1).astype(np.uint32)


def random_bits(seed: int, offset: int, sequence: int, heads: int, head: int, rows: int, keys: int) -> np.ndarray:
    """The bytes of (sequence, head)'s [rows, keys] elements, by the rule of dropout.h."""
    i = np.arange(rows, dtype=np.int64)[:, None]
    j = np.arange(keys, dtype=np.int64)[None, :]
    stream = (offset + sequence * heads + head) % 2**64
    counters = np.empty((rows, keys, 4), dtype=np.uint32)
    counters[..., 0] = (j >> 5) * 4 + ((j >> 1) & 3)
    counters[..., 1] = (i >> 4) * 8 + (i & 7)
    counters[..., 2] = stream & 0xFFFFFFFF
    counters[..., 3] = stream >> 32
    words = philox4x32_10(counters, (seed & 0xFFFFFFFF, seed >> 32))
    lane = np.broadcast_to(8 * ((i >> 3) & 1) + 2 * ((j >> 3) & 3) + (j & 1), (rows, keys))
    word = np.take_along_axis(words, (lane // 4)[..., None], axis=-1)[..., 0]
    return (word >> (8 * (lane % 4)).astype(np.uint32)) & np.uint32(0xFF)


def keep_mask(seed: int, offset: int, dropout_p: float, sequences: int, heads: int, rows: int,
              keys: int, skipped: int = 0) -> np.ndarray:
    """bool [sequences, heads, rows, keys]: which elements of P the kernels keep.  ``skipped``: the
    first rows, which see no key (bottom-right causal, M > N) and which the runtime leaves out, so that
    the rule numbers the others from 0 (runtime/dropout.py); they are False here."""
    threshold = keep_threshold(dropout_p)
    kept = np.stack([np.stack([random_bits(seed, offset, b, heads, h, rows - skipped, keys) < threshold
                               for h in range(heads)]) for b in range(sequences)])
    return np.concatenate([np.zeros((sequences, heads, skipped, keys), dtype=bool), kept], axis=2)
