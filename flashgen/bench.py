"""``flashgen bench``: flashgen side by side with the attention a user would otherwise pick.

Forward and backward throughput over a grid of shapes, in one process, with
CUDA events, warm-up, the median of many repeats and three input sets used in
turn (so repeated runs do not measure the cache).  TFLOP/s follow
FlashAttention's convention: forward 4*B*H*M*N*D (halved for causal),
backward 2.5x that.

Backward timing: flashgen calls ``attention_backward`` directly (no autograd);
torch's SDPA backends are timed with ``torch.autograd.grad`` on one retained
forward graph, the cheapest honest path to their backward kernels.  Needs
torch for the peers (and for the inputs); flashgen itself runs through CuPy.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

TORCH_BACKENDS = ("flash", "efficient", "cudnn")


@dataclass
class Point:
    dtype: str
    head_dim: int
    causal: bool
    batch: int
    heads: int
    seqlen: int


@dataclass
class Result:
    impl: str
    direction: str  # "fwd" | "bwd"
    point: Point
    ms: Optional[float]  # None: not applicable here
    tflops: Optional[float]
    note: str = ""

    def as_dict(self) -> dict:
        return dict(asdict(self), point=asdict(self.point))


def default_grid(dtypes=("f16", "bf16"), head_dims=(64, 128), hidden=2048, tokens=16384,
                 seqlens=(512, 1024, 2048, 4096, 8192, 16384)) -> List[Point]:
    return [Point(d, hd, causal, max(1, tokens // s), hidden // hd, s)
            for d in dtypes for hd in head_dims for causal in (False, True) for s in seqlens]


def flops(p: Point, direction: str) -> float:
    f = 4.0 * p.batch * p.heads * p.seqlen * p.seqlen * p.head_dim / (2 if p.causal else 1)
    return f * (2.5 if direction == "bwd" else 1.0)


def time_ms(fn: Callable[[int], None], torch, warmup: int = 3, repeats: int = 20) -> float:
    """Median milliseconds of ``fn(i)`` (i picks the input set) between CUDA events."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _inputs(torch, p: Point, sets: int = 3):
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[p.dtype]
    shape = (p.batch, p.seqlen, p.heads, p.head_dim)
    return [[torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4)] for _ in range(sets)]  # q k v dO


def bench_point(p: Point, impls: List[str], torch, repeats: int = 20) -> List[Result]:
    import cupy

    from flashgen.runtime import api

    sets = _inputs(torch, p)
    causal = "top_left" if p.causal else None
    results = []

    def record(impl, direction, fn, note=""):
        try:
            ms = time_ms(fn, torch, repeats=repeats)
            results.append(Result(impl, direction, p, ms, flops(p, direction) / ms / 1e9, note))
        except Exception as e:  # a peer that does not support this point
            torch.cuda.synchronize()
            results.append(Result(impl, direction, p, None, None, f"{type(e).__name__}: {str(e)[:80]}"))

    if "flashgen" in impls:
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        cp_sets = [[cupy.from_dlpack(t) for t in s] for s in sets]
        with stream:
            fwd_out = [api.attention_forward(q, k, v, causal=causal) for q, k, v, _ in cp_sets]
            record("flashgen", "fwd", lambda i: api.attention_forward(*cp_sets[i % 3][:3], causal=causal))
            record("flashgen", "bwd", lambda i: api.attention_backward(
                cp_sets[i % 3][3], *cp_sets[i % 3][:3], *fwd_out[i % 3], causal=causal))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for backend in TORCH_BACKENDS:
        impl = f"sdpa-{backend}"
        if impl not in impls:
            continue
        kind = {"flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION}[backend]
        # SDPA takes [B, H, S, D]: transposed views of the same BMHK buffers
        t_sets = [[t.transpose(1, 2).requires_grad_(j < 3) if j < 3 else t.transpose(1, 2)
                   for j, t in enumerate(s)] for s in sets]
        with torch.nn.attention.sdpa_kernel(kind):
            record(impl, "fwd", lambda i: sdpa(*t_sets[i % 3][:3], is_causal=p.causal))
            try:
                outs = [sdpa(*s[:3], is_causal=p.causal) for s in t_sets]
            except Exception as e:
                results.append(Result(impl, "bwd", p, None, None, f"{type(e).__name__}: {str(e)[:80]}"))
                continue
            record(impl, "bwd", lambda i: torch.autograd.grad(outs[i % 3], t_sets[i % 3][:3], t_sets[i % 3][3],
                                                              retain_graph=True))
    del sets
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    return results


def call_overhead_us(torch, calls: int = 2000) -> Dict[str, float]:
    """Host microseconds per call on a tiny problem (selection, packing, launch), vs SDPA's call."""
    import cupy

    from flashgen.runtime import api

    q = torch.randn(1, 64, 1, 64, device="cuda", dtype=torch.float16)
    cq = cupy.from_dlpack(q)
    out, lse = api.attention_forward(cq, cq, cq)
    tq = q.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases = {
        "flashgen.attention_forward": lambda: api.attention_forward(cq, cq, cq),
        "flashgen.attention_backward": lambda: api.attention_backward(out, cq, cq, cq, out, lse),
        "torch sdpa (forward)": lambda: sdpa(tq, tq, tq),
    }
    result = {}
    for name, fn in cases.items():
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        result[name] = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    return result


def plot(results: List[Result], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.point.dtype, r.point.head_dim, r.point.causal, r.direction) for r in results})
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (dtype, hd, causal, direction) in zip(axes.flat, panels):
        for impl in sorted({r.impl for r in results}):
            pts = sorted((r.point.seqlen, r.tflops) for r in results if r.impl == impl and r.tflops
                         and (r.point.dtype, r.point.head_dim, r.point.causal, r.direction) == (dtype, hd, causal, direction))
            if pts:
                ax.plot([s for s, _ in pts], [t for _, t in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{direction} {dtype} hdim {hd}{' causal' if causal else ''}", fontsize=10)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
