"""Launching a family's kernel: ``Params`` by value on the caller's stream, the CUfunction for a plan.

Every family packs its kernel's ``Params`` record (the spec's ABI, as a NumPy
structured dtype) into a per-thread buffer with ``fill``, then calls ``launch``;
``handle`` gives the CUfunction a launch plan re-launches with.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from flashgen.runtime import tensormap
from flashgen.runtime.registry import KernelBinary, Registry

_params = threading.local()


def launch(registry: Registry, binary: KernelBinary, device: int, grid, block, params, stream, entry: str = ""):
    """Launch with ``Params`` passed by value.  CuPy is handed the record's bytes as one opaque
    void item: describing the 60-field structured dtype on every launch cost ~50 us.  ``entry``
    names a helper kernel of the instance (no dynamic shared memory)."""
    fn = registry.function(binary, device, entry)
    raw = params.view(np.dtype((np.void, params.dtype.itemsize)))
    fn(grid, block, (raw,), shared_mem=0 if entry else binary.constants["shared_memory_bytes"], stream=stream)


def handle(registry: Registry, binary: KernelBinary, device: int, entry: str = "") -> int:
    """The CUfunction behind the registry's CuPy kernel on ``device`` (for plans.LaunchPlan)."""
    import cupy

    fn = registry.function(binary, device, entry)
    with cupy.cuda.Device(device):
        return getattr(fn, "kernel", fn).ptr  # RawKernel.kernel: its Function on the current device


def on_device(cupy, device: int):
    """A context that makes ``device`` current (a no-op when it already is).

    A thread that has made no runtime call yet (torch's autograd engine thread, whose first
    backward replays a plan made on the main thread, say) reports device 0 with no CUDA context
    bound, and a driver-API launch there fails with CUDA_ERROR_INVALID_CONTEXT: setting the device
    binds its primary context."""
    if cupy.cuda.runtime.getDevice() != device:
        return cupy.cuda.Device(device)
    if not cupy.cuda.driver.ctxGetCurrent():
        cupy.cuda.runtime.setDevice(device)
    return _NO_SWITCH


_NO_SWITCH = contextlib.nullcontext()  # stateless, so one instance serves every call


def params_buffer(spec_class):
    """A per-thread Params buffer of a family, so a call allocates nothing on the host after warm-up."""
    buf = getattr(_params, spec_class.FAMILY, None)
    if buf is None:
        dtype = spec_class.params_dtype()
        buf = tensormap.aligned_buffer(dtype.itemsize).view(dtype)  # tensor maps need 64-byte alignment
        setattr(_params, spec_class.FAMILY, buf)
    return buf


def fill(buf, **fields):
    """Set every Params field in one assignment (fields not named are 0); one record
    assignment costs a few microseconds where sixty field writes cost ~60."""
    names = buf.dtype.names
    unknown = fields.keys() - set(names)
    if unknown:
        raise AssertionError(f"not Params fields: {sorted(unknown)}")  # a bug in a family module, not the caller's
    zero = _zero_record(buf.dtype)
    buf[0] = tuple(fields[name] if name in fields else zero[name] for name in names)


_zero_records = {}


def _zero_record(dtype):
    """An all-zero record of ``dtype`` (its void fields, the tensor maps, need bytes, not 0)."""
    zero = _zero_records.get(dtype)
    if zero is None:
        zero = _zero_records[dtype] = np.zeros(1, dtype=dtype)[0]
    return zero


def packed_offsets(*sizes: int) -> tuple:
    """Byte offsets of consecutive buffers (each 256-byte aligned) after the first, and the total."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // 256) * 256
    return tuple(offsets[1:]) + (end,)
