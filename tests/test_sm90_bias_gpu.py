"""flashgen's Hopper kernels with an additive attention bias (the sm90 `bias` instances) on a 9.0 GPU
against the float64 reference: out, lse, dq, dk, dv and dbias.

Needs CuPy, an H100/H200 and both sm90 families built (`flashgen build --arch sm90a`); skipped
cleanly otherwise.  Results land in poisoned (NaN) memory, so an element a kernel forgot to write
fails, and every call must be served by an sm90 bias instance (checked through flashgen.explain).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    BIAS_BROADCASTS, BWD_TOL, FWD_TOL, assert_same_bits, gpu_marks, hopper_kernels, lse_err, make_bias, randn,
    reference, rel_err,
)
from bias_checks import GRID, GRID_IDS, assert_bias_pair, check_bias, selected  # noqa: E402
from flashgen.spec.sm90_bwd import Sm90Bwd  # noqa: E402
from flashgen.spec.sm90_fwd import Sm90Fwd  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()
needs_sm90 = pytest.mark.skipif(
    not (any(b.spec.bias for b in hopper_kernels(Sm90Fwd.FAMILY))
         and any(b.spec.bias for b in hopper_kernels(Sm90Bwd.FAMILY))),
    reason="needs a 9.0 GPU and the sm90 bias instances (flashgen build --arch sm90a)")


check = functools.partial(check_bias, "sm90")
assert_sm90_bias = functools.partial(assert_bias_pair, "sm90")


@needs_sm90
@pytest.mark.parametrize("dtype,K,broadcast,M,N,causal", GRID, ids=GRID_IDS)
def test_bias_matches_float64_reference(dtype, K, broadcast, M, N, causal):
    rng = np.random.default_rng([K, M, N, len(dtype), BIAS_BROADCASTS.index(broadcast), len(causal or "")])
    check(rng, dtype, B=2, M=M, N=N, H=3, K=K, broadcast=broadcast, causal=causal)


@needs_sm90
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("causal,window,softcap", [(None, (100, 50), 0.0), ("bottom_right", (300, None), 0.0),
                                                   (None, None, 5.0), ("top_left", (200, None), 4.0)])
def test_bias_with_window_and_softcap(dtype, causal, window, softcap):
    rng = np.random.default_rng([len(dtype), int(softcap), len(causal or "")])
    check(rng, dtype, B=2, M=700, N=1000, H=2, K=128, broadcast="H", causal=causal, window=window, softcap=softcap)


@needs_sm90
def test_softcap_with_bias_at_head_dim_64_runs_on_the_128_tier_backward():
    """The forward takes it on the head-dim-64 bias instances; the backward has no soft-capping with
    bias at 64 (spec/sm90_bwd.py), so the 128 tier's instance serves it (TMA zero-fills the head dim)."""
    rng = np.random.default_rng(64)
    q, k, v = (randn(rng, (1, 130, 2, 64), "f16") for _ in range(3))
    bias = make_bias(rng, "f16", 1, 2, 130, 130)
    forward, backward = assert_sm90_bias(q, k, v, attn_bias=bias, softcap=5.0)
    assert "_k64_" in forward and "_k128_" in backward and "_softcap_" in backward, (forward, backward)
    check(rng, "f16", B=2, M=130, N=257, H=2, K=64, broadcast="B", softcap=5.0, causal="bottom_right")


@needs_sm90
@pytest.mark.parametrize("dtype,K,causal", [("bf16", 64, None), ("f16", 128, "bottom_right"), ("bf16", 128, "top_left")])
def test_bias_grouped_query(dtype, K, causal):
    """4 query heads per k/v head: dk, dv summed per group, dbias per query head."""
    check(np.random.default_rng([K, 4]), dtype, B=2, M=333, N=517, H=8, Hk=2, K=K, broadcast="B", causal=causal)


@needs_sm90
@pytest.mark.parametrize("layout", ["bhsk", "padded"])
def test_bias_with_strided_inputs(layout):
    check(np.random.default_rng(3), "bf16", B=2, M=257, N=300, H=3, K=64, broadcast="HM", layout=layout,
          causal="top_left")


@needs_sm90
def test_bias_head_dim_between_tiers_and_strided_bias():
    """Head dim 96 runs on the 128 tier; a bias that is a strided slice of a wider buffer (row stride
    a multiple of 8, no copy) and one with an odd key count (copied into padded rows)."""
    rng = np.random.default_rng(96)
    wide = randn(rng, (2, 3, 210, 1032), "f16")[:, :, 5:205, 4:1004]  # (2, 3, 200, 1000)
    check(rng, "f16", B=2, M=200, N=1000, H=3, K=96, bias=wide)
    check(rng, "f16", B=2, M=200, N=999, H=3, K=96, causal="top_left")


@needs_sm90
def test_bias_with_infinite_entries():
    """-inf in the bias masks keys; a row that is -inf throughout sees no key: out 0, lse -inf, no
    gradient (dbias 0 there)."""
    rng = np.random.default_rng(7)
    B, H, M, N = 1, 2, 150, 260
    bias = randn(rng, (B, H, M, N), "bf16")
    bias[:, :, :, 100:130] = -np.inf
    bias[:, 1, 17, :] = -np.inf
    _, grads = check(rng, "bf16", B=B, M=M, N=N, H=H, K=64, bias=bias)
    assert not bool(grads[3][:, 1, 17].astype(cupy.float32).any()), "dbias of a row that sees no key"


@needs_sm90
def test_bias_deterministic_and_without_dbias():
    rng = np.random.default_rng(11)
    (q, k, v, do, bias, out, lse), grads = check(rng, "f16", B=2, M=600, N=700, H=4, Hk=2, K=128, broadcast="M",
                                                 causal="top_left", deterministic=True)
    again = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, bias_requires_grad=True,
                                        causal="top_left", deterministic=True)
    assert_same_bits(grads, again)
    plain = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, causal="top_left")
    assert len(plain) == 3
    for a, b in zip(plain, grads):
        assert rel_err(a, b.astype(cupy.float64)) < BWD_TOL["f16"]


@needs_sm90
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("broadcast", ["B", "BH"])
def test_dbias_added_over_many_planes_stays_within_tolerance_and_deterministic_repeats(dtype, broadcast):
    """Where the bias broadcasts, the kernels add every tile into dbias (TMA reduce-adds in the input
    dtype, one rounding per add): over 16 batches (and 4 heads with BH) the sum stays within the
    backward's tolerance of the float64 reference.  deterministic=True (per-plane dbias, summed in float
    by _dbias_sum) repeats bit for bit and agrees with it."""
    rng = np.random.default_rng([16, len(dtype), len(broadcast)])
    (q, k, v, do, bias, out, lse), grads = check(rng, dtype, B=16, M=257, N=300, H=4, K=64, broadcast=broadcast,
                                                 causal="top_left")
    ordered = [flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, bias_requires_grad=True,
                                           causal="top_left", deterministic=True) for _ in range(2)]
    assert_same_bits(*ordered)
    assert rel_err(grads[3], ordered[0][3].astype(cupy.float64)) < BWD_TOL[dtype]


@needs_sm90
def test_bias_beyond_the_bias_tiers_falls_back_to_example41():
    """Head dim 256 has no sm90 bias instance: explain says why and example 41 serves the call."""
    rng = np.random.default_rng(256)
    q, k, v = (randn(rng, (1, 64, 2, 256), "f16") for _ in range(3))
    bias = randn(rng, (1, 2, 64, 64), "f16")
    rows = flashgen.explain(q, k, v, attn_bias=bias)
    assert next(name for name, _, verdict in rows if verdict == "selected").startswith("mem_eff_fwd")
    assert any(name.startswith("sm90_fwd") and verdict == "built without bias" for name, _, verdict in rows)


@needs_sm90
def test_float32_bias_goes_to_example41_and_a_mixed_dtype_is_refused():
    """A bias has q's dtype: float32 calls (and their bias) run on example 41; an f16 call with a
    float32 bias is a TypeError before any launch."""
    rng = np.random.default_rng(32)
    q, k, v = (randn(rng, (2, 70, 2, 64), "f32") for _ in range(3))
    bias = make_bias(rng, "f32", 2, 2, 70, 70, "H")
    assert selected(q, k, v, attn_bias=bias).startswith("mem_eff_fwd")
    out, lse = flashgen.attention_forward(q, k, v, attn_bias=bias)
    ref_out, ref_lse = reference(q, k, v, bias=bias)
    assert rel_err(out, ref_out) < FWD_TOL["f32"] and lse_err(lse, ref_lse) < FWD_TOL["f32"]
    with pytest.raises(TypeError, match="attn_bias has dtype float32, expected float16"):
        flashgen.attention_forward(*(x.astype(cupy.float16) for x in (q, k, v)), attn_bias=bias)
