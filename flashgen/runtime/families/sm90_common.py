"""What flashgen's own families share at run time: who they serve, band, softcap, tensor maps.

``OwnKernelFamily`` holds what sm90_fwd, sm90_bwd and the Ampere sm80_fwd and sm80_bwd all
refuse and how they request and refuse; ``HopperFamily`` adds the 9.0 GPU and TMA,
``AmpereFamily`` the 8.0 GPU.  The Ampere families compile a bias in as the Hopper ones do
(``bias`` instances, read by pointer: ``ampere_bias_fields``).

``sm90_fwd`` and ``sm90_bwd`` (``flashgen/csrc/flashgen/sm90_*.h``) take the
same run-time options (band mask, soft-capping, packed batches) through the
same ``Params`` fields, and read q, k, v (and grad_out) through TMA tensor maps.
An attention bias is compiled in (``bias`` instances, head dims up to 128): a call
with one is served by those, one without by the others.  So is dropout, in both pairs
(``dropout`` instances, ``runtime/dropout.py``: a dropout call runs on one pair in both
directions, or on example 41 in both).  A call reaches them when
it needs nothing only example 41 has; otherwise they refuse it with the reason,
and the next family is asked.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np

from flashgen.errors import UnsupportedError
from flashgen.mods import BUILTIN_MODS
from flashgen.runtime import dropout, score_mods, tensormap
from flashgen.runtime.arrays import alignment, cupy_module, elem_strides
from flashgen.runtime.device import device_info
from flashgen.runtime.families import RuntimeFamily, planned_forward_outputs, selector, visible_lse
from flashgen.runtime.launch import on_device
from flashgen.runtime.registry import KernelBinary
from flashgen.runtime.select import KEYS_CAP, Request, mask_block
from flashgen.runtime.validate import MASKS, Call, Problem
from flashgen.spec.sm90_tile import SPARSE_POINTER_FIELDS

UNBOUNDED = 2**30  # an unbounded side of the band mask (flashgen::sm90::kUnbounded)
PACKED_ROWS_LIMIT = 2**28  # packed batches: a sequence's band shift stays in int32
LOG2_E = math.log2(math.e)
AMPERE_CC = 80  # bf16 mma.sync, ldmatrix, cp.async: the oldest GPU AmpereFamily's kernels run on


def band(p: Problem) -> Tuple[int, int, int]:
    """(band_lo, band_hi, band_from_end) of the band mask: key j is visible to query i iff
    i + band_lo <= j <= i + band_hi.  The window sits on the causal diagonal (top-left unless
    causal='bottom_right'); a causal mask caps its right side at 0.  Unbounded sides are
    +-2**30, which the kernels' block arithmetic stays clear of (M, N < 2**30).  Packed
    batches get top-left bounds and band_from_end = 1 under 'bottom_right': the kernels move
    each sequence's band onto its own diagonal (M, N < 2**28 there)."""
    from_end = p.mask == MASKS["bottom_right"]
    packed = p.seqstart_q is not None
    diagonal = p.N - p.M if from_end and not packed else 0
    left, right = p.window if p.window is not None else (None, None)
    lo = -UNBOUNDED if left is None else diagonal - left
    hi = UNBOUNDED if right is None else diagonal + right
    if p.mask:
        hi = min(hi, diagonal)
    return max(lo, -UNBOUNDED), min(hi, UNBOUNDED), int(from_end and packed)


def band_fields(p: Problem) -> dict:
    """The Params fields of the band mask, soft-capping and packed batches, as both kernels read them.

    Soft-capping makes scores softcap * tanh(scale * q.k / softcap) (a zero scale makes every
    score 0 with or without it, so it is left off there); packed batches pass the device
    offsets (nullptr for fixed length)."""
    lo, hi, from_end = band(p)
    softcap = {"softcap_in": p.scale / p.softcap, "softcap_out": p.softcap / p.scale} if p.softcap and p.scale else {}
    return {"band_lo": lo, "band_hi": hi, "band_from_end": from_end, "scale_log2": p.scale * LOG2_E,
            "seqstart_q": p.seqstart_q.data.ptr if p.seqstart_q is not None else 0,
            "seqstart_k": p.seqstart_k.data.ptr if p.seqstart_k is not None else 0, **softcap}


# A bias TMA box: 64 keys (one 128-byte swizzle span of 16-bit values) x 64 query rows, as the
# kernels lay the tiles out in shared memory (flashgen::sm90::kBiasBox)
BIAS_BOX = 64
BIAS_SWIZZLE_BYTES = 128


def bias_fields(bias) -> dict:
    """The steps of the validated [B, H, M, N] bias: 0 for a dim it broadcasts (read at coordinate
    0 of the tensor map, ``tensormap.bias_view``), else 1; nothing for a call without a bias."""
    if bias is None:
        return {}
    sb, sh, sm, _ = bias.strides
    return {"bias_batch_step": int(sb != 0), "bias_head_step": int(sh != 0), "bias_row_step": int(sm != 0)}


def ampere_bias_fields(bias) -> dict:
    """The Params fields of the validated [B, H, M, N] bias for the Ampere kernels (sm80_fwd, sm80_bwd),
    which read it by pointer: its element strides, 0 for a dim it broadcasts (validation leaves rows
    16-byte aligned, keys contiguous); nothing for a call without a bias."""
    if bias is None:
        return {}
    sb, sh, sm, _ = elem_strides(bias)
    return {"bias_ptr": bias.data.ptr, "bias_stride_b": sb, "bias_stride_h": sh, "bias_stride_m": sm}


def encode_bias_map(params: np.ndarray, bias, p: Problem) -> None:
    """Encode the bias's tensor map into ``params``' ``bias_map`` (after ``fill``, which zeroes it),
    for a call with a bias."""
    if bias is not None:
        _encode_box_map(params, "bias_map", tensormap.bias_view(bias), p.dtype)


def encode_dbias_map(params: np.ndarray, dbias, p: Problem) -> None:
    """Encode ``dbias_map``, through which sm90_bwd's bias instances store dbias [B, H, M, N] in the
    bias's boxes (or, with ``dbias_add``, add them into the bias's shape), where the call wants it: as
    wide as a row's padded pitch, so that the masked keys' zeros fill the padding past N
    (``_dbias_sum`` reads it with a row's last 16 bytes) instead of leaving it unwritten."""
    if dbias is not None:
        (B, H, M, _), (sb, sh, sm, sn) = dbias.shape, dbias.strides
        view = tensormap.View((B, M, H, sm // dbias.itemsize), (sb, sm, sh, sn), dbias.itemsize, dbias.data)
        _encode_box_map(params, "dbias_map", view, p.dtype)


def _encode_box_map(params: np.ndarray, field: str, view, dtype: str) -> None:
    raw = params.view(np.uint8)
    at = params.dtype.fields[field][1]
    tensormap.encode_bmhk(raw[at:at + tensormap.TENSOR_MAP_BYTES], view, dtype, BIAS_BOX, BIAS_BOX,
                          BIAS_SWIZZLE_BYTES)


def dbias_fields(dbias) -> dict:
    """The Params fields of the backward's dbias output [B, H, M, N] (``Sm90BwdRuntime.dbias``: rows
    padded, packed otherwise): pointer and row stride, or nothing when it is not wanted (dbias_ptr
    stays null)."""
    if dbias is None:
        return {}
    sb, sh, sm, _ = elem_strides(dbias)
    assert (sb, sh) == (dbias.shape[1] * dbias.shape[2] * sm, dbias.shape[2] * sm), "dbias rows are packed"
    return {"dbias_ptr": dbias.data.ptr, "dbias_row_stride": sm}


def check_compiled_bias(binary: KernelBinary, call: Call) -> None:
    """A bias instance reads the bias for every tile it computes (without one it would fault on the
    GPU) and a plain one ignores ``attn_bias`` (the result would be wrong).  Selection keeps them
    apart (``Request.compiled_bias``); this stops a launch that names the kernel itself."""
    if binary.spec.bias != (call.bias is not None):
        built = "with" if binary.spec.bias else "without"
        raise ValueError(f"{binary.name} is built {built} an attention bias (compiled in); "
                         f"the call has {'none' if binary.spec.bias else 'one'}")


def check_compiled_dropout(binary: KernelBinary, call: Call) -> None:
    """A plain instance ignores dropout_p (no mask drawn) and a dropout one draws a mask a call without
    dropout must not get (or pays for one with p = 0): selection keeps them apart
    (``Request.compiled_dropout``); this stops a launch that names the kernel itself."""
    if binary.spec.dropout != (call.p.dropout_p > 0):
        built = "with" if binary.spec.dropout else "without"
        raise ValueError(f"{binary.name} is built {built} dropout (compiled in); the call has "
                         f"{'none' if binary.spec.dropout else 'dropout_p > 0'}")


# a sparse call's block mask: its arrays' pointers, in Params order (BlockMask.kernel_arrays' for the
# forward, backward_arrays' for the backward): after the family's own per-call pointers
SPARSE_POINTERS = tuple(field.name for field in SPARSE_POINTER_FIELDS)
PACKED_POINTERS = ("seqstart_q", "seqstart_k")  # a packed batch's offsets (Params of the sm90 and sm80 pairs)


def sparse_refusal(call: Call) -> Optional[str]:
    """What of a block-mask call both Hopper families' sparse instances lack (the tile size, dtype and
    head dim are selection's: see ``Request.block_sparse``), or None."""
    p, bm = call.p, call.block_mask
    if p.mask or p.window is not None:  # the public calls fold both into the mask (block_masks.fold_band)
        return ("a block mask with a causal mask or window not folded into it: the sparse kernels take "
                "neither (BlockMask.with_band folds them)")
    if call.bias is not None:
        return "a block mask with attn_bias: the sparse kernels have no bias"
    if bm.partial_bits is None:
        return f"a block mask whose key blocks ({bm.block[1]}) are not a multiple of 32 wide (no element bits)"
    return None


def check_compiled_score_mod(binary: KernelBinary, call: Call) -> None:
    """A score-mod instance reads its captured tensors (without them it would fault) and a plain one
    would ignore the mod; selection keeps them apart (``Request.score_mod``), this stops a launch that
    names the kernel itself."""
    asked = "" if call.score_mod is None else call.score_mod.name
    if binary.spec.score_mod != asked:
        built = f"with score mod {binary.spec.score_mod!r}" if binary.spec.score_mod else "without a score mod"
        raise ValueError(f"{binary.name} is built {built}; the call asks for {asked or 'none'}")


def mod_fields(call: Call) -> dict:
    """The Params fields of the call's score mod (its captured tensors), nothing without one."""
    return {} if call.score_mod is None else call.score_mod.fields()


def trailing_pointers(call: Call) -> Tuple[str, ...]:
    """The Params pointer fields a plan takes from the arrays that end a call's signature (api.py):
    its block mask's, its score mod's captured tensors' or its packed offsets' (a call has at most
    one of the three)."""
    if call.block_mask is not None:
        return SPARSE_POINTERS
    if call.p.seqstart_q is not None:
        return PACKED_POINTERS
    return () if call.score_mod is None else call.score_mod.plan_pointers()


def packed_ends(p: Problem) -> Tuple[int, ...]:
    """Where a packed batch's last sequence ends in q's rows and in k's (a plan's ``packed_ends``:
    ``zero_unpacked_rows`` clears the rows past them); () for a batch that is not packed."""
    return () if p.seqstart_q is None else (int(p.starts_q[-1]), int(p.starts_k[-1]))


def check_compiled_sparse(binary: KernelBinary, call: Call) -> None:
    """A sparse instance reads the mask's lists (without them it would fault) and a plain one would
    ignore the mask; selection keeps them apart (``Request.block_sparse``), this stops a launch that
    names the kernel itself."""
    bm = call.block_mask
    if binary.spec.sparse != (bm is not None):
        built = "with" if binary.spec.sparse else "without"
        raise ValueError(f"{binary.name} is built {built} block-mask lists (compiled in); the call has "
                         f"{'none' if binary.spec.sparse else 'one'}")
    rows, keys = mask_block(binary.constants)
    if bm is not None and (bm.block != (rows, keys) or bm.partial_bits is None):
        raise ValueError(f"{binary.name} reads {rows} x {keys} mask blocks; the block mask's are "
                         f"{bm.block[0]} x {bm.block[1]}")


# each compiled-in axis a launch must match, with its check
_COMPILED_AXES = (("bias", check_compiled_bias), ("sparse", check_compiled_sparse), ("dropout", check_compiled_dropout),
                  ("score_mod", check_compiled_score_mod))


def check_compiled(binary: KernelBinary, call: Call) -> None:
    """Raise before a launch where ``binary`` was built for other options than ``call`` has, on every
    compiled-in axis its family's spec declares (bias, block-mask lists, dropout, score mod)."""
    for axis, check in _COMPILED_AXES:
        if axis in type(binary.spec).AXES:
            check(binary, call)


def zero_unpacked_rows(p: Problem, *arrays) -> None:
    """Rows past the last sequence of a packed batch belong to no sequence, so no sm90 kernel
    writes them: zeros (arrays given as q-row, then k-row shaped: out or dq, dk, dv)."""
    if p.seqstart_q is None:
        return
    for x, end in zip(arrays, (p.starts_q[-1], p.starts_k[-1], p.starts_k[-1])):
        if end < x.shape[1]:
            x[:, int(end):] = 0


def zero_replayed_rows(memory, ends: Tuple[int, ...], arrays: Sequence, stream: int) -> None:
    """``zero_unpacked_rows`` for a replay's outputs (contiguous, [1, rows, ...], out or dq, dk, dv):
    each cleared past its plan's ``packed_ends`` by a memset in the launch's stream order."""
    if not ends:
        return
    runtime = cupy_module().cuda.runtime
    for x, end in zip(arrays, ends[:1] + ends[1:] * 2):
        rows = x.shape[1]
        if end < rows:
            row_bytes = x.nbytes // rows
            runtime.memsetAsync(memory.ptr(x) + end * row_bytes, 0, (rows - end) * row_bytes, stream)


def encode_maps(params: np.ndarray, maps: Sequence[str], arrays: Sequence, box_rows: Sequence[int], p: Problem,
                constants: dict) -> None:
    """Encode each array's TMA tensor map into its ``Params`` field (boxes of box_rows x box_cols)."""
    raw = params.view(np.uint8)
    for name, x, rows in zip(maps, arrays, box_rows):
        at = params.dtype.fields[name][1]
        tensormap.encode_bmhk(raw[at:at + tensormap.TENSOR_MAP_BYTES], x, p.dtype, constants["box_cols"], rows,
                              constants["swizzle_bytes"])


class OwnKernelFamily(RuntimeFamily):
    """A family of flashgen's own kernels (sm90_fwd, sm90_bwd, sm80_fwd, sm80_bwd): the options
    they share (band masks, soft-capping, packed batches through the same Params fields), what
    none of them takes, their request, and their refusal.  A subclass adds its GPU in ``unfit``."""

    # an attention bias compiled into some of the family's kernels (a ``bias`` spec axis, which
    # selection matches both ways); a family without one refuses bias calls
    compiled_bias = False
    # dropout compiled into some kernels (a ``dropout`` axis, matched both ways); a family without refuses it.
    # A family with it takes a dropout call only when its pair draws the mask (``dropout.refusal``), whatever
    # its inputs (``run`` conforms them)
    compiled_dropout = False

    def aligned_arrays(self, call: Call) -> Sequence[Tuple[str, object]]:
        """(name, array) of every input whose alignment the kernels' loads need: q, k, v, and a
        backward's out and grad_out, which both backwards read at the same alignment (explain's
        backward call has neither)."""
        given = (("out", call.out), ("grad_out", call.grad_out))
        return (("q", call.q), ("k", call.k), ("v", call.v)) + tuple((name, x) for name, x in given if x is not None)

    def unfit(self, call: Call) -> Optional[str]:
        """What the call needs that none of flashgen's own kernels has, or None."""
        p = call.p
        if call.block_mask is not None:
            why = self.block_mask_refusal(call)
            if why is not None:
                return why
        if call.bias is not None and not self.compiled_bias:
            return "no attn_bias (the example-41 families take it)"
        if p.dropout_p > 0 and not self.compiled_dropout:
            return "no dropout (the example-41 families draw it)"
        if p.dtype == "f32":
            return "float16 or bfloat16 only; the call is float32"
        if p.K != p.Kv:
            return f"equal q/v head dims only; the call has {p.K} and {p.Kv}"
        limit = UNBOUNDED if p.seqstart_q is None else PACKED_ROWS_LIMIT  # band()'s range
        if max(call.q.shape[1], call.k.shape[1]) >= limit:
            return f"fewer than {limit} rows per call (the band arithmetic's range)"
        return None

    def block_mask_refusal(self, call: Call) -> Optional[str]:
        """Why the family does not read ``call``'s block mask (None: it does); by default none does."""
        return ("no block masks (until these kernels read the block lists, the call runs with the mask as a "
                "dense bias)")

    def request(self, call: Call) -> Request:
        p = call.p
        drops = p.dropout_p > 0
        if drops:  # such calls run on inputs conformed to the kernels (dropout.run)
            aligned = 8
        else:
            aligned = alignment([x for _, x in self.aligned_arrays(call)], (p.K, p.Kv))
        mod = call.score_mod
        return Request(self.name, p.dtype, p.K, p.Kv, aligned, drops, call.bias is not None,
                       device_info(p.device), band=p.mask != 0 or p.window is not None, softcap=p.softcap > 0,
                       compiled_bias=self.compiled_bias,
                       block_sparse=None if call.block_mask is None else call.block_mask.block,
                       compiled_dropout=self.compiled_dropout, num_keys=min(p.N, KEYS_CAP),
                       num_queries=min(p.M, KEYS_CAP),
                       score_mod="" if mod is None else mod.name, score_mod_digest="" if mod is None else mod.digest)

    def refusal(self, call: Call) -> Optional[str]:
        """``unfit``, or none of the kernels accepts the call (a head dim over the largest tier,
        misaligned inputs, too little shared memory): the next family is asked."""
        why = self.unfit(call)
        if why is not None:
            return why
        req = self.request(call)
        if self.kernel(call, req) is not None:
            return None
        try:
            verdicts = dict.fromkeys(why for _, _, why in selector(call.registry).explain(req))
        except UnsupportedError as e:  # nothing of this family built for the GPU
            return str(e)
        return "none of its kernels accepts the call: " + "; ".join(verdicts)

    def dropout_refusal(self, call: Call, info) -> Optional[str]:
        """A dropout call is this family's iff its pair draws the mask (``dropout.refusal``)."""
        return dropout.refusal(call, self.name, info)

    def run(self, call: Call):
        if call.p.dropout_p > 0:
            return dropout.run(call, super().run)
        return super().run(call)


class HopperFamily(OwnKernelFamily):
    """A family of flashgen's sm90a kernels: a 9.0 GPU, and inputs TMA can read (every one of
    ``aligned_arrays``: those read through a tensor map, or at its alignment).  A dropout call is
    the pair's if ``dropout.refusal`` says so, whatever its inputs (``run`` conforms them)."""

    compiled_bias = True
    compiled_dropout = True

    def unfit(self, call: Call) -> Optional[str]:
        why = super().unfit(call)
        if why is not None:
            return why
        info = device_info(call.p.device)
        if info.cc != 90:
            return f"a compute-capability 9.0 GPU (H100, H200); GPU {call.p.device} is {info.name} (sm_{info.cc})"
        if call.p.dropout_p > 0:
            return self.dropout_refusal(call, info)
        for name, x in self.aligned_arrays(call):
            why = tensormap.bmhk_problem(x)
            if why:
                return f"TMA cannot read {name}: {why}"
        if call.bias is not None:  # validation copies a bias whose rows are not 16-byte aligned
            why = tensormap.bmhk_problem(tensormap.bias_view(call.bias))
            if why:
                return f"TMA cannot read attn_bias: {why}"
        return self.score_mod_unbuilt(call, info)

    def score_mod_unbuilt(self, call: Call, info) -> Optional[str]:
        """A score-mod call whose mod has no instance of this family for the GPU: the command that builds it."""
        mod = call.score_mod
        if mod is None:
            return None
        try:
            built = {b.spec.score_mod for b in call.registry.for_device(self.name, info)}
        except UnsupportedError:
            built = set()
        return None if mod.name in built else str(score_mods.not_built(mod.name, mod.name in BUILTIN_MODS))


class AmpereFamily(OwnKernelFamily):
    """A family of flashgen's mma.sync kernels (sm80_fwd, sm80_bwd): any GPU of compute
    capability 8.0 or newer; on a 9.0 GPU the sm90 families come first in the dispatch order (and
    their pair before this one for dropout: ``dropout.PAIRS``)."""

    compiled_bias = True
    compiled_dropout = True

    def unfit(self, call: Call) -> Optional[str]:
        why = super().unfit(call)
        if why is not None:
            return why
        info = device_info(call.p.device)
        if info.cc < AMPERE_CC:
            return f"a GPU of compute capability 8.0 or newer; GPU {call.p.device} is {info.name} (sm_{info.cc})"
        if call.p.dropout_p > 0:
            return self.dropout_refusal(call, info)
        return None


def replay_forward(plan, memory, arrays, stream, seed=0, offset=0):
    """(out, lse) of a planned sm90_fwd or sm80_fwd call: outputs allocated through ``memory``,
    then one launch with the pointers of q, k, v and a bias if any (tensor maps' or Params'), out
    and lse, then the plan's ``trailing`` arrays (a block mask's: they end ``arrays``), and the
    call's dropout seed and offset (a dropout plan's)."""
    q, ptr = arrays[0], memory.ptr
    lead = len(arrays) - plan.sizes.get("trailing", 0)
    with on_device(cupy_module(), plan.device):
        handle_ = memory.stream(stream, plan.device)
        out, lse = planned_forward_outputs(memory, plan.sizes, q)
        zero_replayed_rows(memory, plan.sizes.get("packed_ends", ()), (out,), handle_)
        plan.launch(tuple(map(ptr, arrays[:lead])) + (ptr(out), ptr(lse)) + tuple(map(ptr, arrays[lead:])), seed,
                    offset, handle_)
    return out, visible_lse(lse, plan.sizes["M"])
