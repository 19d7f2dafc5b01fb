"""Serving a block mask where no flashgen kernel reads its lists: the mask as a dense bias.

sm90_fwd's and sm90_bwd's sparse instances read them (128 x 128 blocks, no bias, a causal mask
or window folded into the lists by the public calls, and for the backward no soft-capping or
deterministic order; ``families.sparse_family``);
every other call with ``block_mask`` runs as a call with an additive bias: the mask as 0 / -inf
over [B or 1, H or 1, M, N] (a causal mask folded in, so the kernel runs unmasked), plus
``attn_bias`` when one is given, served by the first family that takes such a bias: flashgen's
own bias instances (sm90 on Hopper, sm80 from 8.0 on; head dims up to 128), else example 41, at
the cost of a dense attention with a bias; a warning says so once per process.  The bias is
built on the first call for each dtype and kept with the mask (freed with it; a causal mask or
window is in the mask's lists already, ``BlockMask.with_band``); later calls on other streams wait
for it on the device, never on the host.

Rows that see no key: example 41 divides 0 by 0 on a row of -inf scores (its lse comes out
-inf; flashgen's kernels write 0 there), so after the forward those rows are set to output 0, bit
by bit (the NaN goes too), and
lse -inf: flashgen's convention for rows without keys (bottom-right causal with M > N, empty
varlen sequences).  The backward reads lse +inf on those rows, as on the rows the kernels pad,
so P = exp(s - lse) is 0 there, not exp(-inf + inf): dq is 0 and they add nothing to dk, dv or
dbias.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import replace

import numpy as np

from flashgen.runtime.arrays import dtype_name, padded_rows
from flashgen.runtime.validate import MASKS, Call, checked_bias

WARNING = ("flashgen: block_mask runs dense (the mask becomes an additive [B, H, M, N] bias, on the kernels "
           "that take one), so it is as slow as a dense attention with a bias, not faster for being "
           "sparse; only sm90_fwd and sm90_bwd visit just the listed blocks, for the calls they take "
           "(flashgen.explain says why not).  (Warned once per process.)")

_warned = False
_dense = weakref.WeakKeyDictionary()  # BlockMask -> {dtype: (bias, empty rows, event)}


def warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(WARNING, UserWarning, stacklevel=4)  # the caller of attention_forward/backward


def forward(cupy, call: Call, run):
    """(out, lse) of a block-mask forward through ``run(cupy, call)`` on the dense call."""
    warn_once()
    call, empty = dense_call(cupy, call)
    out, lse = run(cupy, call)
    with _stream(cupy, call):
        bits = out.view(cupy.uint16 if out.itemsize == 2 else cupy.uint32)  # exact zeros, whatever the dtype
        bits *= (~empty).transpose(0, 2, 1)[..., None].astype(bits.dtype)
        lse[...] = cupy.where(empty, cupy.float32(-np.inf), lse)
    return out, lse


def backward(cupy, call: Call, run):
    """The gradients of a block-mask call through ``run(cupy, call)`` on the dense call."""
    warn_once()
    return run(cupy, dense_call(cupy, call)[0])


def dense_call(cupy, call: Call):
    """(the call with the mask as a dense bias, empty [B or 1, H or 1, M]: which rows see no key).

    The call's ``bias`` becomes the mask's dense bias (plus its own ``attn_bias``), its causal
    mask moves into that bias (``p.mask`` 0), a backward's lse becomes +inf on rows without
    keys, and ``block_mask`` leaves it: any family that takes the bias serves it."""
    p, dtype, mask = call.p, call.q.dtype, call.block_mask
    if p.mask:  # the public calls have folded it already (block_masks.fold_band); a call built otherwise
        mask = mask.with_band(None, p.N - p.M if p.mask == MASKS["bottom_right"] else 0)
    stream = _stream(cupy, call)
    with stream:
        bias, empty = _cached(mask, dtype, stream)
        if call.bias is not None:
            total = padded_rows(cupy, (p.B, p.H, p.M, p.N), dtype)
            total[...] = (bias.astype(cupy.float32) + call.bias.astype(cupy.float32)).astype(dtype)
            bias = total
        bias = checked_bias(cupy, bias, p, call.q, p.M, p.N)[0]  # the kernels' offset limits (no copy)
        lse = call.lse
        if call.direction == "bwd":
            lse = cupy.where(empty, cupy.float32(np.inf), lse[:, :, :p.M])
    return replace(call, p=replace(p, mask=0), bias=bias, lse=lse, plan_key=None, block_mask=None), empty


def _stream(cupy, call: Call):
    """The call's stream (given, or CuPy's current: under a torch caller, torch's), made current."""
    return call.stream if call.stream is not None else cupy.cuda.get_current_stream()


def _cached(block_mask, dtype, stream):
    """The mask's fallback bias and empty rows for ``dtype``: built on ``stream`` the first time,
    afterwards waited for on it (an event: no host synchronisation)."""
    kept = _dense.setdefault(block_mask, {})
    key = dtype_name(dtype)
    if key not in kept:
        bias, empty = block_mask.additive(dtype)
        kept[key] = (bias, empty, stream.record())
    else:
        stream.wait_event(kept[key][2])
    return kept[key][:2]
