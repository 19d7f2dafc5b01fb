"""Time flashgen's dropout: plain vs dropout vs example-41 dropout, forward and backward.

    FLASHGEN_KERNEL_PATH=build/kernels python tools/bench_dropout.py [--seqlens 1024,4096,16384] [--repeats 30]
        [--families sm80_fwd,sm80_bwd]

Each point (dtype f16/bf16, head dim 64/128, tokens, causal or not) runs each variant `--warmup`
times, then `--repeats` times between CUDA events (one event pair per call, queued back to back),
and prints medians in ms with the ratios the dropout instances are judged by: dropout/plain
throughput (target >= 0.87) and the speed-up over example 41's dropout (target >= 2.5).  Example 41
is forced with FLASHGEN_FAMILIES=mem_eff_fwd,mem_eff_bwd (both directions: one mask).  ``--families``
restricts the plain and dropout variants to those families (and example 41, for what they refuse):
the Ampere pair on a Hopper GPU, say.
"""
from __future__ import annotations

import argparse
import os
import statistics

import cupy
import ml_dtypes

import flashgen

P = 0.1
VARIANTS = {"plain": ("", 0.0), "dropout": ("", P), "ex41": ("mem_eff_fwd,mem_eff_bwd", P)}


def timed(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    events[-1][1].synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(a, b) for a, b in events)


def point(dtype, head_dim, tokens, causal, warmup, repeats, heads=16, families=""):
    batch = max(1, 16384 // tokens)
    dt = cupy.float16 if dtype == "f16" else ml_dtypes.bfloat16
    q, k, v, do = (cupy.random.standard_normal((batch, tokens, heads, head_dim), dtype=cupy.float32).astype(dt)
                   for _ in range(4))
    times = {}
    for name, (forced, p) in VARIANTS.items():
        os.environ["FLASHGEN_FAMILIES"] = forced or (families and families + ",mem_eff_fwd,mem_eff_bwd")
        opts = dict(causal="top_left" if causal else None, dropout_p=p, seed=1 if p else None)
        try:
            out, lse = flashgen.attention_forward(q, k, v, **opts)
        except (ValueError, flashgen.UnsupportedError) as e:  # example 41's limits, say: a '-' and why
            print(f"# {name} at {dtype} d{head_dim} {tokens} tokens: {str(e).splitlines()[0][:150]}")
            times[name] = (None, None)
            continue
        fwd = timed(lambda: flashgen.attention_forward(q, k, v, **opts), warmup, repeats)
        bwd = timed(lambda: flashgen.attention_backward(do, q, k, v, out, lse, **opts), warmup, repeats)
        times[name] = (fwd, bwd)
    os.environ.pop("FLASHGEN_FAMILIES", None)
    return times


def cell(value, width, digits):
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--dtypes", default="f16,bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--families", default="", help="the plain and dropout variants' families (default: all)")
    args = parser.parse_args(argv)
    print(f"{'dtype':5} {'d':>4} {'tokens':>6} {'causal':6} {'dir':3} {'plain':>8} {'dropout':>8} {'ex41':>8} "
          f"{'drop/plain':>10} {'ex41/drop':>9}")
    for dtype in args.dtypes.split(","):
        for head_dim in map(int, args.head_dims.split(",")):
            for tokens in map(int, args.seqlens.split(",")):
                for causal in (False, True):
                    t = point(dtype, head_dim, tokens, causal, args.warmup, args.repeats, families=args.families)
                    for i, direction in enumerate(("fwd", "bwd")):
                        plain, drop, ex41 = (t[name][i] for name in VARIANTS)
                        print(f"{dtype:5} {head_dim:4} {tokens:6} {str(causal):6} {direction:3} {cell(plain, 8, 3)} "
                              f"{cell(drop, 8, 3)} {cell(ex41, 8, 3)} "
                              f"{cell(plain and drop and plain / drop, 10, 3)} {cell(ex41 and drop and ex41 / drop, 9, 2)}")


if __name__ == "__main__":
    main()
