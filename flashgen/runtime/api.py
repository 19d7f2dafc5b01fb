"""``attention_forward`` / ``attention_backward``: validate, select, pack ``Params``, launch.

Layout is BMHK: q [B, M, H, K], k [B, N, H, K], v [B, N, H, Kv], any strides
with a contiguous last dim.  Inputs are CuPy arrays or anything that speaks
DLPack or ``__cuda_array_interface__`` (torch tensors, zero-copy); outputs
are CuPy arrays.  Every check happens before the launch; a launch goes to the
given or current CuPy stream with no host synchronisation.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from flashgen.errors import UnsupportedError
from flashgen.runtime import plans, tensormap, tuning
from flashgen.runtime.device import device_info
from flashgen.runtime.registry import KernelBinary, Registry, default_registry
from flashgen.runtime.select import Request, Selector, num_splits_key, seq_multiples, workspace_bytes
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.spec.mem_eff_fwd import MemEffFwd
from flashgen.spec.sm90_bwd import Sm90Bwd
from flashgen.spec.sm90_fwd import Sm90Fwd

_MASKS = {None: 0, "top_left": 1, "bottom_right": 2}
_INT32_MAX = 2**31 - 1
_UNBOUNDED = 2**30  # an unbounded side of the sm90 band mask (flashgen::sm90::kUnbounded)
_PACKED_ROWS_LIMIT = 2**28  # packed batches on the sm90 kernels: a sequence's band shift stays in int32
_selectors = {}
_params = threading.local()


def _selector(registry: Registry) -> Selector:
    sel = _selectors.get(id(registry))
    if sel is None or sel.registry is not registry:
        sel = _selectors[id(registry)] = Selector(registry)
    return sel


def _cupy():
    try:
        import cupy
    except ImportError:
        raise UnsupportedError("flashgen's runtime needs CuPy: pip install 'flashgen[cu13]' "
                               "(or cupy-cuda12x / cupy-cuda13x matching your driver)") from None
    return cupy


def _dtype_name(dtype) -> Optional[str]:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(np.dtype(dtype).name)


def as_array(x, name: str):
    """A CuPy view of ``x`` (no copy), or a TypeError that says what to pass (a ValueError for
    negative strides, see ``_check_strides``)."""
    cupy = _cupy()
    if isinstance(x, cupy.ndarray):
        _check_strides(name, x)
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} is a host (NumPy) array; move it to the GPU first (cupy.asarray)")
    if hasattr(x, "__dlpack__"):  # keeps bfloat16 (CUDA array interface has no code for it)
        _check_dlpack_device(name, x)
        try:
            arr = cupy.from_dlpack(x)
        except Exception as e:  # e.g. a CPU torch tensor
            raise TypeError(f"{name}: cannot view it on the GPU through DLPack ({e})") from None
    elif hasattr(x, "__cuda_array_interface__"):
        arr = cupy.asarray(x)
    else:
        raise TypeError(f"{name} must be a CuPy array or a GPU array with DLPack or __cuda_array_interface__, "
                        f"not {type(x).__name__}")
    _check_strides(name, arr)
    return arr


_DLPACK_DEVICES = {1: "the host (CPU)", 3: "pinned host memory", 2: None, 13: None}  # None: CUDA, usable


def _check_dlpack_device(name: str, x):
    """Refuse a DLPack producer that is not on a CUDA device before ``from_dlpack`` sees it: some
    CuPy versions would copy a CPU tensor to the GPU instead of failing (no longer zero-copy)."""
    try:
        kind = int(x.__dlpack_device__()[0])
    except Exception:  # no (usable) __dlpack_device__: from_dlpack decides
        return
    where = _DLPACK_DEVICES.get(kind, f"DLPack device type {kind}")
    if where is not None:
        raise TypeError(f"{name} is on {where}, not a CUDA GPU; move it to the GPU first (e.g. tensor.cuda())")


def _check_strides(name: str, x):
    """Negative strides (reversed views) would reach the kernels as head/row offsets that the
    forward computes in unsigned 32-bit arithmetic (kernel_forward.h:293-296, 828): refuse them."""
    for dim, (n, s) in enumerate(zip(x.shape, x.strides)):
        if n > 1 and s < 0:
            raise ValueError(f"{name} has a negative stride in dim {dim} (a reversed view); the kernels need "
                             f"non-negative strides: pass cupy.ascontiguousarray({name})")


def _check_bmhk(name: str, x, dtype=None, device=None):
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
    _check_strides(name, x)
    _check_input_offsets(name, x)


# The Params fields an input's own strides go into, and the 32-bit products the kernels form
# with them: row offsets `row * strideM` in int32 (backward: kernel_backward.h:1489, 1502, 1512,
# 1531, 1566, 2463, and 803-809 for varlen starts; forward key loop: kernel_forward.h:735, 779,
# 999) and head offsets `head_id * strideH` (uint32 in the forward, kernel_forward.h:293-296;
# int32 in the backward, kernel_backward.h:817-819).  Both kernels must accept an input, so
# the bound is the stricter int32 one.
_OFFSET_FIELDS = {"q": ("q_strideM", "q_strideH"), "k": ("k_strideM", "k_strideH"),
                  "v": ("v_strideM", "v_strideH"), "grad_out": ("gO_strideM", None)}
_SPLIT_ROWS = ("split the call: fewer heads per call (each group copied into its own contiguous array: a row "
               "is heads x head_dim elements) or fewer rows per call (fewer packed sequences, or fewer queries)")
_SPLIT_HEADS = "use a BMHK-contiguous layout (cupy.ascontiguousarray) or split the heads over several calls"


def _check_offset(field: str, what: str, count: int, stride: int, advice: str, limit: int = _INT32_MAX):
    """``count * stride`` is an offset a kernel computes in 32-bit arithmetic; refuse it if it overflows."""
    if count > 0 and count * stride > limit:
        raise ValueError(f"{field}: {what} = {count} * {stride} = {count * stride} overflows the kernels' "
                         f"32-bit offset arithmetic (at most {limit}); {advice}")


def _check_input_offsets(name: str, x):
    fields = _OFFSET_FIELDS.get(name)
    if fields is None or not x.size:
        return
    rows, heads = x.shape[1], x.shape[2]
    stride_m, stride_h = _elem_strides(x)[1:3]
    _check_offset(fields[0], f"{name}'s last row offset (seq - 1) * row stride", rows - 1, stride_m, _SPLIT_ROWS)
    if fields[1] is not None:
        _check_offset(fields[1], f"{name}'s last head offset (heads - 1) * head stride", heads - 1, stride_h,
                      _SPLIT_HEADS)


def _elem_strides(x):
    return tuple(s // x.itemsize for s in x.strides)


def _alignment(arrays, dims) -> int:
    """Largest of 8/4/2/1 dividing every pointer (in elements), stride and dim that matters."""
    values = list(dims)
    for x in arrays:
        values.append(x.data.ptr // x.itemsize if x.data.ptr % x.itemsize == 0 else 1)
        values += [s for s, n in zip(_elem_strides(x)[:3], x.shape[:3]) if n > 1]
    for a in (8, 4, 2):
        if all(v % a == 0 for v in values):
            return a
    return 1


_ROWS_OF = {"q": "num_queries", "o": "num_queries", "gO": "num_queries", "gQ": "num_queries",
            "bias": "num_queries", "gB": "num_queries", "k": "num_keys", "v": "num_keys", "gK": "num_keys",
            "gV": "num_keys"}


def _check_int32(**values):
    """Every value fits its int32 Params field, and every ``X_strideM`` times the last row index
    (``num_queries`` or ``num_keys``, when given) fits the kernels' 32-bit row offsets."""
    for name, v in values.items():
        if not -_INT32_MAX - 1 <= v <= _INT32_MAX:
            raise ValueError(f"{name} = {v} does not fit the kernel's 32-bit field; split the batch")
    for name, stride in values.items():
        rows_name = _ROWS_OF.get(name[:-len("_strideM")]) if name.endswith("_strideM") else None
        if rows_name in values:
            _check_offset(name, f"the last row offset ({rows_name} - 1) * {name}", values[rows_name] - 1,
                          abs(stride), _SPLIT_ROWS)


@dataclass
class _Common:
    """What forward and backward validate the same way."""

    B: int
    M: int
    N: int
    H: int
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


def _read_offsets(cu, name, total):
    """Validate cu_seqlens on the host: returns (cu, host copy); cu may become a CuPy view."""
    cupy = _cupy()
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
    if host[-1] > total:
        raise ValueError(f"{name} ends at {host[-1]} but the packed sequence has {total} rows")
    return cu, host


def _offsets_on_device(cu, host, device):
    """The offsets as the kernels read them: a packed int32 array on ``device`` (a strided view
    such as cu[::2] is copied)."""
    cupy = _cupy()
    if isinstance(cu, cupy.ndarray) and cu.device.id == device and cu.flags.c_contiguous:
        return cu
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def _check_scale(scale) -> float:
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


_UINT32_MAX = 2**32 - 1
_GRID_YZ_MAX = 65535  # CUDA's limit on gridDim.y (heads) and gridDim.z (batch) of both kernels
# Row loops run on int32 counters that step past the last row before the test ends: by a block
# in the forward (kernel_forward.h:722), by num_splits_key * block_j in the backward
# (kernel_backward.h:1359; num_splits_key <= 32767 but in practice < 2**22 / 128).
_MAX_ROWS = 2**31 - 2**22
_SPLIT_BATCH = "split the batch over several calls"


def _check_kernel_limits(c: _Common, q, k, v):
    """Sizes the kernels cannot address: 32-bit products of shapes (and of the contiguous
    outputs' strides) the runtime would put in ``Params``, CUDA's grid limits, and the
    forward's single-query fast path.  Arithmetic on shapes and strides only."""
    if c.M == 0 or c.N == 0:
        return  # nothing is launched
    rows_q, rows_k = q.shape[1], k.shape[1]  # packed rows (>= the longest sequence with cu_seqlens)
    for field, rows in (("num_queries", rows_q), ("num_keys", rows_k)):
        if rows > _MAX_ROWS:
            raise ValueError(f"{field} = {rows} is too large: the kernels count rows in int32 and step up to "
                             f"2**22 rows past the last one; at most {_MAX_ROWS} rows per call")
    for field, n, what in (("num_heads", c.H, "heads"), ("num_batches", c.batches, "batch")):
        if n > _GRID_YZ_MAX:
            raise ValueError(f"{field} = {n}: the kernels launch one block row per head and per batch element, "
                             f"and CUDA grids allow at most {_GRID_YZ_MAX} in y and z; split the {what}")
    # out, dq, dk, dv are contiguous [rows, H, K or Kv]: their row strides are int32 fields
    # (o_strideM; the backward's gQ/gK/gV_strideM() and o_strideM()) and the backward forms
    # row * stride in int32 (kernel_backward.h:808-814, 1424-1425, 1772, 2111, 2147, 2467).
    for field, rows, stride, name in (("o_strideM", rows_q, c.H * c.Kv, "out"),
                                      ("gQ_strideM", rows_q, c.H * c.K, "dq"),
                                      ("gK_strideM", rows_k, c.H * c.K, "dk"),
                                      ("gV_strideM", rows_k, c.H * c.Kv, "dv")):
        _check_offset(field, f"{name}'s row stride heads * head_dim", 1, stride, _SPLIT_HEADS)
        _check_offset(field, f"{name}'s last row offset (seq - 1) * heads * head_dim", rows - 1, stride,
                      _SPLIT_ROWS)
    if c.seqstart_q is None:  # int64_t(batch_id * num_queries): a uint32 product (kernel_forward.h:283, 286)
        _check_offset("num_batches * num_queries", "the output's last batch offset (batch - 1) * num_queries",
                      c.B - 1, rows_q, _SPLIT_BATCH, _UINT32_MAX)
    # lse: batch_id * lse_dim * num_heads + head_id * lse_dim + query_start, uint32 (kernel_forward.h:315)
    lse_dim = -(-c.M // 32) * 32
    _check_offset("logsumexp_ptr", "the lse offsets batch * heads * lse_dim (largest + 1)", c.batches * c.H,
                  lse_dim, _SPLIT_BATCH, _UINT32_MAX + 1)
    if c.dropout_p > 0:
        _check_dropout_offsets(c)
    _check_head_broadcast(c, q, k, v)


def _check_dropout_offsets(c: _Common):
    """The forward and the backward must draw the same Philox number for every element of P.

    The forward offsets each (batch, head) by batch*H*M*N + head*M*N and each element by
    row*N + col in uint32 (kernel_forward.h:241-243, 948-951); the backward computes H*M*N and
    head*(M*N) in int32 (kernel_backward.h:783-784) and row*N + col in int32 (1702-1704).  Where
    these wrap differently the backward redraws another mask and its gradients are silently wrong;
    refuse such calls unless both are exact."""
    mn, heads, batches = c.M * c.N, c.H, c.batches
    fields = [("head * num_queries * num_keys", (heads - 1) * mn, _INT32_MAX),
              ("row * num_keys + col", mn - 1, _INT32_MAX),
              ("batch * heads * num_queries * num_keys + head * num_queries * num_keys", (batches * heads - 1) * mn,
               _UINT32_MAX)]
    if batches > 1:
        fields.append(("num_heads * num_queries * num_keys", heads * mn, _INT32_MAX))
    for what, value, limit in fields:
        if value > limit:
            raise ValueError(f"dropout_batch_head_rng_offset: with dropout the kernels offset the random stream "
                             f"by {what} = {value}, past {limit}; the forward (uint32) and the backward (int32) "
                             f"would then draw different masks.  Split the batch (one call per batch element, "
                             f"with offset=b * heads * M * N so the masks stay independent), or the heads")


def _check_head_broadcast(c: _Common, q, k, v):
    """k and v both broadcast over heads (head stride 0) turn on a decode fast path in the forward
    kernel for any query block holding a single query (kernel_forward.h:336-352): it iterates
    over heads instead of queries, drops the causal mask and writes lse (and reads a bias, draws
    dropout) for the wrong heads.  Refuse the layouts where that changes a result."""
    if _elem_strides(k)[2] != 0 or _elem_strides(v)[2] != 0 or k.shape[2] != c.H:
        return  # (grouped-query k/v reach example 41 repeated, with real head strides)
    if c.H == 1 and c.mask != _MASKS["top_left"]:
        return  # one head: iterating over heads is iterating over that one query; nothing changes
    # the query tile is 32 or 64 rows: a block holds a single query where a length is 1 mod 32
    if c.seqstart_q is None:
        single = q.shape[1] % 32 == 1
    else:
        single = bool(np.any(np.diff(_cupy().asnumpy(c.seqstart_q)) % 32 == 1))
    if single:
        raise UnsupportedError("k and v are both broadcast over heads (head stride 0) and a query block holds a "
                               "single query (a sequence length of 1 mod 32): the example-41 forward then takes a "
                               "decode fast path that writes lse (and applies a top_left mask, bias and dropout) "
                               "for the wrong heads.  Materialise one of them: v = cupy.ascontiguousarray(v)")


def _check_rng(dropout_p, seed, offset):
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs an explicit seed (and offset): attention_backward must "
                         "redraw the same mask from them")
    for name, value in (("seed", 0 if seed is None else seed), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**64:
            raise ValueError(f"{name} must be an integer in [0, 2**64); got {value!r}")


def _check_window(window):
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


def _check_softcap(softcap) -> float:
    if isinstance(softcap, (bool, str, bytes)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0 for none); got {softcap!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0 for none); got {softcap!r}")
    return float(softcap)


def _band(c: _Common) -> Tuple[int, int, int]:
    """(band_lo, band_hi, band_from_end) of the sm90 kernels' band mask: key j is visible to
    query i iff i + band_lo <= j <= i + band_hi.  The window sits on the causal diagonal
    (top-left unless causal='bottom_right'); a causal mask caps its right side at 0.
    Unbounded sides are +-2**30, which the kernels' block arithmetic stays clear of (M, N <
    2**30).  Packed batches get top-left bounds and band_from_end = 1 under 'bottom_right':
    the kernels move each sequence's band onto its own diagonal (M, N < 2**28 there)."""
    from_end = c.mask == _MASKS["bottom_right"]
    packed = c.seqstart_q is not None
    diagonal = c.N - c.M if from_end and not packed else 0
    left, right = c.window if c.window is not None else (None, None)
    lo = -_UNBOUNDED if left is None else diagonal - left
    hi = _UNBOUNDED if right is None else diagonal + right
    if c.mask:
        hi = min(hi, diagonal)
    return max(lo, -_UNBOUNDED), min(hi, _UNBOUNDED), int(from_end and packed)


def _seqstarts(c: _Common) -> dict:
    """The sm90 kernels' packed-batch fields: the device offsets, or nullptr for fixed length."""
    return {"seqstart_q": c.seqstart_q.data.ptr if c.seqstart_q is not None else 0,
            "seqstart_k": c.seqstart_k.data.ptr if c.seqstart_k is not None else 0}


def _zero_unpacked_rows(c: _Common, *arrays) -> None:
    """Rows past the last sequence of a packed batch belong to no sequence, so no sm90 kernel
    writes them: zeros (arrays given as q-row, then k-row shaped: out or dq, dk, dv)."""
    if c.seqstart_q is None:
        return
    for x, end in zip(arrays, (c.starts_q[-1], c.starts_k[-1], c.starts_k[-1])):
        if end < x.shape[1]:
            x[:, int(end):] = 0


def _softcap_fields(c: _Common) -> dict:
    """The sm90 kernels' soft-capping fields: scores become softcap * tanh(scale * q.k / softcap)."""
    if not c.softcap:
        return {"softcap_in": 0.0, "softcap_out": 0.0}
    return {"softcap_in": c.scale / c.softcap, "softcap_out": c.softcap / c.scale}


def _only_on_sm90(c: _Common, family) -> None:
    """Sliding windows and soft-capping exist only in flashgen's sm90 kernels (``family``'s)."""
    if c.window is not None or c.softcap:
        what = " and ".join(n for n, on in (("window", c.window is not None), ("softcap", c.softcap)) if on)
        raise UnsupportedError(
            f"{what} run only on flashgen's {family.FAMILY} kernels: a compute-capability 9.0 GPU, float16 or "
            f"bfloat16 inputs with 16-byte aligned pointers and strides, equal q/v head dims up to "
            f"{max(family.AXES['max_k'])}, no attn_bias or dropout, and cubins from `flashgen build --arch sm90a`")


def _common(q, k, v, causal, scale, dropout_p, seed, offset, cu_seqlens_q, cu_seqlens_k, *, window=None,
            softcap=0.0) -> _Common:
    """Shape, dtype, device and option checks shared by forward and backward (no GPU work
    unless cu_seqlens must be validated)."""
    _check_bmhk("q", q)
    dtype = _dtype_name(q.dtype)
    if dtype is None:
        raise TypeError(f"q has dtype {q.dtype}; flashgen supports float32, float16 and bfloat16")
    _check_bmhk("k", k, q.dtype, q.device.id)
    _check_bmhk("v", v, q.dtype, q.device.id)
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
    if not (causal is None or isinstance(causal, str) and causal in _MASKS):  # no `in` on unhashables
        raise ValueError(f"causal must be None, 'top_left' or 'bottom_right'; got {causal!r}")
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    _check_rng(dropout_p, seed, offset)
    scale = 1.0 / math.sqrt(K) if scale is None else _check_scale(scale)
    window, softcap = _check_window(window), _check_softcap(softcap)
    seqstart_q = seqstart_k = starts_q = starts_k = None
    batches = B
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along dim 1 of a batch of 1; got batch {B}")
        cu_q, starts_q = _read_offsets(cu_seqlens_q, "cu_seqlens_q", M)
        cu_k, starts_k = _read_offsets(cu_seqlens_k, "cu_seqlens_k", N)
        if starts_q.size != starts_k.size:
            raise ValueError(f"cu_seqlens_q has {starts_q.size} entries, cu_seqlens_k {starts_k.size}")
        seqstart_q = _offsets_on_device(cu_q, starts_q, q.device.id)
        seqstart_k = _offsets_on_device(cu_k, starts_k, q.device.id)
        batches = starts_q.size - 1
        M, N = int(np.diff(starts_q).max()), int(np.diff(starts_k).max())
    c = _Common(B, M, H=H, N=N, K=K, Kv=Kv, dtype=dtype, device=q.device.id, mask=_MASKS[causal],
                scale=scale, dropout_p=float(dropout_p), seed=int(seed or 0), offset=int(offset),
                seqstart_q=seqstart_q, seqstart_k=seqstart_k, batches=batches,
                starts_q=starts_q, starts_k=starts_k, window=window, softcap=softcap)
    _check_kernel_limits(c, q, k, v)
    return c


def _bias(cupy, attn_bias, c: _Common, q, rows: int, cols: int):
    """The bias as [B, H, M, N] (broadcast dims get stride 0), with an aligned row stride."""
    if attn_bias is None:
        return None
    if c.seqstart_q is not None:
        raise UnsupportedError("attn_bias with cu_seqlens is not supported by the example-41 kernels")
    b = as_array(attn_bias, "attn_bias")
    if b.dtype != q.dtype:
        raise TypeError(f"attn_bias has dtype {b.dtype}, expected {q.dtype} like q")
    if b.device.id != c.device:
        raise ValueError(f"attn_bias is on GPU {b.device.id}, q is on GPU {c.device}")
    try:
        b = cupy.broadcast_to(b, (c.B, c.H, rows, cols))
    except ValueError:
        raise ValueError(f"attn_bias of shape {tuple(attn_bias.shape)} does not broadcast to "
                         f"[batch, heads, M, N] = {(c.B, c.H, rows, cols)}") from None
    if (cols > 1 and b.strides[3] != b.itemsize) or any(st % 8 for st in _elem_strides(b)[:3]) or b.data.ptr % 16:
        # the kernels read bias rows with 16-byte loads: copy into rows padded to 8 elements
        padded = cupy.zeros((c.B, c.H, rows, -(-cols // 8) * 8), dtype=b.dtype)
        padded[..., :cols] = b
        b = padded[..., :cols]
    # row * bias_strideM: uint32 in the forward (kernel_forward.h:828), int32 in the backward (1605)
    _check_offset("bias_strideM", "attn_bias's last row offset (M - 1) * row stride", rows - 1,
                  _elem_strides(b)[2], _SPLIT_ROWS)
    return b


def _tuned(req: Request, c: _Common) -> Optional[tuning.Choice]:
    """The tuning table's choice for this call's shape bucket on this device, if any."""
    bucket = tuning.Bucket.of(req.family, c.dtype, c.K, c.Kv, c.mask != 0, c.M, c.N, c.batches * c.H)
    return tuning.choice(req.device, bucket)


def _launch(registry, binary: KernelBinary, device: int, grid, block, params, stream, entry: str = ""):
    """Launch with ``Params`` passed by value.  CuPy is handed the record's bytes as one opaque
    void item: describing the 60-field structured dtype on every launch cost ~50 us.  ``entry``
    names a helper kernel of the instance (no dynamic shared memory)."""
    fn = registry.function(binary, device, entry)
    raw = params.view(np.dtype((np.void, params.dtype.itemsize)))
    fn(grid, block, (raw,), shared_mem=0 if entry else binary.constants["shared_memory_bytes"], stream=stream)


def _find_plan(cupy, direction: str, arrays, options: tuple):
    """(key, plan) of a call (see plans.py): the plan made for its key, or None; the key is None
    when the call cannot be planned (an input that is not a CuPy array, an unhashable option)."""
    signature = plans.signature(arrays, cupy.ndarray)
    if signature is None:
        return None, None
    key = (direction, signature, options, tuple(map(type, options)))  # 1 and True hash alike, validate apart
    try:
        return key, plans.lookup(key)
    except TypeError:
        return None, None


def _handle(registry: Registry, binary: KernelBinary, device: int, entry: str = "") -> int:
    """The CUfunction behind the registry's CuPy kernel on ``device`` (for plans.LaunchPlan)."""
    fn = registry.function(binary, device, entry)
    with _cupy().cuda.Device(device):
        return getattr(fn, "kernel", fn).ptr  # RawKernel.kernel: its Function on the current device


def _stream_handle(cupy, stream) -> int:
    """The CUDA stream a call launches on: the one given, else CuPy's current stream."""
    return (stream if stream is not None else cupy.cuda.get_current_stream()).ptr


def _on_device(cupy, device: int):
    """A context that makes ``device`` current (a no-op when it already is)."""
    return _NO_SWITCH if cupy.cuda.runtime.getDevice() == device else cupy.cuda.Device(device)


_NO_SWITCH = contextlib.nullcontext()  # stateless, so one instance serves every call


def _params_buffer(cls):
    """A per-thread Params buffer, so a call allocates nothing on the host after warm-up."""
    buf = getattr(_params, cls.FAMILY, None)
    if buf is None:
        dtype = cls.params_dtype()
        buf = tensormap.aligned_buffer(dtype.itemsize).view(dtype)  # tensor maps need 64-byte alignment
        setattr(_params, cls.FAMILY, buf)
    return buf


def _fill(buf, **fields):
    """Set every Params field in one assignment (fields not named are 0); one record
    assignment costs a few microseconds where sixty field writes cost ~60."""
    names = buf.dtype.names
    unknown = fields.keys() - set(names)
    if unknown:
        raise AssertionError(f"not Params fields: {sorted(unknown)}")  # a bug in this module, not the caller's
    zero = _zero_record(buf.dtype)
    buf[0] = tuple(fields[name] if name in fields else zero[name] for name in names)


_zero_records = {}


def _zero_record(dtype):
    """An all-zero record of ``dtype`` (its void fields, the tensor maps, need bytes, not 0)."""
    zero = _zero_records.get(dtype)
    if zero is None:
        zero = _zero_records[dtype] = np.zeros(1, dtype=dtype)[0]
    return zero


def _varlen_lengths(c: _Common):
    """The packed query offsets and the per-sequence query and key lengths, from the host
    copies validation made (no further device reads)."""
    return c.starts_q, np.diff(c.starts_q), np.diff(c.starts_k)


def _check_varlen_bottom_right(c: _Common) -> None:
    if c.seqstart_q is None or c.mask != _MASKS["bottom_right"]:
        return
    _, q_lens, k_lens = _varlen_lengths(c)
    tall = np.nonzero(q_lens > k_lens)[0]
    if tall.size:
        raise UnsupportedError(f"causal='bottom_right' with cu_seqlens needs every sequence to have at least as "
                               f"many keys as queries; sequence {int(tall[0])} has {int(q_lens[tall[0]])} queries "
                               f"and {int(k_lens[tall[0]])} keys (the kernels keep that offset unsigned)")


_LSE_ROW_BLOCK = 128  # the largest backward block I: the kernel reads lse a whole row block at a time


def _padded_lse(lse, batches: int, heads: int, rows: int, seq_rows=None):
    """lse as the backward reads it: every row block complete, +inf past each sequence's last query
    (``seq_rows``: each packed sequence's query count with cu_seqlens, else None).

    The kernel loads lse for all rows of a block and relies on exp(s - inf) = 0 for rows that
    do not exist; the forward pads only to 32 rows, so a 64- or 128-row block would read past
    its (batch, head) row, past the buffer for the last one (compute-sanitizer: invalid reads,
    NaN gradients).  A copy of B*H*M floats costs nothing next to the backward itself.
    """
    cupy = _cupy()
    padded = cupy.full((batches, heads, -(-max(rows, 1) // _LSE_ROW_BLOCK) * _LSE_ROW_BLOCK), np.inf,
                       dtype=cupy.float32)
    if seq_rows is None:
        padded[:, :, :rows] = lse[:, :, :rows]
    else:  # rows past a sequence's own length were never written by the forward
        for seq, n in enumerate(seq_rows):
            padded[seq, :, :n] = lse[seq, :, :n]
    return padded


def _rows_without_keys(c: _Common, q, k) -> int:
    """With bottom-right causal masking and more queries than keys, the first M - N queries see
    no key at all.  The kernels keep the diagonal offset N - M in an unsigned field and get
    those rows wrong, so the runtime runs them on the last N rows (a square problem) and
    fills the others itself: output 0, lse -inf (a softmax over nothing), no gradient."""
    if c.mask == _MASKS["bottom_right"] and c.seqstart_q is None and q.shape[1] > k.shape[1]:
        return q.shape[1] - k.shape[1]
    return 0


def attention_forward(q, k, v, *, attn_bias=None, causal=None, scale=None, dropout_p=0.0, seed=None, offset=0,
                      cu_seqlens_q=None, cu_seqlens_k=None, window=None, softcap=0.0, stream=None,
                      registry: Optional[Registry] = None):
    """Fused attention forward: returns ``(out [B, M, H, Kv], lse [B, H, M] float32)``.

    ``causal``: None, "top_left" (query i sees keys <= i) or "bottom_right"
    (the diagonal ends at the last key).  With ``cu_seqlens_q/k`` (int32,
    [S+1] offsets) the batch is S packed sequences in dim 1 of a batch of 1;
    ``lse`` is then [S, H, max_seqlen_q].  ``dropout_p > 0`` needs ``seed``;
    pass the same ``seed``/``offset`` to the backward.
    ``window=(left, right)``: a sliding window -- query i sees keys i + d - left
    .. i + d + right (None: no limit on that side), d = N - M with
    causal="bottom_right", else 0; with a causal mask as well, right is 0.
    ``softcap > 0``: scores become softcap * tanh(scale * q.k / softcap).
    Both run on flashgen's sm90 kernels only (9.0 GPUs; else UnsupportedError).
    """
    cupy = _cupy()
    registry = registry or default_registry()
    key = None
    if attn_bias is None and cu_seqlens_q is None and cu_seqlens_k is None:
        key, plan = _find_plan(cupy, "fwd", (q, k, v), (causal, scale, dropout_p, window, softcap, registry))
        if plan is not None:
            if dropout_p or seed is not None or offset:
                _check_rng(dropout_p, seed, offset)
            return _forward_planned(cupy, plan, q, k, v, seed, offset, stream)
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    c = _common(q, k, v, causal, scale, dropout_p, seed, offset, cu_seqlens_q, cu_seqlens_k, window=window,
                softcap=softcap)
    bias = _bias(cupy, attn_bias, c, q, q.shape[1], k.shape[1])
    _check_varlen_bottom_right(c)
    skip = _rows_without_keys(c, q, k)
    if skip:
        part_out, part_lse = attention_forward(
            q[:, skip:], k, v, attn_bias=None if bias is None else bias[:, :, skip:], causal=causal, scale=c.scale,
            dropout_p=dropout_p, seed=seed, offset=offset, window=window, softcap=softcap, stream=stream,
            registry=registry)
    with cupy.cuda.Device(c.device):
        lse_rows = -(-c.M // 32) * 32
        if skip:
            out = cupy.zeros((c.B, c.M, c.H, c.Kv), dtype=q.dtype)
            out[:, skip:] = part_out
            lse = cupy.full((c.B, c.H, lse_rows), -np.inf, dtype=cupy.float32)
            lse[:, :, skip:c.M] = part_lse
            lse[:, :, c.M:] = np.inf  # padding, as the kernels write it
            return out, lse[:, :, :c.M]
        out = cupy.empty((q.shape[0], q.shape[1], c.H, c.Kv), dtype=q.dtype)
        lse = cupy.empty((c.batches, c.H, lse_rows), dtype=cupy.float32)
        if c.M == 0 or c.N == 0 or q.shape[1] == 0:
            out.fill(0)
            lse.fill(-np.inf)  # softmax over no keys: empty sum
            return out, lse[:, :, :c.M]
        hopper = _sm90_request(c, q, k, v, bias)
        binary = _selector(registry).find(hopper, _tuned(hopper, c)) if hopper is not None else None
        if binary is not None:
            _forward_sm90(registry, binary, c, q, k, v, out, lse, stream, key)
            return out, lse[:, :, :c.M]
        _only_on_sm90(c, Sm90Fwd)
        if k.shape[2] != c.H:  # grouped-query attention: the example-41 kernels need one k/v head per q head
            k, v = _repeat_heads(k, c.H), _repeat_heads(v, c.H)
            key = None  # a per-call copy: not a plan
        arrays = [q, k, v] + ([bias] if bias is not None else [])
        req = Request("mem_eff_fwd", c.dtype, c.K, c.Kv, _alignment(arrays, (c.K, c.Kv)), c.dropout_p > 0,
                      bias is not None, device_info(c.device))
        binary = _selector(registry).select(req, _tuned(req, c))
        k_const = binary.constants
        accum = None
        if k_const["needs_output_accum_buffer"]:
            accum = cupy.empty((q.shape[0], q.shape[1], c.H, c.Kv), dtype=cupy.float32)
        qs, ks, vs = _elem_strides(q), _elem_strides(k), _elem_strides(v)
        bs = _elem_strides(bias) if bias is not None else (0, 0, 0, 0)
        _check_int32(q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], q_strideH=qs[2], k_strideH=ks[2],
                     v_strideH=vs[2], bias_strideM=bs[2], o_strideM=c.H * c.Kv, num_queries=q.shape[1],
                     num_keys=k.shape[1])
        p = _params_buffer(MemEffFwd)
        _fill(p, query_ptr=q.data.ptr, key_ptr=k.data.ptr, value_ptr=v.data.ptr,
              attn_bias_ptr=bias.data.ptr if bias is not None else 0,
              seqstart_q_ptr=c.seqstart_q.data.ptr if c.seqstart_q is not None else 0,
              seqstart_k_ptr=c.seqstart_k.data.ptr if c.seqstart_k is not None else 0,
              output_ptr=out.data.ptr, output_accum_ptr=accum.data.ptr if accum is not None else 0,
              logsumexp_ptr=lse.data.ptr, scale=c.scale, head_dim=c.K, head_dim_value=c.Kv,
              num_queries=c.M, num_keys=c.N, num_keys_absolute=c.N, custom_mask_type=c.mask,
              q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], bias_strideM=bs[2], o_strideM=c.H * c.Kv,
              q_strideH=qs[2], k_strideH=ks[2], v_strideH=vs[2], bias_strideH=bs[1],
              q_strideB=qs[0], k_strideB=ks[0], v_strideB=vs[0], bias_strideB=bs[0],
              num_batches=c.batches, num_heads=c.H, use_dropout=c.dropout_p > 0, dropout_prob=c.dropout_p,
              rng_engine_inputs_seed=c.seed, rng_engine_inputs_offset=c.offset)
        grid = (-(-c.M // k_const["queries_per_block"]), c.H, c.batches)
        block = (32, k_const["warps_per_block"], 1)
        _launch(registry, binary, c.device, grid, block, p, stream)
        if key is not None and c.seqstart_q is None:
            plans.remember(key, plans.LaunchPlan.from_params(
                _handle(registry, binary, c.device), c.device, grid, block, k_const["shared_memory_bytes"], p,
                ("query_ptr", "key_ptr", "value_ptr", "output_ptr", "output_accum_ptr", "logsumexp_ptr"),
                c.dropout_p > 0, {"out": out.shape, "lse": lse.shape, "accum": accum is not None, "M": c.M}))
        if c.seqstart_q is not None:  # a sequence with queries but no keys: 0/0 in the kernel
            starts, q_lens, k_lens = _varlen_lengths(c)
            for seq in np.nonzero((q_lens > 0) & (k_lens == 0))[0]:
                out[0, starts[seq]:starts[seq + 1]] = 0
                lse[seq, :, :q_lens[seq]] = -np.inf
    return out, lse[:, :, :c.M]


def _repeat_heads(x, heads: int):
    """[B, S, Hk, D] -> [B, S, heads, D], each k/v head repeated for its group of q heads."""
    return _cupy().repeat(x, heads // x.shape[2], axis=2)


def _sum_groups(grad, heads_kv: int):
    """The gradient of ``_repeat_heads``: [B, S, H, D] summed over each group -> [B, S, heads_kv, D]."""
    B, S, H, D = grad.shape
    cupy = _cupy()
    return cupy.ascontiguousarray(grad.reshape(B, S, heads_kv, H // heads_kv, D).astype(cupy.float32).sum(axis=3)
                                  .astype(grad.dtype))


def _sm90_request(c: _Common, q, k, v, bias, family: str = Sm90Fwd.FAMILY, more=()) -> Optional[Request]:
    """The request for one of flashgen's Hopper families, or None when the call needs what only
    the example-41 kernels have (bias, dropout, float32, different q/v head dims, strides the
    TMA engine cannot describe; ``more``: other arrays with the same needs) or the GPU is not
    a 9.0 one."""
    if bias is not None or c.dropout_p > 0 or c.dtype == "f32" or c.K != c.Kv:
        return None
    limit = _UNBOUNDED if c.seqstart_q is None else _PACKED_ROWS_LIMIT  # the band arithmetic's range (_band)
    if max(q.shape[1], k.shape[1]) >= limit:
        return None
    info = device_info(c.device)
    arrays = (q, k, v) + tuple(more)
    if info.cc != 90 or any(tensormap.bmhk_problem(x) for x in arrays):
        return None
    return Request(family, c.dtype, c.K, c.Kv, _alignment(arrays, (c.K, c.Kv)), False, False, info,
                   band=c.mask != 0 or c.window is not None, softcap=c.softcap > 0)


def _forward_sm90(registry, binary: KernelBinary, c: _Common, q, k, v, out, lse, stream, key):
    """Launch an sm90_fwd kernel: Params with three TMA tensor maps (see spec/sm90_fwd.py)."""
    kc = binary.constants
    lse_rows = lse.shape[2]
    _check_int32(lse_stride_b=c.H * lse_rows)
    band_lo, band_hi, band_from_end = _band(c)
    p = _params_buffer(Sm90Fwd)
    _fill(p, out_ptr=out.data.ptr, lse_ptr=lse.data.ptr, out_stride_b=out.shape[1] * c.H * c.Kv,
          out_stride_m=c.H * c.Kv, out_stride_h=c.Kv, lse_stride_b=c.H * lse_rows, lse_stride_h=lse_rows,
          lse_rows=lse_rows, **_seqstarts(c), num_queries=c.M, num_keys=c.N, head_dim=c.K,
          head_group=c.H // k.shape[2], band_lo=band_lo, band_hi=band_hi, band_from_end=band_from_end,
          scale_log2=c.scale * math.log2(math.e), **_softcap_fields(c))
    raw = p.view(np.uint8)
    maps = ("q_map", "k_map", "v_map")
    for name, x, rows in zip(maps, (q, k, v), (kc["block_m"], kc["block_n"], kc["block_n"])):
        at = p.dtype.fields[name][1]
        tensormap.encode_bmhk(raw[at:at + tensormap.TENSOR_MAP_BYTES], x, c.dtype, kc["box_cols"], rows,
                              kc["swizzle_bytes"])
    grid, block = (-(-c.M // kc["block_m"]), c.H, c.batches), (kc["threads_per_block"], 1, 1)
    _launch(registry, binary, c.device, grid, block, p, stream)
    _zero_unpacked_rows(c, out)
    if key is not None:
        plans.remember(key, plans.LaunchPlan.from_params(
            _handle(registry, binary, c.device), c.device, grid, block, kc["shared_memory_bytes"], p,
            ("out_ptr", "lse_ptr"), False, {"out": out.shape, "lse": lse.shape, "M": c.M, "tma": True},
            tensor_maps=maps))


def _forward_planned(cupy, plan: plans.LaunchPlan, q, k, v, seed, offset, stream):
    """A forward whose signature was seen before: allocate, point, launch (see plans.py)."""
    sizes = plan.sizes
    with _on_device(cupy, plan.device):
        out = cupy.empty(sizes["out"], dtype=q.dtype)
        lse = cupy.empty(sizes["lse"], dtype=cupy.float32)
        if sizes.get("tma"):
            plan.launch((q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr), 0, 0,
                        _stream_handle(cupy, stream))
            return out, (lse if sizes["lse"][2] == sizes["M"] else lse[:, :, :sizes["M"]])
        accum = cupy.empty(sizes["out"], dtype=cupy.float32) if sizes["accum"] else None
        plan.launch((q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, accum.data.ptr if accum is not None else 0,
                     lse.data.ptr), seed or 0, offset, _stream_handle(cupy, stream))
    return out, (lse if sizes["lse"][2] == sizes["M"] else lse[:, :, :sizes["M"]])


def attention_backward(grad_out, q, k, v, out, lse, *, attn_bias=None, bias_requires_grad=False, causal=None,
                       scale=None, dropout_p=0.0, seed=None, offset=0, cu_seqlens_q=None, cu_seqlens_k=None,
                       window=None, softcap=0.0, deterministic=False, stream=None,
                       registry: Optional[Registry] = None):
    """Gradients of ``attention_forward``: returns ``(dq, dk, dv)``, plus ``dbias`` when
    ``bias_requires_grad`` (full [B, H, M, N]; sum over broadcast dims yourself).

    ``out`` and ``lse`` are what the forward returned for the same inputs and
    options (same ``seed``/``offset`` when dropout is on, same ``window`` and ``softcap``).  From the second
    call with the same shapes, strides and options on, dq, dk and dv are
    contiguous arrays carved from one allocation (freed once all three are).
    ``deterministic=True``: dq adds up in a fixed order, so repeated calls give the same bits
    (the example-41 kernels then run without key splits).
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    cupy = _cupy()
    registry = registry or default_registry()
    key = None
    if attn_bias is None and not bias_requires_grad and cu_seqlens_q is None and cu_seqlens_k is None:
        key, plan = _find_plan(cupy, "bwd", (grad_out, q, k, v, out, lse),
                               (causal, scale, dropout_p, window, softcap, deterministic, registry))
        if plan is not None:
            if dropout_p or seed is not None or offset:
                _check_rng(dropout_p, seed, offset)
            if plan.sizes.get("sm90"):
                return _backward_sm90_planned(cupy, plan, grad_out, q, k, v, out, lse, stream)
            return _backward_planned(cupy, plan, grad_out, q, k, v, out, lse, seed, offset, stream)
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    grad_out, out, lse = as_array(grad_out, "grad_out"), as_array(out, "out"), as_array(lse, "lse")
    c = _common(q, k, v, causal, scale, dropout_p, seed, offset, cu_seqlens_q, cu_seqlens_k, window=window,
                softcap=softcap)
    out_shape = (q.shape[0], q.shape[1], c.H, c.Kv)
    for name, x in (("out", out), ("grad_out", grad_out)):
        _check_bmhk(name, x, q.dtype, c.device)
        if tuple(x.shape) != out_shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {out_shape} ([B, M, H, Kv])")
    if lse.dtype != cupy.float32:
        raise TypeError(f"lse must be float32 (as attention_forward returns it); got {lse.dtype}")
    if lse.ndim != 3 or tuple(lse.shape[:2]) != (c.batches, c.H) or lse.shape[2] < c.M:
        raise ValueError(f"lse has shape {tuple(lse.shape)}; expected [{c.batches}, {c.H}, {c.M}] "
                         "as attention_forward returns it")
    if lse.device.id != c.device:
        raise ValueError(f"lse is on GPU {lse.device.id}, q is on GPU {c.device}")
    if attn_bias is None and bias_requires_grad:
        raise ValueError("bias_requires_grad=True without attn_bias")
    bias = _bias(cupy, attn_bias, c, q, q.shape[1], k.shape[1])
    _check_varlen_bottom_right(c)
    hopper = _sm90_request(c, q, k, v, bias, Sm90Bwd.FAMILY, (out, grad_out))
    binary = _selector(registry).find(hopper, _tuned(hopper, c)) if hopper is not None else None
    if binary is not None and c.M and c.N:
        return _backward_sm90(registry, binary, c, grad_out, q, k, v, out, lse, deterministic, stream, key)
    if c.M and c.N:  # an empty problem has nothing to mask: its gradients are the zeros below
        _only_on_sm90(c, Sm90Bwd)
    if k.shape[2] != c.H:  # grouped-query attention: gradients of the repeated k/v, summed per group
        with cupy.cuda.Device(c.device):
            grads = attention_backward(
                grad_out, q, _repeat_heads(k, c.H), _repeat_heads(v, c.H), out, lse, attn_bias=attn_bias,
                bias_requires_grad=bias_requires_grad, causal=causal, scale=c.scale, dropout_p=dropout_p, seed=seed,
                offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, deterministic=deterministic,
                stream=stream, registry=registry)
            return (grads[0], _sum_groups(grads[1], k.shape[2]), _sum_groups(grads[2], k.shape[2])) + tuple(grads[3:])
    if c.dtype != "f32" and (c.K % 8 or c.Kv % 8) and c.M and c.N:
        # The f16/bf16 backward writes dQ/dK/dV rows in 16-byte pieces whatever its alignment
        # (compute-sanitizer: misaligned stores for head dims that are not multiples of 8), so
        # such head dims run zero-padded to the next multiple of 8 and the result is sliced.
        with cupy.cuda.Device(c.device):
            pad = lambda x, n: cupy.pad(x, ((0, 0), (0, 0), (0, 0), (0, -(-n // 8) * 8 - n)))  # noqa: E731
            grads = attention_backward(
                pad(grad_out, c.Kv), pad(q, c.K), pad(k, c.K), pad(v, c.Kv), pad(out, c.Kv), lse,
                attn_bias=attn_bias, bias_requires_grad=bias_requires_grad, causal=causal, scale=c.scale,
                dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                deterministic=deterministic, stream=stream, registry=registry)
        return (grads[0][..., :c.K], grads[1][..., :c.K], grads[2][..., :c.Kv]) + tuple(grads[3:])
    skip = _rows_without_keys(c, q, k)
    if skip:  # see _rows_without_keys: the first `skip` queries see no key and get no gradient
        with cupy.cuda.Device(c.device):
            part_lse = cupy.ascontiguousarray(lse[:, :, skip:c.M])
        part = attention_backward(
            grad_out[:, skip:], q[:, skip:], k, v, out[:, skip:], part_lse,
            attn_bias=None if bias is None else bias[:, :, skip:], bias_requires_grad=bias_requires_grad,
            causal=causal, scale=c.scale, dropout_p=dropout_p, seed=seed, offset=offset, deterministic=deterministic,
            stream=stream, registry=registry)
        with cupy.cuda.Device(c.device):
            dq = cupy.zeros((c.B, c.M, c.H, c.K), dtype=q.dtype)
            dq[:, skip:] = part[0]
            if not bias_requires_grad:
                return dq, part[1], part[2]
            dbias = cupy.zeros((c.B, c.H, c.M, c.N), dtype=q.dtype)
            dbias[:, :, skip:] = part[3]
            return dq, part[1], part[2], dbias
    with cupy.cuda.Device(c.device):
        # varlen: the kernel never visits the queries of a sequence without keys; their dq is 0
        dq = (cupy.zeros_like if c.seqstart_q is not None else cupy.empty_like)(q, order="C")
        dk, dv = cupy.empty_like(k, order="C"), cupy.empty_like(v, order="C")
        cols = -(-k.shape[1] // 8) * 8
        # zeros: with a causal mask the kernel skips key blocks no query sees and never writes their dbias
        dbias_full = (cupy.zeros((c.B, c.H, q.shape[1], cols), dtype=q.dtype) if bias_requires_grad else None)
        dbias = dbias_full[..., :k.shape[1]] if dbias_full is not None else None
        grads = (dq, dk, dv) + ((dbias,) if bias_requires_grad else ())
        if c.M == 0 or c.N == 0 or q.shape[1] == 0 or k.shape[1] == 0:
            for g in grads:
                g.fill(0)
            return grads
        if _elem_strides(out)[1:] != (c.H * c.Kv, c.Kv, 1):
            out = cupy.ascontiguousarray(out)  # the kernel derives out's row stride from H * Kv
            key = None  # a per-call copy: not a plan
        if tensormap.bmhk_problem(out) or tensormap.bmhk_problem(grad_out):
            # Even the unaligned kernels read out and grad_out 16 bytes at a time (compute-sanitizer:
            # misaligned 16-byte reads, then a fault): such inputs (those a TMA tensor map could not
            # describe either) run from fresh, aligned copies.
            out, grad_out = (x.copy() if tensormap.bmhk_problem(x) else x for x in (out, grad_out))
            key = None
        arrays = [q, k, v, out, grad_out] + ([bias] if bias is not None else [])
        req = Request("mem_eff_bwd", c.dtype, c.K, c.Kv, _alignment(arrays, (c.K, c.Kv)), c.dropout_p > 0,
                      bias is not None, device_info(c.device), seq_multiples(c.M, c.N, c.seqstart_q is not None))
        prefer = _tuned(req, c)
        binary = _selector(registry).select(req, prefer)
        split_policy = prefer.splits if prefer is not None and prefer.matches(binary.spec) else "auto"
        if deterministic:  # split keys meet in the workspace in no fixed order
            split_policy = "one"
        kc = binary.constants
        # lse is read a row block at a time: whole blocks of a unit-stride lse need no copy
        pad_lse = c.seqstart_q is not None or c.M % kc["block_i"] or (c.M > 1 and lse.strides[2] != 4)
        if pad_lse:
            lse = _padded_lse(lse, c.batches, c.H, c.M,
                              None if c.seqstart_q is None else _varlen_lengths(c)[1])
        if c.seqstart_q is not None:  # the kernel indexes delta as [H, total_q]
            total_q = q.shape[1]
            delta = cupy.empty((c.H, total_q), dtype=cupy.float32)
            delta_strides = (0, total_q)
        else:
            delta = cupy.empty((c.B, c.H, c.M), dtype=cupy.float32)
            delta_strides = (c.H * c.M, c.M)
        if not kc["kernel_computes_delta"]:
            _delta(grad_out, out, delta)
        splits = num_splits_key(binary, c.batches, c.H, c.N, device_info(c.device), c.K, c.Kv, split_policy)
        ws_bytes = workspace_bytes(binary, c.batches, c.H, c.M, c.N, c.K, c.Kv, splits)
        workspace = None
        if ws_bytes:
            workspace = (cupy.zeros if splits > 1 else cupy.empty)(ws_bytes // 4, dtype=cupy.float32)
        qs, ks, vs, os_ = _elem_strides(q), _elem_strides(k), _elem_strides(v), _elem_strides(out)
        gos, ls = _elem_strides(grad_out), _elem_strides(lse)
        bs = _elem_strides(bias) if bias is not None else (0, 0, 0, 0)
        gbs = _elem_strides(dbias_full) if dbias_full is not None else (0, 0, 0, 0)
        _check_int32(q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], q_strideH=qs[2], k_strideH=ks[2],
                     v_strideH=vs[2], gO_strideM=gos[1], bias_strideM=bs[2], gB_strideM=gbs[2],
                     num_queries=q.shape[1], num_keys=k.shape[1])
        p = _params_buffer(MemEffBwd)
        _fill(p, query_ptr=q.data.ptr, key_ptr=k.data.ptr, value_ptr=v.data.ptr,
              bias_ptr=bias.data.ptr if bias is not None else 0, logsumexp_ptr=lse.data.ptr,
              output_ptr=out.data.ptr, grad_output_ptr=grad_out.data.ptr, delta_ptr=delta.data.ptr,
              cu_seqlens_q_ptr=c.seqstart_q.data.ptr if c.seqstart_q is not None else 0,
              cu_seqlens_k_ptr=c.seqstart_k.data.ptr if c.seqstart_k is not None else 0,
              grad_query_ptr=dq.data.ptr, grad_key_ptr=dk.data.ptr, grad_value_ptr=dv.data.ptr,
              grad_bias_ptr=dbias_full.data.ptr if dbias_full is not None else 0,
              workspace=workspace.data.ptr if workspace is not None else 0,
              scale=c.scale, head_dim=c.K, head_dim_value=c.Kv, num_queries=c.M, num_keys=c.N, num_heads=c.H,
              custom_mask_type=c.mask, q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], bias_strideM=bs[2],
              gO_strideM=gos[1], gB_strideM=gbs[2], gQKV_strideM_multiplier=1,
              rng_engine_inputs_seed=c.seed, rng_engine_inputs_offset=c.offset, dropout_prob=c.dropout_p,
              o_strideH=os_[2], q_strideH=qs[2], k_strideH=ks[2], v_strideH=vs[2], bias_strideH=bs[1],
              o_strideB=os_[0], q_strideB=qs[0], k_strideB=ks[0], v_strideB=vs[0], bias_strideB=bs[0],
              lse_strideB=ls[0], lse_strideH=ls[1], delta_strideB=delta_strides[0], delta_strideH=delta_strides[1],
              num_batches=c.batches, num_splits_key=splits,
              gO_strideB=gos[0], gQ_strideB=_elem_strides(dq)[0], gK_strideB=_elem_strides(dk)[0],
              gV_strideB=_elem_strides(dv)[0], gB_strideB=gbs[0], gO_strideH=gos[2], gQ_strideH=c.K,
              gK_strideH=c.K, gV_strideH=c.Kv, gB_strideH=gbs[1])
        grid, block = (splits, c.H, c.batches), (kc["threads_per_block"], 1, 1)
        _launch(registry, binary, c.device, grid, block, p, stream)
        if key is not None:
            plans.remember(key, plans.LaunchPlan.from_params(
                _handle(registry, binary, c.device), c.device, grid, block, kc["shared_memory_bytes"], p,
                ("query_ptr", "key_ptr", "value_ptr", "logsumexp_ptr", "output_ptr", "grad_output_ptr", "delta_ptr",
                 "grad_query_ptr", "grad_key_ptr", "grad_value_ptr", "workspace"),
                c.dropout_p > 0, {"delta": delta.shape, "delta_in_kernel": bool(kc["kernel_computes_delta"]),
                                  "offsets": _packed_offsets(dq.nbytes, dk.nbytes, dv.nbytes, delta.nbytes, ws_bytes),
                                  "workspace_bytes": ws_bytes, "zero_workspace": splits > 1,
                                  "pad_lse": (c.batches, c.H, c.M) if pad_lse else None}))
    return grads


def _delta(grad_out, out, delta):
    """delta = rowsum(dO * O) as [B, H, M], for the kernels that do not compute it themselves."""
    cupy = _cupy()
    rowsum = (grad_out.astype(cupy.float32) * out.astype(cupy.float32)).sum(axis=-1)  # [B, M, H]
    delta[...] = rowsum.transpose(0, 2, 1).reshape(delta.shape)


def _packed_offsets(*sizes: int) -> tuple:
    """Byte offsets of consecutive buffers (each 256-byte aligned) after the first, and the total."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // 256) * 256
    return tuple(offsets[1:]) + (end,)


def _backward_planned(cupy, plan: plans.LaunchPlan, grad_out, q, k, v, out, lse, seed, offset, stream):
    """A backward whose signature was seen before: allocate, point, launch (see plans.py)."""
    sizes = plan.sizes
    with _on_device(cupy, plan.device):
        if sizes["pad_lse"] is not None:
            lse = _padded_lse(lse, *sizes["pad_lse"])
        # dq, dk, dv, delta and the workspace in one allocation: four pool calls fewer per step
        # (the gradients keep it alive together; each is still its own contiguous array)
        at_dk, at_dv, at_delta, at_workspace, total = sizes["offsets"]
        memory = cupy.empty(total, dtype=cupy.uint8).data
        dq = cupy.ndarray(q.shape, q.dtype, memory)
        dk = cupy.ndarray(k.shape, k.dtype, memory + at_dk)
        dv = cupy.ndarray(v.shape, v.dtype, memory + at_dv)
        delta_ptr = memory.ptr + at_delta
        workspace_ptr = memory.ptr + at_workspace if sizes["workspace_bytes"] else 0
        if not sizes["delta_in_kernel"]:
            _delta(grad_out, out, cupy.ndarray(sizes["delta"], cupy.float32, memory + at_delta))
        stream_handle = _stream_handle(cupy, stream)
        if sizes["zero_workspace"]:
            cupy.cuda.runtime.memsetAsync(workspace_ptr, 0, sizes["workspace_bytes"], stream_handle)
        plan.launch((q.data.ptr, k.data.ptr, v.data.ptr, lse.data.ptr, out.data.ptr, grad_out.data.ptr,
                     delta_ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, workspace_ptr), seed or 0, offset,
                    stream_handle)
    return dq, dk, dv


_SM90_BWD_MAPS = ("q_map", "k_map", "v_map", "do_map")
# per-call pointers after the four tensor maps' (q, k, v, grad_out), in Params order
_SM90_BWD_POINTERS = ("out_ptr", "dout_ptr", "lse_ptr", "lse_log2_ptr", "delta_ptr", "dq_accum_ptr",
                      "dq_counter_ptr", "dq_ptr", "dk_ptr", "dv_ptr")


def _sm90_bwd_layout(kc, c: _Common, q, k):
    """(rows_padded, byte offsets of dk, dv, lse_log2, delta, dq accumulator, counters, total) of
    one allocation holding an sm90_bwd call's outputs and workspace (spec/sm90_bwd.py)."""
    block_m = kc["block_m"]
    if c.seqstart_q is None:
        rows = -(-c.M // block_m) * block_m
    else:  # every sequence's rows start on a block boundary past the blocks of the ones before
        rows = (q.shape[1] + c.batches * block_m) // block_m * block_m
    heads_rows = c.B * c.H * rows
    dq_bytes = q.size * q.itemsize
    dkv_bytes = k.size * k.itemsize
    counters = heads_rows // block_m * 4
    return (rows,) + _packed_offsets(dq_bytes, dkv_bytes, dkv_bytes, heads_rows * 4, heads_rows * 4,
                                     heads_rows * kc["max_k"] * 4, counters)


def _sm90_bwd_buffers(cupy, offsets, q, k, v):
    """dq, dk, dv carved from one new allocation laid out by ``offsets`` (``_sm90_bwd_layout``
    without its rows), and the pointers of the workspace (lse_log2, delta, dq accumulator,
    counters) and of dq, dk, dv: the tail of ``_SM90_BWD_POINTERS``."""
    at_dk, at_dv, at_lse2, at_delta, at_accum, at_counters, total = offsets
    memory = cupy.cuda.alloc(total)  # CuPy's pool, as cupy.empty would use, minus the array
    base = memory.ptr
    dq = cupy.ndarray(q.shape, q.dtype, memory)
    dk = cupy.ndarray(k.shape, k.dtype, memory + at_dk)
    dv = cupy.ndarray(v.shape, v.dtype, memory + at_dv)
    return dq, dk, dv, (base + at_lse2, base + at_delta, base + at_accum, base + at_counters, base, base + at_dk,
                        base + at_dv)


def _backward_sm90(registry, binary: KernelBinary, c: _Common, grad_out, q, k, v, out, lse, deterministic, stream,
                   key):
    """Launch an sm90_bwd instance's three kernels (prep, main, convert; see spec/sm90_bwd.py)."""
    cupy = _cupy()
    kc = binary.constants
    with cupy.cuda.Device(c.device):
        if c.M > 1 and lse.strides[2] != 4:
            lse = cupy.ascontiguousarray(lse)  # the prep kernel reads a row's lse with unit stride
            key = None  # a per-call copy: not a plan
        rows, *offsets = _sm90_bwd_layout(kc, c, q, k)
        dq, dk, dv, (lse_log2, delta, accum, counters, *_) = _sm90_bwd_buffers(cupy, offsets, q, k, v)
        os_, gos, ls = _elem_strides(out), _elem_strides(grad_out), _elem_strides(lse)
        band_lo, band_hi, band_from_end = _band(c)
        _check_int32(out_stride_m=os_[1], out_stride_h=os_[2], dout_stride_m=gos[1], dout_stride_h=gos[2],
                     lse_stride_b=ls[0], lse_stride_h=ls[1], rows_padded=rows * c.H * c.B)
        p = _params_buffer(Sm90Bwd)
        _fill(p, out_ptr=out.data.ptr, dout_ptr=grad_out.data.ptr, lse_ptr=lse.data.ptr, lse_log2_ptr=lse_log2,
              delta_ptr=delta, dq_accum_ptr=accum, dq_counter_ptr=counters, dq_ptr=dq.data.ptr, dk_ptr=dk.data.ptr,
              dv_ptr=dv.data.ptr, **_seqstarts(c), out_stride_b=os_[0], dout_stride_b=gos[0],
              dq_stride_b=q.shape[1] * c.H * c.K, dkv_stride_b=k.shape[1] * k.shape[2] * c.K,
              out_stride_m=os_[1], out_stride_h=os_[2],
              dout_stride_m=gos[1], dout_stride_h=gos[2], dq_stride_m=c.H * c.K, dq_stride_h=c.K,
              dkv_stride_n=k.shape[2] * c.K, dkv_stride_h=c.K, lse_stride_b=ls[0], lse_stride_h=ls[1],
              num_queries=c.M, num_keys=c.N, num_heads=c.H, head_dim=c.K, head_group=c.H // k.shape[2],
              band_lo=band_lo, band_hi=band_hi, band_from_end=band_from_end, rows_padded=rows,
              deterministic=int(deterministic), scale=c.scale,
              scale_log2=c.scale * math.log2(math.e), **_softcap_fields(c))
        raw = p.view(np.uint8)
        for name, x, rows_per_box in zip(_SM90_BWD_MAPS, (q, k, v, grad_out),
                                         (kc["block_m"], kc["block_n"], kc["block_n"], kc["block_m"])):
            at = p.dtype.fields[name][1]
            tensormap.encode_bmhk(raw[at:at + tensormap.TENSOR_MAP_BYTES], x, c.dtype, kc["box_cols"], rows_per_box,
                                  kc["swizzle_bytes"])
        aux_grid, aux_block = (-(-c.M // kc["block_m"]), c.H, c.batches), (kc["aux_threads"], 1, 1)
        grid, block = (-(-c.N // kc["block_n"]), k.shape[2], c.batches), (kc["threads_per_block"], 1, 1)
        _launch(registry, binary, c.device, aux_grid, aux_block, p, stream, "_prep")
        _launch(registry, binary, c.device, grid, block, p, stream)
        _launch(registry, binary, c.device, aux_grid, aux_block, p, stream, "_convert")
        _zero_unpacked_rows(c, dq, dk, dv)
        if key is not None:
            handle = lambda entry: _handle(registry, binary, c.device, entry)  # noqa: E731
            plans.remember(key, plans.LaunchPlan.from_params(
                handle(""), c.device, grid, block, kc["shared_memory_bytes"], p, _SM90_BWD_POINTERS, False,
                {"sm90": True, "layout": tuple(offsets)}, tensor_maps=_SM90_BWD_MAPS,
                before=[(handle("_prep"), aux_grid, aux_block)], after=[(handle("_convert"), aux_grid, aux_block)]))
    return dq, dk, dv


def _backward_sm90_planned(cupy, plan: plans.LaunchPlan, grad_out, q, k, v, out, lse, stream):
    """An sm90 backward whose signature was seen before: one allocation, three launches."""
    with _on_device(cupy, plan.device):
        dq, dk, dv, carved = _sm90_bwd_buffers(cupy, plan.sizes["layout"], q, k, v)
        dout = grad_out.data.ptr
        # tensor maps (q, k, v, grad_out), then _SM90_BWD_POINTERS' order
        plan.launch((q.data.ptr, k.data.ptr, v.data.ptr, dout, out.data.ptr, dout, lse.data.ptr) + carved, 0, 0,
                    _stream_handle(cupy, stream))
    return dq, dk, dv


def explain(q, k, v, *, backward=False, attn_bias=None, dropout_p=0.0, causal=None, window=None, softcap=0.0,
            cu_seqlens_q=None, cu_seqlens_k=None, registry: Optional[Registry] = None):
    """Every candidate kernel for this call, in the order tried, with why it was rejected or chosen
    (on a 9.0 GPU flashgen's sm90_fwd / sm90_bwd kernels are tried first)."""
    cupy = _cupy()
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    c = _common(q, k, v, causal, None, dropout_p, 0 if dropout_p else None, 0, cu_seqlens_q, cu_seqlens_k,
                window=window, softcap=softcap)
    bias = _bias(cupy, attn_bias, c, q, q.shape[1], k.shape[1])
    arrays = [q, k, v] + ([bias] if bias is not None else [])
    family = "mem_eff_bwd" if backward else "mem_eff_fwd"
    req = Request(family, c.dtype, c.K, c.Kv, _alignment(arrays, (c.K, c.Kv)), c.dropout_p > 0,
                  bias is not None, device_info(c.device), seq_multiples(c.M, c.N, False))
    selector = _selector(registry or default_registry())
    rows = []
    hopper = _sm90_request(c, q, k, v, bias, Sm90Bwd.FAMILY if backward else Sm90Fwd.FAMILY)
    if hopper is not None and selector.find(hopper) is not None:  # tried first on 9.0 GPUs
        rows = selector.explain(hopper)
    later = selector.explain(req)
    if c.window is not None or c.softcap:
        later = [(name, target, "no sliding window or soft-capping (sm90 kernels only)") for name, target, _ in later]
    if any(verdict == "selected" for _, _, verdict in rows):
        later = [(name, target, "not tried: an earlier kernel was selected") for name, target, _ in later]
    return rows + later
