"""Read the properties selection needs off a CUDA device (once per device)."""
from __future__ import annotations

import functools

from flashgen.runtime.arch import DeviceInfo


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> DeviceInfo:
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(index)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    return DeviceInfo(index=index, name=name, cc=p["major"] * 10 + p["minor"],
                      multiprocessors=p["multiProcessorCount"],
                      shared_memory_optin=p["sharedMemPerBlockOptin"])
