"""float64 NumPy stand-ins for flashgen's block kernels, with their contract, for the context
parallelism tests on the CPU (``test_context_cpu.py``, ``test_ring_cpu.py``).

``block_forward`` / ``block_backward`` take and return what ``attention_forward`` /
``attention_backward`` do, masks included ("top_left", "bottom_right", ``window``, softcap,
grouped-query k/v), and the backward, like the kernels, takes out and lse as given:
delta = rowsum(dO * out), P = exp(s - lse).  ``attention`` is the plain whole-sequence
attention that a split computation must reproduce; ``global_mask`` its mask over global positions.
"""
from __future__ import annotations

import math

import numpy as np


def visible(M, N, causal=None, window=None):
    """[M, N] bool: key j visible to query i under the kernels' mask, whose diagonal is
    j = i + d (d = N - M for "bottom_right", else 0)."""
    i = np.arange(M)[:, None]
    j = np.arange(N)[None, :]
    diagonal = i + (N - M if causal == "bottom_right" else 0)
    keep = np.ones((M, N), dtype=bool)
    if causal is not None:
        keep &= j <= diagonal
    left, right = window or (None, None)
    if left is not None:
        keep &= j >= diagonal - left
    if right is not None:
        keep &= j <= diagonal + right
    return keep


def global_mask(q_pos, k_pos, causal, window):
    """The mask over global positions: key - query in [-left, right], and <= 0 when causal."""
    d = k_pos[None, :] - q_pos[:, None]
    keep = np.ones(d.shape, dtype=bool)
    left, right = window or (None, None)
    if causal:
        keep &= d <= 0
    if left is not None:
        keep &= d >= -left
    if right is not None:
        keep &= d <= right
    return keep


def _scores(q, k, mask, scale, softcap):
    group = q.shape[2] // k.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bmhk,bnhk->bhmn", q, np.repeat(k, group, axis=2)) * scale
    slope = 1.0
    if softcap:
        t = np.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t
    return np.where(mask, s, -np.inf), slope, scale


def _lse(s):
    top = s.max(-1)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s - safe[..., None]).sum(-1)) + safe


def block_forward(q, k, v, *, causal=None, window=None, scale=None, softcap=0.0):
    """(out [B, M, H, Kv], lse [B, H, M]); a row that sees no key: out 0, lse -inf."""
    mask = visible(q.shape[1], k.shape[1], causal, window)
    s, _, _ = _scores(q, k, mask, scale, softcap)
    lse = _lse(s)
    p = np.where(np.isfinite(lse)[..., None], np.exp(s - np.where(np.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    group = q.shape[2] // k.shape[2]
    return np.einsum("bhmn,bnhk->bmhk", p, np.repeat(v, group, axis=2)), lse


def block_backward(grad_out, q, k, v, out, lse, *, causal=None, window=None, scale=None, softcap=0.0,
                   deterministic=False):
    """(dq, dk, dv) from the given out and lse, as the kernels compute them."""
    mask = visible(q.shape[1], k.shape[1], causal, window)
    s, slope, scale = _scores(q, k, mask, scale, softcap)
    finite = np.isfinite(lse)
    p = np.where(finite[..., None] & mask, np.exp(s - np.where(finite, lse, 0.0)[..., None]), 0.0)
    group = q.shape[2] // k.shape[2]
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    dv = np.einsum("bhmn,bmhk->bnhk", p, grad_out)
    dp = np.einsum("bmhk,bnhk->bhmn", grad_out, v_rep)
    delta = np.einsum("bmhk,bmhk->bhm", grad_out, out)[..., None]
    ds = p * (dp - delta) * slope
    dq = np.einsum("bhmn,bnhk->bmhk", ds, k_rep) * scale
    dk = np.einsum("bhmn,bmhk->bnhk", ds, q) * scale
    fold = lambda g: g.reshape(g.shape[0], g.shape[1], k.shape[2], group, g.shape[3]).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def attention(q, k, v, grad_out=None, *, causal=False, window=None, scale=None, softcap=0.0):
    """Whole-sequence attention with the global mask (key - query in [-left, right], <= 0 with
    ``causal``), by the textbook formulas: (out, lse) and, with ``grad_out``, (dq, dk, dv)."""
    out, lse = block_forward(q, k, v, causal="top_left" if causal else None, window=window, scale=scale,
                             softcap=softcap)
    if grad_out is None:
        return out, lse
    return out, lse, block_backward(grad_out, q, k, v, out, lse, causal="top_left" if causal else None,
                                    window=window, scale=scale, softcap=softcap)
