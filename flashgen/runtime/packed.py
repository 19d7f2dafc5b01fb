"""Packed-sequence offsets validated once: ``flashgen.packed_offsets(cu_seqlens)``.

A varlen call validates its ``cu_seqlens`` on the host, and that read waits for the GPU.  A torch
tensor's validated copy is kept while torch says it is unchanged (host_offsets.py); a CuPy array has
no version counter, so it is read on every call.  A CuPy caller passing the same offsets to many
calls (every layer of a training step) builds a ``PackedOffsets`` once instead: it validates them,
keeps the host copy and a device copy of its own (a later write to the caller's array cannot reach
it), and the calls that take it neither read nor wait, and take launch plans keyed by its contents.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from flashgen.runtime.arrays import cupy_module


@dataclass(frozen=True, eq=False)
class PackedOffsets:
    """Validated packed-sequence offsets (int32, 0 then each sequence's end), for ``cu_seqlens_q`` or
    ``cu_seqlens_k`` of ``attention_forward`` / ``attention_backward``.  Build it with
    ``flashgen.packed_offsets``; it never changes."""

    array: object  # this object's own int32 [S+1] copy on GPU ``device`` (CuPy)
    host: np.ndarray  # the same offsets on the host, read-only
    device: int

    @property
    def sequences(self) -> int:
        return self.host.size - 1

    def __repr__(self) -> str:
        return f"PackedOffsets({self.sequences} sequences, {int(self.host[-1])} rows, GPU {self.device})"


def packed_offsets(cu_seqlens, device: Optional[int] = None) -> PackedOffsets:
    """``cu_seqlens`` (int32 [S+1]: 0, then the end of each packed sequence, never decreasing; a CuPy,
    NumPy or torch array, or any DLPack/CUDA-array-interface one) checked once, for every call that
    passes the result as ``cu_seqlens_q`` or ``cu_seqlens_k`` (whether it fits the call's rows is
    checked per call, on the host).  ``device``: the GPU of its copy; None for the array's own, or
    CuPy's current GPU for a host array.  Reads the offsets (waiting for the GPU) here, once."""
    from flashgen.runtime.validate import read_offsets

    if isinstance(cu_seqlens, PackedOffsets):
        return cu_seqlens
    cupy = cupy_module()
    cu, host = read_offsets(cu_seqlens, "cu_seqlens", None)
    if device is None:
        device = cu.device.id if isinstance(cu, cupy.ndarray) else cupy.cuda.runtime.getDevice()
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device must be a GPU index (an int >= 0) or None; got {device!r}")
    host = np.array(host, dtype=np.int32)
    host.flags.writeable = False
    with cupy.cuda.Device(device):
        array = cupy.asarray(host)  # its own copy: the caller's array may change later
    return PackedOffsets(array, host, device)
