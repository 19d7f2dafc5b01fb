"""Calls on a non-zero GPU, with the arrays on that GPU (needs 2+ GPUs; skipped otherwise).

The registry loads each module once per (cubin, device); a call runs on the
device its arrays live on, whatever CuPy's current device is.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    COUNT = cupy.cuda.runtime.getDeviceCount()
except Exception:
    COUNT = 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(COUNT < 2, reason="needs two or more GPUs")]

import flashgen  # noqa: E402
from attention_reference import BWD_TOL, FWD_TOL, poisoned_allocations, randn, reference, rel_err  # noqa: E402


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_every_gpu_computes_on_its_own_arrays(dtype):
    results = []
    for device in range(COUNT):
        with cupy.cuda.Device(device):
            r = np.random.default_rng(0)  # the same inputs on every GPU
            q, k, v, do = (randn(r, (2, 129, 3, 64), dtype) for _ in range(4))
        with cupy.cuda.Device(0), poisoned_allocations():  # current device 0, arrays elsewhere
            out, lse = flashgen.attention_forward(q, k, v, causal="top_left")
            dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, causal="top_left")
        assert all(x.device.id == device for x in (out, lse, dq, dk, dv))
        with cupy.cuda.Device(device):
            ro, _, (rdq, rdk, rdv, _) = reference(q, k, v, causal="top_left", grad_out=do)
            assert rel_err(out, ro) < FWD_TOL[dtype]
            for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
                assert rel_err(g, ref) < BWD_TOL[dtype]
            results.append(cupy.asnumpy(out))
    for other in results[1:]:
        assert np.array_equal(other, results[0])  # deterministic forward: bitwise equal across GPUs


def test_modules_are_loaded_per_device():
    from flashgen.runtime.registry import default_registry

    for device in range(2):
        with cupy.cuda.Device(device):
            q = cupy.ones((1, 8, 1, 64), dtype=cupy.float16)
        flashgen.attention_forward(q, q, q)
    registry = default_registry()
    loaded = {(path.name, dev) for path, dev in registry._modules}
    fwd = next(name for name, dev in loaded if dev == 0 and "mem_eff_fwd" in name)
    assert (fwd, 1) in loaded
