"""Write BENCHMARKS.md from `flashgen bench --json` files (and the --plot image) and the tuning table.

    FLASHGEN_TUNING=flashgen/tuning/nvidia_h200_sm90.json \\
        flashgen bench --json docs/bench_h200.json --plot docs/bench_h200.png      # on the GPU
    python tools/bench_report.py docs/bench_h200.json docs/bench_h200_repeat.json \\
        flashgen/tuning/nvidia_h200_sm90.json > BENCHMARKS.md

The second JSON (an independent run of the same code) gives the run-to-run
noise; the tuning table gives what tuning changed.
"""
import json
import statistics
import sys
from collections import defaultdict

IMPLS = ["flashgen", "sdpa-efficient", "sdpa-flash", "sdpa-cudnn", "fa4"]

FWD_NEXT_STEPS = """Toward cuDNN: two steps since these tables were measured (issue 16, H200,
flashgen and cuDNN in the same runs).  (1) Block t's S = QK^T is issued with
block t-1's P V and its softmax runs while P V is on the tensor cores, the
consumer warpgroups taking turns to issue (named barriers), the producer a
register-donating warpgroup for every tier: forward median +10% (0.98-1.19x
per point) against the cubins before.  (2) A persistent grid, one CTA per SM,
the producer loading the next tile while the consumers finish the last, work
units query blocks fastest (L2 sharing) and, under a causal mask, pairs of
query blocks j and last-j (equal work): median +3%, up to +16% at short and
causal points.  Forward / cuDNN is then 0.79-1.21 (median 0.97) in one run;
FlashAttention-4 in a run of 8 bf16 points: flashgen / FA4 1.36-1.55 at 1k
tokens, 0.92-1.03 at 8k (the backward: 0.82-1.02 at 1k, 0.62-0.70 at 8k).
Tried and not kept: all tiles ordered by causal length (lost L2 sharing,
-5 to -16% unmasked), a per-round rotation (-30% causal at 16k); earlier, a one-block software pipeline with one producer warp
(15-25% slower).  Next: the short causal points (0.79-0.89 at 512-1k, d64),
O through shared memory with a TMA store."""

BWD_NEXT_STEPS = """Toward cuDNN (behind from 2k tokens on, level or ahead at 512-1k): dQ now
leaves each CTA as one TMA bulk reduce-add per query block; it was 32 float2
atomics per thread, with the warps stalled on long scoreboard 31% and LSU
throttle 14%.  ncu on bf16, head dim 128, 4 x 4096, not causal: the main
kernel takes 4.12 ms at ncu's clocks (5.05 ms with the atomics), SM
throughput 45% of peak, stalls long scoreboard 22%, wait 20%, barrier 12%,
LG throttle 9%.  Next: overlap the next block's S and dP GEMMs with the
current block's softmax (the two warpgroups taking turns), a second dQ tile
so no consumer waits for the TMA unit to read the last one, and three stages
and fewer spills at head dim 64 (its kernels spill 84-104 bytes).  Outside
this grid, head dims 136-256 run on a split-head-dim tile (two warpgroups
share 64 keys, both compute S and dP, dQ by atomics): at 256, 136-171 TFLOP/s
from 1k to 16k tokens against FlashAttention-2's 137-253 and example 41's
32-40 (a separate `flashgen bench --head-dim 256` run); sharing S and dP
through shared memory instead of computing them twice is the next step there."""


def load(path):
    data = json.load(open(path))
    cells = defaultdict(dict)
    for r in data["results"]:
        p = r["point"]
        cells[(r["direction"], p["dtype"], p["head_dim"], p["causal"], p["seqlen"], p["batch"], p["heads"])][r["impl"]] = r
    return data, cells


def ratio(got, a="flashgen", b="sdpa-efficient"):
    """Speed of a relative to b (b's time / a's time), or None."""
    if got.get(a, {}).get("ms") and got.get(b, {}).get("ms"):
        return got[b]["ms"] / got[a]["ms"]
    return None


def span(values) -> str:
    """'lowest to highest' of the ratios that exist, '-' where none does (a peer missing at
    every point, as fa4 is where flash-attn-4 is not installed)."""
    got = [v for v in values if v is not None]
    return f"{min(got):.2f} to {max(got):.2f}" if got else "-"


def fmt(r) -> str:
    """A ratio for a table cell: '-' where either side has no timing at this point."""
    return f"{r:.2f}" if r else "-"


def fa4_sentence(results) -> str:
    """What the report says about fa4: how its compile was kept out, or why it is missing."""
    timed = [r for r in results if r["impl"] == "fa4" and r.get("ms")]
    if timed:
        firsts = [r["compile_s"] for r in timed if r.get("compile_s") is not None]
        took = f" (first calls took {min(firsts):.1f} s to {max(firsts):.1f} s)" if firsts else ""
        return (f"fa4 is FlashAttention-4 (flash-attn-4), whose CuTe DSL kernels are compiled on the first call"
                f"{took}: that call is a warm-up call, in no timing.")
    notes = sorted({r["note"] for r in results if r["impl"] == "fa4" and r.get("note")})
    return f"fa4 (FlashAttention-4) has no timing in this run{': ' + '; '.join(notes) if notes else ''}."


def main(path: str, repeat_path: str, table_path: str) -> None:
    data, cells = load(path)
    repeat_data, repeat = load(repeat_path)
    table = json.load(open(table_path))
    ratios = {k: ratio(v) for k, v in cells.items()}
    repeat_ratios = {k: ratio(repeat[k]) for k in cells if k in repeat}
    drift = [abs(cells[k][i]["ms"] / repeat[k][i]["ms"] - 1) for k in cells if k in repeat
             for i in ("flashgen", "sdpa-efficient")]
    below = sorted((min(ratios[k], repeat_ratios.get(k, ratios[k])), k) for k in cells
                   if k[0] == "bwd" and ratios[k] < 1)
    vs_flash = {k: ratio(v, b="sdpa-flash") for k, v in cells.items()}
    vs_cudnn = {k: ratio(v, b="sdpa-cudnn") for k, v in cells.items()}
    vs_fa4 = {k: ratio(v, b="fa4") for k, v in cells.items()}
    clearly = [(r, k) for r, k in below if r < 0.995]  # slower in both runs by more than the medians' drift
    print(f"""# Benchmarks

Device: **{data['device']}**.  One run, every implementation side by side:

```sh
flashgen build --arch sm90a --out build/kernels
FLASHGEN_KERNEL_PATH=build/kernels FLASHGEN_TUNING=flashgen/tuning/nvidia_h200_sm90.json \\
    flashgen bench --json docs/bench_h200.json --plot docs/bench_h200.png
python tools/bench_report.py docs/bench_h200.json docs/bench_h200_repeat.json \\
    flashgen/tuning/nvidia_h200_sm90.json > BENCHMARKS.md
```

(The table named is the one `flashgen tune` wrote on this GPU and the wheel
ships; the runtime picks it up by GPU name without the variable.)

TFLOP/s, FlashAttention's convention: forward 4·B·H·M·N·D (halved for causal),
backward 2.5x that.  Hidden 2048 (32 heads of 64 or 16 of 128), batch x seqlen
= 16k tokens.  Every implementation is timed in 10 rounds of 3 calls each, in a
new random order every round (so clock ramps and the after-effects of the
previous kernel fall on all alike), after 3 warm-up calls; the figure is the
median of the 30 CUDA-event timings, and three input sets are used in turn.
Each timing includes the call's host work (flashgen's Python, torch's
dispatcher).  flashgen's backward is timed without autograd; torch SDPA's
backends through `torch.autograd.grad` on one retained forward graph (the
cheapest honest path to their backward kernels).  `noise` is the larger of
flashgen's and efficient's spread of round medians, (slowest - fastest) /
median.  A second full run of the same code (docs/bench_h200_repeat.json)
moved each implementation's median by {statistics.median(drift):.1%} (median)
and at most {max(drift):.1%}.

On this GPU both directions run flashgen's own Hopper families (`sm90_fwd`,
`sm90_bwd`: wgmma, TMA, warp-specialised producers; issue 7).  sdpa-efficient
runs CUTLASS example 41, the kernels flashgen falls back to elsewhere (bias,
dropout, float32, head dims above 256, other GPUs); FlashAttention-2 (sdpa-flash),
cuDNN and FlashAttention-4 are the bars for the Hopper families.
{fa4_sentence(data['results'])}

![TFLOP/s vs seqlen](docs/bench_h200.png)
""")
    for direction, family, next_steps in (("fwd", "sm90_fwd", FWD_NEXT_STEPS), ("bwd", "sm90_bwd", BWD_NEXT_STEPS)):
        keys = [k for k in cells if k[0] == direction]
        name = "Forward" if direction == "fwd" else "Backward"
        behind = sorted((min(vs_flash[k], ratio(repeat.get(k, {}), b="sdpa-flash") or vs_flash[k]), k)
                        for k in keys if vs_flash[k] < 1)
        print(f"## {name} ({family}) against FlashAttention-2, cuDNN and FlashAttention-4\n")
        print(f"flashgen / flash over the {len(keys)} {name.lower()} points: {span(vs_flash[k] for k in keys)}; "
              f"flashgen / cudnn: {span(vs_cudnn[k] for k in keys)}; flashgen / fa4: {span(vs_fa4[k] for k in keys)}.")
        if behind:
            print(f"{name} points behind FlashAttention-2 in this run or the repeat run (lower ratio of the two):")
            for r, k in behind:
                print(f"- {k[1]} head dim {k[2]}{' causal' if k[3] else ''} {k[5]} x {k[4]}: {r:.3f}")
        else:
            print(f"No {name.lower()} point is behind FlashAttention-2 in either run.")
        print("\n" + next_steps + "\n")
    worst = {d: min(min(ratios[k], repeat_ratios.get(k, ratios[k])) for k in cells if k[0] == d) for d in ("fwd", "bwd")}
    print(f"""## Against sdpa-efficient (the example-41 kernels)

Lowest flashgen / efficient ratio of the two runs: forward {worst['fwd']:.2f}, backward {worst['bwd']:.2f}.
{len(clearly)} points are below 0.995 in both runs (slower by more than the run-to-run drift).
""")
    for r, key in clearly:
        d, dtype, hd, causal, s, b, h = key
        print(f"- {d} {dtype} head dim {hd}{' causal' if causal else ''} {b} x {s}: {ratios[key]:.3f} "
              f"(repeat run {repeat_ratios.get(key, float('nan')):.3f})")
    for direction in ("fwd", "bwd"):
        print(f"\n## {'Forward' if direction == 'fwd' else 'Backward'}\n")
        print("| dtype | hdim | causal | B x S | " + " | ".join(IMPLS) +
              " | flashgen / efficient | flashgen / flash | flashgen / cudnn | flashgen / fa4 | noise |")
        print("|---" * (9 + len(IMPLS)) + "|")
        for key in sorted(k for k in cells if k[0] == direction):
            _, dtype, hd, causal, s, b, h = key
            got = cells[key]
            vals = " | ".join(f"{got[i]['tflops']:.0f}" if got.get(i, {}).get("tflops") else "-" for i in IMPLS)
            spreads = [got[i]["spread"] for i in ("flashgen", "sdpa-efficient") if got.get(i, {}).get("spread")]
            print(f"| {dtype} | {hd} | {'yes' if causal else 'no'} | {b} x {s} | {vals} | {fmt(ratios[key])} | "
                  f"{fmt(vs_flash[key])} | {fmt(vs_cudnn[key])} | {fmt(vs_fa4[key])} | "
                  f"{f'{max(spreads):.0%}' if spreads else '-'} |")
    print("\n## Per-call host overhead and import time\n")
    print("A tiny problem (1 x 128 x 1 x 64, f16), wall time per call over 500 back-to-back calls, median of")
    print("9 rounds with the implementations interleaved; flashgen's calls repeat one signature and take the")
    print("launch plan (flashgen/runtime/plans.py), as every training step after the first does.  On the")
    print("H200 the backward is sm90_bwd: one allocation, three launches (prep, the main kernel, dQ's")
    print("conversion), four tensor maps re-encoded only when an input's address moved.\n")
    print("First run / repeat run:\n")
    for name, us in data["overhead_us"].items():
        print(f"- {name}: {us:.1f} us / {repeat_data['overhead_us'].get(name, float('nan')):.1f} us")
    print("\nImport, median of 5 fresh interpreters (no GPU work):\n")
    for name, ms in data.get("import_ms", {}).items():
        print(f"- `{name}`: {ms:.1f} ms")
    print(f"""
## Tuning table

`flashgen tune` on the same GPU measured {len(table['measured']['points'])} point/direction pairs
({table['measured']['command']}, {table['measured']['repeats']} timed calls each); {len(table['entries'])}
buckets beat the priority order by more than 1% and are in
`flashgen/tuning/nvidia_h200_sm90.json`:
""")
    for m in table["measured"]["points"]:
        if m["chosen"] == "default":
            continue
        p, ms = m["point"], m["ms"]
        print(f"- {m['direction']} {p['dtype']} head dim {p['head_dim']}{' causal' if p['causal'] else ''} "
              f"{p['batch']} x {p['seqlen']}: {m['chosen']} {ms[m['chosen']]:.3f} ms vs {ms['default']:.3f} ms "
              f"({ms['default'] / ms[m['chosen']] - 1:+.0%})")


if __name__ == "__main__":
    main(*sys.argv[1:4])
