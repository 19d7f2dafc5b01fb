"""flashgen's Ampere-class forward (sm80_fwd) on a GPU of compute capability 8.0 or newer,
against the float64 reference.

Needs CuPy, such a GPU and the family built for it on FLASHGEN_KERNEL_PATH (`flashgen build
--arch sm80`, or `--arch sm90` on an H100/H200: plain sm90 code, which the arch-specific sm90a
build leaves out); skipped cleanly otherwise.  On a 9.0 GPU sm90_fwd comes first in the
dispatch order, so the tests that go through the public API force this family with
FLASHGEN_FAMILIES.  Outputs come from poisoned (NaN) memory, so an element the kernel forgot
to write fails.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    AMPERE_GRID, AMPERE_WINDOW_SHAPES, AMPERE_WINDOWS, BWD_TOL, FWD_TOL, PACKED, PACKED_MASKS, PACKINGS, ampere_kernels,
    gpu_marks, lse_err, make_input, offsets, poisoned_allocations, randn, reference, rel_err,
)
from flashgen.runtime import plans, validate  # noqa: E402
from flashgen.runtime.families import sm80_fwd  # noqa: E402
from flashgen.spec.sm80_fwd import Sm80Fwd  # noqa: E402

pytestmark = gpu_marks()[1]
KERNELS = [b for b in ampere_kernels(Sm80Fwd.FAMILY) if not b.spec.bias and not b.spec.dropout]  # twins: test_sm80_{bias,dropout}_gpu
needs_sm80 = pytest.mark.skipif(not KERNELS, reason="needs a GPU of compute capability 8.0+ and sm80_fwd kernels "
                                                    "(flashgen build --arch sm80, or --arch sm90 on Hopper)")


@pytest.fixture(autouse=True)
def only_this_family(monkeypatch):
    """Forward calls go to sm80_fwd alone (the backward families stay available); plans made
    under another setting never answer (plans.find keys on it)."""
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd,sm90_bwd,mem_eff_bwd")


def selected(q, k, v, **options):
    return next(name for name, _, verdict in flashgen.explain(q, k, v, **options) if verdict == "selected")


def forward_reference(q, k, v, **options):
    """(out, lse) in float64, grouped-query k/v repeated for each query head."""
    group = q.shape[2] // k.shape[2]
    return reference(q, cupy.repeat(k, group, axis=2), cupy.repeat(v, group, axis=2), **options)


def check_forward(q, k, v, dtype, **options):
    """The public forward against the reference; returns (out, lse)."""
    assert selected(q, k, v, **options).startswith("sm80_fwd_"), "the call did not take the sm80 path"
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **options)
    ref_out, ref_lse = forward_reference(q, k, v, **options)
    B, M, H, Kv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    assert out.shape == (B, M, H, Kv) and lse.shape == (B, H, M)
    errors = {"out": rel_err(out, ref_out), "lse": lse_err(lse, ref_lse)}
    assert max(errors.values()) < FWD_TOL[dtype], (errors, options)
    return out, lse


@needs_sm80
@pytest.mark.parametrize("binary", KERNELS, ids=[b.name for b in KERNELS])
def test_every_instance(binary):
    """Each built kernel (not only the one the priority order picks) on odd sizes, M != N, a head
    dim below its tier, both causal kinds, a window with soft-capping, and the lse layout: [B, H,
    rows padded to 32] with +inf in the padding, as the example-41 backward reads it."""
    spec = binary.spec
    rng = np.random.default_rng(abs(hash(spec.name)) % 2**32)
    cases = (((1, 1), spec.max_k, None, None, 0.0), ((7, 129), spec.max_k, "top_left", None, 0.0),
             ((129, 7), spec.max_k - 24, None, None, 0.0), ((1000, 1000), spec.max_k, "bottom_right", None, 0.0),
             ((129, 1000), spec.max_k - 56, "bottom_right", None, 0.0), ((300, 700), spec.max_k, None, (200, 33), 8.0))
    for (M, N), K, causal, window, softcap in cases:
        q, k, v = (randn(rng, (2, S, 3, K), spec.dtype) for S in (M, N, N))
        options = {"causal": causal, "window": window, "softcap": softcap}
        call = validate.forward_call(q, k, v, options, flashgen.attention_forward)
        with poisoned_allocations():  # the family allocates out and lse
            out, lse = sm80_fwd.RUNTIME.launch(call, binary)
        ref_out, ref_lse = reference(q, k, v, **options)
        assert rel_err(out, ref_out) < FWD_TOL[spec.dtype], (M, N, K, options)
        assert lse_err(lse, ref_lse) < FWD_TOL[spec.dtype], (M, N, K, options)
        padded = lse.base if lse.base is not None else lse  # lse is a view of the padded rows the kernel writes
        assert padded.shape == (2, 3, -(-M // 32) * 32)
        assert bool((padded[:, :, M:] == np.inf).all()), "lse padding rows must be +inf, as example 41 writes them"


@needs_sm80
@pytest.mark.parametrize("dtype,K,M,N,causal", AMPERE_GRID,
                         ids=[f"{d}-k{k}-{m}x{n}-{c}" for d, k, m, n, c in AMPERE_GRID])
def test_matches_float64_reference(dtype, K, M, N, causal):
    rng = np.random.default_rng([K, M, N, len(dtype)])
    q, k, v = (randn(rng, (2, S, 3, K), dtype) for S in (M, N, N))
    check_forward(q, k, v, dtype, causal=causal)


@needs_sm80
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("K", [136, 160, 192, 200, 256])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_head_dims_past_128(dtype, K, causal):
    """The 192 and 256 tiers (head dims between them padded) through the public API: odd sizes both
    ways round, grouped-query k/v (two query heads per k/v head), out and lse against float64."""
    rng = np.random.default_rng([K, len(dtype), len(causal or "")])
    tier = 192 if K <= 192 else 256
    for M, N in ((129, 1000), (1000, 77)):
        q = randn(rng, (2, M, 4, K), dtype)
        k, v = (randn(rng, (2, N, 2, K), dtype) for _ in range(2))
        assert f"_k{tier}_" in selected(q, k, v, causal=causal)
        check_forward(q, k, v, dtype, causal=causal)


@needs_sm80
@pytest.mark.parametrize("scale", [0.02, 1.0, -0.3])
def test_scale_of_either_sign(scale):
    """The scores are scaled before the running max, so a negative scale (largest score last) is exact too."""
    rng = np.random.default_rng(int(abs(scale) * 100))
    q, k, v = (randn(rng, (1, S, 2, 64), "bf16") for S in (300, 500, 500))
    check_forward(q, k, v, "bf16", scale=scale, causal="top_left")


@needs_sm80
@pytest.mark.parametrize("layout", ["bhsk", "padded"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_strided_inputs(layout, causal):
    rng = np.random.default_rng(7)
    q, k, v = (make_input(rng, (2, S, 4, 64), "f16", layout) for S in (129, 1000, 1000))
    check_forward(q, k, v, "f16", causal=causal)


@needs_sm80
@pytest.mark.parametrize("K", [128, 192, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_grouped_query_attention_reads_kv_in_place(group, causal, K):
    rng = np.random.default_rng([group, len(causal or ""), K])
    q = randn(rng, (2, 129, 8, K), "bf16")
    k, v = (randn(rng, (2, 1000, 8 // group, K), "bf16") for _ in range(2))
    check_forward(q, k, v, "bf16", causal=causal)


@needs_sm80
@pytest.mark.parametrize("window", AMPERE_WINDOWS, ids=[f"w{a},{b}" for a, b in AMPERE_WINDOWS])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("dtype,K,M,N", AMPERE_WINDOW_SHAPES)
def test_sliding_windows(dtype, K, M, N, window, causal):
    rng = np.random.default_rng([K, M, N, *(x or 0 for x in window)])
    q, k, v = (randn(rng, (2, S, 3, K), dtype) for S in (M, N, N))
    check_forward(q, k, v, dtype, causal=causal, window=window)


@needs_sm80
@pytest.mark.parametrize("softcap", [1.0, 8.0, 50.0])
@pytest.mark.parametrize("dtype,K,causal", [("f16", 64, None), ("bf16", 128, "top_left"), ("bf16", 64, "bottom_right"),
                                           ("f16", 256, "top_left")])
def test_softcap(dtype, K, causal, softcap):
    rng = np.random.default_rng([K, int(softcap)])
    q, k, v = (randn(rng, (2, S, 2, K), dtype) for S in (1000, 777, 777))
    check_forward(q, k, v, dtype, causal=causal, softcap=softcap, scale=0.5)


@needs_sm80
def test_rows_whose_window_holds_no_key():
    """Rows that see no key: out 0, lse -inf, like causal rows without keys."""
    rng = np.random.default_rng(8)
    q, k, v = (randn(rng, (1, S, 2, 64), "f16") for S in (300, 100, 100))
    out, lse = check_forward(q, k, v, "f16", window=(0, 10))  # rows >= 100: no key
    assert bool((out[:, 100:] == 0).all()) and bool(cupy.isneginf(lse[:, :, 100:]).all())


@needs_sm80
@pytest.mark.parametrize("dtype,K,packing,mask", PACKED, ids=[f"{d}-k{k}-{p}-{m}" for d, k, p, m in PACKED])
def test_packed_batches_per_sequence(dtype, K, packing, mask):
    """Sequences packed along dim 1 (cu_seqlens), each against its own reference; lse [S, H,
    longest]; rows past the last sequence come back as zeros; grouped-query k/v."""
    q_lens, k_lens = PACKINGS[packing]
    options = PACKED_MASKS[mask]
    rng = np.random.default_rng([K, len(packing), mask])
    cu_q, cu_k = offsets(q_lens), offsets(k_lens)
    tail = 5
    q = randn(rng, (1, int(cu_q[-1]) + tail, 4, K), dtype)
    k, v = (randn(rng, (1, int(cu_k[-1]) + tail, 2, K), dtype) for _ in range(2))
    packed = dict(cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_k=cupy.asarray(cu_k), **options)
    assert selected(q, k, v, **packed).startswith("sm80_fwd_")
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **packed)
    assert lse.shape == (len(q_lens), 4, max(q_lens))
    for s, (m, n) in enumerate(zip(q_lens, k_lens)):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if m == 0:
            continue
        if n == 0:
            assert bool((out[:, qs] == 0).all()) and bool(cupy.isneginf(lse[s, :, :m]).all())
            continue
        ref_out, ref_lse = forward_reference(q[:, qs], k[:, ks], v[:, ks], **options)
        assert rel_err(out[:, qs], ref_out) < FWD_TOL[dtype], (s, options)
        assert lse_err(lse[s:s + 1, :, :m], ref_lse) < FWD_TOL[dtype], (s, options)
    assert bool((out[:, int(cu_q[-1]):] == 0).all()), "rows past the last sequence must be zeros"


@needs_sm80
def test_lse_feeds_the_example41_backward(monkeypatch):
    """The lse layout and values are the ones example 41's backward reads: gradients from this
    forward's out and lse match the reference."""
    if not ampere_kernels("mem_eff_bwd"):
        pytest.skip("no example-41 backward kernels built for this GPU")
    rng = np.random.default_rng(3)
    q, k, v = (randn(rng, (2, S, 3, 64), "bf16") for S in (1000, 129, 129))
    do = randn(rng, q.shape, "bf16")
    out, lse = check_forward(q, k, v, "bf16", causal="bottom_right")
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd,mem_eff_bwd")
    assert selected(q, k, v, causal="bottom_right", backward=True).startswith("mem_eff_bwd_")
    with poisoned_allocations():
        grads = flashgen.attention_backward(do, q, k, v, out, lse, causal="bottom_right")
    _, _, ref_grads = reference(q, k, v, causal="bottom_right", grad_out=do)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < BWD_TOL["bf16"]


@needs_sm80
def test_planned_repeat_uses_the_new_inputs():
    rng = np.random.default_rng(11)
    plans.clear()
    shape = (2, 257, 4, 128)
    first = [randn(rng, shape, "f16") for _ in range(3)]
    flashgen.attention_forward(*first, causal="top_left")
    second = [randn(rng, shape, "f16") for _ in range(3)]
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(*second, causal="top_left")
    assert [p.family for p in plans._plans.values()] == ["sm80_fwd"]
    ref_out, ref_lse = reference(*second, causal="top_left")
    assert rel_err(out, ref_out) < FWD_TOL["f16"] and lse_err(lse, ref_lse) < FWD_TOL["f16"]
    full, full_lse = flashgen.attention_forward(*[cupy.array(x) for x in second], causal="top_left")
    assert bool((full == out).all()) and bool((full_lse == lse).all()), "planned and full paths differ"


@needs_sm80
def test_what_it_refuses_goes_to_example41(monkeypatch):
    """Bias past the bias tiers, dropout with softcap (dropout alone: test_sm80_dropout_gpu.py), float32,
    different q/v head dims, 4-element alignment and head dims over 256 are refused with the reason, and
    (all families allowed) example 41 serves them."""
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (1, 130, 2, 64), "f16") for _ in range(3))
    bias = randn(rng, (1, 2, 130, 130), "f16")
    odd = randn(rng, (1, 130, 2, 68), "f16")[..., :60]  # row stride 136 elements: 8-aligned, head dim 60 is not
    wide = randn(rng, (1, 130, 2, 264), "f16")
    past_bias_tiers = tuple(randn(rng, (1, 130, 2, 192), "f16") for _ in range(3))  # no bias instance at 192
    for arrays, options, why in ((past_bias_tiers, {"attn_bias": bias}, "built without bias"),
                                 ((q, k, v), {"dropout_p": 0.1, "seed": 1, "softcap": 2.0},
                                  "dropout without attn_bias, block masks or softcap"),
                                 ((q, k, randn(rng, (1, 130, 2, 32), "f16")), {}, "equal q/v head dims only"),
                                 ((odd, odd, odd), {}, "needs 8-element alignment"),
                                 ((wide, wide, wide), {}, "kMaxK 256 < head dim 264")):
        call = validate.forward_call(*arrays, dict(options), flashgen.attention_forward)
        assert why in sm80_fwd.RUNTIME.refusal(call)
    monkeypatch.delenv("FLASHGEN_FAMILIES")
    out, _ = flashgen.attention_forward(wide, wide, wide)
    assert rel_err(out, reference(wide, wide, wide)[0]) < FWD_TOL["f16"]
