"""Time a packed-sequence training step through flashgen.torch on a GPU: ``layers`` layers of
``attention_varlen`` (q = k = v = the layer's input) and a matmul, forward and backward, every layer
passing the same cu_seqlens tensors.  Prints the median step time with the offsets' host copy reused
(flashgen/runtime/host_offsets.py; the packed calls then replay launch plans keyed by the offsets'
contents) and with it read every call (no plan either: what varlen calls did before).  ``--profile``
adds where one step's time goes: the GPU's busy time (the union of its kernels' intervals, from
torch.profiler) against the step's, and the kernels that take the most of it -- host-bound or GPU-bound,
and which kernel selection picked.

    FLASHGEN_KERNEL_PATH=build/kernels python tools/packed_step.py [--layers 16] [--profile]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashgen.torch as ft
from flashgen.runtime import host_offsets

LENGTHS = [512, 1500, 700, 2048, 1024, 300, 1200, 900]  # 8184 tokens in 8 sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="also show one step's GPU time by kernel")
    args = parser.parse_args()
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    tokens, longest = int(cu[-1]), max(LENGTHS)
    x = torch.randn(tokens, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mixers = [torch.randn(args.head_dim, args.head_dim, device="cuda", dtype=torch.bfloat16) / args.head_dim ** 0.5
              for _ in range(args.layers)]

    def step():
        h = x
        for w in mixers:
            h = ft.attention_varlen(h, h, h, cu, cu, longest, longest, causal="top_left") @ w + h
        h.float().square().mean().backward()

    def median_ms():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    reused = median_ms()
    lookup, host_offsets.lookup = host_offsets.lookup, lambda t: None
    try:
        every = median_ms()
    finally:
        host_offsets.lookup = lookup
    print(f"packed step ({args.layers} layers, {tokens} tokens, {args.heads} heads of {args.head_dim}, bf16): "
          f"offsets read once {reused:.2f} ms, every call {every:.2f} ms")
    if args.profile:
        profile(step)


def profile(step, top: int = 8) -> None:
    """One warm step under torch.profiler: its wall time, the GPU's busy time and the top kernels."""
    step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, reached, by_name = 0.0, float("-inf"), {}
    for begin, end, name in kernels:  # microseconds; overlapping kernels count once
        busy += max(0.0, end - max(begin, reached))
        reached = max(reached, end)
        by_name[name] = by_name.get(name, 0.0) + end - begin
    print(f"profiled step: {wall:.2f} ms, GPU busy {busy / 1e3:.2f} ms ({len(kernels)} kernels)")
    for name, us in sorted(by_name.items(), key=lambda item: -item[1])[:top]:
        print(f"  {us / 1e3:8.2f} ms  {name[:90]}")


if __name__ == "__main__":
    main()
