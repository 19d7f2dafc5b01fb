"""TMA tensor maps (``CUtensorMap``) for the Hopper families, encoded from Python.

The sm90 kernels load their tiles with the bulk tensor copy engine, which
reads a 128-byte descriptor of the global tensor (address, sizes, strides,
box, swizzle) that the host must encode.  The driver's
``cuTensorMapEncodeTiled`` does that; it is called here through ``ctypes`` on
``libcuda`` (already loaded by CuPy), so flashgen needs no compiled host
extension and no extra package.  A launch plan keeps the encoded maps and
swaps only their addresses (``cuTensorMapReplaceAddress``) on a repeat call.
"""
from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple, Sequence, Tuple

import numpy as np

from flashgen.errors import UnsupportedError

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGNMENT = 64

# CUtensorMapDataType, CUtensorMapSwizzle (cuda.h)
_DATA_TYPES = {"f16": 6, "bf16": 9}
_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
_L2_PROMOTION_128B = 2
_OOB_FILL_ZERO = 0
_INTERLEAVE_NONE = 0

_lib = None
_lib_lock = threading.Lock()


def _driver():
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as e:
                    raise UnsupportedError(f"the sm90 kernels need the CUDA driver library (libcuda.so.1): {e}") from None
                u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
                lib.cuTensorMapEncodeTiled.argtypes = [
                    ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
                lib.cuTensorMapReplaceAddress.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                lib.cuTensorMapReplaceAddress.restype = ctypes.c_int
                _lib = lib
    return _lib


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` whose address is a multiple of 64 (tensor maps need it)."""
    raw = np.zeros(nbytes + TENSOR_MAP_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % TENSOR_MAP_ALIGNMENT
    return raw[start:start + nbytes]


def bmhk_problem(x) -> str:
    """Why ``x`` ([batch, seq, heads, head_dim], contiguous head dim) cannot be described by a
    tensor map, or "" if it can."""
    itemsize = x.itemsize
    if x.data.ptr % 16:
        return f"its address is not 16-byte aligned ({x.data.ptr % 16} bytes off)"
    for dim, name in ((1, "sequence"), (2, "head"), (0, "batch")):
        if x.shape[dim] > 1 and (x.strides[dim] <= 0 or x.strides[dim] % 16 or x.strides[dim] >= 2**40):
            return (f"its {name} stride is {x.strides[dim] // itemsize} elements; TMA needs a positive multiple "
                    f"of {16 // itemsize} elements below 2**40 bytes")
    return ""


class View(NamedTuple):
    """What ``bmhk_problem`` and ``encode_bmhk`` read of an array: [batch, seq, heads, cols], the
    strides in bytes, the element size, and ``data.ptr``."""

    shape: Tuple[int, int, int, int]
    strides: Tuple[int, int, int, int]
    itemsize: int
    data: object


def bias_view(bias) -> View:
    """The validated attention bias [B, H, M, N] as the sm90 bias tensor map reads it: [batch, query
    rows, heads, keys], each dim the bias broadcasts (stride 0) cut to extent 1, so that the kernels
    read it at coordinate 0 (a zero stride is no valid TMA stride)."""
    (B, H, M, N), (sb, sh, sm, sn) = bias.shape, bias.strides
    return View((B if sb else 1, M if sm else 1, H if sh else 1, N), (sb, sm, sh, sn), bias.itemsize, bias.data)


def encode_bmhk(out: np.ndarray, x, dtype: str, box_cols: int, box_rows: int, swizzle_bytes: int) -> None:
    """Encode ``x`` ([batch, seq, heads, head_dim]) as a 4-D tensor map (head_dim, seq, heads, batch)
    into ``out`` (128 bytes, 64-byte aligned), with boxes of (box_cols, box_rows, 1, 1).

    Rows past ``seq`` and columns past ``head_dim`` read as zeros (the kernels rely on it)."""
    why = bmhk_problem(x)
    if why:
        raise ValueError(f"cannot describe this array to the TMA engine: {why}")
    if box_cols * x.itemsize > swizzle_bytes:
        raise ValueError(f"a {box_cols}-element box row is wider than the {swizzle_bytes}-byte swizzle")
    batch, seq, heads, head_dim = x.shape
    itemsize = x.itemsize
    # a size-1 dimension's stride never multiplies a nonzero index; give it a valid value
    stride_seq = x.strides[1] if seq > 1 else head_dim * itemsize
    stride_seq = -(-stride_seq // 16) * 16
    stride_head = x.strides[2] if heads > 1 else stride_seq * max(seq, 1)
    stride_batch = x.strides[0] if batch > 1 else stride_head * max(heads, 1)
    dims = (ctypes.c_uint64 * 4)(head_dim, max(seq, 1), max(heads, 1), max(batch, 1))
    strides = (ctypes.c_uint64 * 3)(stride_seq, stride_head, stride_batch)
    box = (ctypes.c_uint32 * 4)(box_cols, box_rows, 1, 1)
    element_strides = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    assert out.nbytes == TENSOR_MAP_BYTES and out.ctypes.data % TENSOR_MAP_ALIGNMENT == 0
    status = _driver().cuTensorMapEncodeTiled(
        out.ctypes.data, _DATA_TYPES[dtype], 4, x.data.ptr, dims, strides, box, element_strides,
        _INTERLEAVE_NONE, _SWIZZLES[swizzle_bytes], _L2_PROMOTION_128B, _OOB_FILL_ZERO)
    if status != 0:
        raise ValueError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for shape {tuple(x.shape)}, "
                         f"strides {tuple(x.strides)} bytes, box ({box_cols}, {box_rows})")


def replace_addresses(buffer_address: int, offsets: Sequence[int], pointers: Sequence[int]) -> None:
    """Point the tensor maps at ``buffer_address + offsets[i]`` to ``pointers[i]`` (same shapes)."""
    replace = _driver().cuTensorMapReplaceAddress
    for offset, pointer in zip(offsets, pointers):
        status = replace(buffer_address + offset, pointer)
        if status != 0:
            raise ValueError(f"cuTensorMapReplaceAddress failed (CUresult {status})")
