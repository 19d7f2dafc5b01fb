"""A/B of kernel builds on one GPU: `flashgen bench --impl flashgen` once per variant in a mirrored
order (old a b b a old for rounds=1; each variant twice), then bench_compare of every variant against
the first.

    python tools/kernel_ab.py --variant old=build/kernels --variant cz=build/cz:build/kernels \\
        --out /tmp/ab -- --dtype bf16 --timing queued --head-dim 128 --seqlen 2048 --repeats 20

A variant is NAME=PATH, PATH a FLASHGEN_KERNEL_PATH (a branch's subset first, the full set after it);
--tree NAME=DIR runs that variant's flashgen from another checkout (a branch that changed the runtime
too: its ABI or launch): in DIR (`python -m` puts the working directory before PYTHONPATH), DIR first on
PYTHONPATH.
The mirrored order puts every variant's two runs at the same mean position in the session, so a
clock that drifts over it moves no variant against another; what the untouched direction of a
change moves is the session's noise floor (bench_compare prints it).  Runs go to OUT/NAME_I.json;
--table prints old ms / new ms per point as Markdown, the form BENCHMARKS.md quotes.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_compare  # noqa: E402


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a variant is NAME=KERNEL_PATH, got {text!r}")
    if not name.replace("_", "").replace("-", "").isalnum():
        raise argparse.ArgumentTypeError(f"variant name {name!r}: letters, digits, '-' and '_' only (a file name)")
    return name, path


def run_order(names: list[str], rounds: int) -> list[tuple[str, int]]:
    """(variant, its run index) in the order to run: names then names reversed, ``rounds`` times."""
    order, seen = [], dict.fromkeys(names, 0)
    for _ in range(rounds):
        for name in names + names[::-1]:
            order.append((name, seen[name]))
            seen[name] += 1
    return order


def point_table(rows, direction: str) -> str:
    """Markdown of ``bench_compare.compare``'s rows: old ms / new ms (> 1: the new build is faster, each
    side's runs pooled by their median) per (dtype, head dim, mask, group) row and seqlen column; empty
    when ``direction`` was not run."""
    ratios = {((p["dtype"], p["head_dim"], p["causal"], p["group"]), p["seqlen"]): ratio
              for ratio, _, p, d in rows if d == direction}
    if not ratios:
        return ""
    seqlens = sorted({s for _, s in ratios})
    label = [f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seqlens]
    lines = ["| dtype | head dim | mask | group | " + " | ".join(label) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in seqlens) + " |"]
    for row in sorted({r for r, _ in ratios}):
        dtype, hd, causal, group = row
        cells = [f"{ratios[row, s]:.3f}" if (row, s) in ratios else "" for s in seqlens]
        lines.append(f"| {dtype} | {hd} | {'causal' if causal else 'none'} | {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", type=parse_variant, action="append", required=True,
                    help="NAME=KERNEL_PATH; the first is the baseline (repeatable, at least two)")
    ap.add_argument("--tree", type=parse_variant, action="append", default=[],
                    help="NAME=DIR: that variant's flashgen from the checkout DIR")
    ap.add_argument("--out", type=Path, required=True, help="directory for the runs' JSONs")
    ap.add_argument("--rounds", type=int, default=1, help="mirrored passes (each gives a variant two runs)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one bench run may take")
    ap.add_argument("--table", action="store_true", help="also a Markdown table per direction")
    ap.add_argument("--dry-run", action="store_true", help="print the runs, run nothing")
    ap.add_argument("--no-run", action="store_true",
                    help="compare the runs already in OUT (say, fetched from the device machine)")
    args = ap.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    names = [name for name, _ in args.variant]
    if len(names) < 2 or len(set(names)) != len(names):
        ap.error("give at least two variants with distinct names")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if any(a in ("--json", "--impl") or a.startswith(("--json=", "--impl=")) for a in bench_args):
        ap.error("kernel_ab sets --impl flashgen and --json itself; leave them out of the bench arguments")
    paths, trees = dict(args.variant), {name: str(Path(d).resolve()) for name, d in args.tree}
    args.out = args.out.resolve()  # a tree's runs start in its directory
    if set(trees) - set(names):
        ap.error(f"--tree for no variant: {', '.join(sorted(set(trees) - set(names)))}")
    if not (args.dry_run or args.no_run):
        args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for name, i in [] if args.no_run else run_order(names, args.rounds):
        out = args.out / f"{name}_{i}.json"
        cmd = [sys.executable, "-m", "flashgen", "bench", "--impl", "flashgen", *bench_args, "--json", str(out)]
        env = {"FLASHGEN_KERNEL_PATH": paths[name]}
        if name in trees:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (trees[name], os.environ.get("PYTHONPATH"))))
        if args.dry_run:
            cd = f"cd {trees[name]} && " if name in trees else ""
            print(cd + " ".join(f"{k}={v}" for k, v in env.items()) + f" python -m {' '.join(cmd[2:])}")
            continue
        done = subprocess.run(cmd, env={**os.environ, **env}, cwd=trees.get(name), capture_output=True, text=True,
                              timeout=args.timeout)
        print(f"{name} run {i}: rc {done.returncode}, {time.monotonic() - t0:.0f} s", flush=True)
        if done.returncode:
            sys.stderr.write(done.stdout[-2000:] + done.stderr[-2000:])
            return done.returncode
    if args.dry_run:
        return 0
    runs = {name: [str(args.out / f"{name}_{i}.json") for i in range(2 * args.rounds)] for name in names}
    missing = [r for name in names for r in runs[name] if not Path(r).is_file()]
    if missing:
        raise SystemExit(f"runs missing in {args.out}: {', '.join(Path(r).name for r in missing)}")
    loaded = {name: [bench_compare.load(r, "flashgen") for r in runs[name]] for name in names}
    for name in names[1:]:
        print(f"== {name} / {names[0]}", flush=True)
        rows = bench_compare.compare(loaded[name], loaded[names[0]])
        if not rows:
            raise SystemExit(f"no point measured by flashgen in every run of {name} and {names[0]}")
        bench_compare.print_comparison(rows, 8)
        if args.table:
            for direction in ("fwd", "bwd"):
                table = point_table(rows, direction)
                if table:
                    print(f"\n{direction}, old ms / new ms:\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
