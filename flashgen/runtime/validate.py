"""Validation shared by every family: shapes, dtypes, devices, strides, options, cu_seqlens.

A call is checked once, before any family is asked, into a :class:`Problem` (sizes and
options, the same for forward and backward) and a :class:`Call` (the problem, its
arrays as CuPy views and what a family needs to serve or re-enter it).  Nothing here
launches work; only packed batches read their offsets back to the host.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import numpy as np

from flashgen.errors import UnsupportedError
from flashgen.runtime import host_offsets, score_mods
from flashgen.runtime.arrays import (as_array, check_strides, cupy_module, device_address, dtype_name, elem_strides,
                                     padded_rows)
from flashgen.runtime.block_masks import BlockMask
from flashgen.runtime.limits import SPLIT_ROWS, check_input_offsets, check_kernel_limits, check_offset
from flashgen.runtime.packed import PackedOffsets
from flashgen.runtime.registry import default_registry

MASKS = {None: 0, "top_left": 1, "bottom_right": 2}


def check_bmhk(name: str, x, dtype=None, device=None):
    if x.ndim != 4:
        raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim]; got shape {tuple(x.shape)}")
    if any(n < 0 for n in x.shape):
        raise ValueError(f"{name} has a negative size: shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} has dtype {x.dtype}, expected {dtype} like q")
    if device is not None and x.device.id != device:
        raise ValueError(f"{name} is on GPU {x.device.id}, q is on GPU {device}")
    if x.size and x.shape[3] > 1 and x.strides[3] != x.itemsize:
        raise ValueError(f"{name} must have a contiguous last (head_dim) dimension; its stride is "
                         f"{x.strides[3] // x.itemsize} elements (use cupy.ascontiguousarray)")
    check_strides(name, x)
    check_input_offsets(name, x)


@dataclass
class Problem:
    """What forward and backward validate the same way."""

    B: int
    M: int
    N: int
    H: int
    Hk: int  # key/value heads: H // Hk query heads share each (grouped-query attention when Hk < H)
    K: int
    Kv: int
    dtype: str
    device: int
    mask: int
    scale: float
    dropout_p: float
    seed: int
    offset: int
    seqstart_q: object  # device int32 [S+1] or None
    seqstart_k: object
    batches: int  # B, or the number of sequences when varlen
    starts_q: object = None  # host copies of the validated offsets (varlen only)
    starts_k: object = None
    window: Optional[Tuple[Optional[int], Optional[int]]] = None  # (left, right); None: no window
    softcap: float = 0.0  # 0: no soft-capping

    @property
    def group(self) -> int:
        """Query heads per key/value head (1: multi-head attention; validated to divide H)."""
        return self.H // self.Hk


def read_offsets(cu, name, total):
    """Validate cu_seqlens on the host: returns (cu, host copy); cu may become a CuPy view.  Read once,
    not per call: a ``PackedOffsets`` (validated when built), and a torch CUDA tensor while torch says
    it is unchanged (host_offsets).  ``total``: the rows the offsets index (None: not checked here)."""
    given, host = cu, None
    if isinstance(cu, PackedOffsets):
        cu, host = cu.array, cu.host
    elif getattr(cu, "is_cuda", False) is True:  # a torch CUDA tensor: its copy, if it is unchanged
        host = host_offsets.lookup(cu)
        if host is not None:
            cu = as_array(cu, name)
    if host is None:
        cu, host = _read_host(cu, name)
        if getattr(given, "is_cuda", False) is True:
            host_offsets.remember(given, host)
    if total is not None and host[-1] > total:
        raise ValueError(f"{name} ends at {host[-1]} but the packed sequence has {total} rows")
    return cu, host


def _read_host(cu, name):
    """(cu, its validated host copy), read from the device (waiting for the GPU): cu may become a
    CuPy view."""
    cupy = cupy_module()
    if isinstance(cu, cupy.ndarray):
        host = cupy.asnumpy(cu)
    else:
        try:
            host = np.asarray(cu)
        except Exception:  # e.g. a torch CUDA tensor: view it through DLPack, then read it back
            cu = as_array(cu, name)
            host = cupy.asnumpy(cu)
    if host.dtype != np.int32:
        raise TypeError(f"{name} must be int32; got {host.dtype}")
    if host.ndim != 1 or host.size < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (start offsets + end)")
    if host[0] != 0 or np.any(np.diff(host) < 0):
        raise ValueError(f"{name} must start at 0 and never decrease; got {host.tolist()[:8]}")
    return cu, host


def offsets_on_device(cu, host, device):
    """The offsets as the kernels read them: a packed int32 array on ``device`` (a strided view
    such as cu[::2] is copied)."""
    cupy = cupy_module()
    if isinstance(cu, cupy.ndarray) and cu.device.id == device and cu.flags.c_contiguous:
        return cu
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def check_scale(scale) -> float:
    if isinstance(scale, (bool, str, bytes)):
        value = math.nan
    else:
        try:
            value = float(scale)
        except (TypeError, ValueError):
            value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite real number (or None for 1/sqrt(head_dim)); got {scale!r}")
    return value


def check_rng(dropout_p, seed, offset):
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs an explicit seed (and offset): attention_backward must "
                         "redraw the same mask from them")
    for name, value in (("seed", 0 if seed is None else seed), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**64:
            raise ValueError(f"{name} must be an integer in [0, 2**64); got {value!r}")


def check_window(window):
    """``window`` as (left, right) with None for an unbounded side, or None for no window."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be (left, right): how many keys before and after the diagonal a query "
                        f"sees, None for no limit; got {window!r}")
    for side, w in zip(("left", "right"), window):
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer))):
            raise TypeError(f"window's {side} size must be an int or None; got {w!r}")
        if w is not None and w < 0:
            raise ValueError(f"window's {side} size must be >= 0; got {w}")
    left, right = (None if w is None else int(w) for w in window)
    return None if left is None and right is None else (left, right)


def check_softcap(softcap) -> float:
    if isinstance(softcap, (bool, str, bytes)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0 for none); got {softcap!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0 for none); got {softcap!r}")
    return float(softcap)


def problem(q, k, v, causal, scale, dropout_p, seed, offset, cu_seqlens_q, cu_seqlens_k, *, window=None,
            softcap=0.0) -> Problem:
    """Shape, dtype, device and option checks shared by forward and backward (no GPU work
    unless cu_seqlens must be validated)."""
    check_bmhk("q", q)
    dtype = dtype_name(q.dtype)
    if dtype is None:
        raise TypeError(f"q has dtype {q.dtype}; flashgen supports float32, float16 and bfloat16")
    check_bmhk("k", k, q.dtype, q.device.id)
    check_bmhk("v", v, q.dtype, q.device.id)
    B, M, H, K = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v have different sequence lengths: {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"head counts differ: q {H}, k {k.shape[2]}, v {v.shape[2]}")
    if k.shape[2] != H and (k.shape[2] == 0 or H % k.shape[2]):
        raise ValueError(f"q has {H} heads, k and v {k.shape[2]}: grouped-query attention needs q's head count "
                         f"to be a multiple of k's (each k/v head serves H / Hk consecutive q heads)")
    if k.shape[3] != K:
        raise ValueError(f"q and k head dims differ: {K} and {k.shape[3]}")
    N, Kv = k.shape[1], v.shape[3]
    if B == 0 or H == 0:
        raise ValueError(f"empty batch: batch={B}, heads={H}")
    if K == 0 or Kv == 0:
        raise ValueError(f"head dims must be >= 1; got {K} and {Kv}")
    if not (causal is None or isinstance(causal, str) and causal in MASKS):  # no `in` on unhashables
        raise ValueError(f"causal must be None, 'top_left' or 'bottom_right'; got {causal!r}")
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    check_rng(dropout_p, seed, offset)
    scale = 1.0 / math.sqrt(K) if scale is None else check_scale(scale)
    window, softcap = check_window(window), check_softcap(softcap)
    seqstart_q = seqstart_k = starts_q = starts_k = None
    batches = B
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along dim 1 of a batch of 1; got batch {B}")
        cu_q, starts_q = read_offsets(cu_seqlens_q, "cu_seqlens_q", M)
        cu_k, starts_k = read_offsets(cu_seqlens_k, "cu_seqlens_k", N)
        if starts_q.size != starts_k.size:
            raise ValueError(f"cu_seqlens_q has {starts_q.size} entries, cu_seqlens_k {starts_k.size}")
        seqstart_q = offsets_on_device(cu_q, starts_q, q.device.id)
        seqstart_k = offsets_on_device(cu_k, starts_k, q.device.id)
        batches = starts_q.size - 1
        M, N = int(np.diff(starts_q).max()), int(np.diff(starts_k).max())
    c = Problem(B, M, H=H, Hk=k.shape[2], N=N, K=K, Kv=Kv, dtype=dtype, device=q.device.id, mask=MASKS[causal],
                scale=scale, dropout_p=float(dropout_p), seed=int(seed or 0), offset=int(offset),
                seqstart_q=seqstart_q, seqstart_k=seqstart_k, batches=batches,
                starts_q=starts_q, starts_k=starts_k, window=window, softcap=softcap)
    check_kernel_limits(c, q, k, v)
    if c.M and c.N:
        check_head_broadcast(c, q, k, v)
    return c


def check_head_broadcast(c: Problem, q, k, v):
    """k and v both broadcast over heads (head stride 0) turn on a decode fast path in the forward
    kernel for any query block holding a single query (kernel_forward.h:336-352): it iterates
    over heads instead of queries, drops the causal mask and writes lse (and reads a bias, draws
    dropout) for the wrong heads.  Refuse the layouts where that changes a result."""
    if elem_strides(k)[2] != 0 or elem_strides(v)[2] != 0 or k.shape[2] != c.H:
        return  # (grouped-query k/v reach example 41 repeated, with real head strides)
    if c.H == 1 and c.mask != MASKS["top_left"]:
        return  # one head: iterating over heads is iterating over that one query; nothing changes
    # the query tile is 32 or 64 rows: a block holds a single query where a length is 1 mod 32
    if c.seqstart_q is None:
        single = q.shape[1] % 32 == 1
    else:
        single = bool(np.any(np.diff(c.starts_q) % 32 == 1))
    if single:
        raise UnsupportedError("k and v are both broadcast over heads (head stride 0) and a query block holds a "
                               "single query (a sequence length of 1 mod 32): the example-41 forward then takes a "
                               "decode fast path that writes lse (and applies a top_left mask, bias and dropout) "
                               "for the wrong heads.  Materialise one of them: v = cupy.ascontiguousarray(v)")


def checked_bias(cupy, attn_bias, c: Problem, q, rows: int, cols: int):
    """(the bias as [B, H, M, N] (broadcast dims get stride 0) with an aligned row stride, whether
    it is a copy of the caller's): a copy is per-call work that a launch plan, which launches on the
    caller's pointers, would skip."""
    if attn_bias is None:
        return None, False
    if c.seqstart_q is not None:
        raise UnsupportedError("attn_bias with cu_seqlens is not supported: neither the sm90 nor the example-41 "
                               "kernels read a bias for packed sequences")
    b = as_array(attn_bias, "attn_bias")
    if b.dtype != q.dtype:
        raise TypeError(f"attn_bias has dtype {b.dtype}, expected {q.dtype} like q")
    if b.device.id != c.device:
        raise ValueError(f"attn_bias is on GPU {b.device.id}, q is on GPU {c.device}")
    shape = (c.B, c.H, rows, cols)
    try:
        full = cupy.broadcast_to(b, shape)
    except ValueError:
        raise ValueError(f"attn_bias of shape {tuple(attn_bias.shape)} does not broadcast to "
                         f"[batch, heads, M, N] = {shape}") from None
    copied = bool((cols > 1 and full.strides[3] != full.itemsize) or any(st % 8 for st in elem_strides(full)[:3])
                  or full.data.ptr % 16)
    if copied:
        # the kernels read bias rows with 16-byte loads: copy into rows padded to 8 elements, only the
        # caller's own extents (a bias shared by the batch stays one plane, read as such, broadcast again)
        own = ((1,) * (4 - b.ndim) + tuple(b.shape))[:3] + (cols,)  # (broadcast_to passed: each extent 1 or whole)
        padded = padded_rows(cupy, own, b.dtype)
        padded[...] = cupy.broadcast_to(b, own)
        full = cupy.broadcast_to(padded, shape)
    b = full
    # row * bias_strideM: uint32 in the forward (kernel_forward.h:828), int32 in the backward (1605)
    check_offset("bias_strideM", "attn_bias's last row offset (M - 1) * row stride", rows - 1,
                  elem_strides(b)[2], SPLIT_ROWS)
    return b, copied


def dbias_folds(attn_bias, B: int, H: int) -> Tuple[int, int]:
    """(batches, heads) whose planes add up into one plane of the dbias ``attention_backward`` returns:
    B where the caller's bias has extent 1 in the batch dim (or no such dim), H likewise for heads,
    else 1.  dbias is then [B / batches, H / heads, M, N], as autograd wants the gradient of such a
    bias, and B (or H) times smaller than the kernels' per-(batch, head) planes."""
    shape = tuple(attn_bias.shape)
    return (B if len(shape) < 4 or shape[-4] == 1 else 1), (H if len(shape) < 3 or shape[-3] == 1 else 1)


def fold_dbias(cupy, dbias, attn_bias, B: int, H: int):
    """dbias summed over ``dbias_folds`` (in float32, rounded once) where the kernels that served the
    call left it per (batch, head); as it is where they summed it (sm90_bwd's ``_dbias_sum``)."""
    batches, heads = dbias_folds(attn_bias, B, H)
    if dbias.shape[:2] == (B // batches, H // heads):
        return dbias
    axes = tuple(axis for axis, n in ((0, batches), (1, heads)) if n > 1)
    return dbias.sum(axis=axes, keepdims=True, dtype=cupy.float32).astype(dbias.dtype)


def check_block_mask(block_mask, c: Problem, q, k) -> Optional[BlockMask]:
    """The call's block mask, checked against its shapes and device (None: none given).  Any block
    size serves: the sparse kernels take the sizes they read, the dense fallback (``block_fallback``)
    every other."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask (build it once with flashgen.block_mask(mask, B, H, M, N)); "
                        f"got {type(block_mask).__name__}")
    if c.seqstart_q is not None:
        raise UnsupportedError("block_mask with cu_seqlens is not supported: pass the batch unpacked, or keep the "
                               "sequences packed in one row and mask across them (a document mask)")
    if block_mask.device is None:
        raise ValueError("block_mask was built on the host (device='cpu'); build it on q's GPU "
                         f"(flashgen.block_mask(..., device={c.device}))")
    if block_mask.device != c.device:
        raise ValueError(f"block_mask is on GPU {block_mask.device}, q is on GPU {c.device}")
    B, H, M, N = block_mask.shape
    if B not in (1, c.B) or H not in (1, c.H) or (M, N) != (q.shape[1], k.shape[1]):
        raise ValueError(f"block_mask is for [B, H, M, N] = {block_mask.shape}; the call has "
                         f"{(c.B, c.H, q.shape[1], k.shape[1])} (B and H may also be 1)")
    return block_mask


def varlen_lengths(c: Problem):
    """The packed query offsets and the per-sequence query and key lengths, from the host
    copies validation made (no further device reads)."""
    return c.starts_q, np.diff(c.starts_q), np.diff(c.starts_k)


def check_varlen_bottom_right(c: Problem) -> None:
    if c.seqstart_q is None or c.mask != MASKS["bottom_right"]:
        return
    _, q_lens, k_lens = varlen_lengths(c)
    tall = np.nonzero(q_lens > k_lens)[0]
    if tall.size:
        raise UnsupportedError(f"causal='bottom_right' with cu_seqlens needs every sequence to have at least as "
                               f"many keys as queries; sequence {int(tall[0])} has {int(q_lens[tall[0]])} queries "
                               f"and {int(k_lens[tall[0]])} keys (the kernels keep that offset unsigned)")


def rows_without_keys(c: Problem, q, k) -> int:
    """With bottom-right causal masking and more queries than keys, the first M - N queries see
    no key at all.  The kernels keep the diagonal offset N - M in an unsigned field and get
    those rows wrong, so the runtime runs them on the last N rows (a square problem) and
    fills the others itself: output 0, lse -inf (a softmax over nothing), no gradient."""
    if c.mask == MASKS["bottom_right"] and c.seqstart_q is None and q.shape[1] > k.shape[1]:
        return q.shape[1] - k.shape[1]
    return 0


@dataclass
class Call:
    """A validated call, as every family sees it.

    ``options`` are the caller's keyword arguments: a family that serves a call by
    re-entering the public function with changed inputs (grouped-query k/v repeated,
    head dims padded, rows without keys split off) calls ``again``, which goes through
    validation and family selection anew.  ``plan_key`` is where the family leaves a
    launch plan (``plans.py``); a family that copies inputs per call sets it to None.
    """

    direction: str  # "fwd" or "bwd"
    p: Problem
    q: object
    k: object
    v: object
    bias: object  # [B, H, M, N] (broadcast dims with stride 0), or None
    options: dict
    entry: Callable  # attention_forward or attention_backward
    out: object = None  # backward only: the forward's output, grad_out and lse
    grad_out: object = None
    lse: object = None
    plan_key: object = None
    extra: dict = field(default_factory=dict)  # what a family keeps between its steps
    block_mask: Optional[BlockMask] = None  # validated; while it runs dense, ``bias`` holds it (block_fallback)
    score_mod: Optional[score_mods.BoundScoreMod] = None  # validated, with its captured tensors

    @property
    def registry(self):
        return self.options["registry"]

    @property
    def stream(self):
        return self.options["stream"]

    def again(self, *arrays, **changes):
        """The public function on other arrays and options: validated and dispatched anew."""
        return self.entry(*arrays, **{**self.options, **changes})


# The public functions' keyword arguments and their defaults: a Call's options always hold
# all of its direction's, so a family reads them directly and ``again`` passes them back.
FORWARD_OPTIONS = dict(attn_bias=None, block_mask=None, causal=None, scale=None, dropout_p=0.0, seed=None, offset=0,
                       cu_seqlens_q=None, cu_seqlens_k=None, window=None, softcap=0.0, score_mod=None, mod_tensors=None,
                       stream=None, registry=None)
BACKWARD_OPTIONS = dict(FORWARD_OPTIONS, bias_requires_grad=False, deterministic=False)


def _complete(defaults: dict, options: dict) -> dict:
    unknown = options.keys() - defaults.keys()
    if unknown:
        raise TypeError(f"unexpected options: {sorted(unknown)}")
    options = {**defaults, **options}
    options["registry"] = options["registry"] or default_registry()
    return options


def forward_call(q, k, v, options: dict, entry: Callable, plan_key=None) -> Call:
    """Validate a forward call: ``options`` are attention_forward's keywords (defaults filled in)."""
    cupy = cupy_module()
    options = _complete(FORWARD_OPTIONS, options)
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    p = problem(q, k, v, options["causal"], options["scale"], options["dropout_p"], options["seed"], options["offset"],
                options["cu_seqlens_q"], options["cu_seqlens_k"], window=options["window"], softcap=options["softcap"])
    b, copied = checked_bias(cupy, options["attn_bias"], p, q, q.shape[1], k.shape[1])
    bm = check_block_mask(options["block_mask"], p, q, k)
    check_varlen_bottom_right(p)
    mod = score_mods.bind(options, p, q, k)
    # a block mask's arrays are in the plan's key (api.py); a plan is left only where a sparse kernel
    # reads them (the dense fallback clears the key: block_fallback.dense_call)
    return Call("fwd", p, q, k, v, b, options, entry, plan_key=kept_plan_key(plan_key, copied, p, options),
                block_mask=bm, score_mod=mod)


def kept_plan_key(plan_key, bias_copied: bool, p: Problem, options: dict):
    """``plan_key``, or None where the kernels read a per-call copy a replay would not make: of the
    bias (``checked_bias``) or of the offsets (``offsets_copied``)."""
    return None if bias_copied or offsets_copied(p, options) else plan_key


def offsets_copied(p: Problem, options: dict) -> bool:
    """Whether the kernels read a copy of the caller's cu_seqlens (strided, or not on q's GPU), which
    a launch plan, reading the caller's own arrays, would not see."""
    if p.seqstart_q is None:
        return False
    given = [options[name] for name in ("cu_seqlens_q", "cu_seqlens_k")]
    given = [cu.array if isinstance(cu, PackedOffsets) else cu for cu in given]
    return any(seq.data.ptr != device_address(cu) for seq, cu in zip((p.seqstart_q, p.seqstart_k), given))


def backward_call(grad_out, q, k, v, out, lse, options: dict, entry: Callable, plan_key=None) -> Call:
    """Validate a backward call: the forward's checks, then out, grad_out and lse against them."""
    cupy = cupy_module()
    options = _complete(BACKWARD_OPTIONS, options)
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    grad_out, out, lse = as_array(grad_out, "grad_out"), as_array(out, "out"), as_array(lse, "lse")
    p = problem(q, k, v, options["causal"], options["scale"], options["dropout_p"], options["seed"],
                options["offset"], options["cu_seqlens_q"], options["cu_seqlens_k"], window=options["window"],
                softcap=options["softcap"])
    out_shape = (q.shape[0], q.shape[1], p.H, p.Kv)
    for name, x in (("out", out), ("grad_out", grad_out)):
        check_bmhk(name, x, q.dtype, p.device)
        if tuple(x.shape) != out_shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {out_shape} ([B, M, H, Kv])")
    if lse.dtype != cupy.float32:
        raise TypeError(f"lse must be float32 (as attention_forward returns it); got {lse.dtype}")
    if lse.ndim != 3 or tuple(lse.shape[:2]) != (p.batches, p.H) or lse.shape[2] < p.M:
        raise ValueError(f"lse has shape {tuple(lse.shape)}; expected [{p.batches}, {p.H}, {p.M}] "
                         "as attention_forward returns it")
    if lse.device.id != p.device:
        raise ValueError(f"lse is on GPU {lse.device.id}, q is on GPU {p.device}")
    if options["attn_bias"] is None and options["bias_requires_grad"]:
        raise ValueError("bias_requires_grad=True without attn_bias")
    b, copied = checked_bias(cupy, options["attn_bias"], p, q, q.shape[1], k.shape[1])
    bm = check_block_mask(options["block_mask"], p, q, k)
    check_varlen_bottom_right(p)
    mod = score_mods.bind(options, p, q, k)
    return Call("bwd", p, q, k, v, b, options, entry, out=out, grad_out=grad_out, lse=lse,
                plan_key=kept_plan_key(plan_key, copied, p, options), block_mask=bm, score_mod=mod)
