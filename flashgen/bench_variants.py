"""Bench points with an attention bias or dropout: what they cost flashgen, and the peers that take them.

A ``Point`` with ``variant`` set times the point's calls (causal or not, as it says) with:

* ``bias``: an additive bias [1, H, S, S] in the inputs' dtype, one per query head (the shape of a
  relative-position bias), random, and its gradient in every backward: flashgen's
  ``bias_requires_grad=True``, a bias that requires grad for the torch peers.
* ``dropout``: dropout on the probabilities with p = ``DROPOUT_P`` (flashgen: a fixed seed, the
  same in both directions; the torch peers draw their own).

Beside ``flashgen`` (the variant on the runtime's own choice of kernels) two twins run in the same
rounds wherever flashgen is asked: ``flashgen-plain``, the same call without the bias or dropout,
and ``flashgen-example41``, the variant on CUTLASS example 41's kernels (FLASHGEN_FAMILIES set to
``EXAMPLE41`` while it runs): the two yardsticks of issue 17, fg/plain and fg/ex41 in the table.
Every backward returns the bias's gradient in the bias's shape, summed over the batch (flashgen's
``attention_backward`` sums over the dims a bias broadcasts in, as autograd does for the peers).
The peers: SDPA's backends with ``attn_mask`` (a causal point folds the causal mask into it as
-inf, SDPA taking no causal flag beside a mask) or ``dropout_p``; flex_attention with the bias as a
``score_mod`` reading it (its gradient too); FlashAttention-4 takes neither, flex no dropout, SDPA's
flash backend no bias: their cells say so.  Bias and dropout cost no FLOPs in FlashAttention's
count, so TFLOP/s compare with the plain points' too.
"""
from __future__ import annotations

from typing import List

from flashgen.bench import (Point, Timed, causal_option, flashgen_entries, flashgen_torch_entries, flex_entries,
                            sdpa_entries)

VARIANTS = ("bias", "dropout")
DROPOUT_P = 0.1
SEED = 20261128  # flashgen's dropout seed; the offset stays 0
EXAMPLE41 = "mem_eff_fwd,mem_eff_bwd"


def _check(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown bench variant {variant!r}; the bench knows {', '.join(VARIANTS)}")


def flashgen_options(p: Point, bias=None) -> dict:
    """What flashgen's forward and backward both take at the point: the causal mask, and the bias
    (``bias``, on the GPU) or the dropout and its seed."""
    _check(p.variant)
    options = causal_option(p)
    if p.variant == "bias":
        return dict(options, attn_bias=bias)
    return dict(options, dropout_p=DROPOUT_P, seed=SEED)


def sdpa_mask(p: Point, bias, torch):
    """The bias as SDPA's ``attn_mask`` at the point: itself, or at a causal point a copy with -inf
    above the diagonal, a leaf that requires grad (built outside the timings, as a user builds it
    once per step)."""
    if not p.causal:
        return bias
    above = torch.ones((p.seqlen, p.seqlen), dtype=torch.bool, device=bias.device).triu(1)
    return bias.detach().masked_fill(above, float("-inf")).requires_grad_()


def entries(p: Point, impls: List[str], sets, t_sets, torch) -> List[Timed]:
    """Each asked implementation's forward and backward with the point's bias or dropout, and
    flashgen's two twins (``bench_point``)."""
    _check(p.variant)
    q = sets[0][0]
    bias = (torch.randn((1, p.heads, p.seqlen, p.seqlen), device=q.device, dtype=q.dtype).requires_grad_()
            if p.variant == "bias" else None)
    grads = (bias,) if bias is not None else ()
    out: List[Timed] = []
    if "flashgen" in impls:
        import cupy

        options = flashgen_options(p, None if bias is None else cupy.from_dlpack(bias.detach()))
        backward = {"bias_requires_grad": True} if bias is not None else {}
        out += flashgen_entries(sets, torch, backward_options=backward, **options)
        out += flashgen_entries(sets, torch, impl="flashgen-plain", **causal_option(p))
        out += flashgen_entries(sets, torch, impl="flashgen-example41", families=EXAMPLE41, backward_options=backward,
                                **options)
    if "flashgen-torch" in impls:
        options = flashgen_options(p, bias)
        if p.variant == "dropout":
            del options["seed"]  # the adapter draws one from torch's generator, as a training step lets it
        out += flashgen_torch_entries(sets, torch, grad_also=grads, **options)
    if bias is None:
        out += sdpa_entries(p, impls, t_sets, torch, dropout_p=DROPOUT_P, is_causal=p.causal)
    else:  # the bias (causal folded in) as attn_mask, its gradient too; the flash backend takes none
        mask = sdpa_mask(p, bias, torch)
        out += sdpa_entries(p, [i for i in impls if i != "sdpa-flash"], t_sets, torch, grad_also=(mask,),
                            attn_mask=mask)
        if "sdpa-flash" in impls:
            out += [Timed("sdpa-flash", direction, None, error="takes no bias") for direction in ("fwd", "bwd")]
    for impl in impls:
        if impl == "fa4" or (impl == "flex" and p.variant == "dropout"):
            out += [Timed(impl, direction, None, error=f"takes no {p.variant}") for direction in ("fwd", "bwd")]
    if "flex" in impls and bias is not None:
        out += flex_entries(p, t_sets, torch, score_mod=lambda score, b, h, q_idx, kv_idx: score + bias[0, h, q_idx,
                                                                                                       kv_idx],
                            grad_also=grads)
    return out
