"""A representative set of forward+backward calls for compute-sanitizer (see run.sh beside this).

Covers every family (the Ampere ones, sm80_fwd and sm80_bwd, forced with FLASHGEN_FAMILIES where
an earlier family would serve their calls), each dtype, aligned and 4-aligned (unaligned kernels), the
block-aligned backward kernels (M and N multiples of the block),
dropout, the largest kMaxK tier (head dim 320), split keys > 1 (few batch x
heads, many keys), causal kinds, bias with its gradient, varlen, block masks and (on a 9.0 GPU) the
sm90 ALiBi instances (a score mod).  Sizes are
small: the sanitizer slows kernels down a hundredfold.  Families with no kernels on the path for the
GPU (a plain sm90 build has no sm90_fwd/sm90_bwd) have their own cases skipped, with a line saying so.
"""
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
from attention_reference import make_bias, randn  # noqa: E402

import flashgen  # noqa: E402
from flashgen.runtime.device import device_info  # noqa: E402
from flashgen.runtime.registry import default_registry  # noqa: E402

r = np.random.default_rng(0)


def built(family: str):
    """The kernels of ``family`` on the path that GPU 0 runs (none from a plain sm90 build for sm90_*)."""
    try:
        return default_registry().for_device(family, device_info(0))
    except flashgen.UnsupportedError:
        return []


HOPPER = bool(built("sm90_fwd")) and bool(built("sm90_bwd"))
if not HOPPER:
    print("no sm90_fwd and sm90_bwd kernels for this GPU: their cases are skipped")


def call(dtype, B, M, N, H, K, Kv=None, offset=False, **opts):
    """Forward and backward twice with new data: the first call takes the full path, the second
    its launch plan (flashgen/runtime/plans.py)."""
    for _ in range(2):
        grads = call_once(dtype, B, M, N, H, K, Kv, offset, **dict(opts))
    return grads


def call_once(dtype, B, M, N, H, K, Kv=None, offset=False, **opts):
    Kv = Kv or K
    Hk = opts.pop("heads_kv", H)
    deterministic = opts.pop("deterministic", False)
    q, k, v = randn(r, (B, M, H, K), dtype), randn(r, (B, N, Hk, K), dtype), randn(r, (B, N, Hk, Kv), dtype)
    if offset:  # a 4-element offset: only the unaligned kernels accept it
        q = randn(r, (B * M * H * K + 4,), dtype)[4:].reshape(B, M, H, K)
    bias = opts.pop("bias", None)  # True: a full [B, H, M, N] bias; a string: the dims it broadcasts
    if bias:
        opts["attn_bias"] = make_bias(r, dtype, B, H, M, N, "" if bias is True else bias)
    out, lse = flashgen.attention_forward(q, k, v, **opts)
    grads = flashgen.attention_backward(randn(r, out.shape, dtype), q, k, v, out, lse,
                                        bias_requires_grad=bias is not None and bias, deterministic=deterministic,
                                        **opts)
    cupy.cuda.runtime.deviceSynchronize()
    return grads


for dtype in ("f32", "f16", "bf16"):
    call(dtype, 2, 70, 90, 2, 64)                                      # aligned, kMaxK 64
    call(dtype, 1, 33, 65, 2, 128, causal="top_left")                  # kMaxK 128 (128x128 on sm90)
    call(dtype, 1, 40, 300, 1, 320, 256)                               # largest tier, K != Kv, split keys
    call(dtype, 2, 17, 29, 2, 36, offset=True)                         # unaligned kernels
    call(dtype, 1, 64, 64, 2, 64, dropout_p=0.3, seed=7)               # dropout
    call(dtype, 1, 50, 20, 2, 64, causal="bottom_right", bias=True)    # rows without keys, bias gradient
    call(dtype, 1, 128, 256, 2, 128, causal="top_left")                # M, N block multiples: block-aligned (f16/bf16)
    call(dtype, 2, 64, 64, 2, 64)
# flashgen's Hopper forward and backward (9.0 GPUs; the aligned, bias-free f16/bf16 calls above
# take them too): several key blocks with partial tiles, a head dim below its tier, grouped-query
# k/v, rows without keys, the deterministic dQ order, sliding windows and soft-capping
for dtype in ("f16", "bf16") if HOPPER else ():
    call(dtype, 1, 300, 260, 4, 96, causal="bottom_right")
    call(dtype, 2, 129, 200, 2, 40)
    call(dtype, 1, 200, 333, 8, 128, heads_kv=2, causal="top_left")
    call(dtype, 1, 300, 130, 2, 64, causal="bottom_right")
    call(dtype, 2, 257, 300, 2, 128, deterministic=True)
    call(dtype, 1, 300, 700, 4, 64, heads_kv=2, window=(100, 20), softcap=10.0)   # band at both edges, softcap
    call(dtype, 1, 400, 100, 2, 128, window=(0, 5), deterministic=True)          # rows whose window is empty
    call(dtype, 1, 200, 333, 4, 256, heads_kv=2, causal="top_left")                 # the split head dim
    call(dtype, 1, 150, 300, 2, 192, deterministic=True, softcap=4.0)               # its deterministic order
    # band calls of 8 or more query heads a k/v head walk the query blocks from the last (head dims over 64):
    # odd counts, rotated first heads, a window, the deterministic dQ order on the split head dim
    call(dtype, 1, 300, 333, 8, 128, heads_kv=1, causal="top_left")
    call(dtype, 2, 200, 130, 16, 256, heads_kv=2, window=(60, 0), deterministic=True)
    # the persistent forward: more work units than SMs, so each CTA walks several tiles (one at
    # a time, or causal pairs with an odd count), carrying its K/V ring, Q buffer and turns over
    call(dtype, 2, 700, 500, 40, 64)
    call(dtype, 2, 700, 500, 40, 128, causal="top_left")
    # the bias instances: odd key counts (partial TMA boxes of bias, dbias chunks into the row
    # padding), rows past M, grouped-query dbias per query head, windows with soft-capping, a head
    # dim below its tier, broadcast dims
    call(dtype, 1, 300, 259, 4, 64, heads_kv=2, causal="bottom_right", bias=True)
    call(dtype, 2, 129, 201, 2, 128, window=(50, 10), softcap=5.0, bias="M")   # one bias row per head
    call(dtype, 2, 77, 130, 2, 96, deterministic=True, bias="BH")
    call(dtype, 1, 130, 200, 2, 64, softcap=3.0, bias="H")                     # backward on the 128 tier
    # the dropout instances (runtime/dropout.py): partial tiles, grouped-query k/v, both tiers (96 on 128),
    # a window, rows without keys (the backward leaves them out as the forward does), a head dim the
    # runtime pads to 8, the deterministic order
    call(dtype, 1, 300, 259, 4, 64, heads_kv=2, causal="bottom_right", dropout_p=0.2, seed=3)
    call(dtype, 2, 129, 201, 2, 96, window=(50, 10), dropout_p=0.5, seed=4, offset=9, deterministic=True)
    call(dtype, 1, 77, 130, 2, 44, causal="top_left", dropout_p=0.1, seed=5)
# the sm90 ALiBi instances (score_mod="alibi"; 9.0 GPUs with an sm90a build on the path, not a plain
# sm90 one): odd key and query counts (the indices past the sequence that the mod clamps before it
# reads the slope), grouped-query k/v, both bands, a window, a head dim below its tier, the
# deterministic order
if any(b.spec.score_mod == "alibi" for b in built("sm90_fwd")):
    slope = {"slope": cupy.asarray([2.0 ** (-2.0 * i) for i in range(1, 5)], dtype=cupy.float32)}
    for dtype in ("f16", "bf16"):
        call(dtype, 1, 259, 300, 4, 64, heads_kv=2, causal="bottom_right", score_mod="alibi", mod_tensors=slope)
        call(dtype, 2, 129, 201, 4, 96, window=(50, 10), score_mod="alibi", mod_tensors=slope)
        call(dtype, 1, 77, 130, 4, 128, deterministic=True, score_mod="alibi", mod_tensors=slope)
elif HOPPER:
    print("no sm90 ALiBi kernels on the path: their cases are skipped")
# packed batches: example 41 (float32) and, on a 9.0 GPU, sm90 (a sequence without keys, one
# without queries, rows past the last sequence, a band per sequence, the deterministic order)
cu_q, cu_k = np.array([0, 5, 5, 40], np.int32), np.array([0, 0, 30, 70], np.int32)
for dtype in ("f32", "f16"):
    q = randn(r, (1, 40, 2, 64), dtype)
    kv = randn(r, (1, 70, 2, 64), dtype)
    out, lse = flashgen.attention_forward(q, kv, kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    flashgen.attention_backward(out, q, kv, kv, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
cu_q, cu_k = np.array([0, 300, 300, 301, 560], np.int32), np.array([0, 400, 410, 420, 1000], np.int32)
q = randn(r, (1, 570, 4, 128), "bf16")
kv = randn(r, (1, 1000, 2, 128), "bf16")
for options in (dict(causal="bottom_right", deterministic=True), dict(window=(64, 8), softcap=5.0)):
    deterministic = options.pop("deterministic", False)
    out, lse = flashgen.attention_forward(q, kv, kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)
    flashgen.attention_backward(out, q, kv, kv, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                deterministic=deterministic, **options)
# the last sequence short (its query blocks past the end are in the grid): without the pool each
# array is an allocation of its own, so memcheck sees a read past the workspace's end
cupy.cuda.set_allocator(None)
cu_q, cu_k = np.array([0, 300, 310], np.int32), np.array([0, 200, 500], np.int32)
for K in (64, 128):
    q = randn(r, (1, 310, 2, K), "f16")
    kv = randn(r, (1, 500, 2, K), "f16")
    out, lse = flashgen.attention_forward(q, kv, kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal="top_left")
    flashgen.attention_backward(out, q, kv, kv, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal="top_left")
cupy.cuda.runtime.deviceSynchronize()
# packed batches through flashgen.torch (where torch is installed): the same offsets tensors three
# times, so the third forward and backward replay plans keyed by the offsets' contents, which point the
# kernels at the caller's offsets and clear the rows past the last sequence (q's 20, k's 40)
try:
    import torch
    import flashgen.torch as flashgen_torch
except ImportError:
    torch = None
    print("no torch: the packed plans' replay is skipped")
if torch is not None:
    cu_q = torch.tensor([0, 100, 100, 280], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 60, 200, 260], dtype=torch.int32, device="cuda")
    for _ in range(3):
        q = torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flashgen_torch.attention_varlen(q, kv, kv, cu_q, cu_k, 180, 140, causal="top_left")
        torch.autograd.grad(out, (q, kv), torch.ones_like(out))
    torch.cuda.synchronize()
# sm90_fwd's and sm90_bwd's sparse instances (block masks of 128 x 128 blocks, on a 9.0 GPU; served dense
# elsewhere): partial and full blocks, a query block and rows without keys, ragged last blocks (M = 300: the
# 64-query steps of head dim 128 stop at the last query), the mask broadcast over the batch, grouped-query
# k/v (the backward walks each query head's lists), a key block no query sees; each array still its own
# allocation, so a read past the lists, the bits or the workspace is seen
for dtype, K in (("f16", 64), ("bf16", 128)):
    visible = cupy.asarray(r.random((1, 4, 300, 259)) < 0.2)
    visible[:, 1, :, :128] = True
    visible[:, :, 128:256] = False
    visible[:, :, ::7] = False
    visible[:, 2:, :, 128:] = False
    q, do, kv = randn(r, (2, 300, 4, K), dtype), randn(r, (2, 300, 4, K), dtype), randn(r, (2, 259, 2, K), dtype)
    mask = flashgen.block_mask(visible, 1, 4, 300, 259)
    out, lse = flashgen.attention_forward(q, kv, kv, block_mask=mask)
    flashgen.attention_backward(do, q, kv, kv, out, lse, block_mask=mask)
cupy.cuda.runtime.deviceSynchronize()
# flashgen's Ampere forward and backward (any 8.0+ GPU with sm80_fwd and sm80_bwd built; on Hopper a
# plain sm90 build), forced ahead of the sm90 families: one and several key blocks, partial tiles, a head
# dim below its tier, grouped-query k/v, both causal kinds, rows without keys, windows with soft-capping,
# deterministic dQ, the 192 and 256 tiers (a head dim padded to each; 32-column swizzle atoms at 192),
# a packed batch whose last sequence is short (each array its own allocation still), the launch plans'
# replay, the bias instances (odd key counts: bias chunks and dbias pairs past the last key, rows past M,
# grouped-query dbias per query head, each broadcast form, a window, soft-capping without dbias), the
# dropout instances (runtime/dropout.py: partial tiles, grouped-query k/v, both tiers, 96 on 128, a
# window, rows without keys, a head dim the runtime pads to 8), and every built backward kernel directly
# (dispatch picks one tile per tier; the 99 KB ones -- 64 keys at 128, 4 warps and one dS^T buffer at
# 256 -- serve sm86/sm89 only; a bias kernel gets a bias, a dropout one dropout)
sm80_backwards = built("sm80_bwd") if built("sm80_fwd") else []
if not sm80_backwards:
    print("no sm80_fwd and sm80_bwd kernels for this GPU: their cases are skipped")
if sm80_backwards:
    from flashgen.runtime import validate
    from flashgen.runtime.families import sm80_bwd

    os.environ["FLASHGEN_FAMILIES"] = "sm80_fwd,sm80_bwd"
    for dtype in ("f16", "bf16"):
        for B, M, N, H, Hk, K, options in ((2, 70, 90, 2, 2, 64, {}), (1, 300, 260, 4, 4, 96, {"causal": "bottom_right"}),
                                           (1, 200, 333, 8, 2, 128, {"causal": "top_left", "deterministic": True}),
                                           (1, 300, 130, 2, 2, 64, {"causal": "bottom_right"}),
                                           (1, 300, 700, 4, 2, 64, {"window": (100, 20), "softcap": 10.0}),
                                           (1, 400, 100, 2, 2, 128, {"window": (0, 5)}),
                                           (1, 150, 200, 4, 2, 256, {"causal": "bottom_right", "deterministic": True}),
                                           (2, 130, 77, 2, 1, 176, {"window": (30, 20), "softcap": 5.0}),
                                           (1, 300, 259, 4, 2, 64, {"causal": "bottom_right", "dropout_p": 0.2,
                                                                    "seed": 3}),
                                           (2, 129, 201, 2, 2, 96, {"window": (50, 10), "dropout_p": 0.5, "seed": 4,
                                                                    "deterministic": True}),
                                           (1, 77, 130, 2, 2, 44, {"causal": "top_left", "dropout_p": 0.1, "seed": 5})):
            call(dtype, B, M, N, H, K, heads_kv=Hk, **options)  # full path, then the plans
        call(dtype, 1, 300, 259, 4, 64, heads_kv=2, causal="bottom_right", bias=True)
        call(dtype, 2, 129, 201, 2, 128, window=(50, 10), bias="M")
        call(dtype, 2, 77, 130, 2, 96, deterministic=True, bias="BH")
        call(dtype, 1, 130, 200, 2, 40, causal="top_left", bias="H")
        q, k, v, do = (randn(r, shape, dtype) for shape in ((1, 130, 2, 64), (1, 200, 2, 64), (1, 200, 2, 64),
                                                            (1, 130, 2, 64)))
        soft = dict(attn_bias=make_bias(r, dtype, 1, 2, 130, 200, "B"), softcap=3.0)  # dbias is refused with it
        out, lse = flashgen.attention_forward(q, k, v, **soft)
        flashgen.attention_backward(do, q, k, v, out, lse, **soft)
    cu_q, cu_k = np.array([0, 300, 300, 301, 560], np.int32), np.array([0, 400, 410, 420, 1000], np.int32)
    q, do = randn(r, (1, 570, 4, 128), "bf16"), randn(r, (1, 570, 4, 128), "bf16")
    kv = randn(r, (1, 1000, 2, 128), "bf16")
    for options in ({"window": (64, 8), "softcap": 5.0}, {"causal": "bottom_right"}):
        packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)
        out, lse = flashgen.attention_forward(q, kv, kv, **packed)
        flashgen.attention_backward(do, q, kv, kv, out, lse, deterministic=True, **packed)
    for binary in sm80_backwards:
        q, do = (randn(r, (2, 150, 4, binary.spec.max_k - 8), binary.spec.dtype) for _ in range(2))
        k, v = (randn(r, (2, 200, 2, binary.spec.max_k - 8), binary.spec.dtype) for _ in range(2))
        bias = make_bias(r, binary.spec.dtype, 2, 4, 150, 200, "H") if binary.spec.bias else None
        dropout = {"dropout_p": 0.3, "seed": 6} if binary.spec.dropout else {}  # (no softcap beside it)
        for options in ({"causal": "top_left", "deterministic": True, "bias_requires_grad": bias is not None,
                         **dropout},
                        {"window": (30, 40), **(dropout or {"softcap": 4.0})}):
            options["attn_bias"] = bias
            forward = {key: value for key, value in options.items() if key not in ("deterministic", "bias_requires_grad")}
            out, lse = flashgen.attention_forward(q, k, v, **forward)
            sm80_bwd.RUNTIME.launch(validate.backward_call(do, q, k, v, out, lse, dict(options),
                                                           flashgen.attention_backward), binary)
    del os.environ["FLASHGEN_FAMILIES"]
    cupy.cuda.runtime.deviceSynchronize()
print("representative set done")
