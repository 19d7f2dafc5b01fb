"""PyTorch adapter: flashgen's kernels as differentiable torch functions and operators.

    import flashgen.torch as ft
    out = ft.attention(q, k, v, causal="top_left")          # [B, M, H, K] CUDA tensors
    out = ft.scaled_dot_product_attention(q, k, v, is_causal=True)   # torch's [B, H, S, D]
    out = ft.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)     # packed [total, H, K]
    ft.register_transformers()    # then attn_implementation="fg_attention" in transformers

Tensors go to the runtime as they are (no copies): outputs come from torch's caching
allocator, kernels run on torch's current stream, and a repeated call takes the
runtime's launch plan.  The operators (``flashgen.torch.ops``) have fake
implementations, so ``torch.compile(fullgraph=True)`` traces through them; CUDA
graphs capture a call once it has run eagerly (its plan exists); under
``torch.autocast`` the inputs are cast to the autocast dtype, as for SDPA.
``import flashgen`` never imports torch; only this package does.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from flashgen.runtime.packed import PackedOffsets
from flashgen.torch import ops
from flashgen.torch.transformers import register_transformers

__all__ = ["attention", "attention_varlen", "scaled_dot_product_attention", "register_transformers"]

_SEED_LIMIT = 2**63  # the operators carry the seed as an int64


def _autocast(*tensors):
    """Cast floating inputs to the autocast dtype when autocast is on for CUDA (SDPA does the same)."""
    if not torch.is_autocast_enabled("cuda"):
        return tensors
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def _seed(dropout_p: float, seed: Optional[int]) -> int:
    """An explicit seed, or one drawn from torch's generator for dropout (torch.manual_seed repeats it)."""
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64)) if dropout_p > 0 else 0
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**63) in flashgen.torch; got {seed!r}")
    return seed


def _window(window) -> Tuple[int, int]:
    """(left, right) with -1 for an unbounded side; the runtime checks the values themselves."""
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be (left, right), None for no limit on a side; got {window!r}")
    for side in window:
        if side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < 0):
            raise ValueError(f"window sides must be ints >= 0 or None; got {window!r}")
    return tuple(-1 if side is None else side for side in window)


def _causal(causal) -> int:
    if not (causal is None or isinstance(causal, str)) or causal not in ops.CAUSAL:
        raise ValueError(f"causal must be None, 'top_left' or 'bottom_right'; got {causal!r}")
    return ops.CAUSAL[causal]


def _run(q, k, v, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale, dropout_p, seed, offset,
         window, softcap, deterministic, block_mask=None, mods=None):
    """Check the options and tensors, then run the forward operator (eager or traced)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False; got {deterministic!r}")
    left, right = _window(window)
    causal, seed = _causal(causal), _seed(dropout_p, seed)
    for name, t in (("q", q), ("k", k), ("v", v), ("attn_bias", attn_bias)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.is_cuda):
            where = f"on {t.device}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
            raise TypeError(f"{name} is {where}, not a CUDA tensor: flashgen.torch takes CUDA tensors (.cuda())")
    q, k, v, attn_bias = _autocast(q, k, v, attn_bias)
    return ops.forward(q, k, v, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal,
                       None if scale is None else float(scale), float(dropout_p), seed, int(offset), left, right,
                       float(softcap), deterministic, block_mask=block_mask, mods=mods)


def attention(q, k, v, attn_bias=None, *, causal=None, scale=None, dropout_p=0.0, seed=None, offset=0, window=None,
              softcap=0.0, deterministic=False, block_mask=None, score_mod=None, mod_tensors=None,
              return_lse=False) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """softmax(q k^T * scale + bias) v over [B, M, H, K] tensors (k, v: [B, N, Hk, K/Kv], H a
    multiple of Hk), differentiable in q, k, v and attn_bias (broadcastable to [B, H, M, N]).

    ``causal``, ``window``, ``softcap``, ``dropout_p``/``seed``/``offset`` and
    ``deterministic`` are ``flashgen.attention_forward``'s and ``attention_backward``'s.
    With ``dropout_p > 0`` and no ``seed``, one is drawn from torch's generator.  With
    ``return_lse``: (out, lse [B, H, M] float32, not differentiable).  ``block_mask``: a
    ``flashgen.block_mask`` built on the tensors' GPU (it gets no gradient); eager calls only for
    now (which kernels serve it: ``flashgen.attention_forward``).  ``score_mod`` and ``mod_tensors``:
    ``flashgen.attention_forward``'s (under ``torch.compile`` the mod by its name); the captured tensors
    get no gradient: one that requires grad is refused.
    """
    mods = None if score_mod is None else (score_mod, mod_tensors)
    out, lse = _run(q, k, v, attn_bias, None, None, 0, causal, scale, dropout_p, seed, offset, window, softcap,
                    deterministic, block_mask, mods)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *, causal=None,
                     scale=None, dropout_p=0.0, seed=None, offset=0, window=None, softcap=0.0, deterministic=False,
                     return_lse=False):
    """Attention over packed sequences: q [total_q, H, K], k/v [total_k, Hk, K/Kv], sequence i
    being rows cu_seqlens_q[i]:cu_seqlens_q[i+1] (int32 CUDA tensors of S+1 offsets).  Returns
    out [total_q, H, Kv] (and with ``return_lse`` lse [S, H, max_seqlen_q]).  ``max_seqlen_q``
    must be at least the longest query sequence (it sizes lse, as FlashAttention's does);
    ``max_seqlen_k`` is accepted for the same signature."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D [total, heads, head_dim] for attention_varlen; got {tuple(x.shape)}")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
        raise ValueError(f"max_seqlen_q must be a positive int; got {max_seqlen_q!r}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            hint = ("; flashgen.packed_offsets is for the CuPy API -- flashgen.torch reads a tensor's offsets once "
                    "and again only after the tensor changes" if isinstance(cu, PackedOffsets) else "")
            raise TypeError(f"{name} must be an int32 CUDA tensor; got a {type(cu).__name__}{hint}")
    out, lse = _run(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    causal, scale, dropout_p, seed, offset, window, softcap, deterministic)
    return (out[0], lse) if return_lse else out[0]


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` on flashgen's kernels: [B, H, L, E]
    query, [B, Hk, S, E] key and [B, Hk, S, Ev] value (Hk < H only with ``enable_gqa``), a bool
    (True = take part) or additive float mask broadcastable to [B, H, L, S], top-left
    ``is_causal``.  Returns [B, H, L, Ev], a transposed view of a [B, L, H, Ev] buffer (no copies)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("flashgen's scaled_dot_product_attention takes 4-D [batch, heads, seq, dim] tensors")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads, key {key.shape[1]}: pass enable_gqa=True for "
                         "grouped-query attention")
    if attn_mask is not None and is_causal:
        raise ValueError("pass attn_mask or is_causal, not both (as torch's SDPA requires)")
    bias = attn_mask
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~attn_mask,
                                                                                                  -math.inf)
    elif attn_mask is not None:
        bias = attn_mask.to(query.dtype)  # the kernels add a bias of q's dtype
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), bias,
                    causal="top_left" if is_causal else None, scale=scale, dropout_p=dropout_p)
    return out.transpose(1, 2)
