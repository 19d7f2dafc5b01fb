"""Fake device arrays and a fake ``cupy`` for the hostile-input table (hostile_cases.py), and the two
backends its case builders make arrays with: fake ones on the CPU, real ones on a GPU."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from types import SimpleNamespace

import numpy as np
import pytest

from flashgen.runtime.block_masks import block_mask
from flashgen.runtime.registry import Registry

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BF16 = None

INT32_MAX = 2**31 - 1
FAKE_PTR = 0x7F2A00000000  # 256-byte aligned, like every CuPy allocation
DTYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64, "i32": np.int32}


def np_dtype(name: str):
    if name == "bf16":
        if BF16 is None:
            pytest.skip("bfloat16 needs ml_dtypes")
        return BF16
    return np.dtype(DTYPES[name])


# === fake device arrays and a fake CuPy ======================================================

class FakeDevArray:
    """What the runtime reads off a CuPy array; strides in elements here, bytes on the object."""

    def __init__(self, shape, dtype=np.float16, strides=None, ptr=FAKE_PTR, device=0, host=None):
        self.shape = tuple(int(n) for n in shape)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        packed, step = [], 1
        for n in reversed(self.shape):
            packed.insert(0, step)
            step *= max(n, 1)
        strides = packed if strides is None else list(strides)
        self.strides = tuple(s * self.itemsize for s in strides)
        contiguous = all(s == p for s, p, n in zip(strides, packed, self.shape) if n > 1)
        self.flags = SimpleNamespace(c_contiguous=contiguous)
        self.device = SimpleNamespace(id=device)
        self.data = SimpleNamespace(ptr=ptr, device_id=device)
        self.host = host

    def __getitem__(self, key):  # only `x[..., :n]`, as _bias uses it on its padded copy
        assert key[0] is Ellipsis and key[1].start is None and key[1].step is None, key
        view = FakeDevArray(self.shape[:-1] + (key[1].stop,), self.dtype, ptr=self.data.ptr, device=self.device.id)
        view.strides = self.strides
        return view

    def __setitem__(self, key, value):
        pass


def fake_broadcast_to(x, shape):
    if x.ndim > len(shape):
        raise ValueError("too many dims")
    lead = len(shape) - x.ndim
    src_shape = (1,) * lead + x.shape
    src_strides = (0,) * lead + tuple(s // x.itemsize for s in x.strides)
    strides = []
    for have, want, s in zip(src_shape, shape, src_strides):
        if have == want:
            strides.append(s)
        elif have == 1:
            strides.append(0)
        else:
            raise ValueError("not broadcastable")
    return FakeDevArray(shape, x.dtype, strides=strides, ptr=x.data.ptr, device=x.device.id)


def fake_asarray(x):
    if isinstance(x, np.ndarray):
        return FakeDevArray(x.shape, x.dtype, host=x.copy())
    cai = x.__cuda_array_interface__
    return FakeDevArray(cai["shape"], np.dtype(cai["typestr"]), host=getattr(x, "host", None))


def make_fake_cupy():
    """A ``cupy`` module with just what validation may touch; anything else fails the test."""
    m = types.ModuleType("cupy")
    m.ndarray = FakeDevArray
    m.float32 = np.float32
    m.asnumpy = lambda a: a.host.copy() if a.host is not None else np.zeros(a.shape, a.dtype)
    m.asarray = fake_asarray
    m.from_dlpack = lambda x: x.fake_view  # fake CUDA DLPack producers carry the view they stand for
    m.broadcast_to = fake_broadcast_to
    m.zeros = lambda shape, dtype=np.float32: FakeDevArray(shape, dtype)
    m.cuda = SimpleNamespace(Device=lambda index: contextlib.nullcontext())

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AssertionError(f"cupy.{name} used before validation finished (GPU work before the error)")

    m.__getattr__ = __getattr__
    return m


class DLPackProducer:
    """Something that speaks DLPack and says where it lives (kind 1: CPU, 2: CUDA)."""

    def __init__(self, kind, fake_view=None):
        self.kind, self.fake_view = kind, fake_view

    def __dlpack__(self, stream=None):
        raise AssertionError("the device type must be checked before the capsule is taken")

    def __dlpack_device__(self):
        return (self.kind, 0)


class CudaOnlyTensor:
    """A GPU tensor of another library: no host view (np.asarray fails), a CUDA array interface."""

    def __init__(self, values):
        self.host = np.asarray(values, np.int32)
        self.__cuda_array_interface__ = {"shape": self.host.shape, "typestr": "<i4", "data": (0, False),
                                         "version": 3}

    def __array__(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


# === backends: the same case builders make fake or real arrays ===============================

class HostInputs:
    """What both backends hand over as host memory where device arrays belong."""

    def torch_cpu(self, shape):
        torch = pytest.importorskip("torch")
        return torch.zeros(shape, dtype=torch.float16)

    def dlpack_cpu(self, shape):
        return DLPackProducer(1)


class CpuBackend(HostInputs):
    name = "cpu"
    extra = {"registry": Registry([])}  # validation must not need a kernel

    def randn(self, shape, dtype="f16", device=0):
        return FakeDevArray(shape, np_dtype(dtype), device=device)

    def strided(self, shape, strides, dtype="f16"):
        return FakeDevArray(shape, np_dtype(dtype), strides=strides)

    def offset(self, shape, elems, dtype="f16"):
        return FakeDevArray(shape, np_dtype(dtype), ptr=FAKE_PTR + 256 + elems * np_dtype(dtype).itemsize)

    def reversed(self, shape, dim, dtype="f16"):
        x = FakeDevArray(shape, np_dtype(dtype))
        x.strides = tuple(-s if d == dim else s for d, s in enumerate(x.strides))
        return x

    def every_other(self, shape, dtype="f16"):  # last dim with stride 2
        packed = FakeDevArray(shape[:-1] + (2 * shape[-1],), np_dtype(dtype))
        return FakeDevArray(shape, np_dtype(dtype), strides=[s // packed.itemsize for s in packed.strides[:-1]] + [2])

    def host(self, shape, dtype="f16"):
        return np.zeros(shape, np_dtype(dtype))

    def lse(self, shape, dtype="f32", device=0):
        return FakeDevArray(shape, np_dtype(dtype), device=device)

    def cu(self, values, dtype=np.int32, on_device=False, contiguous=True):
        host = np.asarray(values, dtype)
        if not on_device:
            return host
        strides = None if contiguous else [2] * host.ndim
        return FakeDevArray(host.shape, host.dtype, strides=strides, host=host)

    def other_device(self):
        return 1

    def block_mask(self, shape, device=0):
        """A causal block mask for [B, H, M, N] = ``shape`` on GPU ``device`` (None: the host); built
        with NumPy and then said to be on the device (validation reads only its shape and device)."""
        return dataclasses.replace(block_mask(causal_mask, *shape, device="cpu"), device=device)


def causal_mask(b, h, q, kv):
    return q >= kv


class GpuBackend(HostInputs):
    name = "gpu"
    extra: dict = {}

    def __init__(self, cp):
        self.cp = cp
        self.rng = np.random.default_rng(0)

    def _dtype(self, name):
        dt = np_dtype(name)
        if name == "bf16":
            try:
                self.cp.zeros(1, dtype=dt)
            except Exception:
                pytest.skip("this CuPy has no bfloat16 arrays")
        return dt

    def randn(self, shape, dtype="f16", device=0):
        dt = self._dtype(dtype)
        if device >= self.cp.cuda.runtime.getDeviceCount():
            pytest.skip(f"needs GPU {device}")
        with self.cp.cuda.Device(device):
            return self.cp.asarray(self.rng.standard_normal(shape).astype(np.float32)).astype(dt)

    def strided(self, shape, strides, dtype="f16"):
        dt = self._dtype(dtype)
        buf = self.cp.zeros(64, dtype=dt)  # never read: validation must refuse these views
        return self.cp.lib.stride_tricks.as_strided(buf, shape=shape, strides=[s * dt.itemsize for s in strides])

    def offset(self, shape, elems, dtype="f16"):
        dt = self._dtype(dtype)
        n = math.prod(shape)
        flat = self.cp.asarray(self.rng.standard_normal(n + elems + 8).astype(np.float32)).astype(dt)
        return flat[elems:elems + n].reshape(shape)

    def reversed(self, shape, dim, dtype="f16"):
        x = self.randn(shape, dtype)
        return x[(slice(None),) * dim + (slice(None, None, -1),)]

    def every_other(self, shape, dtype="f16"):
        return self.randn(shape[:-1] + (2 * shape[-1],), dtype)[..., ::2]

    def host(self, shape, dtype="f16"):
        return np.zeros(shape, np_dtype(dtype))

    def lse(self, shape, dtype="f32", device=0):
        return self.randn(shape, dtype, device)

    def cu(self, values, dtype=np.int32, on_device=False, contiguous=True):
        host = np.asarray(values, dtype)
        if not on_device:
            return host
        if contiguous:
            return self.cp.asarray(host)
        return self.cp.asarray(np.repeat(host, 2, axis=-1))[..., ::2]

    def other_device(self):
        if self.cp.cuda.runtime.getDeviceCount() < 2:
            pytest.skip("needs a second GPU")
        return 1

    def block_mask(self, shape, device=0):
        if device is None:
            return block_mask(causal_mask, *shape, device="cpu")
        with self.cp.cuda.Device(device):
            return block_mask(causal_mask, *shape, device=device)
