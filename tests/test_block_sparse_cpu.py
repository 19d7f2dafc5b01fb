"""Block-sparse sm90_fwd without a GPU: the partial blocks' element bits, the sparse instances of
the spec, and which block-mask calls the Hopper forward takes or refuses (and why).

The bits are checked against the dense mask element by element (decoded with NumPy shifts, not
with the builder's packing), for document, causal + window, random and all-full masks, ragged
M and N, B/H broadcast and chunked evaluation.  Nothing here imports CuPy.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from flashgen.runtime import block_masks
from flashgen.runtime.block_masks import block_mask


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)


def dense(mask, B, H, M, N):
    if callable(mask):
        mask = mask(np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1),
                    np.arange(M).reshape(1, 1, M, 1), np.arange(N).reshape(1, 1, 1, N))
    return np.broadcast_to(np.asarray(mask), (B, H, M, N))


def decoded(bm):
    """partial_bits unpacked bit by bit: bool [P, block_m, block_n]."""
    words = bm.partial_bits.astype(np.uint64)
    bits = (words[..., None] >> np.arange(32, dtype=np.uint64)) & 1  # [P, rows, words, 32]
    return bits.reshape(*bits.shape[:2], -1).astype(bool)


def assert_bits(bm, visible):
    """Every partial block's tile holds its element mask (zeros past M and N); tiles are numbered
    in (query block, batch, head, key block) order, consecutive per (b, h, qb) along kv_indices."""
    (B, H, M, N), (rows, cols) = bm.shape, bm.block
    QB, KB = bm.num_blocks
    index, tiles = bm.partial_index, decoded(bm)
    assert index.shape == (B, H, QB, KB) and index.dtype == np.int32 and bm.partial_bits.dtype == np.uint32
    padded = np.zeros((B, H, QB * rows, KB * cols), dtype=bool)
    padded[:, :, :M, :N] = visible
    expected_tile = 0
    for qb in range(QB):
        for b in range(B):
            for h in range(H):
                listed = bm.kv_indices[b, h, qb, :bm.kv_num_blocks[b, h, qb]]
                for t, kb in enumerate(listed):
                    assert index[b, h, qb, kb] == index[b, h, qb, listed[0]] + t == expected_tile
                    block = padded[b, h, qb * rows:(qb + 1) * rows, kb * cols:(kb + 1) * cols]
                    assert not block.all() and block.any()
                    np.testing.assert_array_equal(tiles[expected_tile], block)
                    expected_tile += 1
                others = np.setdiff1d(np.arange(KB), listed)
                assert (index[b, h, qb, others] == -1).all()
    assert bm.partial_bits.shape == (max(expected_tile, 1), rows, cols // 32)
    if expected_tile == 0:
        assert not bm.partial_bits.any()


def documents(M, n=8, seed=0):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, M), size=min(n, M) - 1, replace=False))
    doc = np.zeros(M, dtype=np.int64)
    doc[cuts] = 1
    return np.cumsum(doc)


MASKS = {
    "documents": lambda M, N: (lambda b, h, q, kv: (q >= kv) & (documents(max(M, N))[q] == documents(max(M, N))[kv])),
    "causal_window": lambda M, N: (lambda b, h, q, kv: (q >= kv) & (q - kv < 200)),
    "per_head": lambda M, N: (lambda b, h, q, kv: (kv % (h + 2) == 0) | (q == kv)),
    "all_full": lambda M, N: (lambda b, h, q, kv: q >= -1),
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("M, N", [(1, 1), (7, 300), (129, 1000), (1000, 129), (384, 512)])
def test_partial_bits_are_the_element_mask(name, M, N):
    fn = MASKS[name](M, N)
    B, H = (1, 3) if name == "per_head" else (2, 1)
    bm = block_mask(fn, B, H, M, N, device="cpu")
    assert_bits(bm, dense(fn, B, H, M, N))


def test_random_blocks_with_empty_rows_and_broadcast_batch():
    rng = np.random.default_rng(1)
    visible = rng.random((1, 2, 700, 900)) < 0.02
    visible[:, 1, :, 256:384] = True  # a full key block for every query block of head 1
    visible[:, :, 128:256] = False  # query block 1 without keys
    bm = block_mask(visible, 3, 2, 700, 900, device="cpu")  # B = 3 served by the mask's one batch
    assert_bits(bm, np.broadcast_to(visible, (3, 2, 700, 900)))
    assert (bm.partial_index[:, :, 1] == -1).all()


def test_chunks_number_tiles_as_one_pass(monkeypatch):
    fn = MASKS["documents"](1000, 1000)
    whole = block_mask(fn, 2, 2, 1000, 1000, device="cpu")
    monkeypatch.setattr(block_masks, "CHUNK_ELEMENTS", 1)  # one query block per chunk
    chunked = block_mask(fn, 2, 2, 1000, 1000, device="cpu")
    np.testing.assert_array_equal(whole.partial_index, chunked.partial_index)
    np.testing.assert_array_equal(whole.partial_bits, chunked.partial_bits)
    assert_bits(chunked, dense(fn, 2, 2, 1000, 1000))


def test_widths_that_are_not_multiples_of_32_record_no_bits():
    bm = block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 100, 100, block=(64, 48), device="cpu")
    assert bm.partial_index is None and bm.partial_bits is None
    assert_bits(block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 100, 100, block=(48, 64), device="cpu"),
                dense(lambda b, h, q, kv: q >= kv, 1, 1, 100, 100))
