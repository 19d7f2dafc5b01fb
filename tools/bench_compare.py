"""Did a change make any grid point slower?  Compare one implementation across two sets of
`flashgen bench --json` runs (new and old code over the same cubins, runs alternated).

    flashgen bench --impl flashgen --json new1.json        # in the new tree, then the old one,
    (cd ../old && flashgen bench --impl flashgen --json ../old1.json)   # alternating, 2-3 times
    python tools/bench_compare.py new1.json,new2.json old1.json,old2.json [--impl flashgen]

Per point, the median TFLOP/s of the new runs over the median of the old ones; the old
runs' own spread ((max - min) / median) is the run-to-run noise a slowdown must exceed.  With
both directions in the runs, each gets a summary of its own: a change to one kernel leaves the
other's ratios as the session's noise floor.
"""
from __future__ import annotations

import argparse
import json
import statistics


def load(path: str, impl: str) -> dict:
    """{(point, direction): TFLOP/s} of ``impl`` in one bench JSON.  A point without a group (a
    file from before GQA points) is multi-head, group 1, and one without a mask, score mod or variant
    (bias, dropout) has none, so old and new files still pair up."""
    with open(path) as f:
        results = json.load(f)["results"]
    absent = {"group": 1, "mask": "", "score_mod": "", "variant": ""}
    return {(json.dumps({**absent, **r["point"]}, sort_keys=True), r["direction"]): r["tflops"]
            for r in results if r["impl"] == impl and r["tflops"]}


def compare(new_runs, old_runs):
    """(new/old ratio, old spread, point, direction) per point both sides measured, slowest first."""
    rows = []
    for key in set.intersection(*(set(r) for r in new_runs + old_runs)):
        new, old = [r[key] for r in new_runs], [r[key] for r in old_runs]
        spread = (max(old) - min(old)) / statistics.median(old)
        rows.append((statistics.median(new) / statistics.median(old), spread, json.loads(key[0]), key[1]))
    return sorted(rows, key=lambda row: row[0])


def direction_summary(rows, direction: str) -> str:
    ratios = [r[0] for r in rows if r[3] == direction]
    return (f"{direction} ({len(ratios)}): median {statistics.median(ratios):.3f}, "
            f"{min(ratios):.3f}-{max(ratios):.3f}")


def print_comparison(rows, show: int) -> None:
    """The summary of ``compare``'s rows (per direction too, when both are there), the ``show`` slowest, and
    as many of those faster than the old runs' spread, fastest first."""
    ratios = [r[0] for r in rows]
    beyond = [r for r in rows if r[0] < 1 - r[1]]
    gains = [r for r in rows if r[0] > 1 + r[1]]
    print(f"{len(rows)} points: new/old median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}; slower than the old runs' own spread: {len(beyond)}, faster: {len(gains)}")
    directions = sorted({r[3] for r in rows})
    if len(directions) > 1:  # a change to one direction: the other's ratios are the noise floor
        print("  " + "; ".join(direction_summary(rows, d) for d in directions))
    for row in rows[:show]:
        print(row_line(*row))
    if show and gains:
        print("  faster:")
        for row in gains[::-1][:show]:
            print(row_line(*row))


def row_line(ratio, spread, p, direction) -> str:
    gqa = f" H{p['heads']}/{p['heads'] // p['group']}" if p["group"] > 1 else ""
    return (f"  {ratio:.3f} (old spread {spread:.1%}) {p['dtype']} d{p['head_dim']} "
            f"{'causal' if p['causal'] else 'full'}{gqa} S{p['seqlen']} {direction}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new", help="comma-separated bench JSONs of the new code")
    ap.add_argument("old", help="comma-separated bench JSONs of the old code")
    ap.add_argument("--impl", default="flashgen")
    ap.add_argument("--show", type=int, default=8, help="slowest points to list, and as many of the faster ones")
    args = ap.parse_args(argv)
    rows = compare([load(p, args.impl) for p in args.new.split(",")], [load(p, args.impl) for p in args.old.split(",")])
    if not rows:
        raise SystemExit(f"no point measured for {args.impl} in every file")
    print_comparison(rows, args.show)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
