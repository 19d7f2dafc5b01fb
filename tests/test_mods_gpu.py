"""Mask mods on a GPU (flashgen/mods.py): a built-in or declared mask mod, bound to CuPy tensors,
makes a block mask that the sparse (or dense fallback) kernels serve; forward and gradients
against float64 with the mod evaluated densely."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
from attention_reference import (  # noqa: E402
    BWD_TOL, FWD_TOL, gpu_marks, lse_err, poisoned_allocations, randn, reference, rel_err,
)

HAVE_GPU, pytestmark = gpu_marks()

import flashgen  # noqa: E402
from flashgen.mods import BUILTIN_MODS, MaskMod  # noqa: E402
from flashgen.runtime import block_fallback  # noqa: E402


@pytest.fixture(autouse=True)
def warned_already(monkeypatch):
    monkeypatch.setattr(block_fallback, "_warned", True)


def dense(fn, B, H, M, N):
    """The mod over every (b, h, q, kv) as the additive float32 bias a reference takes (0 or -inf)."""
    ix = (cupy.arange(B)[:, None, None, None], cupy.arange(H)[None, :, None, None],
          cupy.arange(M)[None, None, :, None], cupy.arange(N)[None, None, None, :])
    visible = cupy.broadcast_to(fn(*ix), (B, H, M, N))
    return cupy.where(visible, 0.0, -cupy.inf).astype(cupy.float32)


def tensors_for(name, B, N, r):
    if name == "document":
        return {"doc": cupy.asarray(np.sort(r.integers(0, 5, (B, N)), axis=1).astype(np.int32))}
    if name == "prefix_lm":
        return {"prefix": cupy.asarray(r.integers(0, N, B).astype(np.int32))}
    return {}


CASES = [  # mod, dtype, B, H, Hk, M, N, K
    ("document", "bf16", 2, 4, 2, 384, 384, 128),
    ("document", "f16", 1, 2, 2, 129, 1000, 64),
    ("prefix_lm", "f16", 2, 4, 4, 300, 300, 64),
    ("prefix_lm", "bf16", 2, 8, 2, 1000, 1000, 128),
    ("causal", "f16", 1, 2, 2, 7, 7, 64),
]


@pytest.mark.parametrize("name,dtype,B,H,Hk,M,N,K", CASES)
def test_builtin_mask_mods_through_block_masks_match_float64(name, dtype, B, H, Hk, M, N, K):
    r = np.random.default_rng(M + N + K)
    mod = BUILTIN_MODS[name]
    fn = mod.function(mod.bind(tensors_for(name, B, N, r), dict(B=B, H=H, M=M, N=N)), xp=cupy)
    bm = flashgen.block_mask(fn, B, 1, M, N)
    q, do = randn(r, (B, M, H, K), dtype), randn(r, (B, M, H, K), dtype)
    k, v = randn(r, (B, N, Hk, K), dtype), randn(r, (B, N, Hk, K), dtype)
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, block_mask=bm)
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm)
    ro, rl, (rdq, rdk, rdv, _) = reference(q, k, v, grad_out=do, bias=dense(fn, B, 1, M, N))
    assert rel_err(out, ro) < FWD_TOL[dtype] and lse_err(lse, rl) < FWD_TOL[dtype]
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, ref, zero_scale=np.sqrt(K)) < BWD_TOL[dtype]


def test_a_declared_per_head_mask_mod():
    """A user's mod with a per-head captured tensor and integer arithmetic (C's / and %)."""
    B, H, M, N, K = 2, 4, 257, 300, 64
    mod = MaskMod("kv_idx <= q_idx + span[h] && (q_idx - kv_idx) % 5 != 1", tensors={"span": "i32[H]"})
    span = cupy.asarray([0, 16, 100, 300], dtype=cupy.int32)
    fn = mod.function(mod.bind({"span": span}, dict(B=B, H=H, M=M, N=N)), xp=cupy)
    bm = flashgen.block_mask(fn, 1, H, M, N)
    r = np.random.default_rng(5)
    q, do = randn(r, (B, M, H, K), "f16"), randn(r, (B, M, H, K), "f16")
    k, v = randn(r, (B, N, H, K), "f16"), randn(r, (B, N, H, K), "f16")
    out, lse = flashgen.attention_forward(q, k, v, block_mask=bm)
    dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, block_mask=bm)
    ro, rl, (rdq, rdk, rdv, _) = reference(q, k, v, grad_out=do, bias=dense(fn, 1, H, M, N))
    assert rel_err(out, ro) < FWD_TOL["f16"]
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, ref, zero_scale=np.sqrt(K)) < BWD_TOL["f16"]
