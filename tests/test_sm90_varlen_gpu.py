"""Packed (varlen) batches on flashgen's Hopper families (sm90_fwd, sm90_bwd).

Sequences of different lengths -- empty ones, one-token ones, ones with queries
but no keys and the other way round, M != N within a sequence -- packed along
dim 1 of a batch of 1 and described by cu_seqlens_q/k, each checked against the
float64 reference of that sequence alone (forward, lse and all three
gradients, outputs in poisoned memory), with masks, windows, soft-capping and
grouped-query heads.  Rows past the last sequence belong to none and must come
back as zeros.  Skipped cleanly without a 9.0 GPU and the sm90 cubins.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    assert_same_bits,
    BWD_TOL, FWD_TOL, gpu_marks, reference, hopper_kernels, lse_err, make_input, poisoned_allocations,
    rel_err,
)
from flashgen.spec.sm90_bwd import Sm90Bwd  # noqa: E402
from flashgen.spec.sm90_fwd import Sm90Fwd  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()

SM90 = bool(hopper_kernels(Sm90Fwd.FAMILY)) and bool(hopper_kernels(Sm90Bwd.FAMILY))
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs a 9.0 GPU and both sm90 families (flashgen build --arch sm90a)")


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def run_packed(rng, dtype, q_lens, k_lens, H, K, Hk=None, tail=0, layout="contiguous", deterministic=False,
               **options):
    """Forward and backward of the packed batch; every sequence checked against its own float64
    reference.  ``tail`` rows after the last sequence (in q, k and v) belong to none."""
    cu_q, cu_k = offsets(q_lens), offsets(k_lens)
    q = make_input(rng, (1, int(cu_q[-1]) + tail, H, K), dtype, layout)
    k, v = (make_input(rng, (1, int(cu_k[-1]) + tail, Hk or H, K), dtype, layout) for _ in range(2))
    do = make_input(rng, q.shape, dtype, layout)
    packed = dict(cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_k=cupy.asarray(cu_k), **options)
    for backward, family in ((False, "sm90_fwd_"), (True, "sm90_bwd_")):
        chosen = next(name for name, _, verdict in flashgen.explain(q, k, v, backward=backward, **packed)
                      if verdict == "selected")
        assert chosen.startswith(family), f"a packed batch did not take the sm90 path: {chosen}"
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **packed)
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, deterministic=deterministic, **packed)
    assert lse.shape == (len(q_lens), H, max(q_lens))
    errors = {}
    for s, (m, n) in enumerate(zip(q_lens, k_lens)):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if n == 0:  # queries without keys: a softmax over nothing
            assert bool((out[:, qs] == 0).all()) and bool((dq[:, qs] == 0).all())
            assert bool(cupy.isneginf(lse[s, :, :m]).all())
            continue
        if m == 0:  # keys no query sees: no gradient
            assert bool((dk[:, ks] == 0).all()) and bool((dv[:, ks] == 0).all())
            continue
        ref_out, ref_lse, ref_grads = reference(q[:, qs], k[:, ks], v[:, ks], grad_out=do[:, qs], **options)
        got = (out[:, qs], lse[s:s + 1, :, :m], dq[:, qs], dk[:, ks], dv[:, ks])
        for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, (ref_out, ref_lse) + ref_grads):
            errors[f"{name}[{s}]"] = lse_err(x, r) if name == "lse" else rel_err(x, r)
    fwd = max((e for name, e in errors.items() if name[:3] in ("out", "lse")), default=0.0)
    bwd = max((e for name, e in errors.items() if name[:2] in ("dq", "dk", "dv")), default=0.0)
    assert fwd < FWD_TOL[dtype] and bwd < BWD_TOL[dtype], (errors, options)
    for x, end in ((out, cu_q[-1]), (dq, cu_q[-1]), (dk, cu_k[-1]), (dv, cu_k[-1])):
        assert bool((x[:, int(end):] == 0).all()), "rows past the last sequence must be zeros"
    return (q, k, v, do, packed), (out, lse, dq, dk, dv)


# (query lengths, key lengths): odd sizes, M != N per sequence, empty and one-token sequences,
# sequences longer than a block next to tiny ones
PACKINGS = {
    "square": ((1, 7, 129, 1000), (1, 7, 129, 1000)),
    "ragged": ((129, 0, 7, 300, 1), (1000, 5, 7, 128, 2000)),
    "keyless": ((300, 64, 1), (0, 1000, 3)),
    "long-short": ((2048, 3, 515), (2048, 700, 515)),
}
MASKS = [dict(), dict(causal="top_left"), dict(causal="bottom_right"), dict(window=(50, 10)),
         dict(causal="bottom_right", window=(100, None)), dict(softcap=20.0, causal="top_left")]


def _allowed(q_lens, k_lens, options):
    # bottom-right causal masks need every sequence to have at least as many keys as queries
    return options.get("causal") != "bottom_right" or all(m <= n for m, n in zip(q_lens, k_lens))


CASES = [(dtype, K, packing, i) for dtype, K in (("f16", 64), ("bf16", 128), ("f16", 96), ("bf16", 64))
         for packing in PACKINGS for i, options in enumerate(MASKS) if _allowed(*PACKINGS[packing], options)]


@needs_sm90
@pytest.mark.parametrize("dtype,K,packing,mask", CASES,
                         ids=[f"{d}-k{k}-{p}-{'+'.join(f'{a}={b}' for a, b in MASKS[i].items()) or 'full'}"
                              for d, k, p, i in CASES])
def test_packed_batch_matches_float64_reference_per_sequence(dtype, K, packing, mask):
    rng = np.random.default_rng([K, len(dtype), len(packing), mask])
    run_packed(rng, dtype, *PACKINGS[packing], H=4, K=K, Hk=(4, 2, 1)[mask % 3], tail=mask % 2 * 5,
               **MASKS[mask])


@needs_sm90
@pytest.mark.parametrize("layout", ["padded", "bhsk"])
def test_packed_strided_inputs(layout):
    rng = np.random.default_rng(len(layout))
    run_packed(rng, "bf16", (200, 1, 129), (150, 40, 1000), H=2, K=64, layout=layout, causal="top_left")


@needs_sm90
def test_packed_batch_without_any_key():
    """No sequence has a key (N = 0 overall): outputs 0, lse -inf, zero gradients; the window
    and soft-cap are moot, not refused (the fuzzer's seed 3, case 126)."""
    run_packed(np.random.default_rng(126), "f16", (179, 3), (0, 0), H=3, K=128, tail=2, deterministic=True,
               window=(1, 0), softcap=19.0)


@needs_sm90
def test_packed_deterministic_backward_repeats_bit_for_bit():
    rng = np.random.default_rng(17)
    (q, k, v, do, packed), (out, lse, *first) = run_packed(
        rng, "f16", (1000, 300, 700), (1200, 300, 2000), H=4, K=128, Hk=2, deterministic=True, window=(300, 20))
    for _ in range(2):
        again = flashgen.attention_backward(do, q, k, v, out, lse, deterministic=True, **packed)
        assert_same_bits(first, again)


@needs_sm90
def test_packed_batch_agrees_with_the_same_sequences_padded_to_one_length():
    """The same two sequences as a fixed-length batch (equal lengths): identical results."""
    rng = np.random.default_rng(3)
    (q, k, v, do, packed), (out, lse, dq, dk, dv) = run_packed(rng, "f16", (384, 384), (512, 512), H=2, K=64,
                                                               causal="bottom_right")
    batched = [x.reshape(2, x.shape[1] // 2, *x.shape[2:]) for x in (q, k, v, do)]
    b_out, b_lse = flashgen.attention_forward(*batched[:3], causal="bottom_right")
    b_grads = flashgen.attention_backward(batched[3], *batched[:3], b_out, b_lse, causal="bottom_right")
    assert bool((b_out.reshape(out.shape) == out).all()) and bool((b_lse == lse).all())
    for g, b in zip((dq, dk, dv), b_grads):
        assert float(abs(g.astype(cupy.float32) - b.reshape(g.shape).astype(cupy.float32)).max()) < 1e-2
