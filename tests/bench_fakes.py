"""Fakes for the benchmark's CPU tests (test_bench*.py): what the timed code reads of torch, the
adapter and SDPA/flex, and `flashgen bench` on one point with made-up timings.  The host_bench
fixture (conftest.py) puts bench_point's inputs on the CPU."""
from __future__ import annotations

import contextlib
import sys
import time
import types

from click.testing import CliRunner

from flashgen import bench, bench_host
from flashgen.cli import main


class FakeEvent:
    """torch.cuda.Event on the host clock."""

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def host_torch(torch):
    """torch with torch.cuda's timing calls on the host clock: enough for bench_point's loops."""
    cuda = types.SimpleNamespace(Event=FakeEvent, synchronize=lambda: None, empty_cache=lambda: None)
    return types.SimpleNamespace(nn=torch.nn, autograd=torch.autograd, cuda=cuda)


def adapter(monkeypatch, attention):
    """flashgen.torch as bench imports it, with this ``attention``."""
    monkeypatch.setitem(sys.modules, "flashgen.torch", types.SimpleNamespace(attention=attention))


POINT = bench.Point("f16", 8, True, 2, 3, 16)


def bench_cli(monkeypatch, tflops, *args, compile_s=None, notes=None, overhead=None, points=None):
    """`flashgen bench` on one point, with a fake GPU torch and these TFLOP/s per implementation
    (and compile seconds per implementation and direction, and notes per implementation); the
    points timed are appended to ``points`` if given."""
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True,
                                                                  get_device_name=lambda: "Fake GPU"))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    seen, timings = [], []

    def bench_point(p, impls, torch, repeats, all_instances, queued):
        seen.append(impls)
        if points is not None:
            points.append(p)
        timings.append(queued)
        return [bench.Result(i, d, p, 1.0, tflops.get(i), (notes or {}).get(i, ""), spread=0.01,
                             compile_s=(compile_s or {}).get((i, d))) for i in impls for d in ("fwd", "bwd")]

    monkeypatch.setattr(bench, "bench_point", bench_point)
    monkeypatch.setattr(bench_host, "call_overhead_us", lambda torch: overhead or {"flashgen.torch forward": 12.5})
    monkeypatch.setattr(bench_host, "import_times_ms", lambda: {})
    result = CliRunner().invoke(main, ["bench", "--dtype", "f16", "--head-dim", "64", "--seqlen", "512", *args],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(set(timings)) == 1 and timings[0] == ("queued" in args)  # --timing reaches every point
    return seen[0], result.output


def table(output):
    lines = output.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("dtype"))
    return [line.split() for line in lines[start:start + 4]]  # header, rule, fwd, bwd


def sdpa_nn(sdpa, backend: list):
    """torch.nn with ``sdpa`` as scaled_dot_product_attention and sdpa_kernel choosing a backend as on
    a GPU: the chosen one is ``backend[-1]`` while it is in force."""
    @contextlib.contextmanager
    def sdpa_kernel(kind):
        backend.append(kind)
        try:
            yield
        finally:
            backend.pop()

    kinds = types.SimpleNamespace(FLASH_ATTENTION="flash", EFFICIENT_ATTENTION="efficient", CUDNN_ATTENTION="cudnn")
    return types.SimpleNamespace(functional=types.SimpleNamespace(scaled_dot_product_attention=sdpa),
                                 attention=types.SimpleNamespace(SDPBackend=kinds, sdpa_kernel=sdpa_kernel))


def fake_nn(refuse_gqa=()):
    """torch.nn with SDPA backends chosen by sdpa_kernel as on a GPU; those in ``refuse_gqa`` (and
    any, without enable_gqa) answer fewer k/v heads as torch does: "No available kernel"."""
    calls, backend = [], []

    def attend(q, k, v, enable_gqa, refused):
        group = q.shape[1] // k.shape[1]
        if group > 1 and (refused or not enable_gqa):
            raise RuntimeError("No available kernel. Aborting execution.")
        return q * k.repeat_interleave(group, 1) + v.repeat_interleave(group, 1)

    def sdpa(q, k, v, is_causal=False, **kwargs):
        calls.append((backend[-1], tuple(k.shape), kwargs))
        return attend(q, k, v, kwargs.get("enable_gqa", False), backend[-1] in refuse_gqa)

    def flex(q, k, v, block_mask=None, **kwargs):
        calls.append(("flex", tuple(k.shape), kwargs))
        return attend(q, k, v, kwargs.get("enable_gqa", False), False)

    return sdpa_nn(sdpa, backend), flex, calls
