"""Dropout on flashgen's Ampere-class kernels (sm80_fwd / sm80_bwd dropout instances) against float64.

The reference takes its keep mask from tests/philox_reference.py (the NumPy copy of the rule in
flashgen/csrc/flashgen/dropout.h, which the sm90 pair draws by too), so the kernels must draw exactly
those bits.  Needs CuPy, a GPU of compute capability 8.0 or newer and both families' dropout instances
built for it (`flashgen build --arch sm80 --kernels '*dropout*'`, or `--arch sm90` on an H100/H200);
skipped cleanly otherwise.  Every test forces the sm80 pair (FLASHGEN_FAMILIES), which on a 9.0 GPU
the sm90 pair would otherwise serve first.  Outputs land in poisoned (NaN) memory.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    BWD_TOL, FWD_TOL, ampere_kernels, f64, gpu_marks, reference, hopper_kernels, make_input,
    poisoned_allocations, reference_scores, rel_err,
)
from flashgen.runtime import plans  # noqa: E402
from philox_reference import keep_mask  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()

FORCED = "sm80_fwd,sm80_bwd,mem_eff_fwd,mem_eff_bwd"
BUILT = [b for family in ("sm80_fwd", "sm80_bwd") for b in ampere_kernels(family) if b.spec.dropout]
needs_dropout = pytest.mark.skipif(len({b.spec.FAMILY for b in BUILT}) < 2,
                                   reason="needs a GPU of compute capability 8.0+ and both sm80 families' dropout "
                                          "instances (flashgen build --arch sm80, or --arch sm90 on Hopper)")
HOPPER_PAIR = {b.spec.FAMILY for family in ("sm90_fwd", "sm90_bwd") for b in hopper_kernels(family) if b.spec.dropout}
P = 0.17


@pytest.fixture(autouse=True)
def the_sm80_pair(monkeypatch):
    """Both directions on the sm80 pair (example 41 stays allowed: it must refuse these calls itself);
    plans made under another setting never answer (plans.find keys on it)."""
    monkeypatch.setenv("FLASHGEN_FAMILIES", FORCED)


def selected(q, k, v, backward, **options):
    return next(name for name, _, verdict in flashgen.explain(q, k, v, backward=backward, **options)
                if verdict == "selected")


def inputs(rng, dtype, B, M, N, H, K, Hk=None, layout="contiguous"):
    Hk = Hk or H
    return (make_input(rng, (B, M, H, K), dtype, layout), make_input(rng, (B, N, Hk, K), dtype, layout),
            make_input(rng, (B, N, Hk, K), dtype, layout), make_input(rng, (B, M, H, K), dtype, layout))


def skipped_rows(M, N, causal):
    return M - N if causal == "bottom_right" and M > N else 0


def check(q, k, v, do, causal=None, seed=1234, offset=0, window=None, deterministic=False):
    """Forward and backward on the sm80 dropout instances against the float64 reference with the
    NumPy rule's mask; returns (out, grads)."""
    dtype = "bf16" if q.dtype.name == "bfloat16" else "f16"
    options = dict(causal=causal, dropout_p=P, seed=seed, offset=offset, window=window)
    for backward in (False, True):
        name = selected(q, k, v, backward, **options)
        assert name.startswith("sm80_") and name.endswith("_dropout_sm80"), name
    B, M, H = q.shape[0], q.shape[1], q.shape[2]
    N = k.shape[1]
    keep = cupy.asarray(keep_mask(seed, offset, P, B, H, M, N, skipped_rows(M, N, causal)))
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **options)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, deterministic=deterministic, **options)
    ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out=do, causal=causal, window=window, keep=keep, p=P)
    assert rel_err(out, ref_out) < FWD_TOL[dtype]
    finite = cupy.isfinite(ref_lse)
    assert cupy.allclose(lse[finite], ref_lse[finite], atol=1e-3), "lse is of the undropped scores"
    errors = {name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)}
    assert all(e < BWD_TOL[dtype] for e in errors.values()), errors
    return out, grads


CASES = [("f16", 64, 1, 1, None, 1), ("bf16", 64, 7, 129, "top_left", 1), ("f16", 128, 129, 7, "bottom_right", 1),
         ("bf16", 128, 1000, 129, None, 4), ("f16", 96, 129, 1000, "top_left", 3),
         ("bf16", 64, 1000, 1000, "bottom_right", 8), ("f16", 128, 1000, 1000, None, 2), ("bf16", 96, 7, 1000, None, 1),
         ("f16", 40, 129, 129, "top_left", 1), ("bf16", 44, 65, 300, "bottom_right", 2)]


@needs_dropout
@pytest.mark.parametrize("dtype,K,M,N,causal,group", CASES,
                         ids=[f"{d}-k{k}-{m}x{n}-{c}-g{g}" for d, k, m, n, c, g in CASES])
def test_matches_float64_with_the_rules_mask(dtype, K, M, N, causal, group):
    """Odd sizes, M != N (bottom-right with M > N: rows without keys), grouped-query ratios, both causal
    kinds, head dims 64, 128, 96 and 40 (below their tier: zero-filled) and 44 (the runtime pads it to 48)."""
    rng = np.random.default_rng([K, M, N, group])
    check(*inputs(rng, dtype, B=2, M=M, N=N, H=2 * group, K=K, Hk=2), causal=causal)


@needs_dropout
@pytest.mark.parametrize("layout", ["bhsk", "padded"])
def test_strided_inputs(layout):
    """Heads-major storage and slices of wider buffers: read in place by the kernels, the same mask."""
    rng = np.random.default_rng(21)
    check(*inputs(rng, "f16", B=2, M=200, N=333, H=4, K=64, Hk=2, layout=layout), causal="top_left", offset=3)


@needs_dropout
def test_a_sliding_window_and_the_deterministic_order():
    rng = np.random.default_rng(5)
    q, k, v, do = inputs(rng, "f16", B=1, M=300, N=300, H=2, K=64)
    check(q, k, v, do, window=(37, 11))
    _, grads = check(q, k, v, do, causal="bottom_right", window=(50, None), deterministic=True)
    _, again = check(q, k, v, do, causal="bottom_right", window=(50, None), deterministic=True)
    assert all(cupy.array_equal(a, b) for a, b in zip(grads, again)), "deterministic: the same bits"


def drawn_mask(q, k, seed, offset):
    """The keep mask the forward the call selects drew, read back from its output with v = identity
    (out[b, i, h, j] = P_ij keep_ij / (1 - p): head dim N, so q and k must have N columns too)."""
    B, N, H, K = k.shape
    assert N == K, "v = identity needs equal q/v head dims (the pairs' dropout instances)"
    eye = cupy.broadcast_to(cupy.eye(N, dtype=q.dtype)[None, :, None, :], (B, N, H, N)).copy()
    with poisoned_allocations():
        out, _ = flashgen.attention_forward(q, k, eye, dropout_p=P, seed=seed, offset=offset)
    ratio = f64(out).transpose(0, 2, 1, 3) * (1 - P) / cupy.exp(reference_scores(q, k))
    keep = ratio > 0.5
    assert bool((cupy.abs(ratio - keep) < 0.05).all()), "dropout output is not P * {0, 1/(1-p)}"
    return keep


@needs_dropout
@pytest.mark.parametrize("K", [64, 128])
def test_the_forward_draws_the_rules_mask_as_the_sm90_pair_does(K, monkeypatch):
    """The mask read back from the sm80 forward's own output is the rule's, bit for bit -- and, where the
    sm90 pair is built too (an H100/H200 with sm90a and sm90 builds), the one that pair's forward draws
    for the same call, so either pair serves either direction of a call."""
    rng = np.random.default_rng(K)
    q, k = (make_input(rng, (2, K, 3, K), "f16", "contiguous") * 0.3 for _ in range(2))
    assert selected(q, k, k, False, dropout_p=P, seed=99, offset=6).startswith("sm80_fwd_")
    keep = drawn_mask(q, k, 99, 6)
    assert bool((keep == cupy.asarray(keep_mask(99, 6, P, 2, 3, K, K))).all())
    if HOPPER_PAIR == {"sm90_fwd", "sm90_bwd"}:
        monkeypatch.delenv("FLASHGEN_FAMILIES")
        assert selected(q, k, k, False, dropout_p=P, seed=99, offset=6).startswith("sm90_fwd_")
        assert bool((drawn_mask(q, k, 99, 6) == keep).all())


@needs_dropout
def test_the_kept_fraction_and_the_seed_and_offset_contract():
    """Same (seed, offset) repeats the bits, another offset or seed draws another mask."""
    rng = np.random.default_rng(9)
    q, k, v, do = inputs(rng, "f16", B=2, M=512, N=512, H=4, K=64)
    run = lambda seed, offset: flashgen.attention_forward(q, k, v, dropout_p=P, seed=seed, offset=offset)[0]  # noqa: E731
    a = run(7, 0)
    assert cupy.array_equal(a, run(7, 0))
    assert not cupy.array_equal(a, run(7, 8)) and not cupy.array_equal(a, run(8, 0))
    check(q, k, v, do, seed=7, offset=8)


@needs_dropout
def test_plan_replay_uses_each_calls_seed_and_offset():
    """The first call leaves plans on the sm80 pair (seed and offset are not in their key); the later ones
    replay them and must still match the reference drawn with their own seed and offset."""
    plans.clear()
    rng = np.random.default_rng(11)
    q, k, v, do = inputs(rng, "bf16", B=1, M=256, N=384, H=2, K=128)
    first = None
    for seed, offset in ((1, 0), (2, 0), (2, 5)):
        check(q, k, v, do, causal="top_left", seed=seed, offset=offset)
        served = plans.served()  # the backward's plan: made by the first call, replayed by the others
        assert served is not None and served.has_rng and served.family == "sm80_bwd"
        first = first or served
        assert served is first, "later calls replay the first call's plan"


@needs_dropout
def test_example_41_draws_both_directions_when_the_pair_is_incomplete(monkeypatch):
    """FLASHGEN_FAMILIES without sm80_bwd: the forward must not draw on sm80 either (another mask)."""
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd,mem_eff_fwd,mem_eff_bwd")
    rng = np.random.default_rng(3)
    q, k, v, _ = inputs(rng, "f16", B=1, M=64, N=64, H=2, K=64)
    assert selected(q, k, v, False, dropout_p=P, seed=1).startswith("mem_eff_fwd")
    assert selected(q, k, v, True, dropout_p=P, seed=1).startswith("mem_eff_bwd")
