"""Host cost of a call: what flashgen's runtime, its PyTorch adapter and SDPA spend on the host
per call on a tiny problem, and what importing them costs (``flashgen bench`` prints both).

Apart from ``bench``: these time no kernels (the GPU work is negligible), only the Python and
driver work around them, which a training step pays on every call.
"""
from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable, Dict

from flashgen.bench import error_note


def call_overhead_us(torch, calls: int = 400, rounds: int = 15) -> Dict[str, float]:
    """Host microseconds per call on a tiny problem (1 x 128 x 1 x 64, f16), against SDPA's call.

    flashgen's calls repeat one signature, so they take the planned path (runtime/plans.py)
    as a training loop does after its first step; the PyTorch adapter's calls are measured
    too (``adapter_overhead_cases``), so what it adds to the CuPy calls shows.  The GPU work
    is negligible; each figure is the minimum over ``rounds`` (implementations interleaved) of
    the wall time per call over ``calls`` back-to-back calls.  The minimum, as ``timeit``
    advises: the work is the same in every round and the host's other tenants only ever add
    time (a median moved single figures by 15% between runs on the device machine's host).
    """
    import cupy

    from flashgen.runtime import api

    q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.float16)
    cq = cupy.from_dlpack(q)
    out, lse = api.attention_forward(cq, cq, cq)
    tq = q.transpose(1, 2).detach().requires_grad_()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t_out = sdpa(tq, tq, tq)
    t_grad = torch.ones_like(t_out)
    cases = {
        "flashgen.attention_forward": lambda: api.attention_forward(cq, cq, cq),
        "flashgen.attention_backward": lambda: api.attention_backward(out, cq, cq, cq, out, lse),
        "torch sdpa forward": lambda: sdpa(tq, tq, tq),
        "torch sdpa backward (autograd.grad)": lambda: torch.autograd.grad(t_out, tq, t_grad, retain_graph=True),
        **adapter_overhead_cases(q, torch),
    }
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: min(t) for name, t in times.items()}


def adapter_cost_ratios(overhead: Dict[str, float]) -> Dict[str, float]:
    """The PyTorch adapter's own host cost over the CuPy path's, per direction, from
    ``call_overhead_us``: (flashgen.torch's call - the no-op op's) / the CuPy call's.  The no-op op
    is what torch's autograd charges any Python op, which no adapter can avoid.  Empty where
    the adapter was not measured."""
    pairs = {"forward": ("flashgen.torch forward", "no-op torch op forward", "flashgen.attention_forward"),
             "backward": ("flashgen.torch backward (autograd.grad)", "no-op torch op backward (autograd.grad)",
                          "flashgen.attention_backward")}
    return {direction: (overhead[adapter] - overhead[noop]) / overhead[cupy]
            for direction, (adapter, noop, cupy) in pairs.items() if {adapter, noop, cupy} <= overhead.keys()}


def adapter_overhead_cases(q, torch) -> Dict[str, Callable[[], object]]:
    """The PyTorch adapter's calls for ``call_overhead_us``, paired like SDPA's: the forward on a
    leaf that requires grad (as in training), the backward through autograd on one retained
    forward output that replayed a plan (so its backward replays the plan's follower, as a
    training step's does: flashgen/torch/ops.py).  None of them where the adapter cannot run (a
    warning says why), so the overhead of the other calls is still measured."""
    try:
        from flashgen.torch import attention

        tq_bmhk = q.detach().requires_grad_()
        attention(tq_bmhk, tq_bmhk, tq_bmhk)  # the full path, which leaves the forward's plan
        out = attention(tq_bmhk, tq_bmhk, tq_bmhk)  # a replay, as every training step's after the first
    except Exception as ex:
        warnings.warn(f"flashgen.torch call overhead not measured: {error_note(ex)}", stacklevel=2)
        return {}
    grad = torch.ones_like(out)
    noop = _noop_op(torch)
    noop_out = noop(tq_bmhk, tq_bmhk, tq_bmhk)
    return {
        "flashgen.torch forward": lambda: attention(tq_bmhk, tq_bmhk, tq_bmhk),
        "flashgen.torch backward (autograd.grad)": lambda: torch.autograd.grad(out, tq_bmhk, grad, retain_graph=True),
        "no-op torch op forward": lambda: noop(tq_bmhk, tq_bmhk, tq_bmhk),
        "no-op torch op backward (autograd.grad)": lambda: torch.autograd.grad(noop_out, tq_bmhk, grad,
                                                                               retain_graph=True),
    }


def _noop_op(torch) -> Callable:
    """An autograd op shaped like flashgen.torch's (q, k, v, bias and the options in; out and a
    non-differentiable lse out; dq, dk, dv back) that launches nothing and allocates nothing:
    what torch's autograd costs any Python op.  The adapter's own overhead is its call minus this."""

    class NoOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bias, options):
            ctx.save_for_backward(q, k, v)
            lse = q.view_as(q)
            ctx.mark_non_differentiable(lse)
            return q.view_as(q), lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            return grad_out, grad_out, grad_out, None, None

    return lambda q, k, v: NoOp.apply(q, k, v, None, (0, None, 0.0))[0]


def import_times_ms() -> Dict[str, float]:
    """Median wall milliseconds of ``import flashgen``, of its runtime and of CuPy (which the
    runtime imports on its first call), each in a fresh interpreter; none touches the GPU."""
    import subprocess
    import sys

    result = {}
    for name, stmt in (("import flashgen", "import flashgen"), ("import flashgen.runtime", "import flashgen.runtime"),
                       ("import cupy", "import cupy")):
        code = f"import time; t = time.perf_counter(); {stmt}; print((time.perf_counter() - t) * 1e3)"
        runs = [float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                     text=True).stdout) for _ in range(5)]
        result[name] = statistics.median(runs)
    return result
