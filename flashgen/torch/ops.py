"""flashgen's attention as PyTorch operators: ``torch.ops.flashgen.attention_forward/backward``.

Both are ``torch.library`` custom ops with fake implementations (shapes and strides
without a GPU), so ``torch.compile(fullgraph=True)`` traces through them, and the
forward has a registered autograd formula.  Eager calls take a plain
``autograd.Function`` over the same two implementations instead: the custom-op
dispatcher costs tens of microseconds per call, as much as the runtime's whole launch
path (``flashgen.runtime.plans``).  Tensors go to the runtime as they are: torch in,
torch out, on torch's current stream, outputs from torch's caching allocator.

Options travel as plain ints and floats (an operator schema has no None in a tuple):
``causal`` 0/1/2 (none, top-left, bottom-right), a window side < 0 for unbounded,
``max_seqlen_q`` 0 for fixed-length batches.  A block mask (``flashgen.block_mask``) is no
tensor an operator schema can carry: it takes the eager path only, and under
``torch.compile`` it is refused until the kernels read its lists as tensors.  A score mod
(``mods``: its name or declaration and its captured tensors, which get no gradient) takes launch
plans through the runtime in eager calls; under ``torch.compile`` the operators take it by name,
with its captured tensors as a list and their names in one comma-separated string.
"""
from __future__ import annotations

import functools
import os
from typing import List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from flashgen.errors import UnsupportedError
from flashgen.runtime import api, families, plans
from flashgen.runtime.arrays import cupy_module
from flashgen.runtime.limits import lse_rows
from flashgen.runtime.memory import memory_for
from flashgen.runtime.registry import default_registry
from flashgen.runtime.score_mods import check_no_grad
from flashgen.runtime.validate import MASKS, check_rng, dbias_folds

CAUSAL = MASKS  # the runtime's codes for its causal option
_CAUSAL_NAMES = {code: name for name, code in CAUSAL.items()}


def _query_rows(q: Tensor, max_seqlen_q: int) -> int:
    return max_seqlen_q if max_seqlen_q else q.shape[1]


def _lse_strides(heads: int, rows: int) -> Tuple[int, int, int]:
    """The forward's lse is [batches, heads, rows] inside rows padded to 32 (+inf), as the kernels write it."""
    padded = lse_rows(rows)
    return heads * padded, padded, 1


@functools.lru_cache(maxsize=64)  # a training loop repeats a few option sets: build each dict once
def _runtime_options(causal: int, scale: Optional[float], dropout_p: float, seed: int, offset: int,
                     window_left: int, window_right: int, softcap: float) -> dict:
    window = None
    if window_left >= 0 or window_right >= 0:
        window = (window_left if window_left >= 0 else None, window_right if window_right >= 0 else None)
    return dict(causal=_CAUSAL_NAMES[causal], scale=scale, dropout_p=dropout_p, seed=seed if dropout_p else None,
                offset=offset, window=window, softcap=softcap)


def _mod_options(mods) -> dict:
    """The runtime's score_mod and mod_tensors from the eager path's ``mods`` pair (None: no mod)."""
    return {} if mods is None else {"score_mod": mods[0], "mod_tensors": mods[1]}


def _operator_mods(score_mod: str, mod_names: str, mod_tensors: List[Tensor]):
    """The eager path's ``mods`` pair from the operators' mod arguments ("": no mod)."""
    if not score_mod:
        return None
    return score_mod, dict(zip(mod_names.split(",") if mod_names else (), mod_tensors))


def _mod_arguments(mods) -> tuple:
    """The operators' (score_mod, mod_names, mod_tensors) for a traced call's ``mods`` pair: the mod
    by name, its captured tensors sorted by name.  Checked here, while torch.compile traces: a
    schema holds no ScoreMod declaration, and a captured tensor gets no gradient."""
    if mods is None:
        return "", "", []
    score_mod, tensors = mods
    if not isinstance(score_mod, str):
        raise UnsupportedError("flashgen.torch: under torch.compile a score mod goes by its name (score_mod='alibi'); "
                               "a ScoreMod declaration is for eager calls: build it (`flashgen build --mods FILE`) "
                               "and pass its name")
    if tensors is not None and not isinstance(tensors, Mapping):
        raise TypeError(f"mod_tensors must be a dict of name -> tensor; got {type(tensors).__name__}")
    names = sorted(tensors or {})
    for name in names:
        x = tensors[name]
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"mod_tensors key {name!r} is not a name the mod can declare")
        if not isinstance(x, Tensor):
            raise TypeError(f"mod_tensors[{name!r}] is a {type(x).__name__}; under torch.compile captured tensors "
                            "are torch tensors")
        check_no_grad(score_mod, name, x)  # the runtime's own check, here while tracing
    return score_mod, ",".join(names), [tensors[name] for name in names]


def _with_lse_layout(lse: Tensor, heads: int, rows: int) -> Tensor:
    """lse in the layout the fake implementation promises (padded to 32 rows, or to max_seqlen_q's)."""
    strides = _lse_strides(heads, rows)
    if tuple(lse.shape[1:]) == (heads, rows) and lse.stride() == strides:
        return lse
    # the whole padded block, so the pad after the last head's rows lies inside the storage too
    padded = torch.full((lse.shape[0], heads, strides[1]), float("inf"), dtype=torch.float32, device=lse.device)
    padded[:, :, :lse.shape[2]] = lse
    return padded[:, :, :rows]


def _contiguous(x: Tensor) -> Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _forward(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
             cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, causal: int, scale: Optional[float], dropout_p: float,
             seed: int, offset: int, window_left: int, window_right: int, softcap: float,
             block_mask=None, mods=None) -> Tuple[Tensor, Tensor]:
    """(out, lse) as the runtime returns them, a packed batch's lse padded to ``max_seqlen_q`` rows:
    what the eager path needs (its tensors may have any strides; only the op promises some)."""
    options = _runtime_options(causal, scale, dropout_p, seed, offset, window_left, window_right, softcap)
    out, lse = api.attention_forward(q, k, v, attn_bias=attn_bias, block_mask=block_mask, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, **_mod_options(mods), **options)
    if max_seqlen_q:
        if lse.shape[2] > max_seqlen_q:
            raise ValueError(f"max_seqlen_q is {max_seqlen_q}, but the longest query sequence has {lse.shape[2]} rows")
        lse = _with_lse_layout(lse, q.shape[2], max_seqlen_q)
    return out, lse


def forward_impl(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                 cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, causal: int, scale: Optional[float],
                 dropout_p: float, seed: int, offset: int, window_left: int, window_right: int, softcap: float,
                 deterministic: bool, score_mod: str, mod_names: str, mod_tensors: List[Tensor]
                 ) -> Tuple[Tensor, Tensor]:
    """(out [B, M, H, Kv], lse [batches, H, rows] float32) of BMHK q, k, v (see ``api.attention_forward``),
    in the strides the fake implementation promises.

    ``deterministic`` is the backward's option, carried so that it reaches it; ``score_mod`` ("" for
    none), ``mod_names`` and ``mod_tensors`` are ``_mod_arguments``'."""
    out, lse = _forward(q, k, v, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale, dropout_p, seed,
                        offset, window_left, window_right, softcap,
                        mods=_operator_mods(score_mod, mod_names, mod_tensors))
    return _contiguous(out), _with_lse_layout(lse, q.shape[2], _query_rows(q, max_seqlen_q))


def _grads(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, attn_bias: Optional[Tensor],
           bias_requires_grad: bool, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], causal: int,
           scale: Optional[float], dropout_p: float, seed: int, offset: int, window_left: int, window_right: int,
           softcap: float, deterministic: bool, block_mask=None, mods=None) -> tuple:
    """(dq, dk, dv, dbias [B, H, M, N] or None when not asked for) as the runtime returns them: the
    eager backward's, which allocates nothing it does not return."""
    options = _runtime_options(causal, scale, dropout_p, seed, offset, window_left, window_right, softcap)
    # autograd may hand a gradient with any strides; the kernels need a contiguous head dim
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    grads = api.attention_backward(grad_out, q, k, v, out, lse, attn_bias=attn_bias,
                                   bias_requires_grad=bias_requires_grad, block_mask=block_mask,
                                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, deterministic=deterministic,
                                   **_mod_options(mods), **options)
    return grads[0], grads[1], grads[2], grads[3] if bias_requires_grad else None


def backward_impl(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  attn_bias: Optional[Tensor], bias_requires_grad: bool, cu_seqlens_q: Optional[Tensor],
                  cu_seqlens_k: Optional[Tensor], causal: int, scale: Optional[float], dropout_p: float,
                  seed: int, offset: int, window_left: int, window_right: int, softcap: float,
                  deterministic: bool, score_mod: str, mod_names: str, mod_tensors: List[Tensor]) -> List[Tensor]:
    """[dq, dk, dv, dbias], contiguous as the fake implementation promises (an empty dbias when not
    asked for: an operator returns tensors)."""
    dq, dk, dv, dbias = _grads(grad_out, q, k, v, out, lse, attn_bias, bias_requires_grad, cu_seqlens_q,
                               cu_seqlens_k, causal, scale, dropout_p, seed, offset, window_left, window_right,
                               softcap, deterministic, mods=_operator_mods(score_mod, mod_names, mod_tensors))
    dbias = q.new_empty((0,)) if dbias is None else _contiguous(dbias)
    return [_contiguous(dq), _contiguous(dk), _contiguous(dv), dbias]


attention_forward = torch.library.custom_op("flashgen::attention_forward", mutates_args=(),
                                            device_types="cuda")(forward_impl)
attention_backward = torch.library.custom_op("flashgen::attention_backward", mutates_args=(),
                                             device_types="cuda")(backward_impl)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale, dropout_p,
                            seed, offset, window_left, window_right, softcap, deterministic, score_mod, mod_names,
                            mod_tensors):
    batches = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    rows = _query_rows(q, max_seqlen_q)
    out = q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))
    lse = torch.empty_strided((batches, q.shape[2], rows), _lse_strides(q.shape[2], rows), dtype=torch.float32,
                              device=q.device)
    return out, lse


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, attn_bias, bias_requires_grad, cu_seqlens_q, cu_seqlens_k,
                             causal, scale, dropout_p, seed, offset, window_left, window_right, softcap,
                             deterministic, score_mod, mod_names, mod_tensors):
    if bias_requires_grad:  # summed over the batch and heads where the bias has extent 1, as the runtime does
        batches, heads = dbias_folds(attn_bias, q.shape[0], q.shape[2])
        dbias = q.new_empty((q.shape[0] // batches, q.shape[2] // heads, q.shape[1], k.shape[1]))
    else:
        dbias = q.new_empty((0,))
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias]


OPTION_COUNT = 12  # the operators' options after q, k, v, attn_bias (cu_seqlens_q ... deterministic); then
# score_mod, mod_names and mod_tensors


def _save(ctx, q, k, v, attn_bias, options: tuple, out, lse, mod_tensors=()) -> None:
    """Save what the backward needs: the tensors (a score mod's captured ones last), and the options
    after q, k, v, attn_bias (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, ..., deterministic:
    the forward's order)."""
    ctx.save_for_backward(q, k, v, attn_bias, out, lse, *mod_tensors)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _setup_context(ctx, inputs, output):
    score_mod, mod_names, mod_tensors = inputs[4 + OPTION_COUNT:]
    _save(ctx, *inputs[:4], tuple(inputs[4:4 + OPTION_COUNT]), *output, mod_tensors)
    ctx.mod_arguments, ctx.captured = (score_mod, mod_names), len(mod_tensors)


def _gradients(ctx, grad_out: Tensor, backward, operator: bool = False) -> tuple:
    """dq, dk, dv, dbias through ``backward``: the operator (its score mod arguments after the
    options), or its implementation in eager mode (a block mask and a score mod as keywords)."""
    q, k, v, attn_bias, out, lse, *mod_tensors = ctx.saved_tensors
    cu_q, cu_k, _, *options = ctx.options
    bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
    if operator:
        tail, masked = (*ctx.mod_arguments, mod_tensors), {}
    else:
        tail = ()
        masked = {name: getattr(ctx, name) for name in ("block_mask", "mods") if getattr(ctx, name, None) is not None}
    dq, dk, dv, dbias = backward(grad_out, q, k, v, out, lse, attn_bias, bias_grad, cu_q, cu_k, *options, *tail,
                                 **masked)
    return dq, dk, dv, dbias.sum_to_size(attn_bias.shape) if bias_grad else None


def _operator_gradients(ctx, grad_out: Tensor, grad_lse: Tensor) -> tuple:
    """The operator's autograd formula: one gradient per input, in the inputs' structure (a list
    of None for the captured tensors, which get none)."""
    return (*_gradients(ctx, grad_out, attention_backward, operator=True), *(None,) * OPTION_COUNT, None, None,
            [None] * ctx.captured)


attention_forward.register_autograd(_operator_gradients, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """The same forward and backward without the custom-op dispatcher (eager mode), its options
    in one argument: the autograd engine's work grows with the number of inputs, and this path
    is what a training step pays on every call."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, options, block_mask, mods):
        # not packed, no block mask or score mod (the shortcut key has no place for their arrays)
        plannable = block_mask is None and mods is None and options[0] is None and options[1] is None
        key = _shortcut_key(q, k, v, attn_bias, options) if plannable else None
        plan = None if key is None else plans.lookup(key)
        if plan is not None:
            out, lse = _replayed_forward(plan, q, k, v, attn_bias, options)
        else:
            out, lse = _forward(q, k, v, attn_bias, *options[:-1], block_mask=block_mask, mods=mods)
            # the forward's launch plan when it replayed one; none with a block mask, a score mod or packed
            # offsets, whose backward plans end with arrays the follower replay does not pass (api.py's own
            # plans serve them)
            plan = plans.served() if block_mask is None and mods is None and options[0] is None else None
            if plan is not None and key is not None:
                plans.remember(key, plan)
        ctx.plan = plan
        _save(ctx, q, k, v, attn_bias, options, out, lse)
        ctx.block_mask, ctx.mods = block_mask, mods
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse (a launch per backward)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None:  # only lse (not differentiable) reached the loss
            return None, None, None, None, None, None, None
        if ctx.plan is not None:
            return _replayed_gradients(ctx, grad_out) + (None, None, None)
        return _gradients(ctx, grad_out, _grads) + (None, None, None)


def _shortcut_key(q, k, v, attn_bias, options: tuple) -> Optional[tuple]:
    """The key under which an eager forward finds the plan its signature left, made from the
    adapter's own option tuple (less seed and offset, which a plan takes per call) instead of
    going through ``api.attention_forward``, which rebuilds its keyword options and its key on
    every call.  It holds what api's key holds: the tensors' signature, the options, the families
    allowed and the registry.  None for tensors no plan serves."""
    arrays = (q, k, v) if attn_bias is None else (q, k, v, attn_bias)
    parts = plans.tensor_signature(arrays, Tensor)
    if parts is None:
        return None
    return ("torch fwd", parts, options[2:6], options[8:11], os.environ.get(plans.FAMILIES_VARIABLE, ""),
            default_registry())


def _replayed_forward(plan, q, k, v, attn_bias, options: tuple) -> Tuple[Tensor, Tensor]:
    """(out, lse) of a forward whose shortcut key (``_shortcut_key``) an earlier call left ``plan`` under."""
    dropout_p, seed, offset = options[5:8]
    if dropout_p or offset:
        check_rng(dropout_p, seed if dropout_p else None, offset)
    arrays = (q, k, v) if attn_bias is None else (q, k, v, attn_bias)
    return families.replay(plan, memory_for(q, cupy_module()), arrays, seed if dropout_p else None, offset, None)


def _replayed_gradients(ctx, grad_out: Tensor) -> tuple:
    """dq, dk, dv, dbias (None unless the bias requires grad) of a step whose forward replayed the
    launch plan ``ctx.plan``.

    Such a forward laid out out and lse as its plan lays them out, and autograd hands the backward
    a grad_out of out's shape, dtype and device; so the forward plan, grad_out's strides and
    alignment, ``deterministic`` and whether dbias is wanted decide the backward's plan.  The
    forward plan keeps it (``followers``) after the first such backward, which takes the runtime's
    path; later ones replay it without the lookup by the signature of six or seven tensors (a fifth
    of the backward's host time on a small problem)."""
    q, k, v, attn_bias, out, lse = ctx.saved_tensors  # (eager calls save no captured tensors)
    if grad_out.stride(-1) != 1:  # as _grads: the kernels need a contiguous head dim
        grad_out = grad_out.contiguous()
    dropout_p, seed, offset, *_, deterministic = ctx.options[5:]
    bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
    follower = (grad_out.stride(), grad_out.data_ptr() % plans.ALIGNMENT_BYTES, deterministic, bias_grad)
    plan = ctx.plan.followers.get(follower)
    if plan is None:
        grads = _grads(grad_out, q, k, v, out, lse, attn_bias, bias_grad, None, None, *ctx.options[3:])
        made = plans.served()
        if made is not None:
            ctx.plan.followers[follower] = made
    else:
        arrays = (grad_out, q, k, v, out, lse) if attn_bias is None else (grad_out, q, k, v, out, lse, attn_bias)
        grads = families.replay(plan, memory_for(q, cupy_module()), arrays, seed if dropout_p else None, offset, None)
    dbias = grads[3].sum_to_size(attn_bias.shape) if bias_grad else None
    return grads[0], grads[1], grads[2], dbias


# torch's C apply, under Function.apply's Python layer: that layer only serves functorch transforms
# (it routes vmap/grad to custom_function_call and unwraps tensors that escaped one: their data
# pointer then raises), and it cost an eager forward about 5 us of the adapter's ~28 on an H200's host
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_apply = super(torch.autograd.Function, EagerAttention).apply if _transforms_active else EagerAttention.apply


def forward(q, k, v, attn_bias, *options, block_mask=None, mods=None) -> Tuple[Tensor, Tensor]:
    """The forward op while torch.compile traces, the autograd.Function otherwise (same arguments)."""
    if torch.compiler.is_compiling():
        if block_mask is not None:
            raise UnsupportedError("flashgen.torch: block_mask under torch.compile is not supported yet (the operators "
                                   "take tensors only; the block lists become their inputs once the kernels read "
                                   "them): call this attention eagerly, outside the compiled region")
        return attention_forward(q, k, v, attn_bias, *options, *_mod_arguments(mods))
    if _transforms_active is not None and _transforms_active():
        return EagerAttention.apply(q, k, v, attn_bias, options, block_mask, mods)
    return _apply(q, k, v, attn_bias, options, block_mask, mods)
