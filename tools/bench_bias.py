"""How much an attention bias costs flashgen's Hopper kernels: the same call with a bias, without
one, and with the bias on the example-41 path, timed side by side (flashgen.bench's interleaved
rounds, CUDA events, three input sets in turn).

    python tools/bench_bias.py [--seqlen 1024 --seqlen 16384 ...] [--no-dbias] [--json out.json]
        [--families sm80_fwd,sm80_bwd] [--no-example41]

The bias is per head, [1, H, S, S] in the inputs' dtype (the shape of a relative-position bias);
the backward returns its gradient too unless --no-dbias.  The example-41 path is the same call
under FLASHGEN_FAMILIES=mem_eff_fwd,mem_eff_bwd; ``--families`` restricts the other two to those
families (and example 41, for what they refuse): the Ampere pair on a Hopper GPU, say.
``--no-example41`` leaves the example-41 variant out (its column '-'), for A/Bs of flashgen's own
bias kernels where only those are built.  Per point and direction it prints TFLOP/s of the three
and the two ratios the bias work is judged by: bias / plain (target >= 0.85) and bias / example 41
(target >= 2.5).  Needs torch (CUDA events) and CuPy; TFLOP/s count as flashgen
bench does (causal halves them).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashgen.bench import Point, Timed, _inputs, default_grid, flops, time_interleaved  # noqa: E402

EXAMPLE41 = "mem_eff_fwd,mem_eff_bwd"


@contextlib.contextmanager
def families(value):
    """FLASHGEN_FAMILIES set to ``value`` (None: unset) while an entry runs (read on every dispatch)."""
    saved = os.environ.pop("FLASHGEN_FAMILIES", None)
    if value is not None:
        os.environ["FLASHGEN_FAMILIES"] = value
    try:
        yield
    finally:
        os.environ.pop("FLASHGEN_FAMILIES", None)
        if saved is not None:
            os.environ["FLASHGEN_FAMILIES"] = saved


def entries(p: Point, dbias: bool, torch, cupy, api, allowed=None, example41=True):
    """(label, direction, Timed) of the three variants at one point (two without ``example41``)."""
    sets = [[cupy.from_dlpack(t) for t in s] for s in _inputs(torch, p)]
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[p.dtype]
    bias = cupy.from_dlpack(torch.randn((1, p.heads, p.seqlen, p.seqlen), device="cuda", dtype=dtype))
    causal = "top_left" if p.causal else None
    out = []
    own = allowed and f"{allowed},{EXAMPLE41}"
    variants = (("bias", own, bias), ("plain", own, None)) + ((("example41", EXAMPLE41, bias),) if example41 else ())
    for label, forced, attn_bias in variants:
        context = functools.partial(families, forced)
        with families(forced):
            fwd = [api.attention_forward(q, k, v, causal=causal, attn_bias=attn_bias) for q, k, v, _ in sets]
        grad = dbias and attn_bias is not None
        out.append((label, "fwd", Timed(label, "fwd", lambda i, b=attn_bias: api.attention_forward(
            *sets[i % 3][:3], causal=causal, attn_bias=b), context)))
        out.append((label, "bwd", Timed(label, "bwd", lambda i, b=attn_bias, f=fwd, g=grad: api.attention_backward(
            sets[i % 3][3], *sets[i % 3][:3], *f[i % 3], causal=causal, attn_bias=b, bias_requires_grad=g),
            context)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", choices=["f16", "bf16"])
    parser.add_argument("--head-dim", action="append", type=int)
    parser.add_argument("--seqlen", action="append", type=int)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-dbias", action="store_true", help="backward without bias_requires_grad")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--families", help="the bias and plain variants' families (default: all)")
    parser.add_argument("--no-example41", action="store_true", help="leave the example-41 variant out")
    args = parser.parse_args()
    import cupy
    import torch

    from flashgen.runtime import api

    grid = default_grid(tuple(args.dtype or ("f16", "bf16")), tuple(args.head_dim or (64, 128)), args.hidden,
                        args.tokens, tuple(args.seqlen or (1024, 2048, 4096, 8192, 16384)))
    rows = []
    print(f"{'dtype':5} {'hd':>3} {'causal':6} {'seqlen':>6} {'dir':3} {'bias':>7} {'plain':>7} {'ex41':>7} "
          f"{'bias/plain':>10} {'bias/ex41':>9}")
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for p in grid:
        with stream:
            timed = entries(p, not args.no_dbias, torch, cupy, api, args.families, not args.no_example41)
            time_interleaved([t for _, _, t in timed], torch, repeats=args.repeats)
        tflops = {(label, d): flops(p, d) / statistics.median(t.times) / 1e9 if t.times else None
                  for label, d, t in timed}
        for d in ("fwd", "bwd"):
            b, plain, ex41 = (tflops.get((label, d)) for label in ("bias", "plain", "example41"))
            ratio = lambda x, y: f"{x / y:.2f}" if x and y else "-"  # noqa: E731
            fmt = lambda x: f"{x:7.1f}" if x else "      -"  # noqa: E731
            print(f"{p.dtype:5} {p.head_dim:3} {str(p.causal):6} {p.seqlen:6} {d:3} {fmt(b)} {fmt(plain)} "
                  f"{fmt(ex41)} {ratio(b, plain):>10} {ratio(b, ex41):>9}", flush=True)
            rows.append({"point": vars(p), "direction": d, "bias": b, "plain": plain, "example41": ex41,
                         "errors": {t.impl: t.error for label, dd, t in timed if dd == d and t.error}})
        del timed
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        Path(args.json).write_text(json.dumps({"dbias": not args.no_dbias, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
