"""flashgen.block_mask without a GPU: the builder runs on NumPy with device="cpu".

Every list is checked against a brute-force classification of the dense mask, block by block
(loops are fine at these sizes; the builder itself has none), at densities from nothing to
everything, for masks given as functions and as arrays, ragged sizes, M != N, and B/H
broadcast.  Nothing here imports CuPy.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from flashgen.runtime import block_masks
from flashgen.runtime.block_masks import BlockMask, block_mask


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    """`import cupy` fails inside every test: device="cpu" must not need it."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def dense(mask, B, H, M, N):
    """The element mask as a boolean [B, H, M, N] NumPy array."""
    if callable(mask):
        b, h = np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1)
        q, kv = np.arange(M).reshape(1, 1, M, 1), np.arange(N).reshape(1, 1, 1, N)
        mask = mask(b, h, q, kv)
    return np.broadcast_to(np.asarray(mask), (B, H, M, N))


def brute_force(visible, block):
    """{(b, h, qb): (full key blocks, partial key blocks)} by looking at every block."""
    B, H, M, N = visible.shape
    bm, bn = block
    found = {}
    for b in range(B):
        for h in range(H):
            for qb in range(-(-M // bm)):
                full, partial = [], []
                for kb in range(-(-N // bn)):
                    tile = visible[b, h, qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn]
                    if tile.all():
                        full.append(kb)
                    elif tile.any():
                        partial.append(kb)
                found[b, h, qb] = (full, partial)
    return found


def assert_lists(bm: BlockMask, visible):
    """The forward and transposed lists agree with ``brute_force``; each row is a permutation."""
    B, H, QB, KB = *bm.shape[:2], *bm.num_blocks
    for name, (num, idx) in {"kv": (bm.kv_num_blocks, bm.kv_indices),
                             "full_kv": (bm.full_kv_num_blocks, bm.full_kv_indices),
                             "q": (bm.q_num_blocks, bm.q_indices),
                             "full_q": (bm.full_q_num_blocks, bm.full_q_indices)}.items():
        rows, cols = (KB, QB) if name.endswith("q") else (QB, KB)
        assert num.dtype == np.int32 and idx.dtype == np.int32, name
        assert num.shape == (B, H, rows) and idx.shape == (B, H, rows, cols), name
        assert idx.flags.c_contiguous
        assert (np.sort(idx, axis=-1) == np.arange(cols)).all(), f"{name}: rows must be permutations"
    expected = brute_force(visible, bm.block)
    for (b, h, qb), (full, partial) in expected.items():
        n, nf = bm.kv_num_blocks[b, h, qb], bm.full_kv_num_blocks[b, h, qb]
        assert bm.kv_indices[b, h, qb, :n].tolist() == partial, (b, h, qb)
        assert bm.full_kv_indices[b, h, qb, :nf].tolist() == full, (b, h, qb)
    for b in range(B):
        for h in range(H):
            for kb in range(KB):
                partial = [qb for qb in range(QB) if kb in expected[b, h, qb][1]]
                full = [qb for qb in range(QB) if kb in expected[b, h, qb][0]]
                assert bm.q_indices[b, h, kb, :bm.q_num_blocks[b, h, kb]].tolist() == partial, (b, h, kb)
                assert bm.full_q_indices[b, h, kb, :bm.full_q_num_blocks[b, h, kb]].tolist() == full, (b, h, kb)
    visited = sum(len(f) + len(p) for f, p in expected.values())
    assert bm.density() == pytest.approx(visited / (B * H * QB * KB))


def causal(b, h, q, kv):
    return q >= kv


def window(left, right):
    return lambda b, h, q, kv: (kv >= q - left) & (kv <= q + right)


def documents(lengths):
    """A document mask: each query sees the keys of its own document (M == N == sum(lengths))."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    return lambda b, h, q, kv: doc[q] == doc[kv]


MASKS = {
    "nothing": lambda b, h, q, kv: np.zeros(np.broadcast_shapes(q.shape, kv.shape), dtype=bool),
    "everything": lambda b, h, q, kv: np.ones(np.broadcast_shapes(q.shape, kv.shape), dtype=bool),
    "causal": causal,
    "bottom-right": lambda b, h, q, kv: kv <= q + 9,
    "window": window(37, 5),
    "empty-rows": lambda b, h, q, kv: (q % 5 != 0) & (kv <= q),  # every fifth row sees no key
    "per-head": lambda b, h, q, kv: (kv <= q + 13 * h) & (kv % (b + 2) != 0),
}
SIZES = [(1, 1), (7, 7), (129, 129), (1, 1000), (1000, 7), (129, 300), (300, 129)]
BLOCKS = [(128, 128), (16, 32), (64, 16), (1, 1)]


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("M,N", SIZES)
def test_function_masks_classify_every_block(name, M, N):
    block = BLOCKS[(list(MASKS).index(name) + SIZES.index((M, N))) % len(BLOCKS)]
    if block == (1, 1) and M * N > 10_000:
        block = (16, 16)  # the brute force would take a while
    B, H = (2, 3) if name == "per-head" else (1, 2)
    bm = block_mask(MASKS[name], B, H, M, N, block=block, device="cpu")
    assert (bm.shape, bm.block, bm.device) == ((B, H, M, N), block, None)
    assert_lists(bm, dense(MASKS[name], B, H, M, N))


@pytest.mark.parametrize("M,N,block", [(1000, 1000, (128, 128)), (1000, 1000, (64, 64)), (999, 1000, (128, 64))])
def test_document_masks_with_8_documents(M, N, block):
    lengths = np.random.default_rng(M).multinomial(M - 8, np.ones(8) / 8) + 1  # 8 documents of >= 1 token
    mask = documents(lengths)
    if M != N:  # the last key (past the documents) joins the last document
        mask = (lambda b, h, q, kv, d=mask: d(b, h, q, np.minimum(kv, M - 1)))
    bm = block_mask(mask, 1, 1, M, N, block=block, device="cpu")
    assert_lists(bm, dense(mask, 1, 1, M, N))
    assert 0 < bm.density() < 1


def test_densities_at_the_extremes():
    assert block_mask(MASKS["nothing"], 2, 2, 300, 200, device="cpu").density() == 0
    everything = block_mask(MASKS["everything"], 2, 2, 300, 200, device="cpu")
    assert everything.density() == 1
    assert (everything.kv_num_blocks == 0).all() and (everything.full_kv_num_blocks == 2).all()
    # causal on whole blocks: the diagonal blocks are partial, those below it full
    bm = block_mask(causal, 1, 1, 1024, 1024, device="cpu")
    assert bm.kv_num_blocks.tolist() == [[[1] * 8]]
    assert bm.full_kv_num_blocks.tolist() == [[list(range(8))]]
    assert bm.density() == pytest.approx(36 / 64)


def test_ragged_blocks_count_only_their_existing_elements():
    """129 x 129 causal in 128-blocks: the last block pair holds one element (visible): full."""
    bm = block_mask(causal, 1, 1, 129, 129, device="cpu")
    assert bm.full_kv_indices[0, 0, 1, :bm.full_kv_num_blocks[0, 0, 1]].tolist() == [0, 1]
    assert bm.kv_num_blocks[0, 0].tolist() == [1, 0]


@pytest.mark.parametrize("shape", [(400, 300), (1, 1, 400, 300), (2, 1, 400, 300), (1, 3, 400, 300), (2, 3, 400, 300),
                                   (1, 300), (300,)])
def test_boolean_arrays_broadcast_to_B_H_M_N(shape):
    visible = np.random.default_rng(len(shape)).random(shape) < 0.01
    visible[..., :5] = True  # some full blocks too
    bm = block_mask(visible, 2, 3, 400, 300, block=(64, 32), device="cpu")
    assert bm.mask is visible
    assert_lists(bm, dense(visible, 2, 3, 400, 300))


def test_B_and_H_of_1_broadcast_and_index_arguments_have_the_documented_shapes():
    seen = []

    def mask(b, h, q, kv):
        seen.append((b.shape, h.shape, q.shape, kv.shape))
        return q >= kv

    bm = block_mask(mask, 1, 1, 300, 200, block=(128, 128), device="cpu")
    assert bm.kv_num_blocks.shape == (1, 1, 3)
    assert seen[0][:2] == ((1, 1, 1, 1), (1, 1, 1, 1)) and seen[0][3] == (1, 1, 1, 200)
    assert sum(s[2][2] for s in seen) == 300  # every query row once


def test_chunks_of_query_rows_give_the_same_lists(monkeypatch):
    """Long sequences are evaluated a few query blocks at a time, never as one [B, H, M, N]."""
    rows = []

    def mask(b, h, q, kv):
        rows.append(q.shape[2])
        return (kv <= q) & (kv >= q - 100 * (h + 1))

    whole = block_mask(mask, 2, 2, 1000, 700, block=(64, 64), device="cpu")
    assert rows == [1000]
    rows.clear()
    monkeypatch.setattr(block_masks, "CHUNK_ELEMENTS", 2 * 2 * 700 * 64 * 3)  # three query blocks per chunk
    chunked = block_mask(mask, 2, 2, 1000, 700, block=(64, 64), device="cpu")
    assert rows == [192] * 5 + [40]
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        assert (getattr(whole, name) == getattr(chunked, name)).all(), name
    assert (whole.to_dense() == chunked.to_dense()).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_to_dense_is_the_additive_mask(dtype):
    mask = MASKS["empty-rows"]
    bm = block_mask(mask, 1, 2, 130, 77, block=(32, 32), device="cpu")
    bias = bm.to_dense(dtype)
    visible = dense(mask, 1, 2, 130, 77)
    assert bias.shape == (1, 2, 130, 77) and bias.dtype == dtype and bias.flags.c_contiguous
    assert (bias[visible] == 0).all() and np.isneginf(bias[~visible]).all()
    assert np.isneginf(bias[:, :, ::5]).all(), "rows without a key stay all -inf in to_dense"


def test_the_fallback_bias_folds_the_causal_diagonal_and_names_the_empty_rows():
    """What the runtime's dense fallback runs on: the mask and a causal diagonal in one bias, and
    which rows see no key once both apply."""
    mask = MASKS["window"]  # keys q - 37 .. q + 5
    bm = block_mask(mask, 1, 1, 50, 30, block=(16, 16), device="cpu")
    bias, empty = bm.with_band(None, -20).additive(np.float32)  # also kv <= q - 20
    visible = dense(mask, 1, 1, 50, 30) & (np.arange(30) <= np.arange(50)[:, None] - 20)
    assert (empty == ~visible.any(-1)).all() and empty[0, 0, :20].all() and not empty[0, 0, 20:].any()
    assert (bias[visible] == 0).all() and np.isneginf(bias[~visible]).all()
    assert bias.strides[2] == 32 * 4, "rows padded to 8 elements, as example 41 reads a bias"


def test_the_fallback_bias_pads_its_rows_with_zeros(monkeypatch):
    """The kernels read a bias row's last keys as a 16-byte chunk that reaches into the row padding:
    it holds zeros, not what the allocation held before (initcheck flagged those reads)."""
    bm = block_mask(MASKS["window"], 1, 1, 50, 30, block=(16, 16), device="cpu")
    real_empty = np.empty
    monkeypatch.setattr(np, "empty", lambda *a, **k: np.full_like(real_empty(*a, **k), np.nan))  # poisoned
    bias, _ = bm.additive(np.float16)
    padded = np.lib.stride_tricks.as_strided(bias, bias.shape[:3] + (32,), bias.strides)
    assert (padded[..., 30:] == 0).all()


@pytest.mark.parametrize("args,exc,match", [
    (dict(B=0), ValueError, r"^B must be >= 1; got 0$"),
    (dict(H=-1), ValueError, r"^H must be >= 1; got -1$"),
    (dict(M=2.0), TypeError, r"^M must be an int; got 2.0$"),
    (dict(N=True), TypeError, r"^N must be an int; got True$"),
    (dict(block=128), TypeError, r"^block must be \(query rows, key columns\), e.g. \(128, 128\); got 128$"),
    (dict(block=(128, 0)), ValueError, r"^block's key columns must be >= 1; got 0$"),
    (dict(block=(-64, 64)), ValueError, r"^block's query rows must be >= 1; got -64$"),
    (dict(block=(64, 64, 1)), TypeError, r"^block must be"),
    (dict(device="cuda"), ValueError, r"^device must be None, a GPU index or 'cpu'; got 'cuda'$"),
    (dict(mask=np.ones((4, 6), np.float16)), TypeError,
     r"^a mask array must be boolean \(True: the key is visible\); got float16 \(an additive mask goes in attn_bias\)"),
    (dict(mask=np.ones((4, 5), bool)), ValueError,
     r"^the mask of shape \(4, 5\) does not broadcast to \[B, H, M, N\] = \(2, 3, 4, 6\)$"),
    (dict(mask=np.ones((3, 3, 4, 6), bool)), ValueError, r"^the mask of shape \(3, 3, 4, 6\) does not broadcast"),
    (dict(mask=np.ones((1, 2, 3, 4, 6), bool)), ValueError, r"does not broadcast"),
    (dict(mask=lambda b, h, q, kv: (q >= kv).astype(np.float32)), TypeError,
     r"^mask_fn must return a boolean array; it returned float32 \(compare"),
    (dict(mask=lambda b, h, q, kv: (q >= kv).reshape(-1)), ValueError,
     r"^mask_fn returned shape \(24,\) for rows 0:4, which does not broadcast to \[B, H, rows, N\] = \(2, 3, 4, 6\)"),
    (dict(mask=lambda b, h, q, kv: np.ones((2, 3, 4, 6, 1), bool)), ValueError, r"^mask_fn returned shape"),
    (dict(mask=[[True]]), TypeError, r"^with device='cpu' the mask must be a callable or a NumPy array; got list"),
])
def test_argument_errors(args, exc, match):
    call = {**dict(mask=causal, B=2, H=3, M=4, N=6, device="cpu"), **args}
    with pytest.raises(exc, match=match):
        block_mask(call.pop("mask"), **call)


def test_to_dense_refuses_other_dtypes():
    bm = block_mask(causal, 1, 1, 4, 4, device="cpu")
    with pytest.raises(TypeError, match=r"^dtype must be float32, float16 or bfloat16; got <class 'numpy.int32'>$"):
        bm.to_dense(np.int32)


def test_a_mask_built_on_the_host_is_frozen_and_says_what_it_is():
    bm = block_mask(causal, 1, 4, 256, 512, block=(64, 128), device="cpu")
    assert repr(bm) == "BlockMask(shape=(1, 4, 256, 512), block=(64, 128), device=None, band=None)"
    assert repr(bm.with_band(None, 256)).endswith("band=(None, 256))")  # a folded band says so
    assert bm.num_blocks == (4, 4) and bm.xp is np
    with pytest.raises(AttributeError):
        bm.block = (128, 128)


def test_without_cupy_a_gpu_mask_says_how_to_install_it():
    from flashgen.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="needs CuPy"):
        block_mask(causal, 1, 1, 4, 4)


# --- the runtime's dense fallback (block_fallback) over NumPy ---------------------------------
# CuPy's part in block_fallback is a handful of array functions and a stream; NumPy stands in for
# them, and an emulated example-41 kernel (which divides 0 by 0 on a row of -inf scores, as the
# real one does) stands in for the families.  The GPU tests run the real thing.

class HostStream:
    """A stream that is always finished: what block_fallback asks of CuPy's."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record(self):
        return "event"

    def wait_event(self, event):
        assert event == "event"


HOST_CUPY = SimpleNamespace(float32=np.float32, uint16=np.uint16, uint32=np.uint32, where=np.where, empty=np.empty,
                            cuda=SimpleNamespace(get_current_stream=HostStream))


def example41(call):
    """Forward (out [B, M, H, K], lse) or backward (dq, dk, dv) as example 41 computes them with
    a bias and a causal mask, in float64: P = exp(s - lse), so lse = +inf makes a row's P 0."""
    q, k, v = (x.astype(np.float64) for x in (call.q, call.k, call.v))
    s = np.einsum("bmhk,bnhk->bhmn", q, k) * call.p.scale + call.bias
    if call.p.mask:
        M, N = s.shape[2:]
        s = np.where(np.arange(N) <= np.arange(M)[:, None] + (N - M if call.p.mask == 2 else 0), s, -np.inf)
    with np.errstate(all="ignore"):
        if call.direction == "fwd":
            top = s.max(-1, keepdims=True)
            e = np.exp(s - np.where(np.isfinite(top), top, 0))
            out = np.einsum("bhmn,bnhk->bmhk", e / e.sum(-1, keepdims=True), v)  # 0/0 on rows of -inf
            lse = np.log(e.sum(-1)) + top[..., 0]
            return out.astype(call.q.dtype), lse.astype(np.float32)
        prob = np.exp(s - call.lse[..., None])
        do = call.grad_out.astype(np.float64)
        ds = prob * (np.einsum("bmhk,bnhk->bhmn", do, v) - np.einsum("bmhk,bmhk->bhm", do, call.out)[..., None])
        return (np.einsum("bhmn,bnhk->bmhk", ds, k) * call.p.scale, np.einsum("bhmn,bmhk->bnhk", ds, q) * call.p.scale,
                np.einsum("bhmn,bmhk->bnhk", prob, do))


def reference(q, k, v, do, visible, scale):
    """Attention over the visible keys in float64; a row without any: out 0, lse -inf, no gradient."""
    s = np.where(visible, np.einsum("bmhk,bnhk->bhmn", q, k) * scale, -np.inf)
    top = s.max(-1, keepdims=True)
    with np.errstate(all="ignore"):
        e = np.exp(s - np.where(np.isfinite(top), top, 0))
        prob = np.nan_to_num(e / e.sum(-1, keepdims=True))
        lse = np.log(e.sum(-1)) + top[..., 0]
    out = np.einsum("bhmn,bnhk->bmhk", prob, v)
    ds = prob * (np.einsum("bmhk,bnhk->bhmn", do, v) - np.einsum("bmhk,bmhk->bhm", do, out)[..., None])
    return out, lse, (np.einsum("bhmn,bnhk->bmhk", ds, k) * scale, np.einsum("bhmn,bmhk->bnhk", ds, q) * scale,
                      np.einsum("bhmn,bmhk->bnhk", prob, do))


@pytest.mark.parametrize("name,M,N,causal", [("empty-rows", 70, 50, None), ("window", 40, 90, 1), ("causal", 90, 40, 2),
                                             ("nothing", 9, 9, None), ("per-head", 33, 65, 1)])
def test_the_dense_fallback_gives_rows_without_keys_zeros_and_no_gradient(monkeypatch, name, M, N, causal):
    from flashgen.runtime import block_fallback
    from flashgen.runtime.validate import Call, Problem

    monkeypatch.setattr(block_fallback, "checked_bias", lambda cupy, bias, *args: (bias, False))  # CuPy's checks
    monkeypatch.setattr(block_fallback, "_warned", True)
    B, H, K, scale = 2, 3, 8, 0.4
    r = np.random.default_rng(M)
    q, do = (r.standard_normal((B, M, H, K)).astype(np.float32) for _ in range(2))
    k, v = (r.standard_normal((B, N, H, K)).astype(np.float32) for _ in range(2))
    bm = block_mask(MASKS[name], B, H, M, N, block=(16, 32), device="cpu")
    p = Problem(B, M, N=N, H=H, Hk=H, K=K, Kv=K, dtype="f32", device=0, mask=causal or 0, scale=scale, dropout_p=0.0,
                seed=0, offset=0, seqstart_q=None, seqstart_k=None, batches=B)
    call = Call("fwd", p, q, k, v, None, {"stream": None}, None, block_mask=bm)
    out, lse = block_fallback.forward(HOST_CUPY, call, lambda cupy, c: example41(c))
    visible = dense(MASKS[name], B, H, M, N)
    if causal:
        visible = visible & (np.arange(N) <= np.arange(M)[:, None] + (N - M if causal == 2 else 0))
    ro, rl, (rdq, rdk, rdv) = reference(*(x.astype(np.float64) for x in (q, k, v, do)), visible, scale)
    assert not np.isnan(out).any() and np.allclose(out, ro, atol=1e-5) and (np.isneginf(lse) == np.isneginf(rl)).all()
    assert np.allclose(lse[np.isfinite(rl)], rl[np.isfinite(rl)], rtol=1e-5)
    assert (out.transpose(0, 2, 1, 3)[np.isneginf(rl)] == 0).all()
    back = Call("bwd", p, q, k, v, None, {"stream": None}, None, out=out, grad_out=do, lse=lse, block_mask=bm)
    dq, dk, dv = block_fallback.backward(HOST_CUPY, back, lambda cupy, c: example41(c))
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert not np.isnan(g).any() and np.allclose(g, ref, atol=1e-5)
    assert (dq.transpose(0, 2, 1, 3)[np.isneginf(rl)] == 0).all()


def same_lists(a: BlockMask, b: BlockMask):
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices", "partial_index", "partial_bits"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), name


BANDS = [("top_left", None), ("bottom_right", None), (None, (40, 0)), (None, (None, 25)), ("top_left", (100, None)),
         ("bottom_right", (60, 30))]


def in_band(causal, window, M, N):
    """The band as the kernels' own masks apply it, written out: the window on the causal diagonal
    (top-left unless bottom_right), a causal mask capping its right side at the diagonal."""
    d = N - M if causal == "bottom_right" else 0
    left, right = window or (None, None)

    def visible(q, kv):
        keep = (kv <= q + d) if causal else (kv >= 0)
        if left is not None:
            keep = keep & (kv >= q + d - left)
        if right is not None:
            keep = keep & (kv <= q + d + right)
        return keep
    return visible


@pytest.mark.parametrize("causal, window", BANDS)
@pytest.mark.parametrize("M, N", [(300, 700), (700, 300), (257, 257)])
@pytest.mark.parametrize("block", [(128, 128), (64, 96)])
def test_a_causal_mask_and_window_fold_into_the_lists_as_if_the_mask_had_them(causal, window, M, N, block):
    """fold_band gives exactly the lists (bits too) of the mask built with the band in it, for a
    function mask and for an array mask; the folded mask is built once per band."""
    doc = np.repeat(np.arange(5), -(-max(M, N) // 5))
    band = in_band(causal, window, M, N)

    def documents(b, h, q, kv):
        return (doc[q] == doc[kv]) | ((h == 1) & (kv % 7 == 0))

    for mask in (documents, dense(documents, 1, 2, M, N)):
        bm = block_mask(mask, 1, 2, M, N, block=block, device="cpu")
        folded, kept_causal, kept_window = block_masks.fold_band(bm, causal, window)
        assert kept_causal is None and kept_window is None and folded.band is not None
        assert block_masks.fold_band(bm, causal, window)[0] is folded  # kept with the mask
        direct = block_mask(lambda b, h, q, kv: documents(b, h, q, kv) & band(q, kv), 1, 2, M, N, block=block,
                            device="cpu")
        same_lists(folded, direct)
        assert np.array_equal(folded.to_dense(), direct.to_dense())
        assert folded.density() <= bm.density()


def test_only_a_well_formed_band_beside_a_block_mask_is_folded():
    bm = block_mask(lambda b, h, q, kv: q >= 0, 1, 1, 64, 64, device="cpu")
    for args in ((bm, None, None), (bm, None, (None, None)), ("not a mask", "top_left", None),
                 (None, "top_left", (4, 0)), (bm, "bogus", None), (bm, None, (-1, 0)), (bm, None, (True, 0)),
                 (bm, None, "wide")):
        assert block_masks.fold_band(*args) == args  # validation names what is wrong


def test_arrays_as_converts_each_array_once_per_mask_and_kind():
    """A torch caller's plans key on torch views of a mask's arrays: made on the first call, then
    the same objects (a plan's signature and its pointers stay put)."""
    mask = block_mask(lambda b, h, i, j: j <= i, 1, 2, 256, 256, device="cpu")
    calls = []

    def convert(x):
        calls.append(x)
        return ("view", id(x))

    forward = mask.arrays_as("kernel_arrays", convert)
    assert forward == tuple(("view", id(x)) for x in mask.kernel_arrays())
    assert mask.arrays_as("kernel_arrays", convert) is forward and len(calls) == 6
    backward = mask.arrays_as("backward_arrays", convert)
    assert backward[:4] == tuple(("view", id(x)) for x in mask.backward_arrays()[:4]) and len(calls) == 12
    assert mask.with_band(None, 0).arrays_as("kernel_arrays", convert) is not forward  # a folded mask has its own
