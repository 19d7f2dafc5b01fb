"""Where a short backward's time goes: a fixed cost per key block (one CTA each) against a cost per query.

    FLASHGEN_KERNEL_PATH=build/kernels python tools/bwd_fixed_cost.py [--keys 512] [--batch 128]
        [--head-dims 64,128] [--queries 64,128,256,512,1024,2048] [--no-cudnn]

Keys are fixed (`--keys`, so the grid of key blocks is too) and the query count varies; each
implementation's backward time is fitted as a + b * queries.  b is the work of the steps (per query,
all heads and batches); a is what does not grow with the queries: the CTAs' launch, prologue (K and V
loads) and epilogue (dK and dV stores), and the launches of the prep and convert kernels.  flashgen
runs on CuPy views of torch's tensors, cuDNN through torch SDPA (skipped with --no-cudnn).  Time per
call: CUDA events around 10 calls queued back to back, median of 10 such, after 5 warm-up calls; the
batch is large (hidden 2048) so that the GPU, not the host, sets the pace even at 64 queries.
"""
from __future__ import annotations

import argparse
import statistics

import cupy
import numpy as np
import torch

import flashgen


def per_call_us(fn, warmup: int = 5, rounds: int = 10, calls: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / calls)
    return statistics.median(times)


def backward_calls(batch: int, queries: int, keys: int, heads: int, head_dim: int, cudnn: bool) -> dict:
    """{implementation: a function running one backward} over the same bf16 inputs, [B, S, H, D]."""
    q, do = (torch.randn(batch, queries, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, keys, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cq, ck, cv, cdo = (cupy.from_dlpack(t) for t in (q, k, v, do))
    out, lse = flashgen.attention_forward(cq, ck, cv)
    calls = {"flashgen": lambda: flashgen.attention_backward(cdo, cq, ck, cv, out, lse)}
    if cudnn:  # torch SDPA's cuDNN backend on [B, H, S, D] views of the same buffers
        tq, tk, tv = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
        calls["cudnn"] = lambda: torch.autograd.grad(o, (tq, tk, tv), do.transpose(1, 2), retain_graph=True)
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--queries", default="64,128,256,512,1024,2048")
    ap.add_argument("--no-cudnn", action="store_true", help="flashgen alone")
    args = ap.parse_args(argv)
    queries = [int(m) for m in args.queries.split(",")]
    if len(queries) < 2:
        ap.error("--queries needs two counts or more to fit a line")
    cudnn = not args.no_cudnn
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        heads = 2048 // head_dim
        times: dict = {}
        for m in queries:
            for name, fn in backward_calls(args.batch, m, args.keys, heads, head_dim, cudnn).items():
                times.setdefault(name, []).append(per_call_us(fn))
        for name, ts in times.items():
            b, a = np.polyfit(queries, ts, 1)
            print(f"d{head_dim} {name:8s} " + " ".join(f"M{m}:{t:.0f}" for m, t in zip(queries, ts)) +
                  f" us  fit: a = {a:.0f} us, b = {b:.3f} us per query  ({args.batch} x {heads} heads, "
                  f"{args.keys} keys)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
