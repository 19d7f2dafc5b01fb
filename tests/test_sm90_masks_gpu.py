"""Sliding windows and logit soft-capping on flashgen's Hopper families (sm90_fwd, sm90_bwd).

Both options exist only in the sm90 kernels: on a 9.0 GPU with the families
built they are checked against a float64 reference (forward and all three
gradients, outputs in poisoned memory); everywhere else a call with them must
raise UnsupportedError rather than ignore them.  Skipped cleanly without a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    assert_same_bits,
    BWD_TOL, FWD_TOL, gpu_marks, hopper_kernels, lse_err, make_input, poisoned_allocations,
    randn, reference, rel_err,
)
from flashgen.runtime import plans  # noqa: E402
from flashgen.spec.sm90_bwd import Sm90Bwd  # noqa: E402
from flashgen.spec.sm90_fwd import Sm90Fwd  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()

SM90 = bool(hopper_kernels(Sm90Fwd.FAMILY)) and bool(hopper_kernels(Sm90Bwd.FAMILY))
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs a 9.0 GPU and both sm90 families (flashgen build --arch sm90a)")


def chosen(q, k, v, backward=False, **options):
    return next(name for name, _, verdict in flashgen.explain(q, k, v, backward=backward, **options)
                if verdict == "selected")


def check(rng, dtype, B, M, N, H, K, Hk=None, layout="contiguous", deterministic=False, **options):
    """Forward and backward with ``options`` (causal, window, softcap) against the reference;
    returns the inputs (q, k, v, do) and the results (out, lse, grads)."""
    q = make_input(rng, (B, M, H, K), dtype, layout)
    k, v = (make_input(rng, (B, N, Hk or H, K), dtype, layout) for _ in range(2))
    do = make_input(rng, (B, M, H, K), dtype, layout)
    mask = {name: options[name] for name in ("causal", "window", "softcap") if name in options}
    assert chosen(q, k, v, **mask).startswith("sm90_fwd_"), "the forward did not take the sm90 path"
    assert chosen(q, k, v, backward=True, **mask).startswith("sm90_bwd_"), "the backward did not take the sm90 path"
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **options)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, deterministic=deterministic, **options)
    ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out=do, **options)
    errors = {"out": rel_err(out, ref_out), "lse": lse_err(lse, ref_lse)}
    assert max(errors.values()) < FWD_TOL[dtype], (errors, options)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        errors[name] = rel_err(g, r)
    assert max(errors[n] for n in ("dq", "dk", "dv")) < BWD_TOL[dtype], (errors, options)
    return (q, k, v, do), (out, lse, grads)


# (left, right) windows: one-key band, left-only, right-only, both, right beyond every key
WINDOWS = ((0, 0), (3, None), (None, 5), (100, 50), (1, 1000), (127, 0))
SIZES = ((1, 1), (7, 129), (129, 7), (1000, 129), (129, 1000), (1000, 1000), (1, 1000), (2048, 2048))
GRID = [(dtype, K, *SIZES[(i + j + w) % len(SIZES)], window, causal)
        for i, dtype in enumerate(("f16", "bf16")) for j, K in enumerate((64, 96, 128))
        for w, window in enumerate(WINDOWS) for causal in (None, "bottom_right")]


@needs_sm90
@pytest.mark.parametrize("dtype,K,M,N,window,causal", GRID,
                         ids=[f"{d}-k{k}-{m}x{n}-w{w[0]},{w[1]}-{c}" for d, k, m, n, w, c in GRID])
def test_sliding_window_matches_float64_reference(dtype, K, M, N, window, causal):
    rng = np.random.default_rng([K, M, N, len(dtype), len(causal or ""), *(x or 0 for x in window)])
    check(rng, dtype, B=2, M=M, N=N, H=3, K=K, window=window, causal=causal)


@needs_sm90
@pytest.mark.parametrize("dtype,K", [("f16", 192), ("bf16", 256), ("f16", 232)])
@pytest.mark.parametrize("options", [dict(window=(100, 50)), dict(causal="bottom_right", window=(None, 0)),
                                     dict(softcap=8.0, causal="top_left")])
def test_large_head_dims_forward_masks(dtype, K, options):
    """Head dims above 128 (sm90 forward only): windows, causal bands and soft-capping."""
    rng = np.random.default_rng([K, len(dtype), len(options)])
    q, k, v = (randn(rng, (2, S, 3, K), dtype) for S in (1000, 777, 777))
    assert chosen(q, k, v, **options).startswith(f"sm90_fwd_{dtype}_k{-(-K // 64) * 64}_")
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **options)
    ref_out, ref_lse = reference(q, k, v, **options)
    assert rel_err(out, ref_out) < FWD_TOL[dtype] and lse_err(lse, ref_lse) < FWD_TOL[dtype]


@needs_sm90
@pytest.mark.parametrize("softcap", [1.0, 8.0, 50.0])
@pytest.mark.parametrize("causal", [None, "top_left"])
@pytest.mark.parametrize("dtype,K", [("f16", 64), ("bf16", 128), ("bf16", 96)])
def test_softcap_matches_float64_reference(dtype, K, causal, softcap):
    """Small caps saturate tanh (scores near +-cap, slopes near 0); large ones barely bend it."""
    rng = np.random.default_rng([K, len(dtype), int(softcap), causal is None])
    check(rng, dtype, B=2, M=1000, N=777, H=2, K=K, causal=causal, softcap=softcap, scale=0.5)


@needs_sm90
@pytest.mark.parametrize("scale", [0.3, -0.3, 0.0, -0.7])
@pytest.mark.parametrize("options", [{}, {"causal": "bottom_right"}, {"softcap": 8.0, "window": (100, 20)}],
                         ids=["full", "causal", "softcap-window"])
def test_scale_of_either_sign(scale, options):
    """sm90_fwd takes a row's running max on q.k and scales it after, right for a positive scale
    only (a negative one gave NaN): the runtime runs a negative scale as |scale| on -q and zero as
    float32's smallest scale, so sm90_fwd serves every sign (and the calls with a window or
    soft-cap that no other family takes); sm90_bwd takes any scale.  Zero gives every visible key
    the same weight."""
    for dtype, B, M, N, K in (("f16", 2, 300, 700, 64), ("bf16", 1, 129, 1000, 128)):
        rng = np.random.default_rng([int(abs(scale) * 10), len(options), K])
        q, k, v, do = (randn(rng, (B, S, 2, K), dtype) for S in (M, N, N, M))
        mask = {name: options[name] for name in ("causal", "window", "softcap") if name in options}
        forward = next((name for name, _, verdict in flashgen.explain(q, k, v, scale=scale, **mask)
                        if verdict == "selected"), "none")
        assert forward.startswith("sm90_fwd_"), forward
        assert chosen(q, k, v, backward=True, scale=scale, **mask).startswith("sm90_bwd_")
        q_before = q.copy()
        for _ in range(2):  # the second call would replay a plan if the first had left one
            with poisoned_allocations():
                out, lse = flashgen.attention_forward(q, k, v, scale=scale, **options)
                grads = flashgen.attention_backward(do, q, k, v, out, lse, scale=scale, **options)
        assert bool((q.view(cupy.uint16) == q_before.view(cupy.uint16)).all())  # negated into a copy
        ref_out, ref_lse, ref_grads = reference(q, k, v, scale=scale, grad_out=do, **options)
        assert rel_err(out, ref_out) < FWD_TOL[dtype] and lse_err(lse, ref_lse) < FWD_TOL[dtype]
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) < BWD_TOL[dtype]


@needs_sm90
@pytest.mark.parametrize("group", [1, 4, 8])
def test_window_and_softcap_with_grouped_query_attention(group):
    check(np.random.default_rng(group), "bf16", B=2, M=300, N=1000, H=8, K=128, Hk=8 // group,
          window=(64, 16), causal="bottom_right", softcap=20.0)


@needs_sm90
@pytest.mark.parametrize("layout", ["bhsk", "padded"])
def test_window_on_strided_inputs(layout):
    check(np.random.default_rng(3), "f16", B=2, M=257, N=1000, H=4, K=64, layout=layout, window=(200, 200))


@needs_sm90
def test_window_that_hides_every_key_from_some_rows():
    """Rows whose window holds no key: out 0, lse -inf, no gradient -- like causal rows without keys."""
    rng = np.random.default_rng(8)
    _, (out, lse, grads) = check(rng, "f16", B=1, M=300, N=100, H=2, K=64, window=(0, 10))  # rows >= 100: no key
    assert bool((out[:, 100:] == 0).all()) and bool(cupy.isneginf(lse[:, :, 100:]).all())
    assert bool((grads[0][:, 100:] == 0).all())


@needs_sm90
def test_deterministic_window_repeats_bit_for_bit():
    """Each query block's dQ gets its key blocks (a window's range, not from 0) in order."""
    plans.clear()
    options = dict(window=(700, 300), softcap=30.0)
    (q, k, v, do), (_, _, first) = check(np.random.default_rng(9), "bf16", B=2, M=2048, N=2048, H=4, K=128,
                                         deterministic=True, **options)
    out, lse = flashgen.attention_forward(q, k, v, **options)
    for _ in range(3):
        again = flashgen.attention_backward(do, q, k, v, out, lse, deterministic=True, **options)
        assert_same_bits(first, again)


@needs_sm90
def test_planned_repeat_keeps_window_and_softcap_apart():
    """Launch plans are keyed by window and softcap: a call differing only in them must not reuse
    another's plan."""
    rng = np.random.default_rng(12)
    plans.clear()
    q, k, v = (randn(rng, (1, 513, 2, 64), "f16") for _ in range(3))
    results = {}
    for options in ({}, {"window": (32, 32)}, {"softcap": 2.0}, {"window": (32, 32), "softcap": 2.0}):
        for _ in range(2):  # the second call of each runs from its plan
            out, _ = flashgen.attention_forward(q, k, v, **options)
        ref_out, _ = reference(q, k, v, **options)
        assert rel_err(out, ref_out) < FWD_TOL["f16"], options
        results[str(options)] = out
    assert len({float(abs(x.astype(cupy.float32)).sum()) for x in results.values()}) == 4


@needs_sm90
def test_calls_the_sm90_kernels_cannot_take_are_refused():
    """A window or softcap with an option only example 41 has must fail loudly, not be dropped.
    (A bias or dropout is such an option above head dim 128, where no sm90 kernel has one compiled in.)"""
    rng = np.random.default_rng(4)
    q, k, v = (randn(rng, (1, 64, 2, 64), "f16") for _ in range(3))
    wide = randn(rng, (1, 64, 2, 192), "f16")
    bias = randn(rng, (1, 2, 64, 64), "f16")
    for options in ({"window": (4, 4)}, {"softcap": 5.0}):
        assert "_bias_" in chosen(q, k, v, attn_bias=bias, **options), "head dim 64 has sm90 bias kernels"
        with pytest.raises(flashgen.UnsupportedError, match="sm90"):
            flashgen.attention_forward(wide, wide, wide, attn_bias=bias, **options)
        with pytest.raises(flashgen.UnsupportedError, match="sm90"):
            flashgen.attention_forward(*(x.astype(cupy.float32) for x in (q, k, v)), **options)
        with pytest.raises(flashgen.UnsupportedError, match="sm90"):  # sm90 dropout stops at head dim 128
            flashgen.attention_forward(wide, wide, wide, dropout_p=0.1, seed=1, **options)
        rows = flashgen.explain(wide, wide, wide, attn_bias=bias, **options)
        assert not any(verdict == "selected" for _, _, verdict in rows)
    # head dims up to 256 have sm90 kernels both ways; beyond, the forward refuses first
    check(rng, "f16", B=1, M=300, N=200, H=2, K=192, window=(4, 4), softcap=3.0)
    q = randn(rng, (1, 64, 2, 264), "f16")
    with pytest.raises(flashgen.UnsupportedError, match=r"(?s)sm90_fwd: none of its kernels accepts the call: .*kMaxK 256 < head dim 264"):
        flashgen.attention_forward(q, q, q, window=(4, 4))
