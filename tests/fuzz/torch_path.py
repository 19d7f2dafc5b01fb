"""The fuzzer's ``--torch`` mode: a case's calls through flashgen.torch, the path torch users take.

The case's CuPy inputs become torch tensors by DLPack (the same memory and strides), the forward is
``flashgen.torch.attention`` (``attention_varlen`` for packed cases, its lse sized by a
``max_seqlen_q`` the case may draw past its longest sequence), the gradients come from autograd, and
torch's caching allocator is filled with NaN first, so that an element no kernel writes shows.  The
results go back to CuPy for the fuzzer's checks.  A case's offsets are one pair of torch tensors for
all its calls: the later calls find them read (runtime/host_offsets.py) and replay launch plans.
"""
from __future__ import annotations

import cupy
import numpy as np
import torch

import flashgen.torch as ft

POISON_BYTES = 1 << 28


def offsets(cu_q: np.ndarray, cu_k: np.ndarray) -> tuple:
    """The case's cu_seqlens as int32 CUDA tensors."""
    return tuple(torch.from_numpy(cu).to("cuda") for cu in (cu_q, cu_k))


def poison_cache() -> None:
    """Fill torch's cached free blocks with NaN (the tensor is freed at once; its block stays cached)."""
    torch.full((POISON_BYTES // 4,), float("nan"), device="cuda")


def calls(p: dict, q, k, v, do, opts: dict, cu: tuple, forward_only: bool):
    """(out, lse, gradients or None) of the case through flashgen.torch, as CuPy arrays shaped like the
    CuPy API's: out [B, M, H, Kv], gradients of q, k, v (and the bias).  ``cu``: the case's torch
    offsets (``offsets``) for a packed case, else None."""
    view = torch.from_dlpack
    tq, tk, tv = (view(x).requires_grad_(not forward_only) for x in (q, k, v))
    bias = opts.get("attn_bias")
    tb = None if bias is None else view(bias).requires_grad_(not forward_only)
    options = dict(causal=opts["causal"], scale=opts["scale"], window=opts["window"], softcap=opts["softcap"],
                   dropout_p=opts.get("dropout_p", 0.0), seed=opts.get("seed"), deterministic=p["deterministic"],
                   return_lse=True)
    poison_cache()
    if cu is not None:
        rows_q, rows_k = (max([n for n in lengths] + [1]) for lengths in zip(*p["varlen"]))
        out, lse = ft.attention_varlen(tq[0], tk[0], tv[0], *cu, rows_q + p["lse_extra"], rows_k, **options)
        out = out[None]
    else:
        mods = opts.get("mod_tensors")
        out, lse = ft.attention(tq, tk, tv, tb, block_mask=opts.get("block_mask"), score_mod=opts.get("score_mod"),
                                mod_tensors=None if mods is None else {n: view(t) for n, t in mods.items()},
                                **options)
    grads = None
    if not forward_only:
        leaves = [tq, tk, tv] + ([] if tb is None else [tb])
        grads = tuple(cupy.from_dlpack(g) for g in torch.autograd.grad(out, leaves, view(do)))
    return cupy.from_dlpack(out.detach()), cupy.from_dlpack(lse.detach()), grads
