"""Context parallelism's building blocks: attention of a query shard over one key/value shard,
as partial results that merge through their log-sum-exp.  No communication, no torch.

A sequence split over P devices gives each one a *shard*: runs of consecutive positions
(``shard_segments``; "zigzag" pairs chunk r with chunk 2P-1-r of 2P equal chunks so that
a causal mask leaves every rank the same work).  Attention of a query shard over a key
shard is a few calls of the fused kernels (``plan_blocks``: the mask cut into blocks that
``attention_forward`` can express, fully masked ones skipped).  Their outputs are partial:
(out_j, lse_j) over the keys of shard j.  Over all shards the exact output is

    lse = log(sum_j exp(lse_j)),   out = sum_j exp(lse_j - lse) * out_j,

which ``merge`` accumulates one shard at a time (lse is the natural log of the sum of
exp(scale * q.k), as the kernels return it).  Accumulators are float32 (float64 for float64
inputs, which only a reference runs).  The backward needs no merge: a key
shard's kernel backward given the *final* out and lse (so delta = rowsum(dO * O) of the
final output and P = exp(s - lse) the final probabilities) returns exactly that shard's
share of dq and its own dk, dv; ``partial_backward`` adds them up.

Everything takes torch tensors, CuPy arrays or NumPy arrays (the kernels need the first
two on a GPU); the block kernels are parameters, so any transport (the torch op in
``flashgen.torch.distributed``, NCCL through CuPy, a test's float64 reference on the CPU)
can drive the same code.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from flashgen.runtime.api import attention_backward, attention_forward

Segments = Tuple[Tuple[int, int], ...]  # (first global position, length) of each run, in the shard's order
LAYOUTS = ("zigzag", "contiguous")


def shard_segments(rank: int, world: int, length: int, layout: str = "zigzag") -> Segments:
    """The global positions rank ``rank`` of ``world`` holds of a ``length``-token sequence.

    "zigzag": chunks ``rank`` and ``2 * world - 1 - rank`` of 2 * world equal chunks (a causal
    mask then gives every rank the same number of visible pairs); "contiguous": chunk
    ``rank`` of ``world`` (simple, but with a causal mask rank r works r + 1 times as long as
    rank 0)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}); got {rank}")
    parts = 2 * world if layout == "zigzag" else world
    if length % parts:
        raise ValueError(f"a {layout} split over {world} ranks cuts the sequence into {parts} equal chunks; "
                         f"its length {length} is not a multiple of {parts} (pad it)")
    chunk = length // parts
    if layout == "contiguous":
        return ((rank * chunk, chunk),)
    return ((rank * chunk, chunk), ((parts - 1 - rank) * chunk, chunk))


@dataclass(frozen=True)
class Block:
    """One kernel call: local query rows ``rows`` over local key rows ``cols`` of a shard pair,
    with the mask expressed in ``attention_forward``'s terms (``causal`` "top_left" or None,
    ``window`` (left, right) or None; both None: every pair visible)."""

    rows: slice
    cols: slice
    causal: Optional[str] = None
    window: Optional[Tuple[Optional[int], Optional[int]]] = None

    @property
    def full(self) -> bool:
        return self.causal is None and self.window is None


def plan_blocks(q_segments: Segments, k_segments: Segments, *, causal: bool = False,
                window: Optional[Tuple[Optional[int], Optional[int]]] = None) -> Tuple[Block, ...]:
    """The kernel calls of a query shard over a key shard (both as ``shard_segments``).

    The global mask: key position - query position in [-left, right] (``window``; None: no
    bound), and <= 0 with ``causal``.  Each pair of runs becomes one block at most: skipped
    where no pair is visible, cropped to the rows and keys that see each other, and sent to
    the kernels as "no mask", top-left causal or a window relative to the block's own
    diagonal.  Unmasked blocks that line up merge into one call (the kernels like few large
    calls), and a causal shard over itself without a window is a single top-left call when
    its positions increase (the local order then is the global one)."""
    left, right = (None, None) if window is None else window
    lo = None if left is None else -left
    hi = 0 if causal else right
    q_rows = sum(n for _, n in q_segments)
    k_rows = sum(n for _, n in k_segments)
    if lo is None and hi is None:
        return (Block(slice(0, q_rows), slice(0, k_rows)),)
    starts = [start for start, _ in q_segments]
    if causal and lo is None and q_segments == k_segments and starts == sorted(starts):
        return (Block(slice(0, q_rows), slice(0, k_rows), "top_left"),)
    blocks = []
    q_at = 0
    for q_start, q_len in q_segments:
        k_at = 0
        for k_start, k_len in k_segments:
            block = _run_block(q_len, k_len, q_start - k_start, lo, hi)
            if block is not None:
                rows, cols, causal_code, win = block
                blocks.append(Block(slice(q_at + rows[0], q_at + rows[1]), slice(k_at + cols[0], k_at + cols[1]),
                                    causal_code, win))
            k_at += k_len
        q_at += q_len
    return _coalesce(blocks)


def _run_block(rows: int, cols: int, offset: int, lo: Optional[int], hi: Optional[int]):
    """One run of ``rows`` queries over one run of ``cols`` keys, the queries' first position
    ``offset`` past the keys': local key b is visible to local query a when b - a lies in
    [lo + offset, hi + offset].  Returns ((a0, a1), (b0, b1), causal, window) or None."""
    low = None if lo is None else lo + offset
    high = None if hi is None else hi + offset
    if (low is not None and low > cols - 1) or (high is not None and high < 1 - rows):
        return None  # no visible pair
    # low <= 0 <= high, unless the whole band lies past the diagonal: then shift it onto the
    # kernels' diagonal (b = a) by dropping the leading keys (shift > 0) or leading queries
    # (shift < 0), which see nothing.
    shift = low if low is not None and low > 0 else high if high is not None and high < 0 else 0
    a0, b0 = max(0, -shift), max(0, shift)
    left = None if low is None else shift - low
    right = None if high is None else high - shift
    n_rows, n_cols = rows - a0, cols - b0
    if left is not None:
        n_rows = min(n_rows, n_cols + left)  # later queries see no key of this run
    if right is not None:
        n_cols = min(n_cols, n_rows + right)  # later keys are seen by no query of this run
    if left is not None and left >= n_rows - 1:
        left = None  # every query sees back to the first key
    if right is not None and right >= n_cols - 1:
        right = None
    if left is None and right is None:
        mask, win = None, None
    elif left is None and right == 0:
        mask, win = "top_left", None
    else:
        mask, win = None, (left, right)
    return (a0, a0 + n_rows), (b0, b0 + n_cols), mask, win


def _coalesce(blocks: list) -> Tuple[Block, ...]:
    """Neighbouring unmasked blocks over the same rows with adjacent keys (or the same keys with
    adjacent rows) as one call, until none is left; the order is kept, so sums stay in a fixed
    order."""
    while True:
        merged = []
        for b in blocks:
            a = merged[-1] if merged else None
            if a is not None and a.full and b.full and a.rows == b.rows and a.cols.stop == b.cols.start:
                merged[-1] = Block(a.rows, slice(a.cols.start, b.cols.stop))
            elif a is not None and a.full and b.full and a.cols == b.cols and a.rows.stop == b.rows.start:
                merged[-1] = Block(slice(a.rows.start, b.rows.stop), a.cols)
            else:
                merged.append(b)
        if len(merged) == len(blocks):
            return tuple(merged)
        blocks = merged


def merge(out, lse, part_out, part_lse, rows: slice = slice(None)) -> None:
    """Fold a partial result (``part_out`` [B, m, H, Kv] and ``part_lse`` [B, H, m] over some
    keys) into rows ``rows`` of the accumulators ``out`` [B, M, H, Kv] and ``lse`` [B, H, M],
    in place.

    A partial row whose lse is not finite saw no key (-inf; example 41's kernels write +inf
    for such rows) and adds nothing; a row that no partial has reached stays out 0, lse -inf.
    The weights are exp(lse_i - max), so nothing overflows however far apart the two are."""
    xp = _module(lse)
    have = lse[:, :, rows]
    new = _wide(part_lse)
    new = xp.where(xp.isfinite(new), new, -math.inf)
    top = xp.maximum(have, new)
    top = xp.where(xp.isfinite(top), top, 0.0)  # both -inf: keep the weights exp(-inf) = 0, not NaN
    w_have, w_new = xp.exp(have - top), xp.exp(new - top)
    total = w_have + w_new
    seen = total > 0
    total = xp.where(seen, total, 1.0)
    lse[:, :, rows] = xp.where(seen, top + xp.log(total), -math.inf)
    acc = out[:, rows]  # a view: scaled in place, no second copy of the largest array
    acc *= _per_row(w_have / total)
    acc += _wide(part_out) * _per_row(w_new / total)


def partial_forward(q, k, v, blocks: Sequence[Block], out=None, lse=None, *, scale=None, softcap: float = 0.0,
                    forward: Callable = attention_forward):
    """Attention of q [B, M, H, K] over k, v [B, N, Hk, K/Kv] in ``blocks`` (``plan_blocks``),
    merged into the float32 accumulators ``out`` [B, M, H, Kv] and ``lse`` [B, H, M] (when None:
    created, from the first block's result where it covers every row); returns them.  Call it once per key shard with the same
    accumulators, then cast ``out`` to q's dtype: that is attention over every shard.

    ``forward(q, k, v, causal=, window=, scale=, softcap=) -> (out, lse)``: the block kernel,
    ``attention_forward`` (grouped-query k/v read in place) unless a caller passes another."""
    for block in blocks:
        part_out, part_lse = forward(q[:, block.rows], k[:, block.cols], v[:, block.cols], causal=block.causal,
                                     window=block.window, scale=scale, softcap=softcap)
        if out is None and block.rows == slice(0, q.shape[1]):  # the first result over every row: take it
            xp, lse = _module(part_lse), _wide(part_lse)
            out, lse = _wide(part_out), xp.where(xp.isfinite(lse), lse, -math.inf)
            continue
        if out is None:
            B, M, H = q.shape[:3]
            out, lse = _filled(q, (B, M, H, v.shape[3]), 0.0), _filled(q, (B, H, M), -math.inf)
        merge(out, lse, part_out, part_lse, block.rows)
    if out is None:  # no key of this shard is visible to any query
        B, M, H = q.shape[:3]
        out, lse = _filled(q, (B, M, H, v.shape[3]), 0.0), _filled(q, (B, H, M), -math.inf)
    return out, lse


def partial_backward(grad_out, q, k, v, out, lse, blocks: Sequence[Block], dq=None, dk=None, dv=None, *, scale=None,
                     softcap: float = 0.0, deterministic: bool = False, backward: Callable = attention_backward):
    """This key shard's share of dq, and its own dk, dv, added into float32 accumulators (created
    when None); returns (dq, dk, dv).

    ``out`` (q's dtype) and ``lse`` [B, H, M] must be the *final* ones, over every key shard
    (``partial_forward``'s after the last shard): the kernels then compute delta =
    rowsum(dO * O) and P = exp(s - lse) of the whole softmax, and each block's gradients are
    exactly its share of the whole attention's.  Summing the shards in a fixed order (and
    ``deterministic=True`` for the kernels' own dq) repeats the same bits.

    ``backward(grad_out, q, k, v, out, lse, causal=, window=, scale=, softcap=, deterministic=)``:
    ``attention_backward`` unless a caller passes another."""
    for block in blocks:
        r, c = block.rows, block.cols
        grads = backward(grad_out[:, r], q[:, r], k[:, c], v[:, c], out[:, r], lse[:, :, r], causal=block.causal,
                         window=block.window, scale=scale, softcap=softcap, deterministic=deterministic)
        dq = _add_rows(dq, r, grads[0], q.shape)
        dk = _add_rows(dk, c, grads[1], k.shape)
        dv = _add_rows(dv, c, grads[2], v.shape)
    return tuple(_filled(x, x.shape, 0.0) if acc is None else acc for acc, x in ((dq, q), (dk, k), (dv, v)))


def _add_rows(acc, rows: slice, part, shape):
    """``acc[:, rows] += part``; with no accumulator yet, ``part`` itself (widened) when it covers
    every row, else zeros to add it to."""
    if acc is None and rows == slice(0, shape[1]):
        return _wide(part)
    if acc is None:
        acc = _filled(part, shape, 0.0)
    acc[:, rows] += part  # widened inside the add, with no float32 copy of part
    return acc


def _module(x):
    """torch, cupy or numpy, whichever ``x`` belongs to: the functions used here (exp, log,
    where, maximum, isfinite) have the same names and meaning in all three."""
    root = type(x).__module__.split(".")[0]
    return importlib.import_module(root) if root in ("torch", "cupy") else np


def _wide(x):
    """``x`` in its accumulator dtype: float32, or float64 for float64 inputs (a reference run)."""
    xp = _module(x)
    if xp is not np and xp.__name__ == "torch":
        return x if x.dtype == xp.float64 else x.float()
    return x.astype(np.float64 if x.dtype == np.float64 else np.float32, copy=False)


def _filled(like, shape, value):
    """An accumulator of ``shape`` filled with ``value``: ``like``'s kind, device and ``_wide``
    dtype."""
    xp = _module(like)
    if xp.__name__ == "torch":
        return like.new_full(shape, value, dtype=xp.float64 if like.dtype == xp.float64 else xp.float32)
    dtype = np.float64 if like.dtype == np.float64 else np.float32
    if xp is np:
        return np.full(shape, value, dtype=dtype)
    with like.device:
        return xp.full(shape, value, dtype=dtype)


def _per_row(weights):
    """[B, H, M] row weights as [B, M, H, 1], to scale BMHK outputs."""
    return weights.swapaxes(1, 2)[..., None]
