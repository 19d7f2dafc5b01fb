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
from flashgen.runtime.block_masks import BlockMask, block_mask


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


def test_sparse_instances_are_the_mask_block_tiles_of_tiers_64_and_128():
    from flashgen.spec.sm90_fwd import Sm90Fwd

    sparse = [k for k in Sm90Fwd.default_set() if k.sparse]
    assert {(k.dtype, k.max_k) for k in sparse} == {(d, m) for d in ("f16", "bf16") for m in (64, 128)}
    assert all((k.block_m, k.block_n, k.stages, k.band, k.bias) == (128, 128, 2, False, False) for k in sparse)
    assert all(k.name.endswith("_s2_sparse_sm90a") and k.cpp_type.endswith(", false, false, true, false, false, "
                                                                         "flashgen::sm90::NoScoreMod>") for k in sparse)
    plain = [k for k in Sm90Fwd.default_set() if not k.sparse]
    assert all(k.cpp_type.endswith((", false, false, false, flashgen::sm90::NoScoreMod>", ", false, false, false, ScoreMod_alibi>"))
               or k.staged_o or k.dropout for k in plain), "plain instances compile kSparse (and kStagedO, kDropout) false"
    # after every plain kernel of its dtype: a plain call never reaches one, a sparse call skips the rest
    order = sorted(Sm90Fwd.default_set(), key=lambda k: k.priority)
    for k in sparse:
        later = order[order.index(k):]
        assert not any(o.dtype == k.dtype and not (o.band or o.bias or o.sparse) for o in later)


# --- which block-mask calls sm90_fwd takes -----------------------------------------------------

def _runtime_helpers():
    """tests/runtime_fakes.py (imported here: it imports nothing of CuPy either)."""
    import runtime_fakes as helpers

    return helpers


def sparse_kernels():
    from flashgen.spec.sm90_fwd import Sm90Fwd
    from types import SimpleNamespace

    return [SimpleNamespace(spec=k, name=k.name, constants={"max_k": k.max_k, "alignment": 8, "block_m": k.block_m,
                                                            "block_n": k.block_n, "shared_memory_bytes": 200 * 1024})
            for k in Sm90Fwd.default_set() if k.dtype == "f16"]


def first(kernels, req):
    from flashgen.runtime.select import rejection

    return next((b.name for b in kernels if rejection(b, req) is None), None), {
        b.name: rejection(b, req) for b in kernels}


@pytest.mark.parametrize("K, block, expected", [
    (64, (128, 128), "sm90_fwd_f16_k64_q128x128_s2_sparse_sm90a"),
    (40, (128, 128), "sm90_fwd_f16_k64_q128x128_s2_sparse_sm90a"),
    (96, (128, 128), "sm90_fwd_f16_k128_q128x128_s2_sparse_sm90a"),
    (128, (128, 128), "sm90_fwd_f16_k128_q128x128_s2_sparse_sm90a"),
    (192, (128, 128), None), (64, (64, 128), None), (64, (128, 64), None)])
def test_selection_matches_the_mask_block_with_the_tile_from_the_cubin_constants(K, block, expected):
    from flashgen.runtime.select import Request

    helpers = _runtime_helpers()
    found, why = first(sparse_kernels(), Request("sm90_fwd", "f16", K, K, 8, False, False, helpers.H100,
                                                 compiled_bias=True, block_sparse=block))
    assert found == expected
    if expected is None and K <= 128:
        assert why["sm90_fwd_f16_k64_q128x128_s2_sparse_sm90a"] == (
            f"reads 128 x 128 mask blocks; the block mask's are {block[0]} x {block[1]}")
    plain, why = first(sparse_kernels(), Request("sm90_fwd", "f16", K, K, 8, False, False, helpers.H100,
                                                 compiled_bias=True))
    assert plain is None or "sparse" not in plain
    assert why["sm90_fwd_f16_k128_q128x128_s2_sparse_sm90a"] in ("built with block-mask lists (sparse)",
                                                                 f"kMaxK 128 < head dim {K}")


def test_sm90_fwd_takes_block_masks_it_reads_and_says_why_not_otherwise(monkeypatch):
    import dataclasses

    from flashgen.runtime.families import serving, sm90_common, sm90_fwd

    helpers = _runtime_helpers()
    monkeypatch.setattr(sm90_common, "device_info", lambda index: helpers.H100)
    mask = block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, device="cpu")
    fwd = sm90_fwd.RUNTIME
    assert fwd.reads_block_masks and [f.name for f in serving("fwd") if f.reads_block_masks] == ["sm90_fwd"]

    def call(**options):
        return dataclasses.replace(helpers.fake_call("fwd", **options), block_mask=mask)

    assert fwd.unfit(call()) is None
    assert fwd.unfit(call(causal="top_left")).startswith("a block mask with a causal mask or window not folded")
    assert fwd.unfit(call(window=(3, 0))).startswith("a block mask with a causal mask or window not folded")
    assert fwd.unfit(call(bias=helpers.FakeArray((2, 3, 5, 7), strides=(120, 40, 8, 1)))) == \
        "a block mask with attn_bias: the sparse kernels have no bias"
    assert "float32" in fwd.unfit(call(arrays=helpers.qkv(dtype=np.float32)))
    assert fwd.request(call()).block_sparse == (128, 128)
    odd = block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, block=(128, 48), device="cpu")
    assert fwd.unfit(dataclasses.replace(call(), block_mask=odd)) == \
        "a block mask whose key blocks (48) are not a multiple of 32 wide (no element bits)"
    monkeypatch.setattr(sm90_common, "device_info", lambda index: helpers.A100)
    assert fwd.unfit(call()).startswith("a compute-capability 9.0 GPU")
    for family in serving("fwd")[1:-1]:  # sm80_fwd: reads no block masks
        assert family.unfit(call()).startswith("no block masks (until")


def test_a_sparse_instance_is_never_launched_without_a_mask_it_reads():
    import dataclasses

    from flashgen.runtime.families.sm90_common import check_compiled  # what every launch runs first

    helpers = _runtime_helpers()
    kernels = {b.name: b for b in sparse_kernels()}
    sparse, plain = (kernels["sm90_fwd_f16_k64_q128x128_s2_sparse_sm90a"], kernels["sm90_fwd_f16_k64_q128x128_s2_sm90a"])
    call = helpers.fake_call("fwd")
    with pytest.raises(ValueError, match=r"_sparse_sm90a is built with block-mask lists \(compiled in\); the call has none"):
        check_compiled(sparse, call)
    masked = dataclasses.replace(call, block_mask=block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, device="cpu"))
    with pytest.raises(ValueError, match=r"_s2_sm90a is built without block-mask lists \(compiled in\); the call has one"):
        check_compiled(plain, masked)
    small = dataclasses.replace(call, block_mask=block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, block=(64, 64),
                                                            device="cpu"))
    with pytest.raises(ValueError, match=r"reads 128 x 128 mask blocks; the block mask's are 64 x 64"):
        check_compiled(sparse, small)
    check_compiled(sparse, masked)
    check_compiled(plain, call)


def test_sparse_fields_step_through_the_mask_rows_and_stop_where_it_broadcasts():
    from types import SimpleNamespace

    from flashgen.runtime.families.sm90_fwd import sparse_fields

    def arrays(**shapes):
        return SimpleNamespace(data=SimpleNamespace(ptr=id(shapes)))

    for (B, H), (batch_step, head_step) in {(1, 1): (0, 0), (2, 1): (3, 0), (1, 4): (0, 3), (2, 4): (12, 3)}.items():
        bm = SimpleNamespace(shape=(B, H, 300, 700), num_blocks=(3, 6), **{
            name: arrays() for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                                        "partial_index", "partial_bits")})
        bm.kernel_arrays = lambda bm=bm: BlockMask.kernel_arrays(bm)  # the real order, on the fake's arrays
        fields = sparse_fields(bm)
        assert (fields["sparse_batch_step"], fields["sparse_head_step"], fields["sparse_key_blocks"]) == \
            (batch_step, head_step, 6)
        assert fields["sparse_bits"] == bm.partial_bits.data.ptr and fields["sparse_tiles"] == bm.partial_index.data.ptr
    assert sparse_fields(None) == {}
