"""Where a short attention's time goes: a fixed cost per tile against a cost per step.

    FLASHGEN_KERNEL_PATH=build/kernels python tools/fixed_cost.py [--direction bwd] [--fixed 512]
        [--batch 128] [--head-dims 64,128] [--counts 64,128,256,512,1024,2048] [--no-cudnn]

The backward's tiles are key blocks (one CTA each), its steps query blocks: keys are fixed (`--fixed`,
so the grid of key blocks is too) and the query count varies (`--counts`).  The forward's tiles are
query blocks and its steps key blocks: queries fixed, keys varied.  Each implementation's time is
fitted as a + b * count.  b is the work of the steps (per query or key, all heads and batches); a is
what does not grow with them: a tile's prologue (the backward's K and V loads, the forward's Q) and
epilogue (dK and dV, or O, stores), the CTAs' launches, and the backward's prep and convert.  flashgen
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


def per_call_us(fn, warmup: int = 5, rounds: int = 10, queued: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(queued):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / queued)
    return statistics.median(times)


def calls(direction: str, batch: int, queries: int, keys: int, heads: int, head_dim: int, cudnn: bool) -> dict:
    """{implementation: a function running one forward or backward} over the same bf16 inputs, [B, S, H, D]."""
    q, do = (torch.randn(batch, queries, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, keys, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cq, ck, cv, cdo = (cupy.from_dlpack(t) for t in (q, k, v, do))
    if direction == "fwd":
        runs = {"flashgen": lambda: flashgen.attention_forward(cq, ck, cv)}
    else:  # the forward's out and lse, once
        out, lse = flashgen.attention_forward(cq, ck, cv)
        runs = {"flashgen": lambda: flashgen.attention_backward(cdo, cq, ck, cv, out, lse)}
    if cudnn:  # torch SDPA's cuDNN backend on [B, H, S, D] views of the same buffers
        tq, tk, tv = (t.transpose(1, 2).detach().requires_grad_(direction == "bwd") for t in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def forward():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return sdpa(tq, tk, tv)
        if direction == "fwd":
            runs["cudnn"] = forward
        else:
            o = forward()
            runs["cudnn"] = lambda: torch.autograd.grad(o, (tq, tk, tv), do.transpose(1, 2), retain_graph=True)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--direction", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--fixed", type=int, default=512, help="keys (bwd) or queries (fwd), fixed")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--counts", default="64,128,256,512,1024,2048", help="queries (bwd) or keys (fwd), varied")
    ap.add_argument("--no-cudnn", action="store_true", help="flashgen alone")
    args = ap.parse_args(argv)
    counts = [int(m) for m in args.counts.split(",")]
    if len(counts) < 2:
        ap.error("--counts needs two or more to fit a line")
    varied = "query" if args.direction == "bwd" else "key"
    cudnn = not args.no_cudnn
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        heads = 2048 // head_dim
        times: dict = {}
        for n in counts:
            m, k = (n, args.fixed) if args.direction == "bwd" else (args.fixed, n)
            for name, fn in calls(args.direction, args.batch, m, k, heads, head_dim, cudnn).items():
                times.setdefault(name, []).append(per_call_us(fn))
        for name, ts in times.items():
            b, a = np.polyfit(counts, ts, 1)
            print(f"{args.direction} d{head_dim} {name:8s} " + " ".join(f"{n}:{t:.0f}" for n, t in zip(counts, ts)) +
                  f" us  fit: a = {a:.0f} us, b = {b:.3f} us per {varied}  ({args.batch} x {heads} heads, "
                  f"{args.fixed} {'keys' if args.direction == 'bwd' else 'queries'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
