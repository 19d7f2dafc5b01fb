"""The table and notes ``flashgen bench`` prints (kept apart from the command's options)."""
from __future__ import annotations

from typing import List

from flashgen.cli import _table


# --all-instances: the runtime's own choice, timed back to back with the tiles (bench.bench_point)
DEFAULT_TILE = "flashgen[default]"


def _ratio(got: dict, a: str, b: str) -> str:
    return f"{got[a] / got[b]:.2f}" if got.get(a) and got.get(b) else "-"


def _masking(point) -> str:
    """The table's causal cell: yes / no, or the block mask the point runs under; a score mod after it."""
    masking = point.mask or ("yes" if point.causal else "no")
    return f"{masking}+{point.score_mod}" if getattr(point, "score_mod", "") else masking


def bench_table(grid, results, impls, all_instances: bool) -> str:
    """TFLOP/s per point and direction (H/Hk: query and key/value heads, so a GQA row is told from
    its multi-head twin), a column per implementation, and the two ratios asked
    most: flashgen against sdpa-efficient (fg/efficient, with the noise to judge it by) and what
    the PyTorch adapter keeps of the direct CuPy calls' speed (fg-torch/fg); then, for the peers
    that compile on first use, that first call's seconds (kept out of their TFLOP/s)."""
    from flashgen.bench import JIT_IMPLS

    vs_efficient = "flashgen" in impls and "sdpa-efficient" in impls
    vs_direct = "flashgen" in impls and "flashgen-torch" in impls
    jit = [i for i in impls if i in JIT_IMPLS]
    header = (["dtype", "hdim", "H/Hk", "causal", "seqlen", "dir"] + list(impls)
              + (["best instance / its default"] if all_instances else [])
              + (["fg/efficient", "noise"] if vs_efficient else []) + (["fg-torch/fg"] if vs_direct else [])
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
