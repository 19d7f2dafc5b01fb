"""Whose memory a call's outputs come from: CuPy's pool for CuPy callers, torch's allocator for torch's.

Torch tensors in, torch tensors out.  The full path (validation, selection) works on
zero-copy CuPy views of the inputs (DLPack) and hands its outputs back as torch
tensors; a repeated signature's launch plan (``plans.py``) reads the tensors'
pointers directly and allocates its outputs with torch's caching allocator on torch's
current stream, with no DLPack on the way (on an H200's host a planned torch call measured
17.5 us forward and 32.7 us backward, against 17-18 and 28-33 us for CuPy arrays; the full
path is several hundred).  The families' ``replay`` methods allocate through these
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

    def zeros(self, shape, near, stream: int):
        """``empty``'s array cleared in the order of the CUDA stream handle ``stream`` (the launch's)."""
        x = self.empty(shape, near)
        self.cupy.cuda.runtime.memsetAsync(x.data.ptr, 0, x.nbytes, stream)
        return x

    def carve(self, pieces, workspace_at: int, total: int, stream: int):
        """Contiguous arrays ``(byte offset, shape, like)`` (like's dtype; float32 for like=None)
        and a workspace of bytes ``workspace_at:total``, laid out as one allocation of ``total``
        bytes: (the arrays, base, owner) where workspace byte offset ``at`` is address ``base + at``
        for as long as ``owner`` lives.  ``stream``: the handle the launch goes to (CuPy's pool
        allocates in the order of its current stream, which the launch uses unless given one)."""
        memory = self.cupy.cuda.alloc(total)  # the pool, as cupy.empty would use, minus the arrays
        arrays = [self.cupy.ndarray(shape, self.cupy.float32 if like is None else like.dtype, memory + at)
                  for at, shape, like in pieces]
        return arrays, memory.ptr, memory

    def stream(self, stream, device: int) -> int:
        """The CUDA stream handle to launch on: the given CuPy stream, else CuPy's current one."""
        return (stream if stream is not None else self.cupy.cuda.get_current_stream()).ptr

    def signature(self, arrays):
        return plans.signature(arrays, self.cupy.ndarray)

    @staticmethod
    def mask_arrays(block_mask, which: str) -> tuple:
        """A block mask's ``which`` arrays (``BlockMask.kernel_arrays`` / ``backward_arrays``) as they are."""
        return getattr(block_mask, which)()

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
    """Torch tensors from torch's caching allocator, launched on torch's current stream.

    Allocating is most of what a planned torch call pays on the host beyond CuPy's path: a
    ``new_empty`` took 4.5 us on an H200's host, a block of CuPy's pool 1.2 us.  So every
    output comes from the cheapest factory torch has, ``empty_like`` (3.3 us: no shape or
    options to parse), of the input it matches when that is contiguous, else of a one-element
    template expanded to its shape (not dense, so the copy's strides are contiguous); and a
    workspace is a raw block of the allocator, no tensor at all.
    """

    _TEMPLATES = 256  # distinct (shape, dtype, device) templates kept; each holds a 1-element tensor

    def __init__(self, torch):
        self.torch = torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a plain int, no Stream object
        self._current = raw or (lambda index: torch.cuda.current_stream(index).cuda_stream)
        self._raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
        self._raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
        self._templates = {}

    @staticmethod
    def ptr(x) -> int:
        return x.data_ptr()

    def empty(self, shape, near, f32: bool = False):
        """An uninitialised contiguous tensor of ``near``'s dtype (float32 with ``f32``) on its device."""
        if not f32 and near.size() == shape and near.is_contiguous():
            return self.torch.empty_like(near)
        dtype = self.torch.float32 if f32 else near.dtype
        key = (shape, dtype, near.get_device())  # a torch.Size hashes and compares as its tuple
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= self._TEMPLATES:
                self._templates.pop(next(iter(self._templates)))
            template = self._templates[key] = near.new_empty((1,), dtype=dtype).expand(shape)
        return self.torch.empty_like(template)

    def full_f32(self, shape, value: float, near):
        return near.new_full(shape, value, dtype=self.torch.float32)

    def zeros(self, shape, near, stream: int):
        """``empty``'s tensor cleared in the order of the CUDA stream handle ``stream`` (the launch's,
        which need not be torch's current one)."""
        from cupy.cuda import runtime

        x = self.empty(shape, near)
        runtime.memsetAsync(x.data_ptr(), 0, x.nbytes, stream)
        return x

    def carve(self, pieces, workspace_at: int, total: int, stream: int):
        """As CuPy's, but each array its own tensor (views cost torch as much Python as
        allocations) and the workspace a raw block of the allocator, allocated in the order of the
        launch's ``stream`` and given back when the returned owner is dropped (after the launch)."""
        near = pieces[0][2]
        arrays = [self.empty(shape, near if like is None else like, like is None) for _, shape, like in pieces]
        size = total - workspace_at
        if self._raw_alloc is None or size == 0:
            workspace = near.new_empty((size,), dtype=self.torch.uint8)
            return arrays, workspace.data_ptr() - workspace_at, workspace
        block = _RawBlock(self._raw_alloc(size, stream), self._raw_delete)
        return arrays, block.ptr - workspace_at, block

    def stream(self, stream, device: int) -> int:
        """The given CuPy stream, else torch's current stream on ``device``."""
        return stream.ptr if stream is not None else self._current(device)

    def signature(self, arrays):
        return plans.tensor_signature(arrays, self.torch.Tensor)

    def mask_arrays(self, block_mask, which: str) -> tuple:
        """A block mask's ``which`` arrays as torch views (made once per mask): with CuPy arrays in a
        torch call's signature it would get no launch plan."""
        return block_mask.arrays_as(which, self.torch.from_dlpack)

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


class _RawBlock:
    """A block of torch's caching allocator (device memory, no tensor), given back when dropped:
    like a tensor's, its memory is reused only in the order of the stream it was allocated on."""

    __slots__ = ("ptr", "_delete")

    def __init__(self, ptr: int, delete):
        self.ptr, self._delete = ptr, delete

    def __del__(self):
        self._delete(self.ptr)


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
