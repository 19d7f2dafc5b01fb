"""Host copies of a torch caller's ``cu_seqlens``, kept per tensor while torch says it is unchanged.

Validating packed-sequence offsets reads them on the host, and that copy waits for everything queued
on the caller's stream: every varlen call used to drain the GPU before its launch.  A training step
passes the same offsets tensors to every layer's forward and backward, so the copy made by the first
call serves the rest, and the host runs ahead of the GPU again from the second call on.

A copy is reused only for the same tensor object (held by a weak reference: a new tensor at a freed
one's address is never taken for it) at the same ``_version`` (torch bumps it on every in-place
write, ``copy_`` included; a write that bypasses torch, such as a CuPy kernel on a DLPack view of
the tensor, is not seen: pass a new tensor after one), and never while the stream is being captured
into a CUDA graph: a graph would bake the offsets' longest sequence into its grid, so such a call
still reads them, and the capture refuses the read, as before.  CuPy arrays have no version counter:
they are read every call.
"""
from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict
from typing import Optional

import numpy as np

_MAX_COPIES = 64  # distinct offsets tensors remembered (a step uses two; older ones are dropped)
_copies: "OrderedDict[int, tuple]" = OrderedDict()  # id(tensor) -> (weak ref, _version, host copy)
_lock = threading.Lock()


def _version(t) -> Optional[int]:
    """The tensor's version counter, or None where it has none (inference-mode tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _is_tensor(x) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a torch tensor means torch is loaded
    return torch is not None and isinstance(x, torch.Tensor)


def _capturing(t) -> bool:
    return t.is_cuda and sys.modules["torch"].cuda.is_current_stream_capturing()


def lookup(t) -> Optional[np.ndarray]:
    """The validated host copy of torch tensor ``t``'s offsets, if ``t`` is unchanged since it was
    made (None: read them)."""
    if not _is_tensor(t):
        return None
    entry = _copies.get(id(t))
    if entry is None:
        return None
    ref, version, host = entry
    if ref() is not t or version is None or version != _version(t) or _capturing(t):
        return None
    return host


def remember(t, host: np.ndarray) -> None:
    """Keep ``host``, the validated copy of torch tensor ``t``'s offsets, for later calls with ``t``
    (nothing for other arrays)."""
    if not _is_tensor(t):
        return
    version = _version(t)
    if version is None:
        return
    key = id(t)

    def forget(ref, key=key):  # the tensor died: its id may now name another object
        with _lock:
            if _copies.get(key, (None,))[0] is ref:
                del _copies[key]

    host = host.copy()
    host.flags.writeable = False
    with _lock:
        _copies[key] = (weakref.ref(t, forget), version, host)
        _copies.move_to_end(key)
        while len(_copies) > _MAX_COPIES:
            _copies.popitem(last=False)


def clear() -> None:
    with _lock:
        _copies.clear()
