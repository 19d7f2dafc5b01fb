"""Block-sparse sm90_bwd without a GPU: its sparse instances, which block-mask backwards it takes or
refuses (and why), its Params fields, and the kernel's walk over a mask's lists modelled step by step.

The model (``kernel_view``) replays sm90_bwd.h's SparseWalk and the bit test of consume() thread by
thread from the wgmma accumulator layout; for document, causal + window, random and all-full masks at
ragged sizes it must see exactly the dense mask, with 128- and 64-query steps.  Nothing here imports CuPy.
"""
from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from flashgen.runtime.block_masks import BlockMask, block_mask
from flashgen.spec.sm90_bwd import Sm90Bwd

from test_block_sparse_cpu import MASKS, dense


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)


def test_sparse_instances_are_one_per_dtype_and_tier_after_the_plain_ones():
    sparse = [k for k in Sm90Bwd.default_set() if k.sparse]
    assert {(k.dtype, k.max_k, k.block_m, k.block_n) for k in sparse} == {
        (d, 64, 128, 128) for d in ("f16", "bf16")} | {(d, 128, 64, 128) for d in ("f16", "bf16")}
    assert all((k.stages, k.band, k.softcap, k.bias) == (2, False, False, False) for k in sparse)
    assert all(k.name.endswith("_s2_sparse_sm90a")
               and k.cpp_type.endswith(", false, false, false, true, false, flashgen::sm90::NoScoreMod>") for k in sparse)
    assert all(k.cpp_type.endswith((", false, false, flashgen::sm90::NoScoreMod>", ", false, false, ScoreMod_alibi>"))
               for k in Sm90Bwd.default_set() if not (k.sparse or k.dropout))
    order = sorted(Sm90Bwd.default_set(), key=lambda k: k.priority)
    for k in sparse:  # a plain call never reaches one
        assert not any(o.dtype == k.dtype and not (o.band or o.softcap or o.bias or o.sparse)
                       for o in order[order.index(k):])


@pytest.mark.parametrize("change, reason", [
    ({"band": True}, "sparse without band"), ({"softcap": True}, "sparse without soft-capping"),
    ({"bias": True}, "sparse without bias"),
    ({"max_k": 256, "block_m": 64, "block_n": 64}, "sparse on tiers 64 and 128"),
    ({"stages": 2, "block_m": 64}, "a 64-query step of head dim 64")])
def test_every_other_sparse_candidate_names_its_rule(change, reason):
    kept = next(k for k in Sm90Bwd.default_set() if k.sparse and k.max_k == 64)
    assert dataclasses.replace(kept, **change).pruned_by().reason.startswith(reason)
    assert all(k.pruned_by() is not None for k in Sm90Bwd.candidates() if k.sparse and k not in Sm90Bwd.default_set())


def test_params_end_with_the_mask_fields_then_the_mods_and_sparse_fields_fill_them():
    from flashgen.runtime.families.sm90_bwd import sparse_fields

    from flashgen.spec.sm90_tile import MOD_FIELDS

    assert Sm90Bwd.ABI[-len(MOD_FIELDS):] == MOD_FIELDS, "a score mod's fields come last"
    names = [f.name for f in Sm90Bwd.ABI[:-len(MOD_FIELDS)]]
    assert names[-14:-4] == ["sparse_partial_counts", "sparse_partial_blocks", "sparse_full_counts",
                           "sparse_full_blocks", "sparse_tiles", "sparse_bits", "sparse_batch_step",
                           "sparse_head_step", "sparse_query_blocks", "sparse_key_blocks"]
    for (B, H), (batch_step, head_step) in {(1, 1): (0, 0), (2, 1): (1, 0), (1, 4): (0, 1), (2, 4): (4, 1)}.items():
        arrays = {name: SimpleNamespace(data=SimpleNamespace(ptr=1000 + i)) for i, name in enumerate(
            ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "partial_index", "partial_bits"))}
        bm = SimpleNamespace(shape=(B, H, 300, 700), num_blocks=(3, 6), **arrays)
        bm.backward_arrays = lambda bm=bm: BlockMask.backward_arrays(bm)  # the real order, on the fake's arrays
        fields = sparse_fields(bm)
        assert set(fields) <= set(names)
        assert [fields[n] for n in names[-14:-4]] == [1000, 1001, 1002, 1003, 1004, 1005, batch_step, head_step, 3, 6]
    assert sparse_fields(None) == {}


# --- the kernel's walk and bit test, modelled -----------------------------------------------------

def walk(bm, batch, head, n_block, block_m):
    """SparseWalk for one query head: (m_block, tile) per step, as the producer and consumers take them."""
    B, H = bm.shape[:2]
    b, h = (batch if B > 1 else 0), (head if H > 1 else 0)
    steps_per_block, M = 128 // block_m, bm.shape[2]
    partial, full = int(bm.q_num_blocks[b, h, n_block]), int(bm.full_q_num_blocks[b, h, n_block])
    listed = list(bm.q_indices[b, h, n_block, :partial]) + list(bm.full_q_indices[b, h, n_block, :full])
    for i, q_block in enumerate(listed):
        tile = int(bm.partial_index[b, h, q_block, n_block]) if i < partial else -1
        for half in range(steps_per_block):
            m_block = q_block * steps_per_block + half
            if half == 0 or m_block * block_m < M:
                yield m_block, tile


def kernel_view(bm, batch, head, n_block, block_m):
    """bool [M, 128]: which (query, key of the block) the CTA of key block n_block counts as visible for
    ``head``: steps it never takes are hidden, full steps all visible, partial ones by the bits each
    thread reads for its accumulator registers (consume(): key key_row + 8 ((r / 2) % 2), query
    (r / 4) * 8 + col0 + r % 2, word key_row / 32 of the query's row, bit key_row % 32 + 8 ((r / 2) % 2))."""
    M = bm.shape[2]
    seen = np.zeros((-(-M // block_m) * block_m, 128), dtype=bool)
    for m_block, tile in walk(bm, batch, head, n_block, block_m):
        rows = bm.partial_bits[max(tile, 0)][m_block % (128 // block_m) * block_m:][:block_m].reshape(-1)
        for tid in range(256):  # two consumer warpgroups of 64 keys
            lane, key_row = tid % 32, 64 * (tid // 128) + 16 * (tid // 32 % 4) + tid % 32 // 4
            for r in range(block_m // 2):
                query, key = (r // 4) * 8 + 2 * (lane % 4) + r % 2, key_row + (r // 2) % 2 * 8
                word = rows[query * 4 + key_row // 32]
                visible = tile < 0 or (int(word) >> (key_row % 32 + (r // 2) % 2 * 8)) & 1
                assert not seen[m_block * block_m + query, key], "each element once per head"
                seen[m_block * block_m + query, key] = visible
    return seen[:M]


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("M, N", [(1, 1), (7, 300), (129, 1000), (300, 129)])
@pytest.mark.parametrize("block_m", [128, 64])
def test_the_kernels_walk_and_bits_see_the_dense_mask(name, M, N, block_m):
    fn = MASKS[name](M, N)
    B, H = (1, 3) if name == "per_head" else (2, 1)
    bm = block_mask(fn, B, H, M, N, device="cpu")
    want = dense(fn, B, H, M, N)
    for b in range(B):
        for h in range(H):
            for n_block in range(bm.num_blocks[1]):
                keys = slice(n_block * 128, min(N, (n_block + 1) * 128))  # keys past N: the kernel's bounds mask
                seen = kernel_view(bm, b, h, n_block, block_m)[:, :keys.stop - keys.start]
                np.testing.assert_array_equal(seen, want[b, h, :, keys])


def test_a_64_query_step_past_the_last_query_is_never_taken():
    bm = block_mask(lambda b, h, q, kv: q >= 0, 1, 1, 50, 300, device="cpu")
    assert [list(walk(bm, 0, 0, n, 64)) for n in range(3)] == [[(0, -1)]] * 3
    bm = block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 150, 100, device="cpu")  # partial, then full
    assert list(walk(bm, 0, 0, 0, 64)) == [(0, 0), (1, 0), (2, -1)]
    assert list(walk(bm, 0, 0, 0, 128)) == [(0, 0), (1, -1)]


# --- which block-mask backwards sm90_bwd takes -----------------------------------------------------

def bwd_kernels():
    """The f16 sm90_bwd instances with the constants selection reads from their cubins."""
    return [SimpleNamespace(spec=k, name=k.name, constants={"max_k": k.max_k, "alignment": 8, "block_m": k.block_m,
                                                            "block_n": k.block_n, "mask_rows": 128,
                                                            "shared_memory_bytes": 200 * 1024})
            for k in Sm90Bwd.default_set() if k.dtype == "f16"]


@pytest.mark.parametrize("K, block, expected", [
    (64, (128, 128), "sm90_bwd_f16_k64_q128x128_s2_sparse_sm90a"),
    (40, (128, 128), "sm90_bwd_f16_k64_q128x128_s2_sparse_sm90a"),
    (96, (128, 128), "sm90_bwd_f16_k128_q64x128_s2_sparse_sm90a"),
    (128, (128, 128), "sm90_bwd_f16_k128_q64x128_s2_sparse_sm90a"),
    (192, (128, 128), None), (128, (64, 128), None), (64, (128, 64), None)])
def test_selection_matches_the_mask_block_with_mask_rows_from_the_cubin(K, block, expected):
    from flashgen.runtime.select import Request, rejection
    from runtime_fakes import H100

    req = Request("sm90_bwd", "f16", K, K, 8, False, False, H100, compiled_bias=True, block_sparse=block)
    kernels = bwd_kernels()
    assert next((b.name for b in kernels if rejection(b, req) is None), None) == expected
    if expected is None and K <= 128:
        why = rejection(next(b for b in kernels if b.name == "sm90_bwd_f16_k128_q64x128_s2_sparse_sm90a"), req)
        assert why == f"reads 128 x 128 mask blocks; the block mask's are {block[0]} x {block[1]}"
    plain = dataclasses.replace(req, block_sparse=None)
    assert "sparse" not in next(b.name for b in kernels if rejection(b, plain) is None)


def test_sm90_bwd_takes_block_masks_it_reads_and_says_why_not_otherwise(monkeypatch):
    import runtime_fakes as helpers
    from flashgen.runtime.families import serving, sm90_bwd, sm90_common

    monkeypatch.setattr(sm90_common, "device_info", lambda index: helpers.H100)
    mask = block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, device="cpu")
    bwd = sm90_bwd.RUNTIME
    assert [f.name for f in serving("bwd") if f.reads_block_masks] == ["sm90_bwd"]

    def call(deterministic=False, **options):
        return dataclasses.replace(helpers.fake_call("bwd", deterministic=deterministic, **options), block_mask=mask)

    assert bwd.unfit(call()) is None and bwd.request(call()).block_sparse == (128, 128)
    for options, why in (({"causal": "top_left"}, "a block mask with a causal mask or window not folded"),
                         ({"window": (3, 0)}, "a block mask with a causal mask or window not folded"),
                         ({"bias": helpers.FakeArray((2, 3, 5, 7), strides=(120, 40, 8, 1))},
                          "a block mask with attn_bias: the sparse kernels have no bias"),
                         ({"softcap": 5.0}, "a block mask with softcap: the sparse backward has no soft-capping"),
                         ({"deterministic": True}, "a block mask with deterministic=True: the sparse backward adds "
                                                   "dQ in no fixed order")):
        assert bwd.unfit(call(**options)).startswith(why), options
    monkeypatch.setattr(sm90_common, "device_info", lambda index: helpers.A100)
    assert bwd.unfit(call()).startswith("a compute-capability 9.0 GPU")


def test_a_sparse_backward_is_never_launched_on_calls_it_cannot_run():
    import runtime_fakes as helpers
    from flashgen.runtime.families import sm90_bwd

    kernels = {b.name: b for b in bwd_kernels()}
    sparse, plain = kernels["sm90_bwd_f16_k128_q64x128_s2_sparse_sm90a"], kernels["sm90_bwd_f16_k128_q64x128_s2_sm90a"]
    call = helpers.fake_call("bwd", deterministic=False)
    masked = dataclasses.replace(call, block_mask=block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, device="cpu"))
    check = sm90_bwd.RUNTIME.check_launch
    with pytest.raises(ValueError, match=r"_sparse_sm90a is built with block-mask lists \(compiled in\); the call has"):
        check(call, sparse)
    with pytest.raises(ValueError, match=r"_s2_sm90a is built without block-mask lists \(compiled in\); the call has"):
        check(masked, plain)
    ordered = dataclasses.replace(masked, options={"deterministic": True})
    with pytest.raises(ValueError, match=r"_sparse_sm90a adds dQ in no fixed order: deterministic=True is not for it"):
        check(ordered, sparse)
    small = dataclasses.replace(call, block_mask=block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, block=(64, 128),
                                                            device="cpu"))
    with pytest.raises(ValueError, match=r"reads 128 x 128 mask blocks; the block mask's are 64 x 128"):
        check(small, sparse)
    check(masked, sparse)
    check(call, plain)
