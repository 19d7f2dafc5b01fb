"""flashgen's Hopper forward (sm90_fwd) on a 9.0 GPU against a float64 reference.

Needs CuPy, an H100/H200 and the family built for it on FLASHGEN_KERNEL_PATH
(`flashgen build --arch sm90a`); skipped cleanly otherwise.  Outputs come from
poisoned (NaN) memory, so an element the kernel forgot to write fails.
"""
from __future__ import annotations


import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    BWD_TOL, FWD_TOL, lse_err, make_bias, make_input, poisoned_allocations, randn, reference,
    rel_err, gpu_marks, hopper_kernels,
)
from flashgen.runtime import plans, validate  # noqa: E402
from flashgen.runtime.families import sm90_bwd, sm90_fwd  # noqa: E402
from flashgen.runtime.device import device_info  # noqa: E402
from flashgen.runtime.registry import default_registry  # noqa: E402
from flashgen.spec.sm90_fwd import Sm90Fwd  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()


def _example41_kernels() -> bool:
    try:
        return HAVE_GPU and bool(default_registry().for_device("mem_eff_fwd", device_info(0)))
    except flashgen.UnsupportedError:
        return False


KERNELS = hopper_kernels(Sm90Fwd.FAMILY)
# the others have tests of their own: sparse in test_block_sparse_gpu.py, dropout in test_sm90_dropout_gpu.py,
# score mods in test_score_mods_gpu.py
PLAIN_KERNELS = [b for b in KERNELS if not (b.spec.sparse or b.spec.dropout or b.spec.score_mod)]
needs_kernels = pytest.mark.skipif(not _example41_kernels(), reason="no example-41 kernels built for this GPU")
needs_sm90 = pytest.mark.skipif(not KERNELS, reason="needs a 9.0 GPU and sm90_fwd kernels (flashgen build --arch sm90a)")


def selected(q, k, v, **options):
    return next(name for name, _, verdict in flashgen.explain(q, k, v, **options) if verdict == "selected")


def check_forward(rng, dtype, B, M, N, H, K, causal=None, layout="contiguous"):
    q = make_input(rng, (B, M, H, K), dtype, layout)
    k = make_input(rng, (B, N, H, K), dtype, layout)
    v = make_input(rng, (B, N, H, K), dtype, layout)
    assert selected(q, k, v, causal=causal).startswith("sm90_fwd_"), "the call did not take the sm90 path"
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, causal=causal)
    ref_out, ref_lse = reference(q, k, v, causal=causal)
    assert out.shape == (B, M, H, K) and lse.shape == (B, H, M)
    errors = {"out": rel_err(out, ref_out), "lse": lse_err(lse, ref_lse)}
    assert errors["out"] < FWD_TOL[dtype] and errors["lse"] < FWD_TOL[dtype], errors
    return q, k, v, out, lse


SIZES = ((1, 1), (7, 129), (129, 7), (1000, 129), (129, 1000), (1000, 1000), (1, 1000), (4096, 4096))
HEAD_DIMS = (8, 40, 64, 80, 96, 128, 160, 192, 248, 256)
GRID = [(dtype, K, *SIZES[(i + j) % len(SIZES)], causal)
        for i, dtype in enumerate(("f16", "bf16")) for j, K in enumerate(HEAD_DIMS)
        for causal in (None, "top_left", "bottom_right")]


@needs_sm90
@pytest.mark.parametrize("dtype,K,M,N,causal", GRID, ids=[f"{d}-k{k}-{m}x{n}-{c}" for d, k, m, n, c in GRID])
def test_matches_float64_reference(dtype, K, M, N, causal):
    check_forward(np.random.default_rng([K, M, N, len(dtype)]), dtype, B=2, M=M, N=N, H=3, K=K, causal=causal)


@needs_sm90
@pytest.mark.parametrize("layout", ["bhsk", "padded"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_strided_inputs(layout, causal):
    check_forward(np.random.default_rng(7), "f16", B=2, M=129, N=1000, H=4, K=64, causal=causal, layout=layout)


PERSISTENT = [(dtype, K, M, N, causal, window) for dtype, K, M, N in (("bf16", 64, 1500, 1300), ("f16", 128, 1100, 1100))
              for causal, window in ((None, None), ("top_left", None), ("bottom_right", None), (None, (300, 0)))]


@needs_sm90
@pytest.mark.parametrize("dtype,K,M,N,causal,window", PERSISTENT,
                         ids=[f"{d}-k{k}-{m}x{n}-{c}-{w}" for d, k, m, n, c, w in PERSISTENT])
def test_persistent_ctas_walk_many_tiles(dtype, K, M, N, causal, window):
    """The grid has one CTA per SM, each walking its share of the work (FwdKernel::Schedule): with
    3 x 12 heads and 8-9 query blocks every CTA takes several tiles, or pairs of tiles under a
    band mask (odd and even counts), carrying the K/V ring, the Q buffer and the warpgroups'
    turns from one to the next; a tile computed twice or never shows as a wrong or NaN row."""
    B, H = 3, 12
    rng = np.random.default_rng([K, M, N])
    q, k, v = (randn(rng, (B, S, H, K), dtype) for S in (M, N, N))
    assert selected(q, k, v, causal=causal, window=window).startswith("sm90_fwd_")
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, causal=causal, window=window)
    ref_out, ref_lse = reference(q, k, v, causal=causal, window=window)
    assert rel_err(out, ref_out) < FWD_TOL[dtype] and lse_err(lse, ref_lse) < FWD_TOL[dtype]


@needs_sm90
@pytest.mark.parametrize("binary", PLAIN_KERNELS, ids=[b.name for b in PLAIN_KERNELS])
def test_every_instance(binary):
    """Each built kernel (not only the ones the priority order picks) on odd sizes, M != N; band
    kernels with a causal mask, then a sliding window; soft-capping (a run-time option) on one size;
    bias kernels with a bias, broadcast in a different way in each case."""
    spec = binary.spec
    rng = np.random.default_rng(abs(hash(spec.name)) % 2**32)
    causal = "bottom_right" if spec.band else None
    cases = (((129, 1000), spec.max_k, None, 0.0, ""), ((1000, 1000), spec.max_k - 24, None, 0.0, "M"),
             ((7, 7), spec.max_k, None, 0.0, "BH"),
             ((300, 700), spec.max_k, (200, 33) if spec.band else None, 8.0, "B"))
    for (M, N), K, window, softcap, broadcast in cases:
        q, k, v = (randn(rng, (2, S, 3, K), spec.dtype) for S in (M, N, N))
        bias = make_bias(rng, spec.dtype, 2, 3, M, N, broadcast) if spec.bias else None
        call = validate.forward_call(q, k, v, {"causal": causal, "window": window, "softcap": softcap,
                                               "attn_bias": bias}, flashgen.attention_forward)
        with poisoned_allocations():  # the family allocates out and lse
            out, lse = sm90_fwd.RUNTIME.launch(call, binary)
        ref_out, ref_lse = reference(q, k, v, bias=bias, causal=causal, window=window, softcap=softcap)
        assert rel_err(out, ref_out) < FWD_TOL[spec.dtype], (M, N, K)
        assert lse_err(lse, ref_lse) < FWD_TOL[spec.dtype], (M, N, K)
        padded = lse.base  # lse is a view of the rows the kernel writes, padded to 32
        assert padded.shape[2] == -(-M // 32) * 32
        assert bool((padded[:, :, M:] == np.inf).all()), "lse padding rows must be +inf, as example 41 writes them"


@needs_sm90
@pytest.mark.parametrize("binary", PLAIN_KERNELS, ids=[b.name for b in PLAIN_KERNELS])
@pytest.mark.parametrize("keys", ["rising", "falling"])
def test_rows_whose_max_moves_far_between_key_blocks(binary, keys):
    """Keys scaled up along the sequence ("rising": each key block raises a row's max by several units,
    so the softmax rescales O and the row sum again and again) or down ("falling": the first block
    holds the max and later blocks keep it as their reference)."""
    spec = binary.spec
    rng = np.random.default_rng(13)
    M, N, K = 300, 1000, spec.max_k
    growth = 1 + 0.03 * np.arange(N)
    factor = growth if keys == "rising" else growth[::-1]
    q, v = randn(rng, (2, M, 3, K), spec.dtype), randn(rng, (2, N, 3, K), spec.dtype)
    k = cupy.asarray((rng.standard_normal((2, N, 3, K)) * factor[None, :, None, None]).astype(np.float32))
    k = k.astype(q.dtype)
    causal = "bottom_right" if spec.band else None
    bias = make_bias(rng, spec.dtype, 2, 3, M, N, "") if spec.bias else None
    call = validate.forward_call(q, k, v, {"causal": causal, "attn_bias": bias}, flashgen.attention_forward)
    with poisoned_allocations():
        out, lse = sm90_fwd.RUNTIME.launch(call, binary)
    ref_out, ref_lse = reference(q, k, v, bias=bias, causal=causal)
    assert rel_err(out, ref_out) < FWD_TOL[spec.dtype] and lse_err(lse, ref_lse) < FWD_TOL[spec.dtype]


@needs_sm90
@pytest.mark.parametrize("K", [64, 256])
def test_lse_feeds_the_backward(K):
    """The forward's lse layout is the one both backward families read."""
    rng = np.random.default_rng(3)
    B, M, N, H = 2, 1000, 129, 3
    q, k, v = (randn(rng, (B, S, H, K), "bf16") for S in (M, N, N))
    do = randn(rng, (B, M, H, K), "bf16")
    assert selected(q, k, v, causal="top_left").startswith("sm90_fwd_")
    backward = selected(q, k, v, causal="top_left", backward=True)
    assert backward.startswith("sm90_bwd_"), backward
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, causal="top_left")
        grads = flashgen.attention_backward(do, q, k, v, out, lse, causal="top_left")
    _, _, ref_grads = reference(q, k, v, causal="top_left", grad_out=do)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < BWD_TOL["bf16"]
    # a grad_out TMA cannot describe (4 elements off alignment) sends the backward to example 41,
    # which reads the same lse
    skewed = cupy.empty(do.size + 4, dtype=do.dtype)[4:].reshape(do.shape)
    skewed[...] = do
    call = validate.backward_call(skewed, q, k, v, out, lse, {"causal": "top_left"}, flashgen.attention_backward)
    assert sm90_bwd.RUNTIME.refusal(call) == "TMA cannot read grad_out: its address is not 16-byte aligned (8 bytes off)"
    with poisoned_allocations():
        grads = flashgen.attention_backward(skewed, q, k, v, out, lse, causal="top_left")
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < BWD_TOL["bf16"]


@needs_sm90
def test_planned_repeat_uses_the_new_inputs():
    """The second call with a signature goes through its launch plan, whose tensor maps must
    point at the new arrays (not the first call's)."""
    rng = np.random.default_rng(11)
    plans.clear()
    shape = (2, 257, 4, 128)
    first = [randn(rng, shape, "f16") for _ in range(3)]
    flashgen.attention_forward(*first, causal="top_left")
    second = [randn(rng, shape, "f16") for _ in range(3)]
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(*second, causal="top_left")
    assert len(plans._plans) == 1 and next(iter(plans._plans.values())).tensor_maps, "no tensor-map plan was made"
    ref_out, ref_lse = reference(*second, causal="top_left")
    assert rel_err(out, ref_out) < FWD_TOL["f16"] and lse_err(lse, ref_lse) < FWD_TOL["f16"]
    full, full_lse = flashgen.attention_forward(*[cupy.array(x) for x in second], causal="top_left")
    assert bool((full == out).all()) and bool((full_lse == lse).all()), "planned and full paths differ"


@needs_sm90
def test_falls_back_where_the_family_has_no_kernel():
    """float32, dropout, cu_seqlens-free calls with different q/v head dims and TMA-hostile strides
    go to the example-41 kernels and stay correct."""
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (1, 130, 2, 64), "f16") for _ in range(3))
    assert selected(q.astype(cupy.float32), k.astype(cupy.float32), v.astype(cupy.float32)).startswith("mem_eff")
    wide = randn(rng, (1, 130, 2, 192), "f16")  # dropout instances stop at head dim 128
    assert selected(wide, wide, wide, dropout_p=0.1).startswith("mem_eff")
    assert selected(q, k, randn(rng, (1, 130, 2, 32), "f16")).startswith("mem_eff")
    odd = randn(rng, (1, 130, 2, 68), "f16")[..., :60]  # row stride 136 elements: not 16-byte aligned
    assert selected(odd, odd, odd).startswith("mem_eff")
    out, lse = flashgen.attention_forward(odd, odd, odd)
    ref_out, _ = reference(odd, odd, odd)
    assert rel_err(out, ref_out) < FWD_TOL["f16"]


@needs_sm90
def test_kernel_choice_follows_head_dim_tier_and_mask():
    rng = np.random.default_rng(1)
    for K, tier in ((40, 64), (64, 64), (80, 96), (96, 96), (120, 128), (128, 128), (136, 192), (192, 192),
                    (200, 256), (256, 256)):
        q = randn(rng, (1, 64, 2, K), "bf16")
        for causal in (None, "top_left"):
            name = selected(q, q, q, causal=causal)
            assert f"_k{tier}_" in name and name.startswith("sm90_fwd_bf16") and ("_band_" in name) == bool(causal)
    big = randn(rng, (1, 64, 2, 264), "f16")
    assert selected(big, big, big).startswith("mem_eff"), "no sm90 tier above 256: example 41 serves it"


@needs_kernels
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_grouped_query_attention(group, causal):
    """k/v with H / group heads: the sm90 forward reads them in place (no repeated copy), the
    backward sums the gradients of each group; both against a float64 reference."""
    rng = np.random.default_rng([group, causal is None])
    B, M, N, H, K = 2, 129, 1000, 8, 64
    q = randn(rng, (B, M, H, K), "bf16")
    k, v = (randn(rng, (B, N, H // group, K), "bf16") for _ in range(2))
    do = randn(rng, (B, M, H, K), "bf16")
    if KERNELS:
        assert selected(q, k, v, causal=causal).startswith("sm90_fwd_")
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, causal=causal)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, causal=causal)
    ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out=do, causal=causal)
    assert rel_err(out, ref_out) < FWD_TOL["bf16"] and lse_err(lse, ref_lse) < FWD_TOL["bf16"]
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.shape, name
        assert rel_err(g, r) < BWD_TOL["bf16"], name


@needs_sm90
@pytest.mark.parametrize("N", [7, 1000, 2048, 2049, 5000])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_staged_o_serves_calls_of_few_key_blocks(N, causal):
    """Head dim 128: the staged-O tile takes calls of at most 16 key blocks (any, with a band), the
    176-key tile the longer unmasked ones; both match the reference (M != N, rows past a block,
    poisoned outputs)."""
    rng = np.random.default_rng(N)
    q, k, v = (randn(rng, (2, n, 3, 128), "bf16") for n in (333, N, N))
    name = selected(q, k, v, causal=causal)
    long_unmasked = causal is None and N > 2048
    assert name == ("sm90_fwd_bf16_k128_q128x176_s2_sm90a" if long_unmasked
                    else f"sm90_fwd_bf16_k128_q128x128_s2{'_band' if causal else ''}_staged_o_sm90a"), name
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, causal=causal)
    ref_out, ref_lse = reference(q, k, v, causal=causal)
    assert rel_err(out, ref_out) < FWD_TOL["bf16"] and lse_err(lse, ref_lse) < FWD_TOL["bf16"]


@needs_sm90
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("M, N, H, Hk, K, layout", [
    (1, 2049, 4, 1, 128, "contiguous"),    # one query, a last key block of 113 keys
    (129, 2113, 6, 2, 120, "padded"),      # 12 key blocks of 176 and one of 1, head dim below the tier
    (1000, 4000, 2, 2, 128, "bhsk"),       # heads-major strides
    (7, 5281, 8, 8, 104, "contiguous"),    # 30 blocks and one key
])
def test_the_176_key_tile_serves_long_unmasked_calls(dtype, M, N, H, Hk, K, layout):
    """The 176-key tile (head dim 128, unmasked, more than 2048 keys) against the float64 reference:
    partial last key blocks, M != N, grouped-query heads, strided inputs, head dims below 128."""
    rng = np.random.default_rng(N + M)
    q = make_input(rng, (2, M, H, K), dtype, layout)
    k, v = (make_input(rng, (2, N, Hk, K), dtype, layout) for _ in range(2))
    assert selected(q, k, v) == f"sm90_fwd_{dtype}_k128_q128x176_s2_sm90a"
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v)
    ref_out, ref_lse = reference(q, *(cupy.repeat(x, H // Hk, axis=2) for x in (k, v)))
    assert rel_err(out, ref_out) < FWD_TOL[dtype] and lse_err(lse, ref_lse) < FWD_TOL[dtype]


@needs_kernels
def test_grouped_query_attention_on_the_example41_path():
    """float32 has no sm90 kernel: the runtime repeats k/v for the example-41 forward."""
    rng = np.random.default_rng(2)
    q = randn(rng, (1, 65, 4, 32), "f32")
    k, v = (randn(rng, (1, 70, 1, 32), "f32") for _ in range(2))
    assert selected(q, k, v).startswith("mem_eff_fwd")
    out, lse = flashgen.attention_forward(q, k, v, causal="top_left")
    ref_out, ref_lse = reference(q, cupy.repeat(k, 4, axis=2), cupy.repeat(v, 4, axis=2), causal="top_left")
    assert rel_err(out, ref_out) < FWD_TOL["f32"] and lse_err(lse, ref_lse) < FWD_TOL["f32"]
