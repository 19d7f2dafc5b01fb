"""flashgen's Hopper backward (sm90_bwd) on a 9.0 GPU against a float64 reference.

Needs CuPy, an H100/H200 and the family built for it on FLASHGEN_KERNEL_PATH
(`flashgen build --arch sm90a`); skipped cleanly otherwise.  Gradients land in
poisoned (NaN) memory, so an element the kernels forgot to write fails.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    assert_same_bits,
    BWD_TOL, reference, make_bias, make_input, poisoned_allocations, randn, rel_err, gpu_marks,
    hopper_kernels,
)
from flashgen.runtime import plans, validate  # noqa: E402
from flashgen.runtime.families import sm90_bwd  # noqa: E402
from flashgen.spec.sm90_bwd import Sm90Bwd  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()


KERNELS = hopper_kernels(Sm90Bwd.FAMILY)
# the others have tests of their own: sparse in test_block_sparse_gpu.py, dropout in test_sm90_dropout_gpu.py,
# score mods in test_score_mods_gpu.py
PLAIN_KERNELS = [b for b in KERNELS if not (b.spec.sparse or b.spec.dropout or b.spec.score_mod)]
needs_sm90 = pytest.mark.skipif(not KERNELS, reason="needs a 9.0 GPU and sm90_bwd kernels (flashgen build --arch sm90a)")


def selected_backward(q, k, v, **options):
    return next(name for name, _, verdict in flashgen.explain(q, k, v, backward=True, **options)
                if verdict == "selected")


def inputs(rng, dtype, B, M, N, H, K, Hk=None, layout="contiguous"):
    Hk = Hk or H
    q = make_input(rng, (B, M, H, K), dtype, layout)
    k = make_input(rng, (B, N, Hk, K), dtype, layout)
    v = make_input(rng, (B, N, Hk, K), dtype, layout)
    do = make_input(rng, (B, M, H, K), dtype, layout)
    return q, k, v, do


def gqa_reference(q, k, v, causal, do, **options):
    """dq, dk, dv of the float64 grouped-query reference."""
    return reference(q, k, v, grad_out=do, causal=causal, **options)[2]


def check_backward(q, k, v, do, causal, deterministic=False, **options):
    """options: window, softcap (both passes get them)."""
    dtype = "bf16" if q.dtype.name == "bfloat16" else "f16"
    assert selected_backward(q, k, v, causal=causal, **options).startswith("sm90_bwd_"), \
        "the call did not take the sm90 path"
    out, lse = flashgen.attention_forward(q, k, v, causal=causal, **options)
    with poisoned_allocations():
        grads = flashgen.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                            **options)
    errors = {}
    for name, g, r in zip(("dq", "dk", "dv"), grads, gqa_reference(q, k, v, causal, do, **options)):
        assert g.shape == r.shape, name
        errors[name] = rel_err(g, r)
    assert all(e < BWD_TOL[dtype] for e in errors.values()), errors
    return grads


SIZES = ((1, 1), (7, 129), (129, 7), (1000, 129), (129, 1000), (1000, 1000), (1, 1000), (2048, 2048))
HEAD_DIMS = (8, 40, 64, 96, 128, 160, 192, 256)
GRID = [(dtype, K, *SIZES[(i + j + m) % len(SIZES)], causal)
        for i, dtype in enumerate(("f16", "bf16")) for j, K in enumerate(HEAD_DIMS)
        for m, causal in enumerate((None, "top_left", "bottom_right"))]


@needs_sm90
@pytest.mark.parametrize("dtype,K,M,N,causal", GRID, ids=[f"{d}-k{k}-{m}x{n}-{c}" for d, k, m, n, c in GRID])
def test_matches_float64_reference(dtype, K, M, N, causal):
    rng = np.random.default_rng([K, M, N, len(dtype), len(causal or "")])
    check_backward(*inputs(rng, dtype, B=2, M=M, N=N, H=3, K=K), causal)


@needs_sm90
@pytest.mark.parametrize("layout", ["bhsk", "padded"])
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_strided_inputs(layout, causal):
    check_backward(*inputs(np.random.default_rng(7), "bf16", B=2, M=257, N=1000, H=4, K=64, layout=layout), causal)


@needs_sm90
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_grouped_query_attention(group, causal):
    """k/v with H / group heads are read in place; dk/dv sum their group in registers."""
    rng = np.random.default_rng([group, causal is None])
    check_backward(*inputs(rng, "f16", B=2, M=300, N=1000, H=8, K=128, Hk=8 // group), causal)


@needs_sm90
@pytest.mark.parametrize("binary", PLAIN_KERNELS, ids=[b.name for b in PLAIN_KERNELS])
def test_every_instance(binary):
    """Each built kernel (not only the ones the priority order picks) on odd sizes, M != N: band
    kernels with a causal mask and a sliding window, softcap kernels with soft-capping, bias kernels
    with a bias (broadcast in a different way in each case) and its gradient."""
    spec = binary.spec
    rng = np.random.default_rng(abs(hash(spec.name)) % 2**32)
    causal = "bottom_right" if spec.band else None
    options = {"softcap": 8.0} if spec.softcap else {}
    cases = (((129, 1000), spec.max_k, None, ""), ((1000, 300), spec.max_k - 24, None, "HM"),
             ((7, 7), spec.max_k, None, "B"), ((700, 1000), spec.max_k, (300, 77) if spec.band else None, "M"))
    for (M, N), K, window, broadcast in cases:
        q, k, v, do = inputs(rng, spec.dtype, B=2, M=M, N=N, H=4, K=K, Hk=2)
        bias = make_bias(rng, spec.dtype, 2, 4, M, N, broadcast) if spec.bias else None
        out, lse = flashgen.attention_forward(q, k, v, causal=causal, window=window, attn_bias=bias, **options)
        call = validate.backward_call(do, q, k, v, out, lse, dict(causal=causal, window=window, attn_bias=bias,
                                                                  bias_requires_grad=spec.bias, **options),
                                      flashgen.attention_backward)
        with poisoned_allocations():
            grads = sm90_bwd.RUNTIME.launch(call, binary)
        assert len(grads) == 3 + spec.bias
        expected = gqa_reference(q, k, v, causal, do, window=window, bias=bias, **options)
        for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, expected):
            assert rel_err(g, r) < BWD_TOL[spec.dtype], (name, M, N, K, window, broadcast)


@needs_sm90
@pytest.mark.parametrize("K", [128, 192, 256])  # the dQ tile's bulk reduce-add, the split head dim's atomics
@pytest.mark.parametrize("causal", [None, "top_left"])
@pytest.mark.parametrize("group", [1, 8])  # band calls of 8 heads a group walk their query blocks from the last
def test_deterministic_mode_repeats_bit_for_bit(causal, K, group):
    """Many key blocks add into the same dQ rows; with deterministic=True they do so in key-block
    order, so two calls (the second through its launch plan) agree in every bit."""
    rng = np.random.default_rng(9)
    q, k, v, do = inputs(rng, "bf16", B=2, M=2048, N=2048, H=8, K=K, Hk=8 // group)
    plans.clear()
    first = check_backward(q, k, v, do, causal, deterministic=True)
    out, lse = flashgen.attention_forward(q, k, v, causal=causal)
    for _ in range(3):
        again = flashgen.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=True)
        assert_same_bits(first, again)
    # a key is (direction, signature, options, their types); deterministic is the one bool option
    assert any((True, bool) in zip(key[2], key[3]) and plan.family == "sm90_bwd"
               for key, plan in plans._plans.items()), \
        "the repeats did not use a deterministic sm90 plan"


@needs_sm90
def test_planned_repeat_uses_the_new_inputs():
    """The second call with a signature goes through its launch plan (three kernels, four tensor
    maps), which must read the new arrays."""
    rng = np.random.default_rng(11)
    plans.clear()
    first = inputs(rng, "f16", B=2, M=257, N=300, H=4, K=128)
    out, lse = flashgen.attention_forward(*first[:3], causal="top_left")
    flashgen.attention_backward(first[3], *first[:3], out, lse, causal="top_left")
    second = inputs(rng, "f16", B=2, M=257, N=300, H=4, K=128)
    out, lse = flashgen.attention_forward(*second[:3], causal="top_left")
    with poisoned_allocations():
        grads = flashgen.attention_backward(second[3], *second[:3], out, lse, causal="top_left")
    assert any(p.family == "sm90_bwd" for p in plans._plans.values()), "no sm90 backward plan was made"
    for name, g, r in zip(("dq", "dk", "dv"), grads, gqa_reference(*second[:3], "top_left", second[3])):
        assert rel_err(g, r) < BWD_TOL["f16"], name


@needs_sm90
def test_lse_with_a_row_stride():
    """An lse view whose rows are not unit-stride is copied, not misread."""
    rng = np.random.default_rng(4)
    q, k, v, do = inputs(rng, "f16", B=1, M=100, N=100, H=2, K=64)
    out, lse = flashgen.attention_forward(q, k, v)
    wide = cupy.zeros((1, 2, 200), dtype=cupy.float32)
    wide[:, :, ::2] = lse
    grads = flashgen.attention_backward(do, q, k, v, out, wide[:, :, ::2])
    for name, g, r in zip(("dq", "dk", "dv"), grads, gqa_reference(q, k, v, None, do)):
        assert rel_err(g, r) < BWD_TOL["f16"], name


@needs_sm90
def test_falls_back_where_the_family_has_no_kernel():
    """bias above head dim 128 (a bias up to 128 has bias instances), dropout, float32, head dims
    over 256 and TMA-hostile strides go to the example-41 backward."""
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (1, 130, 2, 64), "f16") for _ in range(3))
    bias = randn(rng, (1, 2, 130, 130), "f16")
    assert selected_backward(q, k, v, attn_bias=bias).startswith("sm90_bwd_f16_k64_q128x128_s2_bias")
    wide = randn(rng, (1, 130, 2, 192), "f16")
    assert selected_backward(wide, wide, wide, attn_bias=bias).startswith("mem_eff_bwd")
    assert selected_backward(wide, wide, wide, dropout_p=0.1).startswith("mem_eff_bwd"), "dropout up to 128"
    assert selected_backward(*(x.astype(cupy.float32) for x in (q, k, v))).startswith("mem_eff_bwd")
    assert selected_backward(*(randn(rng, (1, 64, 2, 136), "f16") for _ in range(3))).startswith("sm90_bwd_f16_k192")
    assert selected_backward(*(randn(rng, (1, 64, 2, 200), "f16") for _ in range(3))).startswith("sm90_bwd_f16_k256")
    big = randn(rng, (1, 64, 2, 264), "f16")
    assert selected_backward(big, big, big).startswith("mem_eff_bwd")
    odd = randn(rng, (1, 130, 2, 68), "f16")[..., :60]  # row stride 136 elements: not 16-byte aligned
    assert selected_backward(odd, odd, odd).startswith("mem_eff_bwd")


@needs_sm90
def test_deterministic_must_be_a_bool():
    q = cupy.zeros((1, 8, 1, 64), dtype=cupy.float16)
    with pytest.raises(TypeError, match="deterministic"):
        flashgen.attention_backward(q, q, q, q, q, cupy.zeros((1, 1, 8), cupy.float32), deterministic="yes")
