"""flashgen's Ampere-class backward (sm80_bwd) on a GPU of compute capability 8.0 or newer,
against the float64 reference.

Needs CuPy, such a GPU and the sm80 families built for it on FLASHGEN_KERNEL_PATH (`flashgen
build --arch sm80`, or `--arch sm90` on an H100/H200: plain sm90 code, which the arch-specific
sm90a build leaves out); skipped cleanly otherwise.  On a 9.0 GPU the sm90 families come
first in the dispatch order, so every test forces the Ampere forward and backward with
FLASHGEN_FAMILIES (the forward's lse is what the backward reads).  Gradients land in poisoned
(NaN) memory, so an element the kernels forgot to write fails.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    AMPERE_GRID, AMPERE_WINDOW_SHAPES, AMPERE_WINDOWS, BWD_TOL, PACKED, PACKED_MASKS, PACKINGS, ampere_kernels,
    assert_same_bits, gpu_marks, reference, make_input, offsets, poisoned_allocations, randn, rel_err,
)
from flashgen.runtime import plans, validate  # noqa: E402
from flashgen.runtime.families import sm80_bwd  # noqa: E402
from flashgen.spec.sm80_bwd import Sm80Bwd  # noqa: E402

pytestmark = gpu_marks()[1]
FORCED = "sm80_fwd,sm80_bwd"
KERNELS = [b for b in ampere_kernels(Sm80Bwd.FAMILY) if not b.spec.bias and not b.spec.dropout]  # twins: test_sm80_{bias,dropout}_gpu
needs_sm80 = pytest.mark.skipif(not KERNELS or not ampere_kernels("sm80_fwd"),
                                reason="needs a GPU of compute capability 8.0+ and the sm80_fwd and sm80_bwd kernels "
                                       "(flashgen build --arch sm80, or --arch sm90 on Hopper)")


@pytest.fixture(autouse=True)
def only_this_family(monkeypatch):
    """Both directions go to the Ampere families alone; plans made under another setting never
    answer (plans.find keys on it)."""
    monkeypatch.setenv("FLASHGEN_FAMILIES", FORCED)


def selected_backward(q, k, v, **options):
    return next(name for name, _, verdict in flashgen.explain(q, k, v, backward=True, **options)
                if verdict == "selected")


def inputs(rng, dtype, B, M, N, H, K, Hk=None, layout="contiguous"):
    Hk = Hk or H
    return (make_input(rng, (B, M, H, K), dtype, layout), make_input(rng, (B, N, Hk, K), dtype, layout),
            make_input(rng, (B, N, Hk, K), dtype, layout), make_input(rng, (B, M, H, K), dtype, layout))


def dtype_of(x) -> str:
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[x.dtype.name]


def out_shape(arrays) -> tuple:
    """[B, M, H, Kv] of q, k, v's out (and grad_out)."""
    return arrays[0].shape[:3] + (arrays[2].shape[3],)


def assert_gradients(grads, q, k, v, do, context, **options):
    """dq, dk, dv against the grouped-query float64 reference (shapes, then relative errors)."""
    dtype = dtype_of(q)
    errors = {}
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference(q, k, v, grad_out=do, **options)[2]):
        assert g.shape == r.shape, name
        errors[name] = rel_err(g, r)
    assert all(e < BWD_TOL[dtype] for e in errors.values()), (errors, context, options)


def check_backward(q, k, v, do, deterministic=False, **options):
    """The public forward and backward (both Ampere families) against the reference."""
    assert selected_backward(q, k, v, **options).startswith("sm80_bwd_"), "the call did not take the sm80 path"
    out, lse = flashgen.attention_forward(q, k, v, **options)
    with poisoned_allocations():
        grads = flashgen.attention_backward(do, q, k, v, out, lse, deterministic=deterministic, **options)
    assert_gradients(grads, q, k, v, do, "public", **options)
    return grads


@needs_sm80
@pytest.mark.parametrize("binary", KERNELS, ids=[b.name for b in KERNELS])
def test_every_instance(binary):
    """Each built kernel (not only the one the priority order picks) on odd sizes (one and many key
    and query blocks, partial ones), M != N, a head dim below its tier, grouped-query k/v, both
    causal kinds, a window with soft-capping, rows without keys, and deterministic mode."""
    spec = binary.spec
    rng = np.random.default_rng(abs(hash(spec.name)) % 2**32)
    cases = (((1, 1), spec.max_k, 1, {}), ((7, 129), spec.max_k, 2, {"causal": "top_left"}),
             ((129, 7), spec.max_k - 24, 1, {}), ((1000, 1000), spec.max_k, 2, {"causal": "bottom_right"}),
             ((129, 1000), spec.max_k - 56, 4, {"causal": "bottom_right"}),
             ((300, 700), spec.max_k, 2, {"window": (200, 33), "softcap": 8.0}),
             ((400, 100), spec.max_k, 1, {"window": (0, 5)}),  # queries from 100 on see no key
             ((257, 300), spec.max_k, 2, {"causal": "top_left", "deterministic": True}))
    for (M, N), K, group, options in cases:
        q, k, v, do = inputs(rng, spec.dtype, B=2, M=M, N=N, H=2 * group, K=K, Hk=2)
        forward = {key: value for key, value in options.items() if key != "deterministic"}
        out, lse = flashgen.attention_forward(q, k, v, **forward)
        call = validate.backward_call(do, q, k, v, out, lse, dict(options), flashgen.attention_backward)
        with poisoned_allocations():  # the family allocates dq, dk, dv and the workspace
            grads = sm80_bwd.RUNTIME.launch(call, binary)
        assert_gradients(grads, q, k, v, do, (spec.name, M, N, K, group), **forward)


@needs_sm80
@pytest.mark.parametrize("dtype,K,M,N,causal", AMPERE_GRID,
                         ids=[f"{d}-k{k}-{m}x{n}-{c}" for d, k, m, n, c in AMPERE_GRID])
def test_matches_float64_reference(dtype, K, M, N, causal):
    rng = np.random.default_rng([K, M, N, len(dtype), len(causal or "")])
    check_backward(*inputs(rng, dtype, B=2, M=M, N=N, H=3, K=K), causal=causal)


@needs_sm80
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("K", [136, 160, 192, 200, 256])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_head_dims_past_128(dtype, K, causal):
    """The 192 and 256 tiers (head dims between them padded) through the public forward and
    backward: odd sizes both ways round, grouped-query k/v, dq/dk/dv against float64, and the
    deterministic order repeated bit for bit."""
    rng = np.random.default_rng([K, len(dtype), len(causal or "")])
    tier = 192 if K <= 192 else 256
    for M, N in ((129, 1000), (1000, 77)):
        q, k, v, do = inputs(rng, dtype, B=2, M=M, N=N, H=4, K=K, Hk=2)
        assert f"_k{tier}_" in selected_backward(q, k, v, causal=causal)
        first = check_backward(q, k, v, do, deterministic=True, causal=causal)
        out, lse = flashgen.attention_forward(q, k, v, causal=causal)
        assert_same_bits(first, flashgen.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                            deterministic=True))


@needs_sm80
@pytest.mark.parametrize("scale", [0.02, 1.0, -0.3])
def test_scale_of_either_sign(scale):
    rng = np.random.default_rng(int(abs(scale) * 100))
    check_backward(*inputs(rng, "bf16", B=1, M=300, N=500, H=2, K=64), scale=scale, causal="top_left")


@needs_sm80
@pytest.mark.parametrize("layout", ["bhsk", "padded"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("K", [64, 128])
def test_strided_inputs(layout, causal, K):
    check_backward(*inputs(np.random.default_rng([K, len(layout)]), "bf16", B=2, M=257, N=1000, H=4, K=K,
                           layout=layout), causal=causal)


@needs_sm80
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("K", [64, 128, 160, 256])
def test_grouped_query_attention(group, causal, K):
    """k/v with H / group heads are read in place; dk/dv sum their group in registers."""
    rng = np.random.default_rng([group, len(causal or ""), K])
    check_backward(*inputs(rng, "f16", B=2, M=300, N=1000, H=8, K=K, Hk=8 // group), causal=causal)


@needs_sm80
@pytest.mark.parametrize("window", AMPERE_WINDOWS, ids=[f"w{a},{b}" for a, b in AMPERE_WINDOWS])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("dtype,K,M,N", AMPERE_WINDOW_SHAPES)
def test_sliding_windows(dtype, K, M, N, window, causal):
    rng = np.random.default_rng([K, M, N, *(x or 0 for x in window)])
    check_backward(*inputs(rng, dtype, B=2, M=M, N=N, H=2, K=K), causal=causal, window=window)


@needs_sm80
@pytest.mark.parametrize("softcap", [1.0, 8.0, 50.0])
@pytest.mark.parametrize("dtype,K,causal,window", [("f16", 64, None, None), ("bf16", 128, "top_left", None),
                                                   ("bf16", 64, "bottom_right", (300, 0)), ("f16", 128, None, (64, 64)),
                                                   ("bf16", 192, None, (64, 64)), ("f16", 256, "top_left", None)])
def test_softcap(dtype, K, causal, window, softcap):
    rng = np.random.default_rng([K, int(softcap)])
    check_backward(*inputs(rng, dtype, B=2, M=1000, N=777, H=2, K=K), causal=causal, window=window, softcap=softcap,
                   scale=0.5)


@needs_sm80
def test_rows_whose_window_holds_no_key_get_no_gradient():
    rng = np.random.default_rng(8)
    q, k, v, do = inputs(rng, "f16", B=1, M=300, N=100, H=2, K=64)
    dq, _, _ = check_backward(q, k, v, do, window=(0, 10))  # rows >= 100: no key
    assert bool((dq[:, 100:] == 0).all())


@needs_sm80
@pytest.mark.parametrize("dtype,K,packing,mask", PACKED, ids=[f"{d}-k{k}-{p}-{m}" for d, k, p, m in PACKED])
def test_packed_batches_per_sequence(dtype, K, packing, mask):
    """Sequences packed along dim 1 (cu_seqlens), each against its own reference (grouped-query
    k/v); rows past the last sequence, and keys of sequences without queries, come back zero."""
    q_lens, k_lens = PACKINGS[packing]
    options = PACKED_MASKS[mask]
    rng = np.random.default_rng([K, len(packing), mask])
    cu_q, cu_k = offsets(q_lens), offsets(k_lens)
    tail = 5
    q, do = (randn(rng, (1, int(cu_q[-1]) + tail, 4, K), dtype) for _ in range(2))
    k, v = (randn(rng, (1, int(cu_k[-1]) + tail, 2, K), dtype) for _ in range(2))
    packed = dict(cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_k=cupy.asarray(cu_k), **options)
    assert selected_backward(q, k, v, **packed).startswith("sm80_bwd_")
    out, lse = flashgen.attention_forward(q, k, v, **packed)
    with poisoned_allocations():
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, **packed)
    for s, (m, n) in enumerate(zip(q_lens, k_lens)):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if m == 0 or n == 0:
            assert bool((dq[:, qs] == 0).all()) and bool((dk[:, ks] == 0).all()) and bool((dv[:, ks] == 0).all())
            continue
        assert_gradients((dq[:, qs], dk[:, ks], dv[:, ks]), q[:, qs], k[:, ks], v[:, ks], do[:, qs], s, **options)
    for g, end in ((dq, cu_q[-1]), (dk, cu_k[-1]), (dv, cu_k[-1])):
        assert bool((g[:, int(end):] == 0).all()), "rows past the last sequence must be zeros"


@needs_sm80
@pytest.mark.parametrize("K", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [None, "top_left"])
@pytest.mark.parametrize("group", [1, 4])
def test_deterministic_mode_repeats_bit_for_bit(causal, K, group):
    """Many key blocks add into the same dQ rows; with deterministic=True they do so in key-block
    order, so repeated calls (after the first, through the launch plan) agree in every bit."""
    rng = np.random.default_rng([9, K, group])
    q, k, v, do = inputs(rng, "bf16", B=2, M=2048, N=2048, H=4, K=K, Hk=4 // group)
    plans.clear()
    first = check_backward(q, k, v, do, deterministic=True, causal=causal)
    out, lse = flashgen.attention_forward(q, k, v, causal=causal)
    for _ in range(3):
        again = flashgen.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=True)
        assert_same_bits(first, again)
    assert any((True, bool) in zip(key[2], key[3]) and plan.family == "sm80_bwd" for key, plan in plans._plans.items()), \
        "the repeats did not use a deterministic sm80 plan"


@needs_sm80
def test_planned_repeat_uses_the_new_inputs_and_matches_the_full_path():
    """The second call with a signature goes through its launch plan (three kernels), which must
    read the new arrays and give what the full path gives, bit for bit (deterministic)."""
    rng = np.random.default_rng(11)
    plans.clear()
    first = inputs(rng, "f16", B=2, M=257, N=300, H=4, K=128, Hk=2)
    out, lse = flashgen.attention_forward(*first[:3], causal="top_left")
    flashgen.attention_backward(first[3], *first[:3], out, lse, causal="top_left", deterministic=True)
    second = inputs(rng, "f16", B=2, M=257, N=300, H=4, K=128, Hk=2)
    out, lse = flashgen.attention_forward(*second[:3], causal="top_left")
    with poisoned_allocations():
        grads = flashgen.attention_backward(second[3], *second[:3], out, lse, causal="top_left", deterministic=True)
    assert any(p.family == "sm80_bwd" for p in plans._plans.values()), "no sm80 backward plan was made"
    assert_gradients(grads, *second, "planned", causal="top_left")
    copies = [cupy.array(x) for x in (*second, out, lse)]
    plans.clear()  # the full path: validation, selection, launch
    full = flashgen.attention_backward(copies[3], *copies[:3], copies[4], copies[5], causal="top_left",
                                       deterministic=True)
    assert_same_bits(grads, full)


@needs_sm80
def test_lse_with_a_row_stride():
    """An lse view whose rows are not unit-stride is copied, not misread."""
    rng = np.random.default_rng(4)
    q, k, v, do = inputs(rng, "f16", B=1, M=100, N=100, H=2, K=64)
    out, lse = flashgen.attention_forward(q, k, v)
    wide = cupy.zeros((1, 2, 200), dtype=cupy.float32)
    wide[:, :, ::2] = lse
    grads = flashgen.attention_backward(do, q, k, v, out, wide[:, :, ::2])
    assert_gradients(grads, q, k, v, do, "strided lse")


@needs_sm80
def test_what_it_refuses_another_family_serves(monkeypatch):
    """Bias past the bias tiers, dropout with softcap (dropout alone: test_sm80_dropout_gpu.py), float32,
    different q/v head dims, 4-element alignment and head dims over 256 are refused with the reason.  With
    every family allowed, a later one in the dispatch order
    (sm90_bwd where built and it fits, else example 41) serves the cases without bias or dropout,
    to the float64 reference.  q, k and v are drawn apart: with q = k (a wide head dim) the softmax
    peaks on the diagonal, and the rounding of O to f16 alone (delta = rowsum(dO * O)) puts even
    an exact dq, dk ~5% off the float64 gradient, past BWD_TOL whichever kernel runs."""
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (1, 130, 2, 64), "f16") for _ in range(3))
    bias = randn(rng, (1, 2, 130, 130), "f16")
    # head dim 60 and head stride 68: 4-element aligned (rows of 136 elements are 8-aligned)
    odd = tuple(randn(rng, (1, 130, 2, 68), "f16")[..., :60] for _ in range(3))
    wide = tuple(randn(rng, (1, 130, 2, 264), "f16") for _ in range(3))
    past_bias_tiers = tuple(randn(rng, (1, 130, 2, 192), "f16") for _ in range(3))  # no bias instance at 192
    cases = ((past_bias_tiers, {"attn_bias": bias}, "built without bias"),
             ((q, k, v), {"dropout_p": 0.1, "seed": 1, "softcap": 2.0}, "dropout without attn_bias, block masks or softcap"),
             (tuple(randn(rng, (1, 130, 2, 64), "f32") for _ in range(3)), {}, "float16 or bfloat16 only"),
             ((q, k, randn(rng, (1, 130, 2, 32), "f16")), {}, "equal q/v head dims only"),
             (odd, {}, "needs 8-element alignment"),
             (wide, {}, "kMaxK 256 < head dim 264"))
    for arrays, options, why in cases:
        out = cupy.zeros(out_shape(arrays), arrays[0].dtype)
        lse = cupy.zeros((1, 2, 130), cupy.float32)
        call = validate.backward_call(out, *arrays, out, lse, dict(options), flashgen.attention_backward)
        assert why in sm80_bwd.RUNTIME.refusal(call), why
    monkeypatch.delenv("FLASHGEN_FAMILIES")
    for arrays, _, why in (case for case in cases if not case[1]):
        rows = flashgen.explain(*arrays, backward=True)
        selected = next(name for name, _, verdict in rows if verdict == "selected")
        assert any(name.startswith("sm80_bwd_") for name, _, _ in rows) and not selected.startswith("sm80_bwd_"), \
            (why, selected)
        do = randn(rng, out_shape(arrays), dtype_of(arrays[0]))
        out, lse = flashgen.attention_forward(*arrays)
        with poisoned_allocations():
            grads = flashgen.attention_backward(do, *arrays, out, lse)
        assert_gradients(grads, *arrays, do, (why, selected))
