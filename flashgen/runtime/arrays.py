"""What the runtime needs to know of an array: a CuPy view of it, its strides in elements, and
how well its pointer and strides are aligned.

Inputs are CuPy arrays or anything that speaks DLPack or ``__cuda_array_interface__``
(torch tensors, zero-copy).  CuPy itself is imported on the first call, never by
``import flashgen``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from flashgen.errors import UnsupportedError


def cupy_module():
    """CuPy, or an UnsupportedError that says how to install it."""
    try:
        import cupy
    except ImportError:
        raise UnsupportedError("flashgen's runtime needs CuPy: pip install 'flashgen[cu13]' "
                               "(or cupy-cuda12x / cupy-cuda13x matching your driver)") from None
    return cupy


def padded_rows(xp, shape, dtype):
    """Zeros of ``shape`` (NumPy or CuPy: ``xp``) inside rows padded to a multiple of 8 elements: the
    layout the kernels read a bias in, 16 bytes at a time, so a row's last chunk takes in the
    padding, which holds zeros rather than whatever the allocation held."""
    *lead, cols = shape
    return xp.zeros((*lead, -(-cols // 8) * 8), dtype=dtype)[..., :cols]


def dtype_name(dtype) -> Optional[str]:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(np.dtype(dtype).name)


def as_array(x, name: str):
    """A CuPy view of ``x`` (no copy), or a TypeError that says what to pass (a ValueError for
    negative strides, see ``check_strides``)."""
    cupy = cupy_module()
    if isinstance(x, cupy.ndarray):
        check_strides(name, x)
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} is a host (NumPy) array; move it to the GPU first (cupy.asarray)")
    if hasattr(x, "__dlpack__"):  # keeps bfloat16 (CUDA array interface has no code for it)
        _check_dlpack_device(name, x)
        if getattr(x, "requires_grad", False):  # torch exports no tensor that requires grad
            x = x.detach()
        try:
            arr = cupy.from_dlpack(x)
        except Exception as e:  # e.g. a CPU torch tensor
            raise TypeError(f"{name}: cannot view it on the GPU through DLPack ({e})") from None
    elif hasattr(x, "__cuda_array_interface__"):
        arr = cupy.asarray(x)
    else:
        raise TypeError(f"{name} must be a CuPy array or a GPU array with DLPack or __cuda_array_interface__, "
                        f"not {type(x).__name__}")
    check_strides(name, arr)
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


def check_strides(name: str, x):
    """Negative strides (reversed views) would reach the kernels as head/row offsets that the
    forward computes in unsigned 32-bit arithmetic (kernel_forward.h:293-296, 828): refuse them."""
    for dim, (n, s) in enumerate(zip(x.shape, x.strides)):
        if n > 1 and s < 0:
            raise ValueError(f"{name} has a negative stride in dim {dim} (a reversed view); the kernels need "
                             f"non-negative strides: pass cupy.ascontiguousarray({name})")


def elem_strides(x):
    return tuple(s // x.itemsize for s in x.strides)


def device_address(x) -> Optional[int]:
    """The device address of a CuPy array or a torch CUDA tensor; None for anything else."""
    if getattr(x, "is_cuda", False) is True:
        return x.data_ptr()
    ptr = getattr(getattr(x, "data", None), "ptr", None)
    return ptr if isinstance(ptr, int) else None


def alignment(arrays, dims) -> int:
    """Largest of 8/4/2/1 dividing every pointer (in elements), stride and dim that matters."""
    values = list(dims)
    for x in arrays:
        values.append(x.data.ptr // x.itemsize if x.data.ptr % x.itemsize == 0 else 1)
        values += [s for s, n in zip(elem_strides(x)[:3], x.shape[:3]) if n > 1]
    for a in (8, 4, 2):
        if all(v % a == 0 for v in values):
            return a
    return 1
