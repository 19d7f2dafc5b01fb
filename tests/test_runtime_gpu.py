"""The runtime on a real GPU against a float64 reference.

Needs CuPy, a CUDA GPU and kernels built for it on FLASHGEN_KERNEL_PATH
(`flashgen build --arch sm90 --out build/kernels`); skipped cleanly otherwise.
Every output is allocated from poisoned memory (all bits set: NaN), so an
element the kernel forgot to write fails the comparison.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import flashgen  # noqa: E402
from attention_reference import (  # noqa: E402
    BWD_TOL, DTYPES, FWD_TOL, f64, lse_err, make_input, poisoned_allocations, randn, recover_keep_mask, reference,
    rel_err, gpu_marks,
)
from flashgen.errors import UnsupportedError  # noqa: E402
from flashgen.runtime import families, plans  # noqa: E402
from flashgen.runtime.registry import default_registry  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()


@pytest.fixture(scope="module", autouse=True)
def kernels_present():
    if not HAVE_GPU:
        return
    try:
        default_registry().for_device("mem_eff_fwd", flashgen.runtime.device.device_info(0))
    except UnsupportedError as e:
        pytest.skip(f"no kernels for this GPU: {e}")


def check_forward_backward(rng, dtype, B, M, N, H, K, Kv, causal=None, bias=None, layout="contiguous"):
    q = make_input(rng, (B, M, H, K), dtype, layout)
    k = make_input(rng, (B, N, H, K), dtype, layout)
    v = make_input(rng, (B, N, H, Kv), dtype, layout)
    do = randn(rng, (B, M, H, Kv), dtype)
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, causal=causal, attn_bias=bias)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, causal=causal, attn_bias=bias,
                                            bias_requires_grad=bias is not None)
    ref_out, ref_lse, ref_grads = reference(q, k, v, bias=bias, causal=causal, grad_out=do)
    assert out.shape == (B, M, H, Kv) and lse.shape == (B, H, M) and out.dtype == q.dtype
    errors = {"out": rel_err(out, ref_out), "lse": lse_err(lse, ref_lse)}
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        if name == "dbias" and bias is None:
            continue
        assert g.shape == r.shape, name
        errors[name] = rel_err(g, r)
    if os.environ.get("FLASHGEN_ERROR_LOG"):  # measured errors, for the notes
        with open(os.environ["FLASHGEN_ERROR_LOG"], "a") as log:
            log.write(json.dumps({"case": [dtype, B, M, N, H, K, Kv, causal, bias is not None, layout],
                                  "errors": errors}) + "\n")
    assert errors["out"] < FWD_TOL[dtype] and errors["lse"] < FWD_TOL[dtype], errors
    assert all(e < BWD_TOL[dtype] for n, e in errors.items() if n not in ("out", "lse")), errors
    return errors


HEAD_DIMS = (8, 40, 64, 80, 128, 160, 256, 320)
SIZES = ((1, 1), (7, 129), (129, 7), (1000, 129), (129, 1000), (1000, 1000), (7, 7), (1, 1000))
CAUSAL = (None, "top_left", "bottom_right")
GRID = [(dtype, K, *SIZES[(i + j) % len(SIZES)], CAUSAL[(i + 2 * j) % 3])
        for i, dtype in enumerate(DTYPES) for j, K in enumerate(HEAD_DIMS)]


@pytest.mark.parametrize("dtype,K,M,N,causal", GRID, ids=[f"{d}-k{k}-{m}x{n}-{c}" for d, k, m, n, c in GRID])
def test_matches_float64_reference(dtype, K, M, N, causal):
    rng = np.random.default_rng([K, M, N, len(dtype)])
    check_forward_backward(rng, dtype, B=2, M=M, N=N, H=3, K=K, Kv=K, causal=causal)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("K,M,N,causal", [(64, 256, 256, None), (128, 128, 384, "top_left"),
                                          (96, 384, 128, "bottom_right"), (32, 64, 64, None)])
def test_block_aligned_backward_kernels(dtype, K, M, N, causal, monkeypatch):
    """M and N multiples of the block: the backward takes a block-aligned kernel (no bounds
    checks), and it matches the reference; one row more and it takes the general kernel.
    (On a 9.0 GPU such calls go to flashgen's own families: they are kept out of the way here.)"""
    built = default_registry().for_device("mem_eff_bwd", flashgen.runtime.device.device_info(0))
    if not any(b.spec.block_aligned for b in built):
        pytest.skip("no block-aligned example-41 backward in this build: plain targets from sm80 on leave f16/bf16 "
                    "below kMaxK 65536 to the sm80 pair (an sm90a or sm75 build has them)")
    for family in families.serving("fwd") + families.serving("bwd"):
        if not family.name.startswith("mem_eff"):
            monkeypatch.setattr(family, "unfit", lambda call: "kept out of the way")
    plans.clear()  # and no plan made earlier may route these signatures either
    r = np.random.default_rng(M + N + K)

    def chosen(rows):
        q, k = randn(r, (2, rows, 2, K), dtype), randn(r, (2, N, 2, K), dtype)
        return [name for name, _, verdict in flashgen.explain(q, k, k, backward=True) if verdict == "selected"][0]

    assert "blockaligned" in chosen(M)
    check_forward_backward(r, dtype, 2, M, N, 2, K, K, causal=causal)
    assert "blockaligned" not in chosen(M + 1)
    plans.clear()  # the plans made here bypassed the other families


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("K,Kv", [(64, 128), (128, 40), (32, 256)])
def test_head_dim_value_differs(dtype, K, Kv):
    check_forward_backward(np.random.default_rng(K * Kv), dtype, B=2, M=129, N=200, H=2, K=K, Kv=Kv)


@pytest.mark.parametrize("layout", ["bhsk", "padded"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_strided_inputs(dtype, layout):
    check_forward_backward(np.random.default_rng(7), dtype, B=2, M=129, N=77, H=3, K=64, Kv=64,
                           causal="top_left", layout=layout)


@pytest.mark.parametrize("dtype,offset", [("f16", 4), ("bf16", 4), ("f16", 1)])
@pytest.mark.parametrize("which", ["out", "grad_out", "both"])
def test_backward_takes_out_and_grad_out_off_16_byte_alignment(dtype, offset, which):
    """out / grad_out `offset` elements off a 16-byte boundary (views into larger buffers): the
    example-41 backward, which reads them 16 bytes at a time, must get aligned copies, not fault."""
    rng = np.random.default_rng([len(which), offset])
    q, k, v = (randn(rng, (2, 1000, 3, 64), dtype) for _ in range(3))
    do = randn(rng, q.shape, dtype)
    out, lse = flashgen.attention_forward(q, k, v, causal="top_left")

    def skewed(x):
        y = cupy.empty(x.size + offset, dtype=x.dtype)[offset:].reshape(x.shape)
        y[...] = x
        return y

    out_given = skewed(out) if which in ("out", "both") else out
    do_given = skewed(do) if which in ("grad_out", "both") else do
    with poisoned_allocations():
        grads = flashgen.attention_backward(do_given, q, k, v, out_given, lse, causal="top_left")
    cupy.cuda.runtime.deviceSynchronize()
    _, _, ref_grads = reference(q, k, v, causal="top_left", grad_out=do)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < BWD_TOL[dtype]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape,causal", [("full", None), ("broadcast_heads", None), ("full", "top_left")])
def test_bias_and_its_gradient(dtype, shape, causal):
    rng = np.random.default_rng(11)
    B, H, M, N = 2, 3, 129, 270  # with top_left, whole key blocks are masked out: their dbias must be 0
    bias = randn(rng, (B, H, M, N) if shape == "full" else (B, 1, M, N), dtype)
    bias = cupy.broadcast_to(bias, (B, H, M, N))
    check_forward_backward(rng, dtype, B=B, M=M, N=N, H=H, K=64, Kv=64, bias=bias, causal=causal)



@pytest.mark.parametrize("shape", [(1, 3, 129, 7), (2, 1, 1, 270), (3, 129, 1)])
def test_a_misaligned_bias_is_padded_in_its_own_extents(shape):
    """A bias whose rows are not 16-byte aligned is copied into padded rows: only the caller's own
    extents, its broadcast dims left at stride 0, so that the kernels read a bias the batch shares
    once (not once a batch) and sm90_bwd adds dbias into the bias's own shape."""
    from flashgen.runtime.validate import FORWARD_OPTIONS, forward_call
    rng = np.random.default_rng(5)
    B, H, M, N = 2, 3, 129, shape[-1] if shape[-1] > 1 else 270
    q = randn(rng, (B, M, H, 64), "f16")
    k = randn(rng, (B, N, H, 64), "f16")
    bias = randn(rng, shape, "f16")
    call = forward_call(q, k, k, dict(FORWARD_OPTIONS, attn_bias=bias), entry=None)
    assert call.bias.shape == (B, H, M, N) and call.bias.strides[2] % 16 == 0
    extents = (1,) * (4 - len(shape)) + shape
    for dim, extent in enumerate(extents[:3]):
        assert (call.bias.strides[dim] == 0) == (extent == 1 and (B, H, M)[dim] > 1), (dim, call.bias.strides)
    assert bool((call.bias == cupy.broadcast_to(bias, (B, H, M, N))).all())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_varlen_matches_per_sequence_reference(dtype):
    rng = np.random.default_rng(3)
    q_lens, k_lens = [7, 129, 1, 300], [50, 129, 33, 1]
    H, K = 2, 64
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = randn(rng, (1, cu_q[-1], H, K), dtype)
    k = randn(rng, (1, cu_k[-1], H, K), dtype)
    v = randn(rng, (1, cu_k[-1], H, K), dtype)
    do = randn(rng, (1, cu_q[-1], H, K), dtype)
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal="top_left")
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                 causal="top_left")
    assert lse.shape == (4, H, max(q_lens))
    for s in range(4):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        ro, rl, (rdq, rdk, rdv, _) = reference(q[:, qs], k[:, ks], v[:, ks], causal="top_left", grad_out=do[:, qs])
        assert rel_err(out[:, qs], ro) < FWD_TOL[dtype]
        assert lse_err(lse[s:s + 1, :, :q_lens[s]], rl) < FWD_TOL[dtype]
        for g, r in ((dq[:, qs], rdq), (dk[:, ks], rdk), (dv[:, ks], rdv)):
            assert rel_err(g, r) < BWD_TOL[dtype]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_dropout_forward_and_backward_draw_the_same_mask(dtype):
    rng = np.random.default_rng(5)
    B, M, N, H, K, p, seed = 2, 100, 64, 3, 64, 0.3, 1234
    q, k = randn(rng, (B, M, H, K), dtype, 0.5), randn(rng, (B, N, H, K), dtype, 0.5)
    v, do = randn(rng, (B, N, H, K), dtype), randn(rng, (B, M, H, K), dtype)
    keep = recover_keep_mask(q, k, p, seed, v=v)  # f16 draws on a flashgen pair where built: its rule's mask
    rate = float(keep.mean())
    assert abs(rate - (1 - p)) < 0.01, rate
    other = recover_keep_mask(q, k, p, seed + 1, v=v)
    assert float((other != keep).mean()) > 0.3  # a different seed, a different mask
    assert bool((recover_keep_mask(q, k, p, seed, v=v) == keep).all())  # the same seed, the same mask

    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, dropout_p=p, seed=seed)
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, dropout_p=p, seed=seed)
    ro, rl, (rdq, rdk, rdv, _) = reference(q, k, v, keep=keep, p=p, grad_out=do)
    assert rel_err(out, ro) < FWD_TOL[dtype]
    for g, r in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, r) < BWD_TOL[dtype]  # only holds if the backward redraws the forward's mask


def test_graph_capture_replays_forward_and_backward():
    rng = np.random.default_rng(9)
    q, k, v = (randn(rng, (2, 257, 4, 64), "f16") for _ in range(3))
    do = randn(rng, (2, 257, 4, 64), "f16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = flashgen.attention_forward(q, k, v, causal="top_left")  # warm-up: select, load
        grads = flashgen.attention_backward(do, q, k, v, out, lse, causal="top_left")
        stream.begin_capture()
        g_out, g_lse = flashgen.attention_forward(q, k, v, causal="top_left")
        g_grads = flashgen.attention_backward(do, q, k, v, g_out, g_lse, causal="top_left")
        graph = stream.end_capture()
        for x in (g_out, g_lse, *g_grads):
            x.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    assert bool((g_out == out).all()) and bool((g_lse == lse).all())
    for a, b in zip(g_grads, grads):
        assert float(cupy.abs(f64(a) - f64(b)).max()) <= 1e-3 * float(cupy.abs(f64(b)).max())


def test_torch_tensors_are_viewed_without_copy():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 65, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = flashgen.attention_forward(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
    err = (torch.from_dlpack(out).float() - ref.transpose(1, 2)).norm() / ref.norm()
    assert float(err) < FWD_TOL["bf16"]
    assert flashgen.runtime.arrays.as_array(q, "q").data.ptr == q.data_ptr()


def test_unsupported_head_dim_names_every_candidate():
    q = cupy.zeros((1, 8, 1, 6), dtype=cupy.float16)  # 6 is not a multiple of 4
    with pytest.raises(UnsupportedError) as e:
        flashgen.attention_forward(q, q, q)
    msg = str(e.value)
    assert "mem_eff_fwd_f16_unaligned_q32x128_k65536_bias_sm80" in msg and "alignment" in msg
    assert "pad the head dim" in msg
    ok = cupy.zeros((1, 8, 1, 64), dtype=cupy.float16)
    rows = flashgen.explain(ok, ok, ok)
    assert sum(1 for *_, verdict in rows if verdict == "selected") == 1


def test_zero_length_sequences_need_no_launch():
    q = cupy.ones((2, 0, 3, 64), dtype=cupy.float16)
    k = cupy.ones((2, 5, 3, 64), dtype=cupy.float16)
    out, lse = flashgen.attention_forward(q, k, k)
    assert out.shape == (2, 0, 3, 64) and lse.shape == (2, 3, 0)
    q = cupy.ones((2, 4, 3, 64), dtype=cupy.float16)
    k0 = cupy.ones((2, 0, 3, 64), dtype=cupy.float16)
    out, lse = flashgen.attention_forward(q, k0, k0)
    assert bool((out == 0).all()) and bool(cupy.isneginf(lse).all())
    dq, dk, dv = flashgen.attention_backward(out, q, k0, k0, out, lse)
    assert bool((dq == 0).all()) and dk.shape == (2, 0, 3, 64)


def test_bad_inputs_raise_before_launch():
    q = cupy.zeros((1, 8, 2, 64), dtype=cupy.float16)
    with pytest.raises(TypeError, match="host"):
        flashgen.attention_forward(np.zeros((1, 8, 2, 64), np.float16), q, q)
    with pytest.raises(TypeError, match="dtype"):
        flashgen.attention_forward(q, q.astype(cupy.float32), q)
    with pytest.raises(ValueError, match="dropout_p"):
        flashgen.attention_forward(q, q, q, dropout_p=1.0, seed=1)
    with pytest.raises(ValueError, match="contiguous"):
        flashgen.attention_forward(cupy.zeros((1, 8, 2, 128), dtype=cupy.float16)[..., ::2], q, q)
    out, lse = flashgen.attention_forward(q, q, q)
    with pytest.raises(ValueError, match="lse has shape"):
        flashgen.attention_backward(out, q, q, q, out, lse[:, :1])
    with pytest.raises(ValueError, match="never decrease"):
        flashgen.attention_forward(q[:1], q[:1], q[:1], cu_seqlens_q=np.array([0, 5, 3], np.int32),
                                   cu_seqlens_k=np.array([0, 4, 8], np.int32))
    with pytest.raises(TypeError, match="int32"):
        flashgen.attention_forward(q[:1], q[:1], q[:1], cu_seqlens_q=np.array([0, 8], np.int64),
                                   cu_seqlens_k=np.array([0, 8], np.int32))
    # the context is healthy afterwards
    again, _ = flashgen.attention_forward(q, q, q)
    assert not bool(cupy.isnan(again).any())
