"""Launch plans: the part of a call that depends only on its signature.

Validation, kernel choice, key-split count, workspace size and every ``Params``
field except the pointers (and the dropout seed and offset) are functions of
the inputs' shapes, strides, dtypes, devices and pointer alignment and of the
options.  The first call with a signature takes the full path (``api.py``,
then the family that serves it), which leaves a plan here; a repeated call
then only allocates its outputs, writes its pointers into a copy of the
plan's ``Params`` bytes and launches.
That is what keeps the per-call host cost near CuPy's own launch cost
(BENCHMARKS.md, "Per-call overhead").
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from flashgen.runtime import tensormap

# Pointer alignment enters selection only through divisibility by 8, 4 and 2
# elements (of at most 4 bytes): the pointer modulo 64 bytes is all a plan may depend on.
ALIGNMENT_BYTES = 64
_MAX_PLANS = 512  # many distinct shapes (e.g. varying sequence lengths) evict the oldest plans

# Which families a call may go to (runtime/families: forced_families) is part of its plan's key.
FAMILIES_VARIABLE = "FLASHGEN_FAMILIES"

# Where example 41's Params keep the Philox seed and offset (flashgen's own kernels name theirs)
EXAMPLE41_RNG_FIELDS = ("rng_engine_inputs_seed", "rng_engine_inputs_offset")

_plans: Dict[tuple, "LaunchPlan"] = {}
_lock = threading.Lock()


def signature(arrays, ndarray) -> Optional[tuple]:
    """What of the call's arrays a plan depends on: shapes, strides, dtypes, devices, and the
    pointers' common alignment (the OR of all pointers modulo 64 bytes: its lowest set bit is
    the largest power of two, up to 64, that divides every pointer).  None when one is not of
    type ``ndarray`` (CuPy's): converting it is per-call work a plan cannot skip."""
    parts, pointers = [], 0
    for x in arrays:
        if type(x) is not ndarray:
            return None
        mem = x.data
        pointers |= mem.ptr
        parts += (x.shape, x.strides, x.dtype, mem.device_id)
    parts.append(pointers % ALIGNMENT_BYTES)
    return tuple(parts)


def tensor_signature(arrays, tensor) -> Optional[tuple]:
    """``signature`` for torch CUDA tensors (strides in elements, torch dtypes: never equal to
    a CuPy signature); None when one is not a CUDA ``tensor``."""
    parts, pointers = ["torch"], 0
    for x in arrays:  # size() rather than shape: a third cheaper; this loop is most of a plan lookup
        if not isinstance(x, tensor):
            return None
        device = x.get_device()  # -1: on the host
        if device < 0:
            return None
        pointers |= x.data_ptr()
        parts.append((x.size(), x.stride(), x.dtype, device))
    parts.append(pointers % ALIGNMENT_BYTES)
    return tuple(parts)


def _driver_launch():
    """cuLaunchKernel through CuPy's driver binding (a RawKernel call costs ~7 us more), called as
    launch(handle, gx, gy, gz, bx, by, bz, shared_memory, stream, argv, extra)."""
    from cupy.cuda import driver

    return driver.launchKernel


@dataclass(frozen=True)
class LaunchPlan:
    """One kernel launch (or a main kernel and its helpers) with everything fixed but its pointers.

    ``words`` are the 64-bit word indices of the per-call fields (the
    pointers, in the order the plan was made with, then the dropout seed and
    offset if any).  The plan's own buffer starts as a copy of the ``Params``
    bytes of the call that made the plan; a launch writes those words into it
    (nothing else there ever changes) and hands cuLaunchKernel a one-entry
    argument array pointing at the buffer (the driver copies the bytes before
    it returns, so a lock around the steps is all the sharing between threads
    needs).  ``sizes`` holds what the caller allocates per call (shapes, flags).

    ``tensor_maps`` are the byte offsets of TMA descriptors in ``Params``
    (the buffer is 64-byte aligned, as the driver wants it): the first
    pointers of a launch become their global addresses, re-encoded only where
    they differ from what the map holds already (CuPy's pool often hands a
    training step the same addresses as the last; each re-encode is a driver
    call).  ``before`` and ``after`` are (CUfunction, grid, block) of helper
    kernels launched around the main one with the same ``Params`` and no
    dynamic shared memory (sm90_bwd's prep and convert).
    """

    handle: int  # CUfunction
    device: int
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    shared_memory: int
    words: Tuple[int, ...]
    has_rng: bool
    sizes: Mapping[str, object]
    launcher: Callable
    tensor_maps: Tuple[int, ...] = ()
    before: Tuple[tuple, ...] = ()
    after: Tuple[tuple, ...] = ()
    buffer: memoryview = field(default=None, compare=False, repr=False)  # 64-bit words of a NumPy array
    argv: np.ndarray = field(default=None, compare=False, repr=False)  # void *kernelParams[1] = {buffer}
    argv_address: int = 0
    map_addresses: list = field(default_factory=list, compare=False, repr=False)  # what the buffer's maps hold
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)
    launches: Tuple[tuple, ...] = ()
    family: str = ""  # the runtime family that replays the plan (runtime/families)
    # a forward plan's backward plans, by what a backward's key adds to it (flashgen.torch's ops)
    followers: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_params(cls, handle: int, device: int, grid, block, shared_memory: int, params: np.ndarray,
                    pointer_fields: Sequence[str], dropout: bool, sizes: Mapping[str, object],
                    launcher: Optional[Callable] = None, tensor_maps: Sequence[str] = (),
                    before: Sequence[tuple] = (), after: Sequence[tuple] = (), family: str = "",
                    rng_fields: Sequence[str] = EXAMPLE41_RNG_FIELDS) -> "LaunchPlan":
        """A plan from a filled ``Params`` record (the structured one-item array that launched);
        a launch takes the pointers for ``tensor_maps`` (field names), then ``pointer_fields``,
        then (``dropout``) each call's seed and offset into the 64-bit ``rng_fields``.
        ``launcher`` stands in for cuLaunchKernel (tests)."""
        assert params.dtype.itemsize % 8 == 0, "Params must be a whole number of 64-bit words"
        fields = list(pointer_fields) + (list(rng_fields) if dropout else [])
        words = []
        for name in fields:
            dtype, offset = params.dtype.fields[name][:2]
            assert dtype.itemsize == 8 and offset % 8 == 0, f"{name} is not an aligned 64-bit field"
            words.append(offset // 8)
        storage = tensormap.aligned_buffer(params.dtype.itemsize)
        storage[:] = params.view(np.uint8)
        argv = np.array([storage.ctypes.data], dtype=np.uint64)
        maps = tuple(params.dtype.fields[name][1] for name in tensor_maps)
        steps = ([(h, g, b, 0) for h, g, b in before] + [(handle, grid, block, shared_memory)] +
                 [(h, g, b, 0) for h, g, b in after])
        launches = tuple((h, *g, *b, smem) for h, g, b, smem in steps)
        return cls(handle, device, tuple(grid), tuple(block), shared_memory, tuple(words), dropout, dict(sizes),
                   launcher or _driver_launch(), maps, tuple(before), tuple(after), memoryview(storage).cast("Q"),
                   argv, argv.__array_interface__["data"][0], [None] * len(maps), launches=launches, family=family)

    def launch(self, pointers: Sequence[int], seed: int, offset: int, stream: int) -> None:
        """Launch on the CUDA stream handle ``stream`` with these pointers (and dropout seed/offset)."""
        maps = len(self.tensor_maps)
        values = (*pointers[maps:], seed, offset) if self.has_rng else pointers[maps:]
        buffer = self.buffer
        with self.lock:
            held = self.map_addresses
            for i in range(maps):
                if held[i] != pointers[i]:
                    tensormap.replace_addresses(int(self.argv[0]), self.tensor_maps[i:i + 1], pointers[i:i + 1])
                    held[i] = pointers[i]
            for index, value in zip(self.words, values):
                buffer[index] = value
            launch, argv = self.launcher, self.argv_address
            for arguments in self.launches:
                launch(*arguments, stream, argv, 0)


def find(signature_of: Callable, direction: str, arrays, options: tuple):
    """(key, plan) of a call: the plan made for its key, or None; the key is None when the call
    cannot be planned (``signature_of(arrays)`` is None: inputs of another kind; an unhashable
    option)."""
    parts = signature_of(arrays)
    if parts is None:
        return None, None
    # 1 and True hash alike, validate apart; the families allowed decide which one made the plan
    key = (direction, parts, options, tuple(map(type, options)), os.environ.get(FAMILIES_VARIABLE, ""))
    try:
        return key, lookup(key)
    except TypeError:
        return None, None


def lookup(key) -> Optional[LaunchPlan]:
    """The plan made for ``key``; raises TypeError if an option in the key is unhashable."""
    return _plans.get(key)


def remember(key, plan: LaunchPlan) -> None:
    with _lock:
        if len(_plans) >= _MAX_PLANS:
            _plans.pop(next(iter(_plans)))
        _plans[key] = plan


def clear() -> None:
    """Forget every plan (after the kernels or the tuning table in use change).  A backward whose
    forward replayed a plan before may still replay that plan's follower once: its kernels stay
    loaded, so that is a correct launch, of the old choice."""
    with _lock:
        _plans.clear()


_served = threading.local()


def note_served(plan: Optional[LaunchPlan]) -> None:
    """Record the plan that served this thread's latest public call (None: the full path)."""
    _served.plan = plan


def served() -> Optional[LaunchPlan]:
    """The plan that served this thread's latest ``attention_forward``/``backward`` call, if one
    did: how ``flashgen.torch`` ties a backward to its forward's plan without a second lookup."""
    return getattr(_served, "plan", None)
