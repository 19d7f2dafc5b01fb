"""Dropout on flashgen's Hopper kernels (sm90_fwd / sm90_bwd dropout instances) against float64.

The reference takes its keep mask from tests/philox_reference.py (the NumPy copy of the rule in
flashgen/csrc/flashgen/dropout.h), so the kernels must draw exactly those bits.  Needs CuPy, an
H100/H200 and both families' dropout instances built (`flashgen build --arch sm90a --kernels
'*dropout*'`); skipped cleanly otherwise.  Outputs land in poisoned (NaN) memory.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    BWD_TOL, FWD_TOL, reference, gpu_marks, hopper_kernels, make_input, poisoned_allocations, rel_err,
)
from flashgen.runtime import plans  # noqa: E402
from philox_reference import keep_mask  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()

BUILT = [b for family in ("sm90_fwd", "sm90_bwd") for b in hopper_kernels(family) if b.spec.dropout]
needs_dropout = pytest.mark.skipif(len({b.spec.FAMILY for b in BUILT}) < 2,
                                   reason="needs a 9.0 GPU and both sm90 families' dropout instances")
P = 0.17


def selected(q, k, v, backward, **options):
    return next(name for name, _, verdict in flashgen.explain(q, k, v, backward=backward, **options)
                if verdict == "selected")


def inputs(rng, dtype, B, M, N, H, K, Hk=None):
    Hk = Hk or H
    return (make_input(rng, (B, M, H, K), dtype, "contiguous"), make_input(rng, (B, N, Hk, K), dtype, "contiguous"),
            make_input(rng, (B, N, Hk, K), dtype, "contiguous"), make_input(rng, (B, M, H, K), dtype, "contiguous"))


def check(q, k, v, do, causal=None, seed=1234, offset=0, window=None):
    """Forward and backward on the sm90 dropout instances against the float64 reference with the
    NumPy rule's mask; returns (out, grads)."""
    dtype = "bf16" if q.dtype.name == "bfloat16" else "f16"
    options = dict(causal=causal, dropout_p=P, seed=seed, offset=offset, window=window)
    for backward in (False, True):
        name = selected(q, k, v, backward, **options)
        assert name.startswith("sm90_") and name.endswith("_dropout_sm90a"), name
    B, M, H = q.shape[0], q.shape[1], q.shape[2]
    N = k.shape[1]
    keep = cupy.asarray(keep_mask(seed, offset, P, B, H, M, N, M - N if causal == "bottom_right" and M > N else 0))
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **options)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, **options)
    ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out=do, causal=causal, window=window, keep=keep, p=P)
    assert rel_err(out, ref_out) < FWD_TOL[dtype]
    finite = cupy.isfinite(ref_lse)
    assert cupy.allclose(lse[finite], ref_lse[finite], atol=1e-3), "lse is of the undropped scores"
    errors = {name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)}
    assert all(e < BWD_TOL[dtype] for e in errors.values()), errors
    return out, grads


CASES = [("f16", 64, 1, 1, None, 1), ("bf16", 64, 7, 129, "top_left", 1), ("f16", 128, 129, 7, "bottom_right", 1),
         ("bf16", 128, 1000, 129, None, 4), ("f16", 96, 129, 1000, "top_left", 3), ("bf16", 64, 1000, 1000,
                                                                                    "bottom_right", 8),
         ("f16", 128, 1000, 1000, None, 2), ("bf16", 96, 7, 1000, None, 1), ("f16", 40, 129, 129, "top_left", 1),
         ("bf16", 44, 65, 300, "bottom_right", 2)]


@needs_dropout
@pytest.mark.parametrize("dtype,K,M,N,causal,group", CASES,
                         ids=[f"{d}-k{k}-{m}x{n}-{c}-g{g}" for d, k, m, n, c, g in CASES])
def test_matches_float64_with_the_rules_mask(dtype, K, M, N, causal, group):
    """Odd sizes, M != N (bottom-right with M > N: rows without keys), grouped-query ratios, both causal
    kinds, head dims 64, 128, 96 and 40 (below their tier: TMA zero-fills) and 44 (the runtime pads it to 48)."""
    rng = np.random.default_rng([K, M, N, group])
    check(*inputs(rng, dtype, B=2, M=M, N=N, H=2 * group, K=K, Hk=2), causal=causal)


@needs_dropout
def test_a_sliding_window_with_dropout():
    rng = np.random.default_rng(5)
    check(*inputs(rng, "f16", B=1, M=300, N=300, H=2, K=64), window=(37, 11))


@needs_dropout
def test_the_kept_fraction_and_the_seed_and_offset_contract():
    """The output of v = identity rows recovers the kept fraction; same (seed, offset) repeats the bits,
    another offset or seed draws another mask."""
    rng = np.random.default_rng(9)
    q, k, v, _ = inputs(rng, "f16", B=2, M=512, N=512, H=4, K=64)
    run = lambda seed, offset: flashgen.attention_forward(q, k, v, dropout_p=P, seed=seed, offset=offset)[0]  # noqa: E731
    a = run(7, 0)
    assert cupy.array_equal(a, run(7, 0))
    assert not cupy.array_equal(a, run(7, 8)) and not cupy.array_equal(a, run(8, 0))
    kept = keep_mask(7, 0, P, 2, 4, 512, 512)
    assert abs(kept.mean() - (1 - P)) < 0.01
    check(q, k, v, _, seed=7, offset=8)


@needs_dropout
def test_plan_replay_uses_each_calls_seed_and_offset():
    """The first call leaves plans (seed and offset are not in their key); the later ones replay them
    and must still match the reference drawn with their own seed and offset."""
    plans.clear()
    rng = np.random.default_rng(11)
    q, k, v, do = inputs(rng, "bf16", B=1, M=256, N=384, H=2, K=128)
    first = None
    for seed, offset in ((1, 0), (2, 0), (2, 5)):
        check(q, k, v, do, causal="top_left", seed=seed, offset=offset)
        served = plans.served()  # the backward's plan: made by the first call, replayed by the others
        assert served is not None and served.has_rng
        first = first or served
        assert served is first, "later calls replay the first call's plan"


@needs_dropout
def test_example_41_draws_both_directions_when_asked(monkeypatch):
    """FLASHGEN_FAMILIES without sm90_bwd: the forward must not draw on sm90 either (another mask)."""
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm90_fwd,mem_eff_fwd,mem_eff_bwd")
    rng = np.random.default_rng(3)
    q, k, v, _ = inputs(rng, "f16", B=1, M=64, N=64, H=2, K=64)
    assert selected(q, k, v, False, dropout_p=P, seed=1).startswith("mem_eff_fwd")
