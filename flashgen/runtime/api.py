"""``attention_forward`` / ``attention_backward`` / ``explain``: validate once, then ask the families.

Layout is BMHK: q [B, M, H, K], k [B, N, Hk, K], v [B, N, Hk, Kv], any strides
with a contiguous last dim.  Inputs are CuPy arrays, torch CUDA tensors, or
anything that speaks DLPack or ``__cuda_array_interface__`` (zero-copy).  Outputs
are of the caller's kind: torch tensors (from torch's allocator) for torch inputs,
CuPy arrays otherwise (``memory.py``).  Every check happens before the launch; a
launch goes to the given CuPy stream, else the caller's current one (CuPy's, or
torch's for torch inputs), with no host synchronisation.

A call takes one of three paths: a repeated signature replays the launch plan its
first call left (``plans.py``); an empty problem, or rows that see no key, get their
answer here (it is the same for every family); anything else goes to the first
family, in the spec's order, that accepts it (``families``).  A call with a block mask
goes there as a call with the mask's dense bias (``block_fallback``).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Mapping, Optional

import numpy as np

from flashgen.runtime import block_fallback, families, host_offsets, plans
from flashgen.runtime.arrays import cupy_module
from flashgen.runtime.block_masks import BlockMask, fold_band
from flashgen.runtime.launch import on_device
from flashgen.runtime.limits import lse_rows
from flashgen.runtime.memory import memory_for
from flashgen.runtime.packed import PackedOffsets
from flashgen.runtime.registry import Registry, default_registry
from flashgen.runtime.validate import Call, backward_call, check_rng, fold_dbias, forward_call, rows_without_keys


def attention_forward(q, k, v, *, attn_bias=None, block_mask=None, causal=None, scale=None, dropout_p=0.0, seed=None,
                      offset=0, cu_seqlens_q=None, cu_seqlens_k=None, window=None, softcap=0.0, score_mod=None,
                      mod_tensors=None, stream=None, registry: Optional[Registry] = None):
    """Fused attention forward: returns ``(out [B, M, H, Kv], lse [B, H, M] float32)``.

    ``causal``: None, "top_left" (query i sees keys <= i) or "bottom_right"
    (the diagonal ends at the last key).  With ``cu_seqlens_q/k`` (int32,
    [S+1] offsets) the batch is S packed sequences in dim 1 of a batch of 1;
    ``lse`` is then [S, H, max_seqlen_q].  The offsets are read on the host, which waits for the
    GPU, except from a ``flashgen.packed_offsets`` (validated once) or a torch tensor torch says is
    unchanged since an earlier call read it.  ``dropout_p > 0`` needs ``seed``;
    pass the same ``seed``/``offset`` to the backward.
    ``window=(left, right)``: a sliding window -- query i sees keys i + d - left
    .. i + d + right (None: no limit on that side), d = N - M with
    causal="bottom_right", else 0; with a causal mask as well, right is 0.
    ``softcap > 0``: scores become softcap * tanh(scale * q.k / softcap).
    Both run on flashgen's own kernels only: forward on sm90_fwd (9.0 GPUs) or sm80_fwd
    (8.0 and later), backward on sm90_bwd (9.0 GPUs); else UnsupportedError.
    ``block_mask``: a ``flashgen.block_mask`` for these shapes, on q's GPU, applied on top of
    ``causal``, ``window`` and ``attn_bias``; a causal mask and a window are folded into it (once per
    mask and band: ``BlockMask.with_band``).  sm90_fwd visits only its listed blocks where it can
    (128 x 128 blocks, f16/bf16, head dims up to 128, no attn_bias: ``explain`` says); other
    calls run it as a dense bias, on flashgen's bias instances where they take it, else on the
    example-41 kernels (warned once).  Rows it leaves without a
    key get output 0 and lse -inf.
    ``score_mod``: a score mod compiled into sm90_fwd instances (``flashgen build --mods``): its name
    ("alibi", or one a mods file declared) or its ``flashgen.mods.ScoreMod``; each score becomes
    mod(scale * q.k, b, h, q_idx, kv_idx) before the mask and the softmax.  ``mod_tensors``: the
    tensors it captures, by name (checked against the declaration: dtype, shape, device, contiguous;
    they get no gradient).  Not with attn_bias, block_mask, softcap, dropout or cu_seqlens.  A mod
    named by a string takes launch plans (its tensors' pointers are per-call words; a ``ScoreMod``
    object validates and selects anew); a mod that is not built is an UnsupportedError naming the
    command that builds it.
    """
    block_mask, causal, window = fold_band(block_mask, causal, window)
    cupy = cupy_module()
    registry = registry or default_registry()
    memory, key = memory_for(q, cupy), None
    packed = None if memory is None else _packed_offsets(cu_seqlens_q, cu_seqlens_k)
    if packed is not None:
        # a block mask's arrays end the signature (a sparse plan points at them), its block size joins
        # the options; one that is not a BlockMask (validation says why) or lacks bits gets no plan;
        # so do a score mod's captured tensors (the mod and their names join the options), and packed
        # offsets (their contents join the options)
        sparse = () if block_mask is None else _mask_arrays(memory, block_mask, "kernel_arrays")
        captured, names = _mod_arrays(score_mod, mod_tensors)
        offsets, contents = packed
        arrays = ((q, k, v) if attn_bias is None else (q, k, v, attn_bias)) + sparse + captured + offsets
        key, plan = plans.find(memory.signature, "fwd", arrays, (causal, scale, dropout_p, window, softcap, registry,
                                                                   getattr(block_mask, "block", None), score_mod,
                                                                   names, contents))
        if plan is not None:
            if dropout_p or seed is not None or offset:
                check_rng(dropout_p, seed, offset)
            outputs = families.replay(plan, memory, arrays, seed, offset, stream)
            plans.note_served(plan)
            return outputs
    options = dict(attn_bias=attn_bias, block_mask=block_mask, causal=causal, scale=scale, dropout_p=dropout_p,
                   seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=window,
                   softcap=softcap, score_mod=score_mod, mod_tensors=mod_tensors, stream=stream, registry=registry)
    call = forward_call(q, k, v, options, attention_forward, key)
    with _full_path(cupy, memory, call):
        outputs = _adopt(memory, _serve(cupy, call, _forward, block_fallback.forward))
    plans.note_served(None)  # not a replay (calls nested in this one may have noted theirs)
    return outputs


def _forward(cupy, call: Call):
    p = call.p
    if p.M == 0 or p.N == 0 or call.q.shape[1] == 0:
        out = cupy.zeros((p.B, call.q.shape[1], p.H, p.Kv), dtype=call.q.dtype)
        return out, cupy.full((p.batches, p.H, p.M), -np.inf, dtype=cupy.float32)  # softmax over no keys
    skip = rows_without_keys(p, call.q, call.k)
    if skip:
        return _forward_without_rows(call, skip)
    return families.dispatch(call)


def _forward_without_rows(call: Call, skip: int):
    """See ``rows_without_keys``: the forward of the last M - skip queries; out 0 and lse -inf
    (a softmax over nothing) for the first ``skip``."""
    cupy, p = cupy_module(), call.p
    part_out, part_lse = call.again(call.q[:, skip:], call.k, call.v, scale=p.scale,  # CuPy views: CuPy out
                                    attn_bias=None if call.bias is None else call.bias[:, :, skip:])
    out = cupy.zeros((p.B, p.M, p.H, p.Kv), dtype=call.q.dtype)
    out[:, skip:] = part_out
    lse = cupy.full((p.B, p.H, lse_rows(p.M)), -np.inf, dtype=cupy.float32)
    lse[:, :, skip:p.M] = part_lse
    lse[:, :, p.M:] = np.inf  # padding, as the kernels write it
    return out, lse[:, :, :p.M]


def attention_backward(grad_out, q, k, v, out, lse, *, attn_bias=None, bias_requires_grad=False, block_mask=None,
                       causal=None,
                       scale=None, dropout_p=0.0, seed=None, offset=0, cu_seqlens_q=None, cu_seqlens_k=None,
                       window=None, softcap=0.0, deterministic=False, score_mod=None, mod_tensors=None, stream=None,
                       registry: Optional[Registry] = None):
    """Gradients of ``attention_forward``: returns ``(dq, dk, dv)``, plus ``dbias`` when
    ``bias_requires_grad``: [B, H, M, N], summed over the batch and the heads where ``attn_bias``
    has extent 1 there (or no such dim), so [1, H, M, N] for a [1, H, M, N] or [H, M, N] bias; a
    broadcast query dim stays whole (sum it yourself).

    ``out`` and ``lse`` are what the forward returned for the same inputs and
    options (same ``seed``/``offset`` when dropout is on, same ``window`` and ``softcap``).  From the second
    call with the same shapes, strides and options on, dq, dk and dv are
    contiguous arrays carved from one allocation (freed once all three are).
    ``deterministic=True``: dq adds up in a fixed order, so repeated calls give the same bits
    (the example-41 kernels then run without key splits).  ``block_mask``: the forward's; the
    mask gets no gradient (``dbias`` is that of ``attn_bias``).  sm90_bwd visits only its listed
    blocks where it can (as the forward, and not ``deterministic`` or ``softcap``: ``explain`` says);
    other calls run it as a dense bias (as the forward).  ``score_mod`` and ``mod_tensors``:
    the forward's (dS carries the mod's declared derivative; the captured tensors get no gradient).
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    block_mask, causal, window = fold_band(block_mask, causal, window)  # as the forward did
    cupy = cupy_module()
    registry = registry or default_registry()
    memory, key = memory_for(q, cupy), None
    packed = None if memory is None else _packed_offsets(cu_seqlens_q, cu_seqlens_k)
    if packed is not None:
        # as in the forward: a block mask's (transposed) arrays end the signature, its block size joins the
        # options, and so do a score mod's captured tensors and packed offsets
        sparse = () if block_mask is None else _mask_arrays(memory, block_mask, "backward_arrays")
        captured, names = _mod_arrays(score_mod, mod_tensors)
        offsets, contents = packed
        arrays = ((grad_out, q, k, v, out, lse) + (() if attn_bias is None else (attn_bias,)) + sparse + captured +
                  offsets)
        key, plan = plans.find(memory.signature, "bwd", arrays, (causal, scale, dropout_p, window, softcap,
                                                                   deterministic, bias_requires_grad, registry,
                                                                   getattr(block_mask, "block", None), score_mod,
                                                                   names, contents))
        if plan is not None:
            if dropout_p or seed is not None or offset:
                check_rng(dropout_p, seed, offset)
            grads = families.replay(plan, memory, arrays, seed, offset, stream)
            plans.note_served(plan)
            return grads
    options = dict(attn_bias=attn_bias, bias_requires_grad=bias_requires_grad, block_mask=block_mask, causal=causal,
                   scale=scale, dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, window=window, softcap=softcap, deterministic=deterministic,
                   score_mod=score_mod, mod_tensors=mod_tensors, stream=stream, registry=registry)
    call = backward_call(grad_out, q, k, v, out, lse, options, attention_backward, key)
    with _full_path(cupy, memory, call):
        grads = _serve(cupy, call, _backward, block_fallback.backward)
        if bias_requires_grad:
            grads = grads[:3] + (fold_dbias(cupy, grads[3], attn_bias, call.p.B, call.p.H),)
        grads = _adopt(memory, grads)
    plans.note_served(None if key is None else plans.lookup(key))  # the plan this call left, if any
    return grads


def _backward(cupy, call: Call):
    p = call.p
    if p.M == 0 or p.N == 0 or call.q.shape[1] == 0 or call.k.shape[1] == 0:  # nothing to differentiate
        grads = tuple(cupy.zeros(x.shape, dtype=x.dtype) for x in (call.q, call.k, call.v))
        if call.options["bias_requires_grad"]:
            grads += (cupy.zeros((p.B, p.H, call.q.shape[1], call.k.shape[1]), dtype=call.q.dtype),)
        return grads
    return families.dispatch(call)


@contextlib.contextmanager
def _full_path(cupy, memory, call: Call):
    """The call's device current, and for a torch caller torch's stream as CuPy's (unless a
    stream was given): the full path allocates and launches through CuPy."""
    with on_device(cupy, call.p.device):
        if memory is None or call.stream is not None:
            yield
        else:
            with memory.full_path(call.p.device):
                yield


def _serve(cupy, call: Call, run, dense):
    """``run(cupy, call)``; a block-mask call goes to the family whose sparse kernels read its lists
    (they leave a plan), else through ``dense`` (block_fallback, which clears the plan key)."""
    if call.block_mask is None:
        return run(cupy, call)
    family = families.sparse_family(call)
    return family.run(call) if family is not None else dense(cupy, call, run)


def _mask_arrays(memory, block_mask, which: str) -> tuple:
    """A block mask's arrays for the plan's signature, of the caller's kind (``memory``); (None,),
    which no signature takes, for something that is not a BlockMask (validation says why)."""
    if not isinstance(block_mask, BlockMask):
        return (None,)
    return memory.mask_arrays(block_mask, which)


def _packed_offsets(cu_seqlens_q, cu_seqlens_k) -> Optional[tuple]:
    """(arrays, contents) that put a call's packed offsets into its plan's key -- the arrays end the
    signature (a plan points the kernels at them), their validated host copies join the options --
    ``((), None)`` for a call without them, and None where their contents are not known without
    reading them (a ``PackedOffsets`` carries its own; a torch tensor's copy is kept while torch says
    it is unchanged: host_offsets; a CuPy array has no version counter): that call takes the full
    path, which reads them."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return (), None
    known = [(cu.array, cu.host) if isinstance(cu, PackedOffsets) else (cu, host_offsets.lookup(cu))
             for cu in (cu_seqlens_q, cu_seqlens_k)]
    if known[0][1] is None or known[1][1] is None:
        return None
    return (known[0][0], known[1][0]), (known[0][1].tobytes(), known[1][1].tobytes())


def _mod_arrays(score_mod, mod_tensors) -> tuple:
    """(arrays, names): a score mod's captured tensors for the plan's signature, by name in sorted order
    (the order ``BoundScoreMod.plan_pointers`` gives their pointers), and the names; ``(None,)``, which
    no signature takes, for ``mod_tensors`` that is not a dict or comes without a mod (validation says
    why)."""
    if mod_tensors is None or (isinstance(mod_tensors, Mapping) and not mod_tensors):
        return (), ()
    if score_mod is None or not isinstance(mod_tensors, Mapping):  # validation refuses these
        return (None,), ()
    names = tuple(sorted(mod_tensors, key=str))
    return tuple(mod_tensors[t] for t in names), names


def _adopt(memory, outputs):
    """The full path's CuPy outputs as the caller's kind of array."""
    return outputs if memory is None else memory.adopt(outputs)


def explain(q, k, v, *, backward=False, attn_bias=None, block_mask=None, dropout_p=0.0, seed=None, offset=0,
            causal=None, window=None, softcap=0.0, scale=None, cu_seqlens_q=None, cu_seqlens_k=None, score_mod=None,
            mod_tensors=None, registry: Optional[Registry] = None):
    """Every candidate kernel for this call, family by family in the order tried, with why it was
    rejected or chosen (on a 9.0 GPU flashgen's sm90_fwd / sm90_bwd kernels come first).  With a
    ``block_mask``, families that read its lists are asked with it, the others with its dense bias
    (``block_fallback``); a causal mask or window beside a block mask is folded into it, as the calls do.
    ``seed`` and ``offset`` are taken so that a call's own arguments can be passed as they are: they are
    checked like the call's, and no choice depends on them."""
    block_mask, causal, window = fold_band(block_mask, causal, window)
    options = dict(attn_bias=attn_bias, block_mask=block_mask, causal=causal, scale=scale, dropout_p=dropout_p,
                   seed=0 if dropout_p and seed is None else seed, offset=offset, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, window=window, softcap=softcap, score_mod=score_mod,
                   mod_tensors=mod_tensors, registry=registry)
    call, dense = forward_call(q, k, v, options, attention_forward), None
    if call.block_mask is not None:
        with on_device(cupy_module(), call.p.device):
            dense = block_fallback.dense_call(cupy_module(), call)[0]
    if backward:
        call, dense = (None if c is None else replace(c, direction="bwd", entry=attention_backward,
                                                      options=dict(c.options, bias_requires_grad=False,
                                                                   deterministic=False))
                       for c in (call, dense))
    return families.explain(call, dense)
