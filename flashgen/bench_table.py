"""The table, notes and plot ``flashgen bench`` prints and draws (kept apart from the command's options)."""
from __future__ import annotations

import math
from typing import Dict, List

from flashgen.cli import _table


# --all-instances: the runtime's own choice, timed back to back with the tiles (bench.bench_point)
DEFAULT_TILE = "flashgen[default]"


def _ratio(got: dict, a: str, b: str) -> str:
    return f"{got[a] / got[b]:.2f}" if got.get(a) and got.get(b) else "-"


def _masking(point) -> str:
    """The table's causal cell: yes / no, or the block mask the point runs under; a score mod, a bias
    or dropout after it."""
    masking = point.mask or ("yes" if point.causal else "no")
    return "+".join([masking] + [extra for extra in (point.score_mod, point.variant) if extra])


def columns(impls, results) -> List[str]:
    """The asked implementations, then those the points added themselves (bench_variants' twins of
    flashgen), in the order they first appear; the tiles of --all-instances have a column of their own."""
    added = dict.fromkeys(r.impl for r in results if r.impl not in impls and not r.impl.startswith("flashgen["))
    return list(impls) + list(added)


def bench_table(grid, results, impls, all_instances: bool) -> str:
    """TFLOP/s per point and direction (H/Hk: query and key/value heads, so a GQA row is told from
    its multi-head twin), a column per implementation, and the two ratios asked
    most: flashgen against sdpa-efficient (fg/efficient, with the noise to judge it by) and what
    the PyTorch adapter keeps of the direct CuPy calls' speed (fg-torch/fg); at bias and dropout
    points, flashgen against the same call without them (fg/plain) and on example 41's kernels
    (fg/ex41); then, for the peers that compile on first use, that first call's seconds (kept out
    of their TFLOP/s)."""
    from flashgen.bench import JIT_IMPLS

    impls = columns(impls, results)
    vs_efficient = "flashgen" in impls and "sdpa-efficient" in impls
    vs_direct = "flashgen" in impls and "flashgen-torch" in impls
    twins = [(label, twin) for label, twin in (("fg/plain", "flashgen-plain"), ("fg/ex41", "flashgen-example41"))
             if "flashgen" in impls and twin in impls]
    jit = [i for i in impls if i in JIT_IMPLS]
    header = (["dtype", "hdim", "H/Hk", "causal", "seqlen", "dir"] + list(impls)
              + (["best instance / its default"] if all_instances else [])
              + (["fg/efficient", "noise"] if vs_efficient else []) + (["fg-torch/fg"] if vs_direct else [])
              + [label for label, _ in twins]
              + [f"{i} compile s" for i in jit])
    table = []
    for point in grid:
        for direction in ("fwd", "bwd"):
            here = [r for r in results if r.point == point and r.direction == direction]
            got = {r.impl: r.tflops for r in here}
            row = [point.dtype, point.head_dim, point.heads_label, _masking(point), point.seqlen, direction]
            row += [f"{got[i]:.0f}" if got.get(i) else "-" for i in impls]
            if all_instances:  # the best tile against the runtime's choice timed alike (not the columns)
                tiles = {i: t for i, t in got.items() if i.startswith("flashgen[") and i != DEFAULT_TILE and t}
                best = max(tiles, key=tiles.get) if tiles else None
                versus = f" {tiles[best] / got[DEFAULT_TILE]:.2f}x" if best and got.get(DEFAULT_TILE) else ""
                row.append(f"{best[len('flashgen['):-1]}{versus}" if best else "-")
            if vs_efficient:
                noise = [r.spread for r in here if r.impl in ("flashgen", "sdpa-efficient") and r.spread is not None]
                row += [_ratio(got, "flashgen", "sdpa-efficient"), f"{max(noise):.0%}" if noise else "-"]
            if vs_direct:
                row.append(_ratio(got, "flashgen-torch", "flashgen"))
            row += [_ratio(got, "flashgen", twin) for _, twin in twins]
            compiled = {r.impl: r.compile_s for r in here if r.compile_s is not None}
            row += [f"{compiled[i]:.1f}" if i in compiled else "-" for i in jit]
            table.append(row)
    return _table(header, table)


def bench_notes(results) -> List[str]:
    """Why cells are "-": each implementation's distinct notes (an import that failed, a point a
    peer does not support), with how many of its results carry each."""
    counts: dict = {}
    for r in results:
        if r.note:
            counts[(r.impl, r.note)] = counts.get((r.impl, r.note), 0) + 1
    total = {impl: sum(r.impl == impl for r in results) for impl, _ in counts}
    return [f"no timing, {impl}: {note} ({n} of {total[impl]})" for (impl, note), n in counts.items()]


def plot_series(results) -> Dict[str, Dict[str, list]]:
    """{panel title: {impl: [(seqlen, TFLOP/s), ...]}}, panels in a stable order.  A panel is one
    dtype, head dim, mask, head grouping and direction, so only the seqlen varies along a line: a
    GQA point and its multi-head twin (same seqlen) land on separate panels, never one zigzag."""
    def panel(r):
        p = r.point
        return p.dtype, p.head_dim, p.causal, p.group, p.heads, p.mask, p.score_mod, p.variant, r.direction

    series: Dict[str, Dict[str, list]] = {}
    for key in sorted({panel(r) for r in results}):
        dtype, hd, causal, group, heads, mask, mod, variant, direction = key
        title = (f"{direction} {dtype} hdim {hd}{' causal' if causal else ''}"
                 f"{f' GQA {heads}/{heads // group}' if group > 1 else ''}"
                 + "".join(f" {extra}" for extra in (mask, mod, variant) if extra))
        lines = {impl: sorted((r.point.seqlen, r.tflops) for r in results
                              if r.impl == impl and r.tflops and panel(r) == key)
                 for impl in sorted({r.impl for r in results})}
        series[title] = {impl: pts for impl, pts in lines.items() if pts}
    return series


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plot_series(results)
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for impl, pts in lines.items():
            ax.plot([s for s, _ in pts], [t for _, t in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
