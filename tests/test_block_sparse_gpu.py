"""sm90_fwd's and sm90_bwd's sparse instances on a GPU: block masks served without a dense bias,
against float64.

Every built sparse instance runs on document masks (8 documents), causal + sliding-window masks,
random block patterns with empty query blocks and rows, and all-full masks, at M, N in
{1, 7, 129, 1000} with M != N, B/H broadcast, grouped-query k/v and head dims below the tier,
into poisoned outputs.  Rows that see no key must come back as output 0 and lse -inf.  Through
the public functions: the sparse kernel is the one selected, the backward agrees with the
sparse forward's lse, and back-to-back calls with different masks each read their own (a replayed
plan points at the call's own mask).  The sparse backwards run on the same masks and sizes from a
float64 forward's output and lse: dq, dk, dv against float64, rows without keys dq 0, keys no query
sees dk = dv = 0.  Skips without a 9.0 GPU or without the sparse kernels built
(`flashgen build --arch sm90a --kernels '*sparse*'`).
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
from attention_reference import (  # noqa: E402
    BWD_TOL, FWD_TOL, gpu_marks, hopper_kernels, lse_err, poisoned_allocations, randn, reference,
    rel_err,
)

HAVE_GPU, pytestmark = gpu_marks()

import flashgen  # noqa: E402
from flashgen.runtime import block_fallback, validate  # noqa: E402
from flashgen.runtime.block_masks import block_mask, fold_band  # noqa: E402
from flashgen.runtime.families import sm90_bwd, sm90_fwd  # noqa: E402

SPARSE = [b for b in hopper_kernels("sm90_fwd") if b.spec.sparse]
needs_sparse = pytest.mark.skipif(not SPARSE, reason="needs a 9.0 GPU and sm90_fwd sparse kernels "
                                                      "(flashgen build --arch sm90a --kernels '*sparse*')")
SPARSE_BWD = [b for b in hopper_kernels("sm90_bwd") if b.spec.sparse]
needs_sparse_bwd = pytest.mark.skipif(not SPARSE_BWD, reason="needs a 9.0 GPU and sm90_bwd sparse kernels "
                                                              "(flashgen build --arch sm90a --kernels '*sparse*')")


@pytest.fixture(autouse=True)
def warned_already(monkeypatch):
    monkeypatch.setattr(block_fallback, "_warned", True)


def documents(n_docs, length, seed=0):
    """8 documents over ``length`` tokens (query and key positions share them), each >= 1 token."""
    n_docs = min(n_docs, length)
    sizes = np.random.default_rng(seed).multinomial(length - n_docs, np.ones(n_docs) / n_docs) + 1
    doc = cupy.asarray(np.repeat(np.arange(n_docs), sizes))
    return lambda b, h, q, kv: doc[q] == doc[kv]


def random_blocks(B, H, M, N, seed):
    """A boolean [B, H, M, N] mask: a random pattern of 128 x 128 blocks (full, partial with random
    elements, or hidden), query block 1 and every 5th row hidden entirely (rows without keys)."""
    rng = np.random.default_rng(seed)
    QB, KB = -(-M // 128), -(-N // 128)
    kind = rng.integers(0, 3, size=(B, H, QB, KB))  # 0 hidden, 1 full, 2 partial
    blocks = np.repeat(np.repeat(kind, 128, axis=2), 128, axis=3)[:, :, :M, :N]
    visible = (blocks == 1) | ((blocks == 2) & (rng.random((B, H, M, N)) < 0.3))
    visible[:, :, 128:256] = False
    visible[:, :, ::5] = False
    return cupy.asarray(visible)


def mask_of(name, B, H, M, N, seed=0):
    """(mask for block_mask, the mask's B and H)."""
    if name == "documents":
        return documents(8, max(M, N), seed), (1, 1)
    if name == "causal-window":
        return (lambda b, h, q, kv: (kv <= q) & (kv > q - 300)), (1, 1)
    if name == "random":
        return random_blocks(B, H, M, N, seed), (B, H)
    if name == "per-head":  # the batch broadcast, heads apart
        return (lambda b, h, q, kv: ((kv + 37 * h) % 256 < 200) & (kv <= q + 64 * h)), (1, H)
    return (lambda b, h, q, kv: (q >= 0) & (kv >= 0)), (1, 1)  # all full


MASKS = ("documents", "causal-window", "random", "per-head", "full")
SIZES = [(1, 1), (7, 7), (129, 1000), (1000, 129), (1000, 1000), (7, 129)]


def check(q, k, v, bm, out, lse, dtype):
    """out and lse against float64 with the mask dense; rows without keys exactly 0 and -inf."""
    group = q.shape[2] // k.shape[2]
    ro, rl = reference(q, cupy.repeat(k, group, axis=2), cupy.repeat(v, group, axis=2), bias=bm.to_dense(cupy.float32))
    assert rel_err(out, ro) < FWD_TOL[dtype] and lse_err(lse, rl) < FWD_TOL[dtype]
    empty = cupy.isneginf(rl)
    rows = cupy.ascontiguousarray(cupy.transpose(empty, (0, 2, 1)))
    assert bool((out[rows] == 0).all()) and bool(cupy.isneginf(lse[empty]).all()), "rows without keys"
    assert bool(cupy.isfinite(lse[~empty]).all())


@needs_sparse
@pytest.mark.parametrize("binary", SPARSE, ids=[b.name for b in SPARSE])
@pytest.mark.parametrize("name", MASKS)
def test_every_sparse_instance_matches_float64(binary, name):
    spec = binary.spec
    for i, (M, N) in enumerate(SIZES):
        rng = np.random.default_rng(1000 * i + len(name))
        B, H, K = 2, 3, spec.max_k - (24 if i % 2 else 0)  # odd sizes: a head dim below the tier
        q, k, v = (randn(rng, (B, S, H, K), spec.dtype) for S in (M, N, N))
        mask, (mb, mh) = mask_of(name, B, H, M, N, seed=i)
        bm = block_mask(mask, mb, mh, M, N)
        call = validate.forward_call(q, k, v, {"block_mask": bm}, flashgen.attention_forward)
        with poisoned_allocations():
            out, lse = sm90_fwd.RUNTIME.launch(call, binary)
        check(q, k, v, bm, out, lse, spec.dtype)
        padded = lse.base
        assert bool((padded[:, :, M:] == np.inf).all()), "lse padding rows are +inf"


@needs_sparse
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("K", [64, 128])
def test_the_public_forward_runs_sparse_and_the_backward_agrees(dtype, K):
    rng = np.random.default_rng(K)
    B, H, Hk, M, N = 2, 4, 2, 1000, 700
    q, do = randn(rng, (B, M, H, K), dtype), randn(rng, (B, M, H, K), dtype)
    k, v = randn(rng, (B, N, Hk, K), dtype), randn(rng, (B, N, Hk, K), dtype)
    bm = block_mask(random_blocks(1, H, M, N, 5), 1, H, M, N)
    rows = flashgen.explain(q, k, v, block_mask=bm)
    chosen = [name for name, _, verdict in rows if verdict == "selected"]
    assert chosen == [f"sm90_fwd_{dtype}_k{K}_q128x128_s2_sparse_sm90a"], rows
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, block_mask=bm)
    check(q, k, v, bm, out, lse, dtype)
    try:
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm)
    except flashgen.UnsupportedError as e:
        pytest.skip(f"no backward kernel built for the dense fallback: {e}")
    _, rl, (rdq, rdk, rdv, _) = reference(q, k, v, grad_out=do, bias=bm.to_dense(cupy.float32))
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, ref, zero_scale=np.sqrt(K)) < BWD_TOL[dtype]
    empty = cupy.ascontiguousarray(cupy.transpose(cupy.isneginf(rl), (0, 2, 1)))
    assert bool((dq[empty] == 0).all()), "rows without keys get no gradient"


def masks_of_one_signature():
    """Five masks over 600 x 600 scores: three of documents with partial blocks, and two whose
    documents end on block boundaries (no partial block), whose arrays have the same shapes and
    different contents."""
    aligned = [cupy.asarray(np.searchsorted(cuts, np.arange(600), side="right")) for cuts in ([256], [128, 384])]
    masks = [block_mask(documents(8, 600, seed), 1, 1, 600, 600) for seed in range(3)]
    return masks + [block_mask(lambda b, h, i, j, doc=doc: doc[i] == doc[j], 1, 1, 600, 600) for doc in aligned]


@needs_sparse
def test_back_to_back_masks_of_one_signature_each_read_their_own(monkeypatch):
    """Same shapes, strides and options, different masks: a call replays the launch plan its
    signature left (the second round launches nothing through the full path) with its own mask's
    arrays, among them two masks whose arrays have the same shapes (documents on block
    boundaries: no partial block) and different contents."""
    rng = np.random.default_rng(9)
    q, k, v = (randn(rng, (1, 600, 2, 64), "f16") for _ in range(3))
    masks = masks_of_one_signature()
    assert masks[-1].partial_bits.shape == masks[-2].partial_bits.shape  # one signature, two contents
    assert not int(masks[-1].kv_num_blocks.sum()) and not int(masks[-2].kv_num_blocks.sum())  # no partial block
    launches = []
    full_path = sm90_fwd.RUNTIME.launch
    monkeypatch.setattr(sm90_fwd.RUNTIME, "launch", lambda call, binary: launches.append(1) or full_path(call, binary))
    for round_ in range(2):
        for bm in masks:
            out, lse = flashgen.attention_forward(q, k, v, block_mask=bm)
            check(q, k, v, bm, out, lse, "f16")
        if round_ == 0:
            first_round = len(launches)
    assert first_round <= len(masks) - 1 and len(launches) == first_round  # the aligned pair shares a plan


@needs_sparse
def test_other_block_sizes_go_dense_and_explain_says_why():
    rng = np.random.default_rng(11)
    q = randn(rng, (1, 300, 2, 64), "f16")
    small = block_mask(lambda b, h, q_, kv: kv <= q_ + 3, 1, 1, 300, 300, block=(64, 64))
    rows = flashgen.explain(q, q, q, block_mask=small)
    assert any(verdict.startswith("reads 128 x 128 mask blocks") for _, _, verdict in rows), rows


@needs_sparse
@pytest.mark.parametrize("causal, window, M, N", [("top_left", None, 700, 300), ("bottom_right", None, 300, 700),
                                                  ("bottom_right", None, 1000, 1000), (None, (200, 0), 1000, 700),
                                                  ("top_left", (150, None), 700, 1000)])
def test_a_causal_mask_or_window_beside_a_block_mask_is_folded_in_and_runs_sparse(monkeypatch, causal, window, M, N):
    """The public calls fold ``causal`` and ``window`` into the mask (once per mask and band): the
    sparse instances serve forward and backward, with float64's answer for the mask and the band."""
    rng = np.random.default_rng(M + N)
    q, do = randn(rng, (2, M, 4, 64), "f16"), randn(rng, (2, M, 4, 64), "f16")
    k, v = randn(rng, (2, N, 2, 64), "f16"), randn(rng, (2, N, 2, 64), "f16")
    bm = block_mask(documents(5, max(M, N), seed=3), 1, 1, M, N)
    folded = fold_band(bm, causal, window)[0]
    rows = flashgen.explain(q, k, v, block_mask=bm, causal=causal, window=window)
    assert [n for n, _, verdict in rows if verdict == "selected"][0].endswith("_sparse_sm90a"), rows
    launched = []
    for runtime in (sm90_fwd.RUNTIME, sm90_bwd.RUNTIME):
        monkeypatch.setattr(runtime, "launch", lambda call, b, full=runtime.launch: launched.append(b.name) or full(call, b))
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, block_mask=bm, causal=causal, window=window)
    check(q, k, v, folded, out, lse, "f16")
    assert len(launched) == 1 and "sparse" in launched[0], launched
    if SPARSE_BWD:
        with poisoned_allocations():
            grads = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm, causal=causal, window=window)
        check_backward(q, k, v, do, folded, out, grads, "f16")
        assert len(launched) == 2 and "sparse" in launched[1], launched


def check_backward(q, k, v, do, bm, out, grads, dtype):
    """dq, dk, dv against float64 (delta from the rounded ``out``, as the kernels take it); rows without
    keys exactly dq 0, keys that no query of their k/v group sees exactly dk = dv = 0."""
    bias = bm.to_dense(cupy.float32)
    _, rl, ref = reference(q, k, v, grad_out=do, bias=bias, out_for_delta=out)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.shape == r.shape and rel_err(g, r, zero_scale=np.sqrt(q.shape[3])) < BWD_TOL[dtype], name
    empty = cupy.ascontiguousarray(cupy.transpose(cupy.isneginf(rl), (0, 2, 1)))
    assert bool((grads[0][empty] == 0).all()), "rows without keys get no gradient"
    group = q.shape[2] // k.shape[2]
    seen = cupy.isfinite(cupy.broadcast_to(bias, rl.shape + (k.shape[1],))).any(axis=2)  # [B, H, N]
    unseen = ~seen.reshape(seen.shape[0], k.shape[2], group, -1).any(axis=2).transpose(0, 2, 1)  # [B, N, Hk]
    for g in grads[1:]:
        assert bool((g[unseen] == 0).all()), "keys no query sees get no gradient"


def float64_forward(q, k, v, bm):
    """The forward's out (in q's dtype) and lse as a backward takes them, from float64."""
    group = q.shape[2] // k.shape[2]
    ro, rl = reference(q, cupy.repeat(k, group, axis=2), cupy.repeat(v, group, axis=2), bias=bm.to_dense(cupy.float32))
    return cupy.ascontiguousarray(ro.astype(q.dtype)), cupy.ascontiguousarray(rl.astype(cupy.float32))  # as a forward writes them


@needs_sparse_bwd
@pytest.mark.parametrize("binary", SPARSE_BWD, ids=[b.name for b in SPARSE_BWD])
@pytest.mark.parametrize("name", MASKS)
def test_every_sparse_backward_matches_float64(binary, name):
    spec = binary.spec
    for i, (M, N) in enumerate(SIZES):
        rng = np.random.default_rng(2000 * i + len(name))
        B, H, Hk, K = 2, 4, (2 if i % 2 else 4), spec.max_k - (24 if i % 2 else 0)  # odd sizes: GQA, head dim below
        q, do = randn(rng, (B, M, H, K), spec.dtype), randn(rng, (B, M, H, K), spec.dtype)
        k, v = randn(rng, (B, N, Hk, K), spec.dtype), randn(rng, (B, N, Hk, K), spec.dtype)
        mask, (mb, mh) = mask_of(name, B, H, M, N, seed=i)
        bm = block_mask(mask, mb, mh, M, N)
        out, lse = float64_forward(q, k, v, bm)
        call = validate.backward_call(do, q, k, v, out, lse, {"block_mask": bm}, flashgen.attention_backward)
        with poisoned_allocations():
            grads = sm90_bwd.RUNTIME.launch(call, binary)
        check_backward(q, k, v, do, bm, out, grads, spec.dtype)


@needs_sparse_bwd
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("K", [64, 128])
def test_the_public_backward_runs_sparse_and_deterministic_goes_dense(dtype, K):
    rng = np.random.default_rng(K + 1)
    B, H, Hk, M, N = 2, 4, 1, 700, 1000
    q, do = randn(rng, (B, M, H, K), dtype), randn(rng, (B, M, H, K), dtype)
    k, v = randn(rng, (B, N, Hk, K), dtype), randn(rng, (B, N, Hk, K), dtype)
    bm = block_mask(random_blocks(1, H, M, N, 7), 1, H, M, N)
    rows = flashgen.explain(q, k, v, block_mask=bm, backward=True)
    tile = "q128x128" if K == 64 else "q64x128"
    assert [n for n, _, verdict in rows if verdict == "selected"] == [f"sm90_bwd_{dtype}_k{K}_{tile}_s2_sparse_sm90a"]
    out, lse = float64_forward(q, k, v, bm)
    launches = []
    full_path = sm90_bwd.RUNTIME.launch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sm90_bwd.RUNTIME, "launch", lambda call, b: launches.append(b.name) or full_path(call, b))
        for _ in range(2):  # the second call replays the first's launch plan
            with poisoned_allocations():
                grads = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm)
            check_backward(q, k, v, do, bm, out, grads, dtype)
    assert launches == [f"sm90_bwd_{dtype}_k{K}_{tile}_s2_sparse_sm90a"]
    try:
        grads = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm, deterministic=True)
    except flashgen.UnsupportedError as e:
        pytest.skip(f"no example-41 kernel built for the dense fallback: {e}")
    check_backward(q, k, v, do, bm, out, grads, dtype)


@needs_sparse_bwd
def test_back_to_back_backwards_of_one_signature_each_read_their_own(monkeypatch):
    """The backward's plans as the forward's: the second round replays every call's plan with the
    call's own mask (the transposed lists end the key), two masks with arrays of one shape included."""
    rng = np.random.default_rng(19)
    q, k, v, do = (randn(rng, (1, 600, 2, 64), "f16") for _ in range(4))
    masks = masks_of_one_signature()
    forwards = [float64_forward(q, k, v, bm) for bm in masks]
    launches = []
    full_path = sm90_bwd.RUNTIME.launch
    monkeypatch.setattr(sm90_bwd.RUNTIME, "launch", lambda call, binary: launches.append(1) or full_path(call, binary))
    for round_ in range(2):
        for bm, (out, lse) in zip(masks, forwards):
            with poisoned_allocations():
                grads = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm)
            check_backward(q, k, v, do, bm, out, grads, "f16")
        if round_ == 0:
            first_round = len(launches)
    assert first_round <= len(masks) - 1 and len(launches) == first_round  # the aligned pair shares a plan
