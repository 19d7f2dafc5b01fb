"""Dropout on flashgen's own kernels: what a call passes them, and which pair of families draws it.

The rule (``flashgen/csrc/flashgen/dropout.h``; tests/philox_reference.py is its NumPy copy):
element (b, h, i, j) of P -- sequence b (batch index, or packed sequence), query head h, query
row i and key j within the sequence -- takes 8 bits from Philox-4x32-10 keyed by ``seed``
(low word first) at the counter

    c0 = (j // 32) * 4 + (j // 2) % 4,   c1 = (i // 16) * 8 + i % 8,
    c2 + 2**32 * c3 = (offset + b * H + h) mod 2**64,

as byte 8 * (i // 8 % 2) + 2 * (j // 8 % 4) + j % 2 of the call's 16 (byte l: bits 8 * (l % 4) ..
8 * (l % 4) + 7 of word l // 4).  It is kept iff that byte is below ``keep_threshold(dropout_p)`` =
round((1 - p) * 256) -- p is quantised to 1/256, as in FlashAttention-2 -- and kept values are
scaled by 1 / (1 - p).  Nothing in it depends on a tile, so every family that draws by it draws the
same mask: ``sm90_fwd`` and ``sm90_bwd`` (wgmma tiles), ``sm80_fwd`` and ``sm80_bwd`` (mma.sync
tiles) are interchangeable per direction.  Under a bottom-right causal mask with more queries than
keys, the first M - N rows see no key and both directions leave them out
(``validate.rows_without_keys``): i then counts from row M - N.

The contract is example 41's (same ``dropout_p``, ``seed``, ``offset`` arguments, ``check_rng``):
pass the forward's seed and offset to the backward; calls whose offsets differ by at least B * H
draw independent masks (example 41 wants B * H * M * N, which is more).  Example 41 draws another
mask from the same (seed, offset), so a dropout call's forward and backward must both run on
flashgen's rule or both on example 41's.  ``drawing_pair`` decides, from what the forward and the
backward call share (GPU, dtype, head dims, options, FLASHGEN_FAMILIES, the kernels built), never
from anything only one of them has: the first of ``PAIRS`` whose forward and backward dropout
kernels can both take the call draws it in both directions; with none, example 41 draws it in
both (``mem_eff_fwd.unfit_example41`` refuses the calls a pair draws).  What only one direction
has -- out's and grad_out's strides, head dims that are not a multiple of 8, a bottom-right
backward's rows without keys -- ``run`` conforms to instead of refusing.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Tuple

from flashgen.runtime import tensormap
from flashgen.runtime.arch import DeviceInfo
from flashgen.runtime.arrays import cupy_module
from flashgen.runtime.device import device_info
from flashgen.runtime.families import forced_families, runtime, selector
from flashgen.runtime.select import Request
from flashgen.runtime.validate import Call, Problem, rows_without_keys

KEEP_ONE = 256  # the byte values an element compares: keep iff byte < threshold
RNG_FIELDS = ("dropout_seed", "dropout_offset")  # the per-call words of a launch plan (plans.py)
MAX_K = 128  # both pairs' dropout instances' largest tier (spec rules)


@dataclass(frozen=True)
class Pair:
    """A forward and a backward family whose dropout instances draw by the rule, and the GPUs they run on."""

    forward: str
    backward: str
    cc_range: Tuple[int, int]  # compute capabilities [lo, hi) the pair's kernels run on
    gpus: str                  # those GPUs, for a refusal

    @property
    def families(self) -> Tuple[str, str]:
        return self.forward, self.backward

    @property
    def name(self) -> str:
        return self.forward.split("_")[0]

    def gpu_refusal(self, p: Problem, info: DeviceInfo) -> Optional[str]:
        if self.cc_range[0] <= info.cc < self.cc_range[1]:
            return None
        return f"{self.gpus}; GPU {p.device} is {info.name} (sm_{info.cc})"


# In the order tried: the Hopper pair where it runs and is built, else the Ampere-class one
PAIRS = (Pair("sm90_fwd", "sm90_bwd", (90, 91), "a compute-capability 9.0 GPU (H100, H200)"),
         Pair("sm80_fwd", "sm80_bwd", (80, 130), "a GPU of compute capability 8.0 or newer"))


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


def _problem_refusal(p: Problem, bias_or_mask: bool = False) -> Optional[str]:
    """What of ``p`` (a bias or block mask with it) keeps every pair from drawing its mask, before
    GPU, FLASHGEN_FAMILIES and the kernels built are asked (None: nothing)."""
    if bias_or_mask or p.softcap:
        return "dropout without attn_bias, block masks or softcap (the example-41 families draw such masks)"
    if p.dtype not in ("f16", "bf16"):
        return f"dropout in float16 or bfloat16; the call is {p.dtype}"
    if p.K != p.Kv or padded_dim(p.K) > MAX_K:
        return f"dropout with equal q/v head dims up to {MAX_K}; the call has {p.K} and {p.Kv}"
    return None


def _pair_refusal(pair: Pair, p: Problem, info: DeviceInfo) -> Optional[str]:
    """Why ``pair`` cannot draw ``p``'s mask on its GPU under FLASHGEN_FAMILIES, the kernels aside."""
    allowed = forced_families()
    if allowed is not None and not set(pair.families) <= set(allowed):
        return (f"dropout needs both {pair.forward} and {pair.backward} (one mask for both directions); "
                "FLASHGEN_FAMILIES leaves one out")
    return pair.gpu_refusal(p, info)


def may_draw(p: Problem) -> bool:
    """Whether some pair may draw ``p``'s mask, judged from the problem alone (validation, which knows no
    family yet): ``drawing_pair`` decides, with the call's bias, block mask and the kernels built."""
    if _problem_refusal(p) is not None:
        return False
    info = device_info(p.device)
    return any(_pair_refusal(pair, p, info) is None for pair in PAIRS)


def _kernels_refusal(pair: Pair, call: Call, info: DeviceInfo) -> Optional[str]:
    """Why the kernels built for this GPU leave ``pair`` without a dropout kernel for the call in a direction."""
    p = call.p
    band = p.mask != 0 or p.window is not None
    for family in pair.families:
        req = Request(family, p.dtype, padded_dim(p.K), padded_dim(p.Kv), 8, True, False, info, band=band,
                      compiled_bias=runtime(family).compiled_bias, compiled_dropout=True)
        if selector(call.registry).find(req) is None:
            return f"no {family} dropout kernel for {p.dtype}, head dim {p.K}, band={band} is built for this GPU"
    return None


def drawing_pair(call: Call, info: Optional[DeviceInfo] = None) -> Tuple[Optional[Pair], str]:
    """(the pair that draws this dropout call's mask in both directions, "") or (None, why none does);
    ``info``: the call's GPU, if known."""
    p = call.p
    why = _problem_refusal(p, call.bias is not None or call.block_mask is not None)
    if why is not None:
        return None, why
    info = info or device_info(p.device)
    reasons = []
    for pair in PAIRS:
        why = _pair_refusal(pair, p, info) or _kernels_refusal(pair, call, info)
        if why is None:
            return pair, ""
        reasons.append(f"{pair.name} pair: {why}")
    return None, "; ".join(reasons)


def refusal(call: Call, family: str, info: Optional[DeviceInfo] = None) -> Optional[str]:
    """Why ``family`` does not run this dropout call (None: its pair draws the mask, in both directions)."""
    pair, why = drawing_pair(call, info)
    if pair is None:
        return why
    if family in pair.families:
        return None
    return f"the {pair.name} pair draws this dropout call's mask, in both directions (runtime/dropout.py)"


def run(call: Call, run_on_kernels: Callable[[Call], tuple]):
    """``run_on_kernels(call)`` for a dropout call a pair draws, on inputs the kernels read: head dims
    that are not a multiple of 8 re-enter the public function zero-padded (results sliced back; the
    mask does not depend on them), a bottom-right backward with more queries than keys leaves out the
    rows that see none as api.py's forward did (so the rows keep the numbers the forward drew them
    by), and inputs a tensor map cannot describe -- nor, so, the Ampere kernels' 16-byte loads -- are
    copied (no plan then)."""
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
