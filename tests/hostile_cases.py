"""Hostile inputs, the table: every invalid call gets its own error, naming the argument, before any launch.

One table of cases -> (exception type, message regex), run twice:

(a) CPU (always): the public ``attention_forward`` / ``attention_backward`` over fake device
    arrays, with a fake ``cupy`` module that only offers what validation may use.  Anything
    else (allocating, querying the device, launching) fails the test: the error has to come
    before any GPU work.  Plus the validation helpers directly: the 32-bit offset limits
    (checked right at and just past each bound), the alignment of offset views, ``_varlen``.
(b) GPU (marked ``gpu``; skipped without CuPy, a GPU or kernels for it): the same table against
    the real API with real arrays.  Sizes past the int32 limits are stride tricks over a tiny
    buffer (as_strided / broadcast views), never big allocations.  After every rejected call
    the device is synchronised (a sticky CUDA error would surface there) and a small valid
    forward (and backward) must still return finite results that match a float64 reference.

Run the GPU part on a GPU machine with
``FLASHGEN_KERNEL_PATH=build/kernels python3 -m pytest tests/test_hostile_inputs_gpu.py``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from flashgen.errors import UnsupportedError
from flashgen.runtime import api


# === the table ===============================================================================

def qkv(X, B=2, M=40, N=48, H=2, K=64, Kv=None, dtype="f16", q=None, k=None, v=None):
    Kv = K if Kv is None else Kv
    return (X.randn((B, M, H, K), dtype) if q is None else q,
            X.randn((B, N, H, K), dtype) if k is None else k,
            X.randn((B, N, H, Kv), dtype) if v is None else v)


def fwd(X, q=None, k=None, v=None, shape=None, **options):
    return "fwd", qkv(X, **(shape or {}), q=q, k=k, v=v), options


def bwd(X, q=None, k=None, v=None, grad_out=None, out=None, lse=None, shape=None, **options):
    q, k, v = qkv(X, **(shape or {}), q=q, k=k, v=v)
    B, M, H = q.shape[:3]
    dtype = (shape or {}).get("dtype", "f16")
    grad_out = X.randn((B, M, H, v.shape[3]), dtype) if grad_out is None else grad_out
    out = X.randn((B, M, H, v.shape[3]), dtype) if out is None else out
    lse = X.lse((B, H, M)) if lse is None else lse
    return "bwd", (grad_out, q, k, v, out, lse), options


def broadcast(X, shape, dtype="f16"):
    """A [B, S, H, K] view of one row: every stride but the last is 0 (no memory behind it)."""
    return X.strided(shape, (0, 0, 0, 1), dtype)


def varlen(X, cu_q, cu_k, q_rows=40, k_rows=48, B=1, on_device=False, **options):
    q, k, v = qkv(X, B=B, M=q_rows, N=k_rows)
    cq = cu_q if not isinstance(cu_q, list) else X.cu(cu_q, on_device=on_device)
    ck = cu_k if not isinstance(cu_k, list) else X.cu(cu_k, on_device=on_device)
    return "fwd", (q, k, v), dict(cu_seqlens_q=cq, cu_seqlens_k=ck, **options)


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable  # backend -> ("fwd" | "bwd", args, kwargs)
    exc: type
    match: str
    where: str = "both"  # "cpu", "gpu" or "both"


V, T, U = ValueError, TypeError, UnsupportedError
ROWS = r"overflows the kernels' 32-bit offset arithmetic \(at most 2147483647\); .*split"
NO_KERNEL = (r"(?s)^no {family} kernel accepts {dtype}, head dims \(64, 64\), alignment {align}, dropout=False on "
             r".*\n  {family}_{dtype}_\w+ \(\w+\): .*needs \d-element alignment of pointers.*pad the head dim")

CASES = [
    # --- dtypes ------------------------------------------------------------------------------
    Case("dtype/q-f16-k-bf16", lambda X: fwd(X, k=X.randn((2, 48, 2, 64), "bf16")), T,
         r"^k has dtype bfloat16, expected float16 like q$"),
    Case("dtype/q-f16-k-f32", lambda X: fwd(X, k=X.randn((2, 48, 2, 64), "f32")), T,
         r"^k has dtype float32, expected float16 like q$"),
    Case("dtype/q-f16-v-f32", lambda X: fwd(X, v=X.randn((2, 48, 2, 64), "f32")), T,
         r"^v has dtype float32, expected float16 like q$"),
    Case("dtype/float64", lambda X: fwd(X, shape=dict(dtype="f64")), T,
         r"^q has dtype float64; flashgen supports float32, float16 and bfloat16$"),
    Case("dtype/int32", lambda X: fwd(X, shape=dict(dtype="i32")), T, r"^q has dtype int32; flashgen supports"),
    Case("dtype/bwd-grad_out-f32", lambda X: bwd(X, grad_out=X.randn((2, 40, 2, 64), "f32")), T,
         r"^grad_out has dtype float32, expected float16 like q$"),
    Case("dtype/bwd-out-bf16", lambda X: bwd(X, out=X.randn((2, 40, 2, 64), "bf16")), T,
         r"^out has dtype bfloat16, expected float16 like q$"),
    # --- shapes ------------------------------------------------------------------------------
    Case("shape/batch-k", lambda X: fwd(X, k=X.randn((3, 48, 2, 64))), V, r"^batch sizes differ: q 2, k 3, v 2$"),
    Case("shape/batch-v", lambda X: fwd(X, v=X.randn((1, 48, 2, 64))), V, r"^batch sizes differ: q 2, k 2, v 1$"),
    Case("shape/seq-k-vs-v", lambda X: fwd(X, v=X.randn((2, 47, 2, 64))), V,
         r"^k and v have different sequence lengths: 48 and 47$"),
    Case("shape/heads-k", lambda X: fwd(X, k=X.randn((2, 48, 3, 64))), V, r"^head counts differ: q 2, k 3, v 2$"),
    Case("shape/heads-v", lambda X: fwd(X, v=X.randn((2, 48, 1, 64))), V, r"^head counts differ: q 2, k 2, v 1$"),
    Case("shape/heads-not-a-group", lambda X: fwd(X, shape=dict(H=3), k=X.randn((2, 48, 2, 64)),
                                                   v=X.randn((2, 48, 2, 64))), V,
         r"^q has 3 heads, k and v 2: grouped-query attention needs q's head count to be a multiple of k's"),
    Case("shape/head-dim-q-vs-k", lambda X: fwd(X, k=X.randn((2, 48, 2, 32))), V,
         r"^q and k head dims differ: 64 and 32$"),
    Case("shape/q-3d", lambda X: fwd(X, q=X.randn((40, 2, 64))), V,
         r"^q must be 4-D \[batch, seq, heads, head_dim\]; got shape \(40, 2, 64\)$"),
    Case("shape/k-5d", lambda X: fwd(X, k=X.randn((2, 48, 2, 64, 1))), V, r"^k must be 4-D"),
    Case("shape/v-3d", lambda X: fwd(X, v=X.randn((2, 48, 128))), V, r"^v must be 4-D"),
    Case("shape/bwd-grad_out", lambda X: bwd(X, grad_out=X.randn((2, 40, 2, 32))), V,
         r"^grad_out has shape \(2, 40, 2, 32\); expected \(2, 40, 2, 64\) \(\[B, M, H, Kv\]\)$"),
    Case("shape/bwd-out", lambda X: bwd(X, out=X.randn((2, 39, 2, 64))), V, r"^out has shape \(2, 39, 2, 64\)"),
    Case("shape/bwd-grad_out-3d", lambda X: bwd(X, grad_out=X.randn((2, 40, 128))), V, r"^grad_out must be 4-D"),
    # --- zero and negative sizes (M = 0 and N = 0 are valid: see the tests after the table) ---
    Case("size/batch-0", lambda X: fwd(X, shape=dict(B=0)), V, r"^empty batch: batch=0, heads=2$"),
    Case("size/heads-0", lambda X: fwd(X, shape=dict(H=0)), V, r"^empty batch: batch=2, heads=0$"),
    Case("size/bwd-batch-0", lambda X: bwd(X, shape=dict(B=0)), V, r"^empty batch: batch=0"),
    Case("size/head-dim-0", lambda X: fwd(X, shape=dict(K=0)), V, r"^head dims must be >= 1; got 0 and 0$"),
    Case("size/head-dim-v-0", lambda X: fwd(X, shape=dict(Kv=0)), V, r"^head dims must be >= 1; got 64 and 0$"),
    Case("size/negative", lambda X: fwd(X, q=X.randn((2, -1, 2, 64))), V, r"^q has a negative size", "cpu"),
    # --- misaligned pointers (a kernel is chosen after allocation: GPU only; see also
    #     test_alignment_of_offset_views and test_unaligned_but_legal_view_is_served_correctly) --
    Case("align/q-offset-1-f16", lambda X: fwd(X, q=X.offset((2, 40, 2, 64), 1)), U,
         NO_KERNEL.format(family="mem_eff_fwd", dtype="f16", align=1), "gpu"),
    Case("align/k-offset-2-f16", lambda X: fwd(X, k=X.offset((2, 48, 2, 64), 2)), U,
         NO_KERNEL.format(family="mem_eff_fwd", dtype="f16", align=2), "gpu"),
    Case("align/v-offset-1-f32", lambda X: fwd(X, v=X.offset((2, 48, 2, 64), 1, "f32"), shape=dict(dtype="f32")),
         U, NO_KERNEL.format(family="mem_eff_fwd", dtype="f32", align=1), "gpu"),
    # (grad_out and out at any offset are copied to aligned buffers: test_runtime_gpu.py)
    # --- lse ---------------------------------------------------------------------------------
    Case("lse/short", lambda X: bwd(X, lse=X.lse((2, 2, 39))), V,
         r"^lse has shape \(2, 2, 39\); expected \[2, 2, 40\] as attention_forward returns it$"),
    Case("lse/2d", lambda X: bwd(X, lse=X.lse((2, 80))), V, r"^lse has shape \(2, 80\)"),
    Case("lse/heads", lambda X: bwd(X, lse=X.lse((2, 3, 40))), V, r"^lse has shape \(2, 3, 40\)"),
    Case("lse/f16", lambda X: bwd(X, lse=X.lse((2, 2, 40), "f16")), T,
         r"^lse must be float32 \(as attention_forward returns it\); got float16$"),
    Case("lse/numpy", lambda X: bwd(X, lse=np.zeros((2, 2, 40), np.float32)), T,
         r"^lse is a host \(NumPy\) array; move it to the GPU first"),
    Case("lse/other-device", lambda X: bwd(X, lse=X.lse((2, 2, 40), device=X.other_device())), V,
         r"^lse is on GPU 1, q is on GPU 0$"),
    Case("lse/reversed", lambda X: bwd(X, lse=X.reversed((2, 2, 40), 2, "f32")), V,
         r"^lse has a negative stride in dim 2"),
    # --- dropout, seed, offset ---------------------------------------------------------------
    *[Case(f"dropout/p={p!r}", (lambda p: lambda X: fwd(X, dropout_p=p, seed=1))(p), V,
           r"^dropout_p must be in \[0, 1\); got ") for p in (-0.1, 1.0, 1.5, float("nan"), float("inf"), "0.1",
                                                             None, True)],
    Case("dropout/bwd-p=1.0", lambda X: bwd(X, dropout_p=1.0, seed=1), V, r"^dropout_p must be in \[0, 1\)"),
    Case("dropout/no-seed", lambda X: fwd(X, dropout_p=0.1), V, r"^dropout_p > 0 needs an explicit seed"),
    Case("dropout/bwd-no-seed", lambda X: bwd(X, dropout_p=0.1), V, r"^dropout_p > 0 needs an explicit seed"),
    *[Case(f"seed/{name}={value!r}", (lambda kw: lambda X: fwd(X, dropout_p=0.1, **kw))({"seed": 1, name: value}),
           V, rf"^{name} must be an integer in \[0, 2\*\*64\); got ")
      for name, value in (("seed", -1), ("seed", 2**64), ("seed", 1.5), ("seed", "7"), ("seed", True),
                          ("offset", -1), ("offset", 2**64), ("offset", None), ("offset", 2.0),
                          ("offset", False))],
    # --- causal, scale -----------------------------------------------------------------------
    *[Case(f"causal/{c!r}", (lambda c: lambda X: fwd(X, causal=c))(c), V,
           r"^causal must be None, 'top_left' or 'bottom_right'; got ")
      for c in ("causal", "TOP_LEFT", "lower_right", "", True, 1, ["top_left"], b"top_left")],
    Case("causal/bwd", lambda X: bwd(X, causal="upper_left"), V, r"^causal must be None"),
    *[Case(f"scale/{s!r}", (lambda s: lambda X: fwd(X, scale=s))(s), V,
           r"^scale must be a finite real number \(or None for 1/sqrt\(head_dim\)\); got ")
      for s in ("0.5", float("nan"), float("inf"), -float("inf"), True, [1.0], np.float32("nan"))],
    # --- cu_seqlens (q [1, 40, 2, 64], k/v [1, 48, 2, 64]) ------------------------------------
    Case("varlen/int64", lambda X: varlen(X, X.cu([0, 20, 40], np.int64), [0, 24, 48]), T,
         r"^cu_seqlens_q must be int32; got int64$"),
    Case("varlen/k-float32", lambda X: varlen(X, [0, 20, 40], X.cu([0, 24, 48], np.float32)), T,
         r"^cu_seqlens_k must be int32; got float32$"),
    Case("varlen/python-list", lambda X: ("fwd", qkv(X, B=1), dict(cu_seqlens_q=[0, 20, 40],
                                                                   cu_seqlens_k=X.cu([0, 24, 48]))), T,
         r"^cu_seqlens_q must be int32; got int64$"),
    Case("varlen/device-int64", lambda X: varlen(X, X.cu([0, 20, 40], np.int64, on_device=True), [0, 24, 48]), T,
         r"^cu_seqlens_q must be int32; got int64$"),
    Case("varlen/decreasing", lambda X: varlen(X, [0, 30, 20, 40], [0, 10, 20, 48]), V,
         r"^cu_seqlens_q must start at 0 and never decrease; got \[0, 30, 20, 40\]$"),
    Case("varlen/decreasing-on-device", lambda X: varlen(X, [0, 20, 40], [0, 30, 20], on_device=True), V,
         r"^cu_seqlens_k must start at 0 and never decrease"),
    Case("varlen/not-from-0", lambda X: varlen(X, [1, 20, 40], [0, 24, 48]), V,
         r"^cu_seqlens_q must start at 0"),
    Case("varlen/q-past-end", lambda X: varlen(X, [0, 20, 41], [0, 24, 48]), V,
         r"^cu_seqlens_q ends at 41 but the packed sequence has 40 rows$"),
    Case("varlen/k-past-end", lambda X: varlen(X, [0, 20, 40], [0, 24, 49]), V,
         r"^cu_seqlens_k ends at 49 but the packed sequence has 48 rows$"),
    Case("varlen/2d", lambda X: varlen(X, [[0, 20, 40]], [0, 24, 48]), V,
         r"^cu_seqlens_q must be 1-D with at least 2 entries"),
    Case("varlen/one-entry", lambda X: varlen(X, [0, 20, 40], [0]), V,
         r"^cu_seqlens_k must be 1-D with at least 2 entries"),
    Case("varlen/only-q", lambda X: ("fwd", qkv(X, B=1), dict(cu_seqlens_q=X.cu([0, 40]))), V,
         r"^pass both cu_seqlens_q and cu_seqlens_k, or neither$"),
    Case("varlen/only-k", lambda X: ("fwd", qkv(X, B=1), dict(cu_seqlens_k=X.cu([0, 48]))), V,
         r"^pass both cu_seqlens_q and cu_seqlens_k, or neither$"),
    Case("varlen/different-counts", lambda X: varlen(X, [0, 20, 40], [0, 48]), V,
         r"^cu_seqlens_q has 3 entries, cu_seqlens_k 2$"),
    Case("varlen/batch-2", lambda X: varlen(X, [0, 20, 40], [0, 24, 48], B=2), V,
         r"^with cu_seqlens the sequences are packed along dim 1 of a batch of 1; got batch 2$"),
    Case("varlen/bwd-decreasing", lambda X: bwd(X, shape=dict(B=1), cu_seqlens_q=X.cu([0, 30, 20]),
                                                cu_seqlens_k=X.cu([0, 24, 48])), V,
         r"^cu_seqlens_q must start at 0 and never decrease"),
    Case("varlen/with-bias", lambda X: varlen(X, [0, 20, 40], [0, 24, 48], attn_bias=X.randn((1, 2, 40, 48))), U,
         r"^attn_bias with cu_seqlens is not supported"),
    # --- arrays that are not (usable) GPU arrays ---------------------------------------------
    Case("foreign/q-numpy", lambda X: fwd(X, q=X.host((2, 40, 2, 64))), T,
         r"^q is a host \(NumPy\) array; move it to the GPU first \(cupy.asarray\)$"),
    Case("foreign/v-numpy", lambda X: fwd(X, v=X.host((2, 48, 2, 64))), T, r"^v is a host \(NumPy\) array"),
    Case("foreign/bwd-grad_out-numpy", lambda X: bwd(X, grad_out=X.host((2, 40, 2, 64))), T,
         r"^grad_out is a host \(NumPy\) array"),
    Case("foreign/q-list", lambda X: fwd(X, q=[[[[0.0]]]]), T,
         r"^q must be a CuPy array or a GPU array with DLPack or __cuda_array_interface__, not list$"),
    Case("foreign/k-None", lambda X: ("fwd", (X.randn((2, 40, 2, 64)), None, X.randn((2, 48, 2, 64))), {}), T,
         r"^k must be a CuPy array .*, not NoneType$"),
    Case("foreign/q-dlpack-on-cpu", lambda X: fwd(X, q=X.dlpack_cpu((2, 40, 2, 64))), T,
         r"^q is on the host \(CPU\), not a CUDA GPU; move it to the GPU first"),
    Case("foreign/k-torch-cpu", lambda X: fwd(X, k=X.torch_cpu((2, 48, 2, 64))), T,
         r"^k is on the host \(CPU\), not a CUDA GPU"),
    Case("foreign/k-other-device", lambda X: fwd(X, k=X.randn((2, 48, 2, 64), device=X.other_device())), V,
         r"^k is on GPU 1, q is on GPU 0$"),
    Case("foreign/bwd-out-other-device", lambda X: bwd(X, out=X.randn((2, 40, 2, 64), device=X.other_device())), V,
         r"^out is on GPU 1, q is on GPU 0$"),
    # --- strides -----------------------------------------------------------------------------
    Case("stride/q-last-dim", lambda X: fwd(X, q=X.every_other((2, 40, 2, 64))), V,
         r"^q must have a contiguous last \(head_dim\) dimension; its stride is 2 elements"),
    Case("stride/v-last-dim", lambda X: fwd(X, v=X.every_other((2, 48, 2, 64))), V,
         r"^v must have a contiguous last"),
    Case("stride/bwd-grad_out-last-dim", lambda X: bwd(X, grad_out=X.every_other((2, 40, 2, 64))), V,
         r"^grad_out must have a contiguous last"),
    Case("stride/k-reversed-seq", lambda X: fwd(X, k=X.reversed((2, 48, 2, 64), 1)), V,
         r"^k has a negative stride in dim 1 \(a reversed view\); .*cupy.ascontiguousarray\(k\)$"),
    Case("stride/q-reversed-heads", lambda X: fwd(X, q=X.reversed((2, 40, 2, 64), 2)), V,
         r"^q has a negative stride in dim 2"),
    Case("stride/bwd-out-reversed", lambda X: bwd(X, out=X.reversed((2, 40, 2, 64), 0)), V,
         r"^out has a negative stride in dim 0"),
    # --- bias ----------------------------------------------------------------------------------
    Case("bias/not-broadcastable", lambda X: fwd(X, attn_bias=X.randn((2, 2, 40, 47))), V,
         r"^attn_bias of shape \(2, 2, 40, 47\) does not broadcast to \[batch, heads, M, N\] = \(2, 2, 40, 48\)$"),
    Case("bias/5d", lambda X: fwd(X, attn_bias=X.randn((1, 2, 2, 40, 48))), V,
         r"^attn_bias of shape \(1, 2, 2, 40, 48\) does not broadcast"),
    Case("bias/f32", lambda X: fwd(X, attn_bias=X.randn((2, 2, 40, 48), "f32")), T,
         r"^attn_bias has dtype float32, expected float16 like q$"),
    Case("bias/numpy", lambda X: fwd(X, attn_bias=X.host((2, 2, 40, 48))), T, r"^attn_bias is a host \(NumPy\)"),
    Case("bias/reversed", lambda X: fwd(X, attn_bias=X.reversed((2, 2, 40, 48), 2)), V,
         r"^attn_bias has a negative stride in dim 2"),
    Case("bias/other-device", lambda X: fwd(X, attn_bias=X.randn((2, 2, 40, 48), device=X.other_device())), V,
         r"^attn_bias is on GPU 1, q is on GPU 0$"),
    Case("bias/bwd-grad-without-bias", lambda X: bwd(X, bias_requires_grad=True), V,
         r"^bias_requires_grad=True without attn_bias$"),
    Case("bias/bwd-not-broadcastable", lambda X: bwd(X, attn_bias=X.randn((3, 1, 1, 48))), V,
         r"^attn_bias of shape \(3, 1, 1, 48\) does not broadcast"),
    # --- block masks (flashgen.block_mask) ---------------------------------------------------
    Case("block_mask/array", lambda X: fwd(X, block_mask=X.host((40, 48), "f16") > 0), T,
         r"^block_mask must be a BlockMask \(build it once with flashgen.block_mask\(mask, B, H, M, N\)\); "
         r"got ndarray$"),
    *[Case(f"block_mask/shape-{label}", (lambda shape: lambda X: fwd(X, block_mask=X.block_mask(shape)))(shape), V,
           rf"^block_mask is for \[B, H, M, N\] = {re.escape(str(shape))}; the call has \(2, 2, 40, 48\) "
           r"\(B and H may also be 1\)$")
      for label, shape in (("rows", (2, 2, 39, 48)), ("keys", (1, 1, 40, 47)), ("heads", (2, 3, 40, 48)),
                           ("batch", (3, 1, 40, 48)), ("transposed", (2, 2, 48, 40)))],
    Case("block_mask/bwd-rows", lambda X: bwd(X, block_mask=X.block_mask((2, 2, 41, 48))), V,
         r"^block_mask is for \[B, H, M, N\] = \(2, 2, 41, 48\)"),
    Case("block_mask/host", lambda X: fwd(X, block_mask=X.block_mask((2, 2, 40, 48), device=None)), V,
         r"^block_mask was built on the host \(device='cpu'\); build it on q's GPU "
         r"\(flashgen.block_mask\(..., device=0\)\)$"),
    Case("block_mask/other-device", lambda X: fwd(X, block_mask=X.block_mask((1, 1, 40, 48), X.other_device())), V,
         r"^block_mask is on GPU 1, q is on GPU 0$"),
    Case("block_mask/varlen", lambda X: varlen(X, [0, 20, 40], [0, 24, 48], block_mask=X.block_mask((1, 2, 40, 48))),
         U, r"^block_mask with cu_seqlens is not supported: pass the batch unpacked"),
    # --- sizes whose offsets overflow the kernels' 32-bit arithmetic (stride tricks only) -----
    Case("int32/q-row-stride", lambda X: fwd(X, q=X.strided((1, 2, 1, 8), (0, 2**31, 8, 1)),
                                             k=broadcast(X, (1, 4, 1, 8)), v=broadcast(X, (1, 4, 1, 8))), V,
         r"^q_strideM: q's last row offset \(seq - 1\) \* row stride = 1 \* 2147483648 = 2147483648 " + ROWS),
    Case("int32/k-rows-times-stride", lambda X: fwd(X, q=broadcast(X, (1, 2, 1, 8)),
                                                    k=X.strided((1, 3, 1, 8), (0, 2**30, 8, 1)),
                                                    v=broadcast(X, (1, 3, 1, 8))), V,
         r"^k_strideM: .* = 2 \* 1073741824 = 2147483648 " + ROWS),
    Case("int32/v-rows-times-stride", lambda X: fwd(X, q=broadcast(X, (1, 2, 1, 8)), k=broadcast(X, (1, 5, 1, 8)),
                                                    v=X.strided((1, 5, 1, 8), (0, 2**29, 8, 1))), V,
         r"^v_strideM: .* = 4 \* 536870912 = 2147483648 "),
    Case("int32/q-heads-times-stride", lambda X: fwd(X, q=X.strided((1, 4, 3, 8), (0, 8, 2**30, 1)),
                                                     k=broadcast(X, (1, 4, 3, 8)), v=broadcast(X, (1, 4, 3, 8))), V,
         r"^q_strideH: q's last head offset \(heads - 1\) \* head stride = 2 \* 1073741824 = 2147483648 "
         r"overflows .*cupy.ascontiguousarray"),
    Case("int32/k-heads-times-stride", lambda X: fwd(X, q=broadcast(X, (1, 4, 5, 8)),
                                                     k=X.strided((1, 4, 5, 8), (0, 8, 2**29, 1)),
                                                     v=broadcast(X, (1, 4, 5, 8))), V, r"^k_strideH: "),
    Case("int32/bwd-grad_out-rows", lambda X: bwd(X, q=broadcast(X, (1, 3, 1, 8)), k=broadcast(X, (1, 4, 1, 8)),
                                                  v=broadcast(X, (1, 4, 1, 8)), out=broadcast(X, (1, 3, 1, 8)),
                                                  grad_out=X.strided((1, 3, 1, 8), (0, 2**30, 8, 1))), V,
         r"^gO_strideM: grad_out's last row offset .* = 2 \* 1073741824 = 2147483648 "),
    Case("int32/out-rows", lambda X: fwd(X, q=broadcast(X, (1, 262146, 1024, 8)), k=broadcast(X, (1, 4, 1024, 8)),
                                         v=broadcast(X, (1, 4, 1024, 8))), V,
         r"^o_strideM: out's last row offset \(seq - 1\) \* heads \* head_dim = 262145 \* 8192 = 2147491840 "),
    Case("int32/dk-rows", lambda X: bwd(X, q=broadcast(X, (1, 4, 1024, 8)), k=broadcast(X, (1, 262146, 1024, 8)),
                                        v=broadcast(X, (1, 262146, 1024, 8)), out=broadcast(X, (1, 4, 1024, 8)),
                                        grad_out=broadcast(X, (1, 4, 1024, 8)), lse=X.lse((1, 1024, 4))), V,
         r"^gK_strideM: dk's last row offset"),
    Case("int32/num-keys", lambda X: fwd(X, q=broadcast(X, (1, 4, 1, 8)), k=broadcast(X, (1, 2**31 - 2**20, 1, 8)),
                                         v=broadcast(X, (1, 2**31 - 2**20, 1, 8))), V,
         r"^num_keys = 2146435072 is too large: .*at most 2143289344 rows per call$"),
    Case("int32/heads-past-grid", lambda X: fwd(X, *(broadcast(X, (1, 4, 65536, 8)) for _ in range(3))), V,
         r"^num_heads = 65536: .*at most 65535 in y and z; split the heads$"),
    Case("int32/batch-past-grid", lambda X: fwd(X, *(broadcast(X, (65536, 4, 1, 8)) for _ in range(3))), V,
         r"^num_batches = 65536: .*split the batch$"),
    Case("int32/varlen-65536-sequences", lambda X: ("fwd", tuple(broadcast(X, (1, 4, 1, 8)) for _ in range(3)),
                                                    dict(cu_seqlens_q=X.cu([0] * 65536 + [4]),
                                                         cu_seqlens_k=X.cu([0] * 65536 + [4]))), V,
         r"^num_batches = 65536: "),
    Case("int32/out-batch-offset", lambda X: fwd(X, q=broadcast(X, (65535, 65540, 1, 8)),
                                                 k=broadcast(X, (65535, 4, 1, 8)), v=broadcast(X, (65535, 4, 1, 8))),
         V, r"^num_batches \* num_queries: .* = 65534 \* 65540 = 4295098360 overflows .*\(at most 4294967295\); "
            r"split the batch"),
    Case("int32/lse-offset", lambda X: fwd(X, q=broadcast(X, (65535, 1024, 65, 8)), k=broadcast(X, (65535, 4, 65, 8)),
                                           v=broadcast(X, (65535, 4, 65, 8))), V,
         r"^logsumexp_ptr: .* = 4259775 \* 1024 = 4362009600 overflows .*\(at most 4294967296\); split the batch"),
    # example 41's limits on its dropout stream (f32: on a 9.0 GPU the sm90 pair draws f16/bf16 masks,
    # whose offsets have no such limits)
    Case("int32/dropout-rng-batch", lambda X: fwd(X, *(broadcast(X, (2, 8192, 32, 8), "f32") for _ in range(3)),
                                                  dropout_p=0.1, seed=1), V,
         r"^dropout_batch_head_rng_offset: .*num_heads \* num_queries \* num_keys = 2147483648, past 2147483647; "
         r".*Split the batch"),
    Case("int32/dropout-rng-heads", lambda X: fwd(X, *(broadcast(X, (1, 8192, 64, 8), "f32") for _ in range(3)),
                                                  dropout_p=0.1, seed=1), V,
         r"^dropout_batch_head_rng_offset: .*head \* num_queries \* num_keys = 4227858432, past 2147483647"),
    Case("int32/bwd-dropout-rng", lambda X: bwd(X, *(broadcast(X, (2, 8192, 32, 8), "f32") for _ in range(3)),
                                                out=broadcast(X, (2, 8192, 32, 8), "f32"),
                                                grad_out=broadcast(X, (2, 8192, 32, 8), "f32"),
                                                lse=X.lse((2, 32, 8192)),
                                                dropout_p=0.1, seed=1), V, r"^dropout_batch_head_rng_offset: "),
    Case("int32/bias-rows", lambda X: fwd(X, broadcast(X, (1, 2, 1, 8)), broadcast(X, (1, 8, 1, 8)),
                                          broadcast(X, (1, 8, 1, 8)),
                                          attn_bias=X.strided((1, 1, 2, 8), (0, 0, 2**31, 1))), V,
         r"^bias_strideM: attn_bias's last row offset \(M - 1\) \* row stride = 1 \* 2147483648 "),
    # --- k and v broadcast over heads with a single-query block: the forward's decode fast
    #     path gets lse (and top_left, bias, dropout) wrong; see test_decode_fast_path_* -------
    *[Case(f"heads-broadcast/{label}", (lambda M, H, causal: lambda X: fwd(
        X, q=X.randn((2, M, H, 64)), k=X.strided((2, 48, H, 64), (48 * 64, 64, 0, 1)),
        v=X.strided((2, 48, H, 64), (48 * 64, 64, 0, 1)), causal=causal))(M, H, causal), U,
        r"^k and v are both broadcast over heads \(head stride 0\) and a query block holds a single query")
      for label, M, H, causal in (("decode-M1-H4", 1, 4, None), ("M33-H2", 33, 2, None),
                                  ("M65-H2-bottom-right", 65, 2, "bottom_right"),
                                  ("M1-H1-top-left", 1, 1, "top_left"))],
    Case("heads-broadcast/varlen-sequence-of-1", lambda X: ("fwd", (
        X.randn((1, 41, 2, 64)), X.strided((1, 48, 2, 64), (48 * 64, 64, 0, 1)),
        X.strided((1, 48, 2, 64), (48 * 64, 64, 0, 1))),
        dict(cu_seqlens_q=X.cu([0, 40, 41]), cu_seqlens_k=X.cu([0, 24, 48]))), U, r"^k and v are both broadcast"),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def call_of(X, case):
    kind, args, options = case.build(X)
    fn = api.attention_forward if kind == "fwd" else api.attention_backward
    return kind, lambda: fn(*args, **options, **X.extra)
