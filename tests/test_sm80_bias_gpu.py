"""flashgen's Ampere-class kernels with an additive attention bias (the sm80 `bias` instances) on a GPU
of compute capability 8.0 or newer, against the float64 reference: out, lse, dq, dk, dv and dbias.

Needs CuPy, such a GPU and the sm80 families built for it on FLASHGEN_KERNEL_PATH (`flashgen build
--arch sm80`, or `--arch sm90` on an H100/H200: plain sm90 code); skipped cleanly otherwise.  Every
test forces the Ampere families ahead of the sm90 ones (FLASHGEN_FAMILIES, example 41 allowed behind
them), results land in poisoned (NaN) memory, so an element a kernel forgot to write fails, and
every call that should run on an sm80 bias instance is checked to (through flashgen.explain).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    BIAS_BROADCASTS, BWD_TOL, FWD_TOL, ampere_kernels, assert_same_bits, gpu_marks, reference, lse_err,
    make_bias, poisoned_allocations, randn, rel_err,
)
from bias_checks import GRID, GRID_IDS, assert_bias_pair, check_bias  # noqa: E402
from flashgen.runtime import validate  # noqa: E402
from flashgen.runtime.families import sm80_bwd, sm80_fwd  # noqa: E402
from flashgen.spec.sm80_bwd import Sm80Bwd  # noqa: E402
from flashgen.spec.sm80_fwd import Sm80Fwd  # noqa: E402

pytestmark = gpu_marks()[1]
FORCED = "sm80_fwd,sm80_bwd,mem_eff_fwd,mem_eff_bwd"
FORWARDS = [b for b in ampere_kernels(Sm80Fwd.FAMILY) if b.spec.bias]
BACKWARDS = [b for b in ampere_kernels(Sm80Bwd.FAMILY) if b.spec.bias]
needs_sm80 = pytest.mark.skipif(not FORWARDS or not BACKWARDS,
                                reason="needs a GPU of compute capability 8.0+ and the sm80 bias instances "
                                       "(flashgen build --arch sm80, or --arch sm90 on Hopper)")


@pytest.fixture(autouse=True)
def ampere_first(monkeypatch):
    """The Ampere families before example 41, the sm90 ones left out; plans made under another setting
    never answer (plans.find keys on it)."""
    monkeypatch.setenv("FLASHGEN_FAMILIES", FORCED)


check = functools.partial(check_bias, "sm80")
assert_sm80_bias = functools.partial(assert_bias_pair, "sm80")


@needs_sm80
@pytest.mark.parametrize("dtype,K,broadcast,M,N,causal", GRID, ids=GRID_IDS)
def test_bias_matches_float64_reference(dtype, K, broadcast, M, N, causal):
    rng = np.random.default_rng([K, M, N, len(dtype), BIAS_BROADCASTS.index(broadcast), len(causal or "")])
    check(rng, dtype, B=2, M=M, N=N, H=3, K=K, broadcast=broadcast, causal=causal)


@needs_sm80
@pytest.mark.parametrize("binary", FORWARDS + BACKWARDS, ids=[b.name for b in FORWARDS + BACKWARDS])
def test_every_bias_instance(binary):
    """Each built bias kernel (not only the one the priority order picks: the 99 KB backward at 128 serves
    sm86/sm89 only) launched directly on odd sizes, M != N, a head dim below its tier, grouped-query k/v,
    each causal kind and a broadcast bias, against the reference."""
    spec = binary.spec
    rng = np.random.default_rng(abs(hash(spec.name)) % 2**32)
    cases = (((1, 1), spec.max_k, 1, "", {}), ((7, 129), spec.max_k, 2, "M", {"causal": "top_left"}),
             ((129, 7), spec.max_k - 24, 1, "B", {}), ((1000, 1000), spec.max_k, 2, "H", {"causal": "bottom_right"}),
             ((129, 1000), spec.max_k - 56, 4, "BHM", {"causal": "bottom_right"}),
             ((300, 700), spec.max_k, 2, "HM", {"window": (200, 33)}))
    for (M, N), K, group, broadcast, options in cases:
        q, k, v, do = (randn(rng, shape, spec.dtype) for shape in ((2, M, 2 * group, K), (2, N, 2, K), (2, N, 2, K),
                                                                   (2, M, 2 * group, K)))
        bias = make_bias(rng, spec.dtype, 2, 2 * group, M, N, broadcast)
        ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out=do, bias=bias, **options)
        if spec.FAMILY == "sm80_fwd":
            call = validate.forward_call(q, k, v, dict(options, attn_bias=bias), flashgen.attention_forward)
            with poisoned_allocations():
                out, lse = sm80_fwd.RUNTIME.launch(call, binary)
            errors = {"out": rel_err(out, ref_out), "lse": lse_err(lse, ref_lse)}
            assert all(e < FWD_TOL[spec.dtype] for e in errors.values()), (spec.name, M, N, K, errors)
            continue
        out, lse = flashgen.attention_forward(q, k, v, attn_bias=bias, **options)
        call = validate.backward_call(do, q, k, v, out, lse, dict(options, attn_bias=bias, bias_requires_grad=True),
                                      flashgen.attention_backward)
        with poisoned_allocations():
            grads = sm80_bwd.RUNTIME.launch(call, binary)
        # per (batch, head) from the family; summed as attention_backward sums it where the bias broadcasts
        grads = grads[:3] + (validate.fold_dbias(cupy, grads[3], bias, 2, 2 * group),)
        errors = {name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads)}
        assert len(grads) == 4 and all(e < BWD_TOL[spec.dtype] for e in errors.values()), (spec.name, M, N, K, errors)


@needs_sm80
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("causal,window", [(None, (100, 50)), ("bottom_right", (300, None)), ("top_left", (0, 0))])
def test_bias_with_windows(dtype, causal, window):
    rng = np.random.default_rng([len(dtype), len(causal or ""), window[0]])
    check(rng, dtype, B=2, M=700, N=1000, H=2, K=128, broadcast="H", causal=causal, window=window)


@needs_sm80
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("softcap", [1.0, 5.0, 30.0])
def test_bias_with_softcap_without_dbias(K, softcap):
    """Soft-capping with a bias: forward, dq, dk and dv on the bias instances (dbias with soft-capping
    is refused by sm80_bwd, see test_what_the_bias_instances_refuse)."""
    rng = np.random.default_rng([K, int(softcap)])
    check(rng, "bf16", B=2, M=300, N=517, H=2, K=K, broadcast="B", softcap=softcap, causal="top_left", dbias=False,
          scale=0.5)


@needs_sm80
@pytest.mark.parametrize("dtype,K,causal,group", [("bf16", 64, None, 4), ("f16", 128, "bottom_right", 4),
                                                  ("bf16", 128, "top_left", 2), ("f16", 64, "top_left", 8)])
def test_bias_grouped_query(dtype, K, causal, group):
    """query heads per k/v head: dk, dv summed per group, dbias per query head."""
    check(np.random.default_rng([K, group]), dtype, B=2, M=333, N=517, H=8, Hk=8 // group, K=K, broadcast="B",
          causal=causal)


@needs_sm80
@pytest.mark.parametrize("layout", ["bhsk", "padded"])
@pytest.mark.parametrize("K", [64, 128])
def test_bias_with_strided_inputs(layout, K):
    check(np.random.default_rng([K, len(layout)]), "bf16", B=2, M=257, N=300, H=3, K=K, broadcast="HM", layout=layout,
          causal="top_left")


@needs_sm80
@pytest.mark.parametrize("scale", [0.0, -0.3, 1.0])
def test_bias_with_a_scale_of_either_sign(scale):
    """With a bias the scores' max is taken after the bias joins them, whatever the scale's sign."""
    check(np.random.default_rng(int(abs(scale) * 10)), "f16", B=1, M=200, N=300, H=2, K=64, broadcast="M",
          scale=scale, causal="bottom_right")


@needs_sm80
def test_bias_head_dims_below_the_tiers_and_strided_bias():
    """Head dims 40 and 96 run on the 64 and 128 tiers; a bias that is a strided slice of a wider buffer
    (row stride a multiple of 8, no copy) and one with an odd key count (copied into padded rows)."""
    rng = np.random.default_rng(96)
    wide = randn(rng, (2, 3, 210, 1032), "f16")[:, :, 5:205, 4:1004]  # (2, 3, 200, 1000)
    check(rng, "f16", B=2, M=200, N=1000, H=3, K=96, bias=wide)
    check(rng, "f16", B=2, M=200, N=999, H=3, K=40, causal="top_left")
    check(rng, "bf16", B=1, M=1, N=7, H=1, K=8, broadcast="BHM")


@needs_sm80
def test_bias_with_infinite_entries():
    """-inf in the bias masks keys; a row that is -inf throughout sees no key: out 0, lse -inf, no
    gradient (dbias 0 there)."""
    rng = np.random.default_rng(7)
    B, H, M, N = 1, 2, 150, 260
    bias = randn(rng, (B, H, M, N), "bf16")
    bias[:, :, :, 100:130] = -np.inf
    bias[:, 1, 17, :] = -np.inf
    (_, _, _, _, _, out, lse), grads = check(rng, "bf16", B=B, M=M, N=N, H=H, K=64, bias=bias)
    assert not bool(out[:, 17, 1].astype(cupy.float32).any()) and bool(cupy.isneginf(lse[:, 1, 17]).all())
    assert not bool(grads[3][:, 1, 17].astype(cupy.float32).any()), "dbias of a row that sees no key"


@needs_sm80
def test_bias_deterministic_planned_and_without_dbias():
    """deterministic=True repeats bit for bit; a backward without dbias (which leaves a launch plan, the
    bias's pointer among its arrays) agrees with the one that returns it, and its planned repeat reads
    a new bias."""
    rng = np.random.default_rng(11)
    (q, k, v, do, bias, out, lse), grads = check(rng, "f16", B=2, M=600, N=700, H=4, Hk=2, K=128, broadcast="M",
                                                 causal="top_left", deterministic=True)
    again = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, bias_requires_grad=True,
                                        causal="top_left", deterministic=True)
    assert_same_bits(grads, again)
    for _ in range(2):  # the second call replays the first's plan
        plain = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, causal="top_left")
        assert len(plain) == 3
        for a, b in zip(plain, grads):
            assert rel_err(a, b.astype(cupy.float64)) < BWD_TOL["f16"]
    other = make_bias(rng, "f16", 2, 4, 600, 700, "M")
    for _ in range(2):  # forward and backward plans with another bias of the same signature
        out2, lse2 = flashgen.attention_forward(q, k, v, attn_bias=other, causal="top_left")
        got = flashgen.attention_backward(do, q, k, v, out2, lse2, attn_bias=other, causal="top_left")
    ref_out, _, ref_grads = reference(q, k, v, grad_out=do, bias=other, causal="top_left")
    assert rel_err(out2, ref_out) < FWD_TOL["f16"]
    assert all(rel_err(g, r) < BWD_TOL["f16"] for g, r in zip(got, ref_grads[:3]))


@needs_sm80
def test_what_the_bias_instances_refuse_example41_serves():
    """Head dim 192 (no bias tier there) and dbias with soft-capping are refused by the Ampere families
    with the reason; example 41 serves the first (the second no family serves: example 41 has no
    soft-capping)."""
    rng = np.random.default_rng(192)
    q, k, v = (randn(rng, (1, 130, 2, 192), "f16") for _ in range(3))
    bias = make_bias(rng, "f16", 1, 2, 130, 130)
    rows = flashgen.explain(q, k, v, attn_bias=bias)
    assert next(name for name, _, verdict in rows if verdict == "selected").startswith("mem_eff_fwd")
    assert any(name.startswith("sm80_fwd") and verdict == "built without bias" for name, _, verdict in rows)
    do = randn(rng, q.shape, "f16")
    out, lse = flashgen.attention_forward(q, k, v, attn_bias=bias)
    grads = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, bias_requires_grad=True)
    _, _, ref_grads = reference(q, k, v, grad_out=do, bias=bias)
    assert all(rel_err(g, r) < BWD_TOL["f16"] for g, r in zip(grads, ref_grads))
    q, k, v = (randn(rng, (1, 130, 2, 64), "f16") for _ in range(3))
    out, lse = flashgen.attention_forward(q, k, v, attn_bias=bias, softcap=5.0)
    call = validate.backward_call(out, q, k, v, out, lse, dict(attn_bias=bias, softcap=5.0, bias_requires_grad=True),
                                  flashgen.attention_backward)
    assert sm80_bwd.RUNTIME.refusal(call).startswith("softcap with bias_requires_grad")


BLOCK_MASKS = [  # dtype, B, H, M, N, K, mask(b, h, q, kv), the mask's (B, H), block, options
    ("f16", 2, 4, 300, 260, 64, lambda b, h, q, kv: (q % 7 != 3) & (kv <= q + 5), (1, 1), (64, 64), {}),
    ("bf16", 2, 2, 129, 700, 128, lambda b, h, q, kv: (kv <= q + 16 * h) & ((kv + b) % 3 != 0), (2, 2), (32, 128),
     {"causal": "bottom_right"}),
    ("f16", 1, 2, 64, 64, 64, lambda b, h, q, kv: (q < 0) & (kv < 0), (1, 1), (128, 128), {}),  # no key anywhere
]


@needs_sm80
@pytest.mark.parametrize("dtype,B,H,M,N,K,mask,mask_bh,block,options", BLOCK_MASKS, ids=["holes", "per-head", "nothing"])
def test_a_block_mask_runs_dense_on_the_bias_instances(dtype, B, H, M, N, K, mask, mask_bh, block, options):
    """No sm80 kernel reads block lists, so a block mask runs as its dense bias (block_fallback), which the
    sm80 bias instances take: forward and gradients against the reference with the same bias, and rows
    that see no key get output 0, lse -inf and dq 0."""
    rng = np.random.default_rng(M + N + K)
    q, do = (randn(rng, (B, M, H, K), dtype) for _ in range(2))
    k, v = (randn(rng, (B, N, H, K), dtype) for _ in range(2))
    bm = flashgen.block_mask(mask, *mask_bh, M, N, block=block)
    for backward in (False, True):
        rows = flashgen.explain(q, k, v, block_mask=bm, backward=backward, **options)
        chosen = next(name for name, _, verdict in rows if verdict == "selected")
        assert chosen.startswith("sm80_bwd_" if backward else "sm80_fwd_") and "_bias_" in chosen, chosen
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, block_mask=bm, **options)
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm, **options)
    ro, rl, (rdq, rdk, rdv, _) = reference(q, k, v, grad_out=do, bias=bm.to_dense(cupy.float32), **options)
    assert rel_err(out, ro) < FWD_TOL[dtype] and lse_err(lse, rl) < FWD_TOL[dtype]
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, ref, zero_scale=np.sqrt(K)) < BWD_TOL[dtype]
    empty = cupy.isneginf(rl)  # [B, H, M]
    rows = cupy.ascontiguousarray(cupy.transpose(empty, (0, 2, 1)))
    assert bool((out[rows] == 0).all()) and bool(cupy.isneginf(lse[empty]).all()) and bool((dq[rows] == 0).all())
