"""Where a kernel's stalls and shared-memory bank conflicts sit, instruction by instruction, from
ncu's source page (the companion of ncu_summary.py, which gives the whole-kernel figures).

    ncu --set full --import-source yes --kernel-name regex:'...' -o rep python3 driver.py   # on the GPU
    ncu -i rep.ncu-rep --page source --print-source sass --csv > rep_sass.csv
    python tools/ncu_sass.py rep_sass.csv [--kernel SUBSTRING ...] [--top N]

For the first launch of each kernel name (or of each name containing a --kernel substring): totals,
then per opcode (the mnemonic with its modifiers, e.g. STS.128) the instructions executed, the
share of stall samples and the shared-memory wavefronts beyond the ideal (bank conflicts), then
the top instructions by stall samples and by excess wavefronts.  Offsets are from the kernel's
first instruction, as nvdisasm prints them, so a line can be found in the cubin's SASS.
"""
from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List

SOURCE, SAMPLES, EXECUTED = "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"
EXCESS, WAVEFRONTS = "L1 Wavefronts Shared Excessive", "L1 Wavefronts Shared"
STALL = re.compile(r"^stall_(\w+)$")  # the all-samples reasons, not the "(Not Issued)" twins
PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclass
class Line:
    offset: int
    source: str
    samples: float
    executed: float
    excess: float
    wavefronts: float
    stalls: Dict[str, float]

    @property
    def opcode(self) -> str:
        return PREDICATE.sub("", self.source).split(" ")[0].rstrip(";")

    @property
    def top_stall(self) -> str:
        reason = max(self.stalls, key=self.stalls.__getitem__, default="")
        return reason if self.stalls.get(reason) else "-"


@dataclass
class Kernel:
    name: str
    lines: List[Line] = field(default_factory=list)


def number(text: str) -> float:
    return 0.0 if text in ("", "-") else float(text.replace(",", ""))


def read(path: str) -> List[Kernel]:
    """Every kernel block of the CSV in order: a ``"Kernel Name", name`` row, a header, the lines."""
    kernels: List[Kernel] = []
    header: Dict[str, int] = {}
    stalls: Dict[str, int] = {}
    base = 0
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append(Kernel(row[1]))
                header = {}
            elif not kernels:
                raise SystemExit(f"{path}: not an ncu source-page CSV (no 'Kernel Name' row before {row[0]!r})")
            elif not header:
                header = {h: i for i, h in enumerate(row)}
                missing = [h for h in (SOURCE, SAMPLES, EXECUTED) if h not in header]
                if missing:
                    raise SystemExit(f"{path}: kernel {kernels[-1].name!r} has no column {missing[0]!r}; "
                                     "export with --page source --print-source sass --csv")
                stalls = {m.group(1): i for h, i in header.items() if (m := STALL.match(h))}
            else:
                address = int(row[header["Address"]], 16) if "Address" in header else len(kernels[-1].lines) * 16
                if not kernels[-1].lines:
                    base = address
                values = [number(row[header[c]]) if c in header else 0.0
                          for c in (SAMPLES, EXECUTED, EXCESS, WAVEFRONTS)]
                kernels[-1].lines.append(Line(address - base, row[header[SOURCE]].strip(), *values,
                                              {name: number(row[i]) for name, i in stalls.items()}))
    if not kernels:
        raise SystemExit(f"{path}: no kernels (expected 'Kernel Name' rows)")
    return kernels


def pick(kernels: List[Kernel], wanted: List[str]) -> List[Kernel]:
    """The first launch of each name, or of each name containing a wanted substring, in order."""
    firsts: Dict[str, Kernel] = {}
    for k in kernels:
        firsts.setdefault(k.name, k)
    if not wanted:
        return list(firsts.values())
    chosen = []
    for w in wanted:
        match = next((k for name, k in firsts.items() if w in name), None)
        if match is None:
            raise SystemExit(f"no kernel name contains {w!r}; names: {', '.join(firsts)}")
        chosen.append(match)
    return chosen


def report(kernel: Kernel, top: int) -> None:
    lines = kernel.lines
    samples = sum(x.samples for x in lines) or 1.0
    print(f"== {kernel.name[:150]}")
    print(f"instructions executed {sum(x.executed for x in lines) / 1e6:.2f} M, stall samples "
          f"{sum(x.samples for x in lines):.0f}, shared wavefronts {sum(x.wavefronts for x in lines) / 1e3:.1f} k "
          f"of which beyond ideal {sum(x.excess for x in lines) / 1e3:.1f} k")
    by_opcode: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for x in lines:
        row = by_opcode[x.opcode]
        row[0] += x.executed
        row[1] += x.samples
        row[2] += x.excess
    print(f"\n{'opcode':32s} {'executed (M)':>12s} {'samples %':>9s} {'excess (k)':>10s}")
    for opcode, (executed, got, excess) in sorted(by_opcode.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{opcode[:32]:32s} {executed / 1e6:12.2f} {100 * got / samples:9.1f} {excess / 1e3:10.1f}")
    print("\ntop instructions by stall samples (offset, samples %, top reason, source):")
    for x in sorted(lines, key=lambda x: -x.samples)[:top]:
        print(f"  {x.offset:06x} {100 * x.samples / samples:5.1f} {x.top_stall:16s} {x.source[:90]}")
    conflicted = [x for x in lines if x.excess > 0]
    if conflicted:
        print("\ntop instructions by shared wavefronts beyond ideal (offset, excess k, of wavefronts k, source):")
        for x in sorted(conflicted, key=lambda x: -x.excess)[:top]:
            print(f"  {x.offset:06x} {x.excess / 1e3:8.1f} {x.wavefronts / 1e3:8.1f} {x.source[:90]}")
    else:
        print("\nno shared-memory wavefronts beyond ideal")
    print()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    parser.add_argument("--kernel", action="append", default=[], help="a substring of a kernel name (repeatable)")
    parser.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error("--top must be at least 1")
    for kernel in pick(read(args.csv), args.kernel):
        report(kernel, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
