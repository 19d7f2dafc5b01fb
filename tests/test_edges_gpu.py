"""Numerics at the edges (GPU): rows that see no key, empty sequences, huge logits, NaN inputs.

Documented behaviour (README, RELIABILITY.md): a query that sees no key gets
output 0 and lse -inf (a softmax over nothing) and contributes no gradient;
large logits stay finite (the online softmax subtracts the running max); a NaN
in an input row poisons that row's output only.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    HAVE_GPU = False
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")]

import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    BWD_TOL, FWD_TOL, lse_err, poisoned_allocations, randn, reference, rel_err,
)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_bottom_right_rows_without_keys(dtype):
    r = np.random.default_rng(1)
    B, M, N, H, K = 2, 200, 70, 3, 64
    q, k, v, do = (randn(r, (B, S, H, K), dtype) for S in (M, N, N, M))
    bias = randn(r, (B, H, M, N), dtype)
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, causal="bottom_right", attn_bias=bias)
        dq, dk, dv, db = flashgen.attention_backward(do, q, k, v, out, lse, causal="bottom_right", attn_bias=bias,
                                                     bias_requires_grad=True)
    skip = M - N
    assert bool((out[:, :skip] == 0).all()) and bool(cupy.isneginf(lse[:, :, :skip]).all())
    assert bool((dq[:, :skip] == 0).all()) and bool((db[:, :, :skip] == 0).all())
    ro, rl, (rdq, rdk, rdv, rdb) = reference(q, k, v, bias=bias, causal="bottom_right", grad_out=do)
    assert rel_err(out, ro) < FWD_TOL[dtype] and lse_err(lse, rl) < FWD_TOL[dtype]
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv), (db, rdb)):
        assert rel_err(g, ref) < BWD_TOL[dtype]


def test_rows_without_keys_leave_an_odd_number_of_lse_rows():
    """551 queries, 256 keys, bottom-right: the first 295 see no key, and the backward of the
    other 256 starts 295 floats into the forward's lse (4-byte aligned), which the example-41
    backward (head dim 356: no other family) must not read in 8-byte vectors as it is
    (fuzz seed 25 case 738: CUDA_ERROR_MISALIGNED_ADDRESS)."""
    r = np.random.default_rng(6)
    M, N, K = 551, 256, 356
    q, k, v, do = (randn(r, (1, S, 1, K), "bf16") for S in (M, N, N, M))
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, causal="bottom_right")
        grads = flashgen.attention_backward(do, q, k, v, out, lse, causal="bottom_right")
    _, _, refs = reference(q, k, v, causal="bottom_right", grad_out=do)
    assert bool((grads[0][:, :M - N] == 0).all())
    for g, ref in zip(grads, refs):
        assert rel_err(g, ref) < BWD_TOL["bf16"]


def test_backward_takes_an_lse_at_any_alignment():
    """An lse view that starts 4 bytes into its buffer, taken twice (the second call replays the
    first's launch plan): the example-41 backward (f32) reads a copy, and the gradients match."""
    r = np.random.default_rng(7)
    B, M, N, H, K = 2, 128, 96, 3, 64
    q, k, v, do = (randn(r, (B, S, H, K), "f32") for S in (M, N, N, M))
    out, lse = flashgen.attention_forward(q, k, v)
    shifted = cupy.empty(lse.size + 1, dtype=cupy.float32)[1:].reshape(lse.shape)
    shifted[...] = lse
    _, _, refs = reference(q, k, v, grad_out=do)
    for _ in range(2):
        with poisoned_allocations():
            grads = flashgen.attention_backward(do, q, k, v, out, shifted)
        for g, ref in zip(grads, refs):
            assert rel_err(g, ref) < BWD_TOL["f32"]


def test_varlen_with_empty_sequences():
    r = np.random.default_rng(2)
    lens = [(5, 0), (0, 30), (35, 40), (1, 1)]  # queries without keys, keys without queries
    cu_q = np.concatenate([[0], np.cumsum([m for m, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([n for _, n in lens])]).astype(np.int32)
    q, do = randn(r, (1, cu_q[-1], 2, 64), "f16"), randn(r, (1, cu_q[-1], 2, 64), "f16")
    k, v = randn(r, (1, cu_k[-1], 2, 64), "f16"), randn(r, (1, cu_k[-1], 2, 64), "f16")
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal="top_left")
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                 causal="top_left")
    assert bool((out[0, 0:5] == 0).all()) and bool(cupy.isneginf(lse[0, :, :5]).all())
    assert bool((dq[0, 0:5] == 0).all())
    assert bool((dk[0, 0:30] == 0).all()) and bool((dv[0, 0:30] == 0).all())  # keys nobody queried
    for s in (2, 3):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        ro, rl, (rdq, rdk, rdv, _) = reference(q[:, qs], k[:, ks], v[:, ks], causal="top_left", grad_out=do[:, qs])
        assert rel_err(out[:, qs], ro) < FWD_TOL["f16"]
        assert lse_err(lse[s:s + 1, :, :lens[s][0]], rl) < FWD_TOL["f16"]
        for g, ref in ((dq[:, qs], rdq), (dk[:, ks], rdk), (dv[:, ks], rdv)):
            assert rel_err(g, ref) < BWD_TOL["f16"]


def test_varlen_bottom_right_with_more_queries_than_keys_is_refused():
    q = cupy.zeros((1, 10, 1, 64), dtype=cupy.float16)
    with pytest.raises(flashgen.UnsupportedError, match="sequence 0 has 6 queries and 4 keys"):
        flashgen.attention_forward(q, q, q, causal="bottom_right", cu_seqlens_q=np.array([0, 6, 10], np.int32),
                                   cu_seqlens_k=np.array([0, 4, 10], np.int32))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_large_logits_stay_finite(dtype):
    r = np.random.default_rng(3)
    q, k = randn(r, (1, 129, 2, 64), dtype, 30.0), randn(r, (1, 129, 2, 64), dtype, 30.0)
    v, do = randn(r, (1, 129, 2, 64), dtype), randn(r, (1, 129, 2, 64), dtype)
    out, lse = flashgen.attention_forward(q, k, v)
    dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse)
    for x in (out, lse, dq, dk, dv):
        assert bool(cupy.isfinite(x).all())
    ro, rl = reference(q, k, v)
    assert rel_err(out, ro) < 10 * FWD_TOL[dtype]  # near-one-hot softmax: rounding of the winning logit


def test_nan_in_a_query_row_stays_in_that_row():
    r = np.random.default_rng(4)
    q, k, v = (randn(r, (1, 64, 1, 64), "f16") for _ in range(3))
    q[0, 5, 0, 3] = np.nan
    out, lse = flashgen.attention_forward(q, k, v)
    bad_rows = cupy.nonzero(cupy.isnan(out).any(axis=(2, 3))[0])[0].get().tolist()
    assert bad_rows == [5]
    healthy, _ = flashgen.attention_forward(*(randn(r, (1, 64, 1, 64), "f16") for _ in range(3)))
    assert bool(cupy.isfinite(healthy).all())


@pytest.mark.parametrize("dtype,head_dim", [("bf16", 64), ("bf16", 128), ("f16", 64)])
def test_nan_in_a_key_row_reaches_exactly_the_queries_that_see_it(dtype, head_dim):
    """Every query that sees a NaN key gets a NaN output, whichever unit computes its exponential (the
    MUFU unit, or a polynomial on the FMA pipe for some register positions), and the queries the causal
    mask hides it from stay finite.  The keys sit at different columns of the tiles' registers."""
    r = np.random.default_rng(5)
    q, k, v = (randn(r, (1, 300, 2, head_dim), dtype) for _ in range(3))
    for j in (0, 1, 9, 130, 257):
        poisoned = k.copy()
        poisoned[0, j, 1, 0] = np.nan
        out, _ = flashgen.attention_forward(q, poisoned, v, causal="top_left")
        bad = cupy.isnan(out[0, :, 1]).any(axis=1).get()
        assert bad[j:].all() and not bad[:j].any(), j
        assert bool(cupy.isfinite(out[0, :, 0]).all())  # the other head


def test_two_keys_that_cancel_are_measured_against_their_summands():
    """One query seeing two keys whose dP nearly agree: dP - delta cancels, so dq and dk are tiny
    next to their terms.  The fuzzer measures such gradients against the terms' size
    (rel_err_to_summands); the sizes bound the exact gradient elementwise and stay of order one
    where the gradient vanishes."""
    from attention_reference import rel_err_to_summands

    r = np.random.default_rng(7)
    q, k = randn(r, (1, 1, 1, 64), "f16"), randn(r, (1, 2, 1, 64), "f16")
    v = cupy.concatenate([randn(r, (1, 1, 1, 64), "f16")] * 2, axis=1)  # equal rows: dP equal, dP - delta = 0
    do = randn(r, (1, 1, 1, 64), "f16")
    _, _, (dq, dk, _, _) = reference(q, k, v, grad_out=do)
    _, _, (sq, sk, _, sds) = reference(q, k, v, grad_out=do, summand_sizes=True)
    assert float(abs(dq).max()) < 1e-12 and float(abs(dk).max()) < 1e-12  # cancelled outright
    assert float(cupy.linalg.norm(sq)) > 1 and float(cupy.linalg.norm(sk)) > 1e-2 and bool((sds > 0).all())
    rv = randn(r, (1, 2, 1, 64), "f16")  # generic values: the sizes bound the gradients
    _, _, (dq, dk, _, ds) = reference(q, k, rv, grad_out=do)
    _, _, (sq, sk, _, sds) = reference(q, k, rv, grad_out=do, summand_sizes=True)
    for g, size in ((dq, sq), (dk, sk), (ds, sds)):
        assert bool((abs(g) <= size * (1 + 1e-12)).all())
    off = dq + 0.05 * sq  # an error of 5% of the terms' size fails a 1e-2 tolerance
    assert rel_err_to_summands(off, dq, sq) == pytest.approx(0.05)
