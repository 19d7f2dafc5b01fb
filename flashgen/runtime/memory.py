"""Whose memory a call's outputs come from: CuPy's pool for CuPy callers, torch's allocator for torch's.

Torch tensors in, torch tensors out.  The full path (validation, selection) works on
zero-copy CuPy views of the inputs (DLPack) and hands its outputs back as torch
tensors; a repeated signature's launch plan (``plans.py``) reads the tensors'
pointers directly and allocates its outputs with torch's caching allocator on torch's
current stream, with no DLPack on the way (on an H200 the runtime's share of a planned
torch call measured 26 us forward and 57 us backward, against 17-22 and 26-40 us for CuPy
arrays; the full path is several hundred).  The families' ``replay`` methods allocate through these
objects, so they serve both kinds of caller with one body.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

from flashgen.runtime import plans


class CupyMemory:
    """CuPy arrays from CuPy's pool, launched on the given or CuPy's current stream."""

    def __init__(self, cupy):
        self.cupy = cupy

    @staticmethod
    def ptr(x) -> int:
        return x.data.ptr

    def empty(self, shape, near, f32: bool = False):
        """An uninitialised array of ``near``'s dtype (float32 with ``f32``) on its device."""
        return self.cupy.empty(shape, dtype=self.cupy.float32 if f32 else near.dtype)

    def full_f32(self, shape, value: float, near):
        return self.cupy.full(shape, value, dtype=self.cupy.float32)

    def carve(self, pieces, workspace_at: int, total: int):
        """Contiguous arrays ``(byte offset, shape, like)`` (like's dtype; float32 for like=None)
        and a workspace of bytes ``workspace_at:total``, laid out as one allocation of ``total``
        bytes: (the arrays, base, owner) where workspace byte offset ``at`` is address ``base + at``
        for as long as ``owner`` lives."""
        memory = self.cupy.cuda.alloc(total)  # the pool, as cupy.empty would use, minus the arrays
        arrays = [self.cupy.ndarray(shape, self.cupy.float32 if like is None else like.dtype, memory + at)
                  for at, shape, like in pieces]
        return arrays, memory.ptr, memory

    def stream(self, stream, device: int) -> int:
        """The CUDA stream handle to launch on: the given CuPy stream, else CuPy's current one."""
        return (stream if stream is not None else self.cupy.cuda.get_current_stream()).ptr

    def signature(self, arrays):
        return plans.signature(arrays, self.cupy.ndarray)

    def row_sums(self, grad_out, out, delta) -> None:
        """delta[b, h, m] = sum_k grad_out[b, m, h, k] * out[b, m, h, k], in float32."""
        rowsum = (grad_out.astype(self.cupy.float32) * out.astype(self.cupy.float32)).sum(axis=-1)
        delta[...] = rowsum.transpose(0, 2, 1).reshape(delta.shape)

    @staticmethod
    def full_path(device: int):
        return contextlib.nullcontext()

    @staticmethod
    def adopt(outputs):
        return outputs


class TorchMemory:
    """Torch tensors from torch's caching allocator, launched on torch's current stream."""

    def __init__(self, torch):
        self.torch = torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a plain int, no Stream object
        self._current = raw or (lambda index: torch.cuda.current_stream(index).cuda_stream)

    @staticmethod
    def ptr(x) -> int:
        return x.data_ptr()

    def empty(self, shape, near, f32: bool = False):
        return near.new_empty(shape, dtype=self.torch.float32) if f32 else near.new_empty(shape)

    def full_f32(self, shape, value: float, near):
        return near.new_full(shape, value, dtype=self.torch.float32)

    def carve(self, pieces, workspace_at: int, total: int):
        """As CuPy's, but each array is its own allocation: torch's allocator caches blocks per
        size, and carving views costs more Python than it saves."""
        near = pieces[0][2]
        arrays = [self.empty(shape, near if like is None else like, like is None) for _, shape, like in pieces]
        workspace = near.new_empty((total - workspace_at,), dtype=self.torch.uint8)
        return arrays, workspace.data_ptr() - workspace_at, workspace

    def stream(self, stream, device: int) -> int:
        """The given CuPy stream, else torch's current stream on ``device``."""
        return stream.ptr if stream is not None else self._current(device)

    def signature(self, arrays):
        return plans.tensor_signature(arrays, self.torch.Tensor)

    def row_sums(self, grad_out, out, delta) -> None:
        rowsum = (grad_out.float() * out.float()).sum(dim=-1)  # [B, M, H]
        delta.copy_(rowsum.transpose(1, 2).reshape(delta.shape))

    def full_path(self, device: int):
        """CuPy's current stream made torch's, so the full path's launches and copies order with
        the caller's torch work."""
        import cupy

        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14: ExternalStream is deprecated
            return cupy.cuda.Stream.from_external(self.torch.cuda.current_stream(device))
        return cupy.cuda.ExternalStream(self._current(device), device)

    def adopt(self, outputs):
        """The full path's CuPy outputs as torch tensors (zero-copy; CuPy's memory stays owned)."""
        return tuple(self.torch.from_dlpack(x) for x in outputs)


_memories = {}


def memory_for(x, cupy) -> Optional[object]:
    """The memory of a caller passing ``x``: CuPy's for CuPy arrays, torch's for CUDA tensors,
    else None (anything else is viewed through DLPack and gets CuPy outputs)."""
    if type(x) is cupy.ndarray:
        found = _memories.get("cupy")
        if found is None:
            found = _memories["cupy"] = CupyMemory(cupy)
        return found
    torch = sys.modules.get("torch")  # never imported here: a torch tensor means torch is loaded
    if torch is not None and isinstance(x, torch.Tensor) and x.is_cuda:
        found = _memories.get("torch")
        if found is None:
            found = _memories["torch"] = TorchMemory(torch)
        return found
    return None
