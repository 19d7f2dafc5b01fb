"""Write BENCHMARKS.md from `flashgen bench --json` files (and the --plot image) and the tuning table.

    FLASHGEN_TUNING=<table> flashgen bench --json docs/bench_h200.json --plot docs/bench_h200.png  # on the GPU
    flashgen bench --group 4 --group 8 --seqlen 2048 --seqlen 8192 \\
        --impl flashgen --impl flashgen-torch --impl fa4 --impl sdpa-cudnn --json docs/bench_h200_gqa.json
    flashgen bench --timing queued --json docs/bench_h200_queued.json  # the short points' GPU time
    flashgen bench --variant bias --variant dropout --json docs/bench_h200_variants.json  # issue 17's bars
    python tools/bench_report.py --update BENCHMARKS.md [--queued docs/bench_h200_queued.json] \\
        [--variants docs/bench_h200_variants.json] docs/bench_h200.json docs/bench_h200_repeat.json <table> docs/bench_h200_gqa.json [flashgen-torch runs ...]

The second JSON (an independent run of the same code) gives the run-to-run
noise; the tuning table (the one the runs used) gives what tuning changed.
Without ``--update`` the report goes to standard output.  With it, the file's own
sections (a "## " heading this report does not write: a session's measurements,
the bias, dropout and block-mask studies) are kept, each after the generated
section it followed, and the file is replaced atomically (flashgen.atomic: flashgen installed,
or PYTHONPATH=. from the repository's root).
"""
import argparse
import contextlib
import io
import json
import re
import statistics
import sys
from collections import defaultdict

from flashgen.atomic import atomic_write_text

IMPLS = ["flashgen", "sdpa-efficient", "sdpa-flash", "sdpa-cudnn", "fa4"]

def load(path):
    """The run and its results by point: (direction, dtype, head dim, causal, seqlen, batch, heads,
    group).  Files written before GQA points existed have no group: they are multi-head (group 1),
    so they still pair with a newer repeat run point for point."""
    data = json.load(open(path))
    cells = defaultdict(dict)
    for r in data["results"]:
        p = r["point"]
        if p.get("mask") or p.get("score_mod") or p.get("variant"):  # --mask/--score-mod/--variant: not these tables
            continue
        cells[(r["direction"], p["dtype"], p["head_dim"], p["causal"], p["seqlen"], p["batch"], p["heads"],
               p.get("group", 1))][r["impl"]] = r
    return data, cells


def shape(key) -> str:
    """'B x S' of a point, and its query/key-value heads where it is grouped-query, so a GQA
    point never reads as its multi-head twin."""
    _, _, _, _, s, b, h, g = key
    return f"{b} x {s}" + (f", {h}/{h // g} heads" if g > 1 else "")


def ratio(got, a="flashgen", b="sdpa-efficient"):
    """Speed of a relative to b (b's time / a's time), or None."""
    if got.get(a, {}).get("ms") and got.get(b, {}).get("ms"):
        return got[b]["ms"] / got[a]["ms"]
    return None


def lower(a, b):
    """The lower of a run's ratio and its repeat run's, of those that exist (a peer without a GQA
    kernel, as sdpa-efficient, has none at a GQA point); None where neither does."""
    got = [r for r in (a, b) if r is not None]
    return min(got) if got else None


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


def torch_ratios(cells, direction: str) -> list:
    """flashgen-torch / flashgen at every point of ``direction`` where both have a timing."""
    return [r for k, v in cells.items() if k[0] == direction
            for r in [ratio(v, a="flashgen-torch", b="flashgen")] if r is not None]


def torch_summary(cells) -> None:
    """What torch callers get: flashgen through flashgen.torch (forward through the op, backward by
    autograd, as a training step) over flashgen on CuPy arrays, per direction."""
    print("\n## Through flashgen.torch\n")
    for direction in ("fwd", "bwd"):
        rs = torch_ratios(cells, direction)
        if rs:
            print(f"- {direction}: flashgen-torch / flashgen {min(rs):.2f} to {max(rs):.2f}, "
                  f"median {statistics.median(rs):.2f}")


def adapter_section(paths) -> None:
    """flashgen-torch / flashgen from runs of the two alone, each named with its timing mode, and
    the adapter's own host cost per call: its call minus torch's autograd floor (a no-op op of
    the same shape, bench.py: _noop_op) beside the CuPy path's."""
    print("\n## flashgen.torch against flashgen on CuPy arrays\n")
    print("`flashgen bench --impl flashgen --impl flashgen-torch --timing T`, the default grid; `queued` issues")
    print("each implementation's calls back to back as a training loop does (each call between its own")
    print("events), `call` times each call alone with its host work before the launch.\n")
    runs = [load(path) for path in paths]
    for path, (data, cells) in zip(paths, runs):
        for direction in ("fwd", "bwd"):
            rs = torch_ratios(cells, direction)
            print(f"- {path} ({data.get('timing', 'call')}), {direction}: {span(rs)}, "
                  f"median {statistics.median(rs):.3f}")
    data = runs[0][0]["overhead_us"]
    floor = {d: data.get(f"no-op torch op {d}") for d in ("forward", "backward (autograd.grad)")}
    if all(floor.values()):
        print(f"\nHost cost per call ({paths[0]}), what the adapter adds over torch's autograd floor:\n")
        for d, cupy in (("forward", "flashgen.attention_forward"), ("backward (autograd.grad)",
                                                                     "flashgen.attention_backward")):
            own = data[f"flashgen.torch {d}"] - floor[d]
            print(f"- {d}: flashgen.torch {data[f'flashgen.torch {d}']:.1f} us - no-op op {floor[d]:.1f} us = "
                  f"{own:.1f} us, {own / data[cupy]:.2f}x the CuPy path's {data[cupy]:.1f} us")


def tflops_cells(got, impls) -> str:
    """A table row's TFLOP/s cells, '-' where an implementation has no timing at this point."""
    return " | ".join(f"{got[i]['tflops']:.0f}" if got.get(i, {}).get("tflops") else "-" for i in impls)


def point_table(cells, shape_header: str, impls, peers: dict, noise: bool = False) -> None:
    """One row per point: each of ``impls``' TFLOP/s, flashgen / each peer (``peers``: impl -> the
    name in the header) and, with ``noise``, the largest spread of round medians among ``impls``."""
    print(f"\n| dir | dtype | hdim | causal | {shape_header} | " + " | ".join(impls) + " | " +
          " | ".join(f"flashgen / {name}" for name in peers.values()) + (" | noise |" if noise else " |"))
    print("|---" * (5 + len(impls) + len(peers) + noise) + "|")
    for key in sorted(cells):
        d, dtype, hd, causal = key[:4]
        got = cells[key]
        row = (f"| {d} | {dtype} | {hd} | {'yes' if causal else 'no'} | {shape(key)} | {tflops_cells(got, impls)} | " +
               " | ".join(fmt(ratio(got, b=peer)) for peer in peers) + " |")
        if noise:
            spreads = [got[i]["spread"] for i in impls if got.get(i, {}).get("spread")]
            row += f" {f'{max(spreads):.0%}' if spreads else '-'} |"
        print(row)


def standing_table(direction: str, runs) -> None:
    """Issue 16's bar per head dim and mask: flashgen / cuDNN and / FlashAttention-4, lowest to
    highest over the points, in each run (``runs``: [(name, cells)], the queued run's GPU time
    beside the lone-call runs', which count host work), and how many points are at or above the
    peer in every run."""
    names = ", ".join(name for name, _ in runs)
    print(f"\nflashgen / peer per head dim and mask ({names}), and the points at or above the peer in every run:\n")
    print(f"| hdim | causal | / cudnn ({names}) | / fa4 ({names}) | >= cudnn | >= fa4 |")
    print("|---" * 6 + "|")
    groups = sorted({(k[2], k[3]) for k in runs[0][1] if k[0] == direction and k[7] == 1})
    for hd, causal in groups:
        cells = []
        counts = []
        for peer in ("sdpa-cudnn", "fa4"):
            per_run = [{k: ratio(v, b=peer) for k, v in run.items() if k[0] == direction and k[2:4] == (hd, causal)
                        and k[7] == 1} for _, run in runs]
            cells.append(", ".join(span(r.values()).replace(" to ", "-") for r in per_run))
            points = [k for k in per_run[0] if all(r.get(k) is not None for r in per_run)]
            counts.append(f"{sum(all(r[k] >= 1 for r in per_run) for k in points)}/{len(points)}")
        print(f"| {hd} | {'yes' if causal else 'no'} | {cells[0]} | {cells[1]} | {counts[0]} | {counts[1]} |")
    print()


def gqa_section(path: str) -> None:
    """Grouped-query points (``flashgen bench --group``) from a run of their own."""
    data, cells = load(path)
    impls = [i for i in ("flashgen", "flashgen-torch", "fa4", "sdpa-cudnn")
             if any(i in v for v in cells.values())]
    print(f"\n## Grouped-query attention ({path})\n")
    print("Query heads / k/v heads as in the shape; k and v are read in place (no repeat).\n")
    for direction in ("fwd", "bwd"):
        keys = [k for k in cells if k[0] == direction]
        print(f"- {direction}: flashgen / cudnn {span(ratio(cells[k], b='sdpa-cudnn') for k in keys)}, "
              f"flashgen / fa4 {span(ratio(cells[k], b='fa4') for k in keys)}")
    point_table(cells, "B x S, heads", impls, {"sdpa-cudnn": "cudnn", "fa4": "fa4"})


def queued_section(path: str, run) -> None:
    """The grid again with ``--timing queued``: each round's calls back to back, so a call's time is the
    GPU's.  Below about 0.3 ms a lone call's timing (the main run) moves 14-49% between rounds (session
    27, H100); queued it moves 1-6%, so these are the figures that decide the short points.  ``run``:
    load(path), which main() also reads for the standing tables."""
    data, cells = run
    peers = [i for i in ("sdpa-cudnn", "fa4", "sdpa-flash") if any(i in v for v in cells.values())]
    print(f"\n## GPU time: the grid with queued calls ({path})\n")
    print(f"`flashgen bench --timing queued` on {data['device']}: a round's calls are issued back to back after "
          "one untimed call, each between its own CUDA events, so a call's time is the GPU's and host work is "
          "hidden, as in a training loop.\n")
    for direction in ("fwd", "bwd"):
        keys = [k for k in cells if k[0] == direction]
        print(f"- {'Forward' if direction == 'fwd' else 'Backward'}: " + "; ".join(
            f"flashgen / {peer} {span(ratio(cells[k], b=peer) for k in keys)}" for peer in peers) + ".")
    point_table(cells, "B x S", ["flashgen"] + peers, {peer: peer for peer in peers}, noise=True)


# Issue 17's bars: a bias or dropout call within 15% of the plain one, 2.5x example 41's
BAR_PLAIN, BAR_EXAMPLE41 = 0.85, 2.5


def at_bar(values, bar: float) -> str:
    """'n of m': how many of the ratios that exist reach ``bar``."""
    got = [v for v in values if v is not None]
    return f"{sum(v >= bar for v in got)} of {len(got)}" if got else "-"


def variant_command(path: str) -> str:
    """The ``flashgen bench --variant`` command a run recorded, writing where the report reads it."""
    command = json.load(open(path))["command"]
    return re.sub(r"--json \S+", f"--json {path}", command) if "--json" in command else f"{command} --json {path}"


def variants_section(paths) -> None:
    """Bias and dropout points (``flashgen bench --variant``), per variant, head dim and direction:
    flashgen against the same call without them and against example 41, with how many points clear
    issue 17's bars, and what flashgen.torch keeps of the CuPy call."""
    points = defaultdict(dict)
    for path in paths:
        for r in json.load(open(path))["results"]:
            p = r["point"]
            if p.get("variant"):
                key = (p["variant"], p["head_dim"], r["direction"], path, p["dtype"], p["causal"], p["seqlen"],
                       p.get("group", 1))
                points[key][r["impl"]] = r
    print(f"\n## Bias and dropout ({', '.join(paths)})\n")
    print("`flashgen bench --variant bias|dropout`: flashgen with the variant against the same call without it "
          "(flashgen-plain) and on example 41's kernels (flashgen-example41), in the same rounds; ranges over "
          f"dtypes, masks and lengths, and the points at or above issue 17's bars ({BAR_PLAIN}, {BAR_EXAMPLE41}).\n")
    print("| variant | head dim | dir | flashgen / plain | at the bar | flashgen / example 41 | at the bar | "
          "flashgen.torch / flashgen |")
    print("|---" * 8 + "|")
    for group in sorted({k[:3] for k in points}, key=lambda g: (g[0], g[1], g[2] != "fwd")):
        cells = [got for k, got in points.items() if k[:3] == group]
        plain = [ratio(got, b="flashgen-plain") for got in cells]
        ex41 = [ratio(got, b="flashgen-example41") for got in cells]
        adapter = [ratio(got, "flashgen-torch", "flashgen") for got in cells]
        print(f"| {' | '.join(map(str, group))} | {span(plain)} | {at_bar(plain, BAR_PLAIN)} | {span(ex41)} | "
              f"{at_bar(ex41, BAR_EXAMPLE41)} | {span(adapter)} |")


def main(path: str, repeat_path: str, table_path: str, gqa_path: str = "", *adapter_paths: str,
         queued_path: str = "", variant_paths=()) -> None:
    data, cells = load(path)
    repeat_data, repeat = load(repeat_path)
    table = json.load(open(table_path))
    ratios = {k: ratio(v) for k, v in cells.items()}
    repeat_ratios = {k: ratio(repeat[k]) for k in cells if k in repeat}
    drift = [abs(cells[k][i]["ms"] / repeat[k][i]["ms"] - 1) for k in cells if k in repeat
             for i in ("flashgen", "sdpa-efficient")
             if cells[k].get(i, {}).get("ms") and repeat[k].get(i, {}).get("ms")]
    below = sorted((lower(ratios[k], repeat_ratios.get(k)), k) for k in cells
                   if k[0] == "bwd" and ratios[k] is not None and ratios[k] < 1)
    vs_flash = {k: ratio(v, b="sdpa-flash") for k, v in cells.items()}
    vs_cudnn = {k: ratio(v, b="sdpa-cudnn") for k, v in cells.items()}
    vs_fa4 = {k: ratio(v, b="fa4") for k, v in cells.items()}
    clearly = [(r, k) for r, k in below if r < 0.995]  # slower in both runs by more than the medians' drift
    queued_run = f"\nflashgen bench --timing queued --json {queued_path}" if queued_path else ""
    queued_option = f" --queued {queued_path}" if queued_path else ""
    variant_runs = "".join(f"\n{variant_command(path)}" for path in variant_paths)
    variant_options = "".join(f" \\\n    --variants {path}" for path in variant_paths)
    print(f"""# Benchmarks

Device: **{data['device']}**.  One run, every implementation side by side:

```sh
flashgen build --arch sm90a --out build/kernels
FLASHGEN_KERNEL_PATH=build/kernels FLASHGEN_TUNING={table_path} \\
    flashgen bench --json docs/bench_h200.json --plot docs/bench_h200.png
flashgen bench --group 4 --group 8 --seqlen 2048 --seqlen 8192 \\
    --impl flashgen --impl flashgen-torch --impl fa4 --impl sdpa-cudnn --json docs/bench_h200_gqa.json
flashgen bench --impl flashgen --impl flashgen-torch --timing queued --json docs/bench_h200_torch_queued.json{queued_run}{variant_runs}
python tools/bench_report.py --update BENCHMARKS.md{queued_option} docs/bench_h200.json docs/bench_h200_repeat.json \\
    {table_path} docs/bench_h200_gqa.json docs/bench_h200_torch_queued.json \\
    docs/bench_h200_torch_queued_repeat.json docs/bench_h200_torch_call.json{variant_options}
```

(The table named is the one these runs used, written by `flashgen tune` on this
GPU; the runtime picks up the table the wheel ships, flashgen/tuning/, by GPU name
without the variable.)

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
    queued = load(queued_path) if queued_path else None
    runs = [("run", cells), ("repeat", repeat)] + ([("queued", queued[1])] if queued else [])
    for direction, family in (("fwd", "sm90_fwd"), ("bwd", "sm90_bwd")):
        keys = [k for k in cells if k[0] == direction]
        name = "Forward" if direction == "fwd" else "Backward"
        behind = sorted((lower(vs_flash[k], ratio(repeat.get(k, {}), b="sdpa-flash")), k)
                        for k in keys if vs_flash[k] is not None and vs_flash[k] < 1)
        print(f"## {name} ({family}) against FlashAttention-2, cuDNN and FlashAttention-4\n")
        print(f"flashgen / flash over the {len(keys)} {name.lower()} points: {span(vs_flash[k] for k in keys)}; "
              f"flashgen / cudnn: {span(vs_cudnn[k] for k in keys)}; flashgen / fa4: {span(vs_fa4[k] for k in keys)}.")
        if behind:
            print(f"{name} points behind FlashAttention-2 in this run or the repeat run (lower ratio of the two):")
            for r, k in behind:
                print(f"- {k[1]} head dim {k[2]}{' causal' if k[3] else ''} {shape(k)}: {r:.3f}")
        else:
            print(f"No {name.lower()} point is behind FlashAttention-2 in either run.")
        standing_table(direction, runs)
    worst = {d: min((lower(ratios[k], repeat_ratios.get(k)) for k in cells if k[0] == d and ratios[k] is not None),
                    default=None) for d in ("fwd", "bwd")}
    print(f"""## Against sdpa-efficient (the example-41 kernels)

Lowest flashgen / efficient ratio of the two runs: forward {fmt(worst['fwd'])}, backward {fmt(worst['bwd'])}.
{len(clearly)} points are below 0.995 in both runs (slower by more than the run-to-run drift).
""")
    for r, key in clearly:
        d, dtype, hd, causal = key[:4]
        print(f"- {d} {dtype} head dim {hd}{' causal' if causal else ''} {shape(key)}: {ratios[key]:.3f} "
              f"(repeat run {repeat_ratios.get(key, float('nan')):.3f})")
    for direction in ("fwd", "bwd"):
        print(f"\n## {'Forward' if direction == 'fwd' else 'Backward'}\n")
        print("| dtype | hdim | causal | B x S | " + " | ".join(IMPLS) +
              " | flashgen / efficient | flashgen / flash | flashgen / cudnn | flashgen / fa4 | noise |")
        print("|---" * (9 + len(IMPLS)) + "|")
        for key in sorted(k for k in cells if k[0] == direction):
            _, dtype, hd, causal = key[:4]
            got = cells[key]
            vals = tflops_cells(got, IMPLS)
            spreads = [got[i]["spread"] for i in ("flashgen", "sdpa-efficient") if got.get(i, {}).get("spread")]
            print(f"| {dtype} | {hd} | {'yes' if causal else 'no'} | {shape(key)} | {vals} | {fmt(ratios[key])} | "
                  f"{fmt(vs_flash[key])} | {fmt(vs_cudnn[key])} | {fmt(vs_fa4[key])} | "
                  f"{f'{max(spreads):.0%}' if spreads else '-'} |")
    torch_summary(cells)
    if adapter_paths:
        adapter_section(adapter_paths)
    if gqa_path:
        gqa_section(gqa_path)
    if queued:
        queued_section(queued_path, queued)
    if variant_paths:
        variants_section(variant_paths)
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
`{table_path}`:
""")
    for m in table["measured"]["points"]:
        if m["chosen"] == "default":
            continue
        p, ms = m["point"], m["ms"]
        print(f"- {m['direction']} {p['dtype']} head dim {p['head_dim']}{' causal' if p['causal'] else ''} "
              f"{p['batch']} x {p['seqlen']}: {m['chosen']} {ms[m['chosen']]:.3f} ms vs {ms['default']:.3f} ms "
              f"({ms['default'] / ms[m['chosen']] - 1:+.0%})")


def sections(text: str):
    """[(heading, text)] of a markdown file, split at its "## " lines; the part before the first is
    the heading None."""
    parts, heading, lines = [], None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            parts.append((heading, "".join(lines)))
            heading, lines = line.strip(), []
        lines.append(line)
    parts.append((heading, "".join(lines)))
    return parts


# The sections main() writes (some only when given their runs): regenerated, never kept
GENERATED_EXACT = {"## Forward", "## Backward", "## Tuning table"}
GENERATED_PREFIXES = ("## Forward (sm90_fwd)", "## Backward (sm90_bwd)", "## Against sdpa-efficient",
                      "## Through flashgen.torch", "## flashgen.torch against flashgen on CuPy arrays",
                      "## Grouped-query attention (", "## Per-call host overhead", "## GPU time: the grid with queued",
                      "## Bias and dropout (")


def is_generated(heading: str) -> bool:
    return heading in GENERATED_EXACT or heading.startswith(GENERATED_PREFIXES)


def merge(generated: str, old: str) -> str:
    """The generated report with the old file's hand-written sections put back: each after the
    generated section it followed there (or after the preamble), those whose generated section is
    gone at the end.  The old file's generated sections are dropped, also those this run did not
    write (no GQA run given, say)."""
    new_parts = sections(generated)
    produced = {h for h, _ in new_parts}
    kept, anchor = defaultdict(list), None
    for heading, text in sections(old):
        if heading is None or heading in produced or is_generated(heading):
            anchor = heading
        else:
            kept[anchor].append(text.rstrip("\n") + "\n\n")
    out = []
    for heading, text in new_parts:  # every section ends in one blank line
        out.append(text.rstrip("\n") + "\n\n")
        out.extend(kept.pop(heading, []))
    for texts in kept.values():
        out.extend(texts)
    return "".join(out).rstrip("\n") + "\n"


def update(path: str, args, queued_path: str = "", variant_paths=()) -> None:
    """Regenerate ``path`` in place, keeping its hand-written sections; written atomically."""
    with open(path) as f:
        old = f.read()
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        main(*args, queued_path=queued_path, variant_paths=variant_paths)
    atomic_write_text(path, merge(report.getvalue(), old))


def parse_args(argv):
    """The command line: options anywhere among the runs (RUN REPEAT TABLE [GQA [TORCH RUNS ...]])."""
    parser = argparse.ArgumentParser(description="Write BENCHMARKS.md from flashgen bench --json runs.")
    parser.add_argument("--update", metavar="BENCHMARKS.md", default="",
                        help="regenerate this file in place, keeping its hand-written sections")
    parser.add_argument("--queued", metavar="QUEUED_RUN", default="", help="the grid timed with --timing queued")
    parser.add_argument("--variants", metavar="VARIANT_RUN", action="append", default=[],
                        help="a flashgen bench --variant run (repeatable): the bias and dropout section")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="RUN REPEAT TABLE [GQA [TORCH RUNS ...]]")
    args = parser.parse_intermixed_args(argv)
    if len(args.runs) < 3:
        parser.error("needs at least a run, its repeat run and the tuning table")
    return args


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    if args.update:
        update(args.update, args.runs, args.queued, args.variants)
    else:
        main(*args.runs, queued_path=args.queued, variant_paths=args.variants)
