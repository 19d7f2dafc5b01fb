"""Dropout on flashgen's Hopper kernels: what a call passes them, and which calls they draw.

The rule (``flashgen/csrc/flashgen/dropout.h``; tests/philox_reference.py is its NumPy copy):
element (b, h, i, j) of P -- sequence b (batch index, or packed sequence), query head h, query
row i and key j within the sequence -- takes 8 bits from Philox-4x32-10 keyed by ``seed``
(low word first) at the counter

    c0 = (j // 32) * 4 + (j // 2) % 4,   c1 = (i // 16) * 8 + i % 8,
    c2 + 2**32 * c3 = (offset + b * H + h) mod 2**64,

as byte 8 * (i // 8 % 2) + 2 * (j // 8 % 4) + j % 2 of the call's 16 (byte l: bits 8 * (l % 4) ..
8 * (l % 4) + 7 of word l // 4).  It is kept iff that byte is below ``keep_threshold(dropout_p)`` =
round((1 - p) * 256) -- p is quantised to 1/256, as in FlashAttention-2 -- and kept values are
scaled by 1 / (1 - p).  Nothing in it depends on a tile, so ``sm90_fwd`` (S in 128 x 128 tiles) and
``sm90_bwd`` (S^T, other tiles) draw the same mask.  Under a bottom-right causal mask with more
queries than keys, the first M - N rows see no key and both directions leave them out
(``validate.rows_without_keys``): i then counts from row M - N.

The contract is example 41's (same ``dropout_p``, ``seed``, ``offset`` arguments, ``check_rng``):
pass the forward's seed and offset to the backward; calls whose offsets differ by at least B * H
draw independent masks (example 41 wants B * H * M * N, which is more).  The two pairs draw
different masks from the same (seed, offset), so a dropout call's forward and backward must run
on the same pair: ``refusal`` decides from what the forward and the backward call share (GPU,
dtype, head dims, options, the kernels built), never from anything only one of them has, and the
example-41 families refuse the calls it gives to the sm90 pair (``mem_eff_fwd.unfit_example41``).
What only one direction has -- out's and grad_out's strides, head dims that are not a multiple of
8, a bottom-right backward's rows without keys -- ``run`` conforms to instead of refusing.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from flashgen.runtime import tensormap
from flashgen.runtime.arch import DeviceInfo
from flashgen.runtime.arrays import cupy_module
from flashgen.runtime.device import device_info
from flashgen.runtime.families import forced_families, selector
from flashgen.runtime.select import Request
from flashgen.runtime.validate import Call, Problem, rows_without_keys

KEEP_ONE = 256  # the byte values an element compares: keep iff byte < threshold
RNG_FIELDS = ("dropout_seed", "dropout_offset")  # the per-call words of a launch plan (plans.py)
PAIR = ("sm90_fwd", "sm90_bwd")
MAX_K = 128  # the dropout instances' largest tier (spec rules)


def keep_threshold(dropout_p: float) -> int:
    """The byte threshold: an element is kept iff its byte is below this (0 .. 256; 256 keeps all, so the
    kernels compare in 32 bits)."""
    return int(round((1.0 - dropout_p) * KEEP_ONE))


def fields(p: Problem) -> dict:
    """The ``dropout_*`` Params fields of a call (none without dropout: a plain instance ignores them)."""
    if p.dropout_p <= 0:
        return {}
    return {"dropout_seed": p.seed, "dropout_offset": p.offset, "dropout_keep": keep_threshold(p.dropout_p),
            "dropout_scale": 1.0 / (1.0 - p.dropout_p)}


def padded_dim(n: int) -> int:
    return -(-n // 8) * 8


def _problem_refusal(p: Problem, info: Optional[DeviceInfo] = None, bias_or_mask: bool = False) -> Optional[str]:
    """What of ``p`` (and FLASHGEN_FAMILIES, the GPU, a bias or block mask) keeps the pair from drawing
    its mask, before the kernels built are asked (None: nothing)."""
    allowed = forced_families()
    if allowed is not None and not set(PAIR) <= set(allowed):
        return ("dropout needs both sm90_fwd and sm90_bwd (one mask for both directions); "
                "FLASHGEN_FAMILIES leaves one out")
    if bias_or_mask or p.softcap:
        return "dropout without attn_bias, block masks or softcap (the example-41 families draw such masks)"
    if p.dtype not in ("f16", "bf16"):
        return f"dropout in float16 or bfloat16; the call is {p.dtype}"
    if p.K != p.Kv or padded_dim(p.K) > MAX_K:
        return f"dropout with equal q/v head dims up to {MAX_K}; the call has {p.K} and {p.Kv}"
    info = info or device_info(p.device)
    if info.cc != 90:
        return f"a compute-capability 9.0 GPU (H100, H200); GPU {p.device} is {info.name} (sm_{info.cc})"
    return None


def may_draw(p: Problem) -> bool:
    """Whether the pair may draw ``p``'s mask, judged from the problem alone (validation, which knows no
    family yet): ``refusal`` decides, with the call's bias, block mask and the kernels built."""
    return _problem_refusal(p) is None


def refusal(call: Call, info: Optional[DeviceInfo] = None) -> Optional[str]:
    """Why the sm90 pair does not draw this dropout call's mask (None: it does, in both directions);
    ``info``: the call's GPU, if known."""
    p = call.p
    why = _problem_refusal(p, info, call.bias is not None or call.block_mask is not None)
    if why is not None:
        return why
    info = info or device_info(p.device)
    band = p.mask != 0 or p.window is not None
    for family in PAIR:
        req = Request(family, p.dtype, padded_dim(p.K), padded_dim(p.Kv), 8, True, False, info, band=band,
                      compiled_bias=True, compiled_dropout=True)
        if selector(call.registry).find(req) is None:
            return f"no {family} dropout kernel for {p.dtype}, head dim {p.K}, band={band} is built for this GPU"
    return None


def run(call: Call, run_on_kernels: Callable[[Call], tuple]):
    """``run_on_kernels(call)`` for a dropout call the pair draws, on inputs the kernels read: head dims
    that are not a multiple of 8 re-enter the public function zero-padded (results sliced back; the
    mask does not depend on them), a bottom-right backward with more queries than keys leaves out the
    rows that see none as api.py's forward did (so the rows keep the numbers the forward drew them
    by), and inputs a tensor map cannot describe are copied (no plan then)."""
    p, cupy = call.p, cupy_module()
    backward = call.direction == "bwd"
    if p.K % 8:
        def pad(x):
            return cupy.pad(x, ((0, 0), (0, 0), (0, 0), (0, padded_dim(x.shape[3]) - x.shape[3])))
        if not backward:
            out, lse = call.again(pad(call.q), pad(call.k), pad(call.v), scale=p.scale)
            return out[..., :p.Kv], lse
        dq, dk, dv = call.again(pad(call.grad_out), pad(call.q), pad(call.k), pad(call.v), pad(call.out), call.lse,
                                scale=p.scale)
        return dq[..., :p.K], dk[..., :p.K], dv[..., :p.Kv]
    if backward:
        skip = rows_without_keys(p, call.q, call.k)
        if skip:
            from flashgen.runtime.families.mem_eff_bwd import without_rows
            return without_rows(call, skip)
    names = ("q", "k", "v") + (("out", "grad_out") if backward else ())
    copies = {name: getattr(call, name).copy() for name in names if tensormap.bmhk_problem(getattr(call, name))}
    if copies:
        call = replace(call, plan_key=None, **copies)
    return run_on_kernels(call)
