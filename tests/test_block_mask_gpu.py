"""Block masks on a GPU: the lists CuPy builds, and the forward and backward with ``block_mask``
(served dense by example 41, or sparse by sm90_fwd: test_block_sparse_gpu.py) against float64
with the dense mask.

Conventions checked: a row the mask (with the causal mask) leaves without a key gets output 0,
lse -inf and dq 0, and adds nothing to dk, dv or dbias; the mask gets no gradient; the dense
fallback warns once per process.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
from attention_reference import (  # noqa: E402
    BWD_TOL, FWD_TOL, gpu_marks, lse_err, poisoned_allocations, randn, reference, rel_err,
)

HAVE_GPU, pytestmark = gpu_marks()

import flashgen  # noqa: E402
from flashgen.runtime import block_fallback  # noqa: E402
from flashgen.runtime.block_masks import block_mask  # noqa: E402


@pytest.fixture(autouse=True)
def warned_already(monkeypatch):
    """The once-per-process warning has its own test; elsewhere it is taken as given."""
    monkeypatch.setattr(block_fallback, "_warned", True)


def documents(n_docs, length, seed=0):
    """A document mask over ``length`` tokens in ``n_docs`` documents (each >= 1 token)."""
    sizes = np.random.default_rng(seed).multinomial(length - n_docs, np.ones(n_docs) / n_docs) + 1
    doc = cupy.asarray(np.repeat(np.arange(n_docs), sizes))
    return lambda b, h, q, kv: doc[q] == doc[cupy.minimum(kv, length - 1)]


MASKS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "window": lambda b, h, q, kv: (kv >= q - 50) & (kv <= q + 10),
    "empty-rows": lambda b, h, q, kv: (q % 7 != 3) & (kv <= q + 5),
    "per-head": lambda b, h, q, kv: (kv <= q + 16 * h) & ((kv + b) % 3 != 0),
    "nothing": lambda b, h, q, kv: (q < 0) & (kv < 0),
    "everything": lambda b, h, q, kv: (q >= 0) & (kv >= 0),
}

CASES = [  # dtype, B, H, Hk, M, N, K, mask, (mask's B, H), block, options
    ("f16", 2, 4, 4, 300, 300, 64, "causal", (1, 1), (128, 128), {}),
    ("bf16", 1, 2, 2, 1000, 1000, 128, "documents", (1, 1), (128, 128), {}),
    ("f32", 2, 2, 2, 129, 700, 40, "window", (2, 1), (64, 32), {}),
    ("f16", 2, 4, 2, 257, 129, 64, "per-head", (2, 4), (128, 64), {}),
    ("bf16", 1, 3, 3, 200, 333, 64, "empty-rows", (1, 3), (32, 128), {"causal": "top_left"}),
    ("f16", 2, 2, 2, 300, 100, 64, "causal", (1, 1), (128, 128), {"causal": "bottom_right"}),  # 200 rows: no key
    ("f16", 1, 2, 2, 64, 64, 32, "nothing", (1, 1), (128, 128), {}),
    ("f32", 1, 2, 2, 7, 1, 8, "everything", (1, 2), (16, 16), {"scale": 0.3}),
    ("f16", 2, 2, 1, 1, 7, 64, "causal", (1, 1), (128, 128), {}),
    ("bf16", 2, 2, 2, 129, 129, 64, "empty-rows", (2, 2), (64, 64), {"scale": 0.2}),
]


def mask_fn(name, N):
    return documents(8, N) if name == "documents" else MASKS[name]


def run(q, k, v, do, bm, **options):
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, block_mask=bm, **options)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm, **options)
    return out, lse, grads


def assert_rows_without_keys(out, lse, dq, empty):
    """``empty`` [B, H, M]: those rows have output 0, lse -inf and dq 0, exactly."""
    rows = cupy.ascontiguousarray(cupy.transpose(empty, (0, 2, 1)))  # [B, M, H]
    assert bool((out[rows] == 0).all()) and bool(cupy.isneginf(lse[empty]).all())
    assert bool((dq[rows] == 0).all())


@pytest.mark.parametrize("dtype,B,H,Hk,M,N,K,name,mask_bh,block,options", CASES)
def test_forward_and_backward_match_float64_with_the_dense_mask(dtype, B, H, Hk, M, N, K, name, mask_bh, block,
                                                                options):
    r = np.random.default_rng(M * N + K)
    q, do = randn(r, (B, M, H, K), dtype), randn(r, (B, M, H, K), dtype)
    k, v = randn(r, (B, N, Hk, K), dtype), randn(r, (B, N, Hk, K), dtype)
    bm = block_mask(mask_fn(name, N), *mask_bh, M, N, block=block)
    out, lse, (dq, dk, dv) = run(q, k, v, do, bm, **options)
    dense = bm.to_dense(cupy.float32)
    ro, rl, (rdq, rdk, rdv, _) = reference(q, k, v, grad_out=do, bias=dense, **options)
    assert rel_err(out, ro) < FWD_TOL[dtype] and lse_err(lse, rl) < FWD_TOL[dtype]
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, ref, zero_scale=np.sqrt(K)) < BWD_TOL[dtype]
    assert_rows_without_keys(out, lse, dq, cupy.isneginf(rl))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_with_attn_bias_the_two_add_up_and_dbias_is_the_bias_gradient(dtype):
    r = np.random.default_rng(7)
    B, H, M, N, K = 2, 3, 200, 260, 64
    q, do = randn(r, (B, M, H, K), dtype), randn(r, (B, M, H, K), dtype)
    k, v = randn(r, (B, N, H, K), dtype), randn(r, (B, N, H, K), dtype)
    bias = randn(r, (1, H, M, N), dtype, 2.0)
    bm = block_mask(MASKS["empty-rows"], 1, 1, M, N, block=(64, 64))
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, attn_bias=bias, block_mask=bm, causal="top_left")
        dq, dk, dv, db = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, block_mask=bm,
                                                     bias_requires_grad=True, causal="top_left")
    total = bm.to_dense(cupy.float32) + bias.astype(cupy.float32)
    ro, rl, (rdq, rdk, rdv, rdb) = reference(q, k, v, grad_out=do, bias=total, causal="top_left")
    assert rel_err(out, ro) < FWD_TOL[dtype] and lse_err(lse, rl) < FWD_TOL[dtype]
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv), (db, rdb)):
        assert rel_err(g, ref) < BWD_TOL[dtype]
    assert db.shape == (1, H, M, N)  # the bias's batch extent: summed over the batch
    hidden = cupy.ascontiguousarray(cupy.broadcast_to(cupy.isneginf(total), db.shape))  # a boolean index, not a view
    assert bool((db[hidden] == 0).all()), "no gradient where masked"


def test_lists_built_on_the_gpu_equal_those_built_with_numpy():
    def mask(b, h, q, kv):  # operators only: the same function serves both modules
        return ((kv <= q + 40 * h) & ((q // 100) == (kv // 100) + b)) | (kv % 97 == 0)

    on_gpu = block_mask(mask, 2, 3, 1000, 777, block=(64, 128))
    on_host = block_mask(mask, 2, 3, 1000, 777, block=(64, 128), device="cpu")
    assert on_gpu.device == cupy.cuda.runtime.getDevice() and on_host.device is None
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        assert isinstance(getattr(on_gpu, name), cupy.ndarray), name
        assert (cupy.asnumpy(getattr(on_gpu, name)) == getattr(on_host, name)).all(), name
    assert on_gpu.density() == on_host.density()
    assert (cupy.asnumpy(on_gpu.to_dense(cupy.float16)) == on_host.to_dense(np.float16)).all()


@pytest.mark.parametrize("dtype,M,N,K", [("f16", 1000, 1000, 64), ("bf16", 129, 700, 128)])
def test_a_mask_mod_by_name_with_its_tensors_runs_its_own_mask(dtype, M, N, K):
    """block_mask("document", mod_tensors=...): the mod's declaration, evaluated on the GPU over the ids,
    is the mask the call runs -- against float64 with the ids' own dense mask."""
    r = np.random.default_rng(M + K)
    B, H = 2, 2
    doc = cupy.asarray(np.sort(r.integers(0, 8, (B, N)), axis=1).astype(np.int32))
    q, do = randn(r, (B, M, H, K), dtype), randn(r, (B, M, H, K), dtype)
    k, v = randn(r, (B, N, H, K), dtype), randn(r, (B, N, H, K), dtype)
    bm = block_mask("document", B, 1, M, N, mod_tensors={"doc": doc})
    assert bm.device == doc.device.id and 0 < bm.density() < 1
    out, lse, (dq, dk, dv) = run(q, k, v, do, bm)
    ids_q, ids_k = doc[:, :M].astype(cupy.int64), doc
    visible = ids_q[:, None, :, None] == ids_k[:, None, None, :]  # [B, 1, M, N]
    dense = cupy.where(visible, 0.0, -cupy.inf).astype(cupy.float32)
    ro, rl, (rdq, rdk, rdv, _) = reference(q, k, v, grad_out=do, bias=cupy.broadcast_to(dense, (B, H, M, N)))
    assert rel_err(out, ro) < FWD_TOL[dtype] and lse_err(lse, rl) < FWD_TOL[dtype]
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, ref, zero_scale=np.sqrt(K)) < BWD_TOL[dtype]


def test_a_mask_mods_tensors_from_torch_give_the_same_lists():
    torch = pytest.importorskip("torch")
    ids = np.sort(np.random.default_rng(3).integers(0, 5, (2, 640)), axis=1).astype(np.int32)
    from_cupy = block_mask("document", 2, 1, 640, 640, mod_tensors={"doc": cupy.asarray(ids)})
    from_torch = block_mask("document", 2, 1, 640, 640, mod_tensors={"doc": torch.from_numpy(ids).cuda()})
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "partial_bits"):
        assert bool((getattr(from_cupy, name) == getattr(from_torch, name)).all()), name
    with pytest.raises(TypeError, match="mod tensor 'doc' is a host \\(NumPy\\) array"):
        block_mask("document", 2, 1, 640, 640, mod_tensors={"doc": ids})


def test_boolean_mask_arrays_on_the_gpu_and_from_numpy():
    visible = cupy.random.default_rng(0).random((1, 2, 150, 90)) < 0.3
    bm = block_mask(visible, 1, 2, 150, 90, block=(32, 32))
    assert bm.mask is visible
    from_host = block_mask(cupy.asnumpy(visible), 1, 2, 150, 90, block=(32, 32))
    assert isinstance(from_host.mask, cupy.ndarray) and bool((from_host.kv_indices == bm.kv_indices).all())
    bias = bm.to_dense(cupy.float32)
    assert bool((bias[visible] == 0).all()) and bool(cupy.isneginf(bias[~visible]).all())


def test_the_first_call_warns_once_and_explain_names_the_fallback(monkeypatch):
    monkeypatch.setattr(block_fallback, "_warned", False)
    r = np.random.default_rng(3)
    q = randn(r, (1, 256, 2, 64), "f16")
    bm = block_mask(MASKS["causal"], 1, 1, 256, 256, block=(64, 64))  # no sparse kernel reads 64 x 64 blocks
    with pytest.warns(UserWarning, match=r"block_mask runs dense \(the mask becomes an additive"):
        out, lse = flashgen.attention_forward(q, q, q, block_mask=bm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashgen.attention_backward(out, q, q, q, out, lse, block_mask=bm)
        flashgen.attention_forward(q, q, q, block_mask=bm)
    for backward in (False, True):
        rows = flashgen.explain(q, q, q, block_mask=bm, backward=backward)
        selected = [name for name, _, verdict in rows if verdict == "selected"]
        # the dense call (the mask as a bias) on the first kernel that takes a bias: a bias instance of
        # flashgen's own where one is built for this GPU (head dim 64 is a bias tier), else example 41
        assert selected and ("_bias_" in selected[0] or selected[0].startswith("mem_eff_")), rows
        # asked first, the sparse instances of the call's dtype (the others are refused for their dtype first)
        if any(name.startswith("sm90_") for name, _, _ in rows):  # a plain (not sm90a) build has none to ask
            sparse = [verdict for name, _, verdict in rows
                      if name.startswith(("sm90_fwd_f16", "sm90_bwd_f16")) and "sparse" in name]
            assert sparse and all(v.startswith("reads 128 x 128 mask blocks") for v in sparse[:2]), sparse


def test_calls_on_other_streams_wait_for_the_cached_dense_bias():
    """The dense bias is built on the first call's stream and kept; a call on another stream
    waits for it there (an event), so both see the finished bias."""
    r = np.random.default_rng(4)
    q, k, v = (randn(r, (2, 700, 4, 64), "f16") for _ in range(3))
    bm = block_mask(MASKS["window"], 1, 1, 700, 700)
    first, second = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    out1, lse1 = flashgen.attention_forward(q, k, v, block_mask=bm, stream=first)
    out2, lse2 = flashgen.attention_forward(q, k, v, block_mask=bm, stream=second)
    second.synchronize()
    first.synchronize()
    assert bool((out1 == out2).all()) and bool((lse1 == lse2).all())
    ro, rl = reference(q, k, v, bias=bm.to_dense(cupy.float32))
    assert rel_err(out2, ro) < FWD_TOL["f16"] and lse_err(lse2, rl) < FWD_TOL["f16"]


def test_a_mask_for_other_shapes_is_refused_with_both_shapes():
    q = randn(np.random.default_rng(5), (2, 100, 2, 64), "f16")
    with pytest.raises(ValueError, match=r"block_mask is for \[B, H, M, N\] = \(1, 1, 100, 99\); the call has "
                                         r"\(2, 2, 100, 100\)"):
        flashgen.attention_forward(q, q, q, block_mask=block_mask(MASKS["causal"], 1, 1, 100, 99))


def test_torch_attention_takes_a_block_mask_eagerly():
    """Eager only for now: under torch.compile it is refused (test_torch_ops_cpu)."""
    torch = pytest.importorskip("torch")
    import flashgen.torch as ft

    g = torch.Generator(device="cuda").manual_seed(0)
    B, M, N, H, K = 2, 300, 400, 4, 64
    q = torch.randn(B, M, H, K, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, N, 2, K, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    bm = block_mask(MASKS["empty-rows"], 1, H, M, N, block=(64, 64))
    out = ft.attention(q, k, v, block_mask=bm, causal="bottom_right")
    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    as_cupy = lambda t: cupy.from_dlpack(t.detach())  # noqa: E731
    ro, _, (rdq, rdk, rdv, _) = reference(as_cupy(q), as_cupy(k), as_cupy(v), grad_out=as_cupy(do),
                                          bias=bm.to_dense(cupy.float32), causal="bottom_right")
    assert rel_err(as_cupy(out), ro) < FWD_TOL["bf16"]
    for g_, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(as_cupy(g_), ref, zero_scale=np.sqrt(K)) < BWD_TOL["bf16"]
