"""Side by side: the figures that explain a kernel's speed, from an ncu raw-page CSV.

    ncu --set full --kernel-name regex:'...' -o rep python3 driver.py       # on the GPU
    ncu -i rep.ncu-rep --page raw --csv > rep_raw.csv
    python tools/ncu_summary.py rep_raw.csv [name-substring ...]

One column per kernel (the first launch of each name, or of each name given -- exact, else the first
containing it -- in that order): duration, launch shape and resources, tensor-pipe activity,
instructions, issue activity and the stall reasons per issued instruction, largest first in
the first column.  Under ncu the clocks are locked to base, so durations are longer than a
benchmark's and only their ratios compare.
"""
from __future__ import annotations

import csv
import sys

# Unit conversions into each figure's unit, keyed by the unit ncu printed
MICROSECONDS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}
KILOBYTES = {"byte": 1e-3, "Kbyte": 1.0, "Mbyte": 1e3}
MEGABYTES = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
FIGURES = [  # (label, metric, {unit: factor} or a plain divisor)
    ("duration (us)", "gpu__time_duration.sum", MICROSECONDS),
    ("grid", "launch__grid_size", 1),
    ("threads", "launch__block_size", 1),
    ("registers/thread", "launch__registers_per_thread", 1),
    ("dynamic smem (KB)", "launch__shared_mem_per_block_dynamic", KILOBYTES),
    ("tensor pipe active %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", 1),
    ("instructions (M)", "smsp__inst_executed.sum", 1e6),
    ("issue active %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("smem bank conflicts (k)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", 1e3),
    ("DRAM read (MB)", "dram__bytes_read.sum", MEGABYTES),
    ("DRAM write (MB)", "dram__bytes_write.sum", MEGABYTES),
]
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def number(text: str) -> float:
    return float(text.replace(",", ""))


def read(path: str):
    """(header, units, rows) of the CSV's metric table."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    top = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if top is None:
        raise SystemExit(f"{path}: no ncu raw-page table (expected a header row starting with 'ID')")
    return rows[top], rows[top + 1], rows[top + 2:]


def pick(header, rows, wanted):
    """The first launch of each kernel name, or of each wanted name (exact, else a substring), in order."""
    name = header.index("Kernel Name")
    if not wanted:
        seen = {}
        for r in rows:
            seen.setdefault(r[name], r)
        return list(seen.items())
    chosen = []
    for w in wanted:
        r = next((r for r in rows if r[name] == w), None) or next((r for r in rows if w in r[name]), None)
        if r is None:
            raise SystemExit(f"no kernel name contains {w!r}")
        chosen.append((r[name], r))
    return chosen


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit(__doc__)
    header, units, rows = read(args[0])
    kernels = pick(header, rows, args[1:])
    column = {h: i for i, h in enumerate(header)}
    for k, (name, _) in enumerate(kernels):
        print(f"[{k}] {name[:150]}")
    lines = []
    for label, metric, unit in FIGURES:
        if metric not in column:
            continue
        if isinstance(unit, dict):
            printed = units[column[metric]].split("/")[0]  # "Kbyte/block": Kbyte
            if printed not in unit:
                raise SystemExit(f"{metric}: unit {printed!r} not in {sorted(unit)}")
            factor = unit[printed]
        else:
            factor = 1 / unit
        lines.append((label, [number(r[column[metric]]) * factor for _, r in kernels]))
    stalls = [h for h in header if h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX)]
    stall_rows = [(h[len(STALL_PREFIX):-len(STALL_SUFFIX)], [number(r[column[h]]) for _, r in kernels]) for h in stalls]
    stall_rows = [row for row in stall_rows if max(row[1]) >= 0.02]
    stall_rows.sort(key=lambda row: -row[1][0])
    width = max(len(label) for label, _ in lines + [(f"stall {s}", 0) for s, _ in stall_rows])
    print(f"{'':{width}s} " + " ".join(f"{f'[{k}]':>12s}" for k in range(len(kernels))))
    for label, values in lines + [(f"stall {s}", v) for s, v in stall_rows]:
        print(f"{label:{width}s} " + " ".join(f"{v:12.2f}" for v in values))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
