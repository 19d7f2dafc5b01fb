"""What a kernel's loops cost in instructions, read statically from its cubin before any GPU time.

    python tools/sass_loops.py build/kernels/sm90a/NAME.cubin [--function NAME] [--against OLD.cubin]

nvdisasm (CUDA's, or the nvidia-cuda-nvdisasm wheel's: `pip install nvidia-cuda-nvdisasm`; --nvdisasm
or $NVDISASM names another) disassembles the function (default: the cubin's name, the main kernel of a
flashgen instance).  Its code is cut into roles where warpgroups re-size their registers (USETMAXREG:
TRY_ALLOC the consumers, DEALLOC the producer; what precedes both is "setup"), and every backward branch
to a label above it closes a loop.  Per role, and for each of its loops (innermost first: a main loop is
usually "consumer loop 1"), the table counts instructions, HGMMA, R2UR (values copied into uniform
registers, as a per-thread wgmma descriptor needs before every wgmma), uniform-datapath instructions
(U*), spill loads and stores (LDL/STL), BSSY (divergent regions) and SHFL.  With --against, the same
for an older build, side by side: session 31's persistent backward showed its 12% longer, uniform-less
step loop here (658 -> 740 instructions, R2UR 48 -> 116) before its A/B did.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
LABEL = re.compile(r"^(\.L_x_\d+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")
COUNTED = ("HGMMA", "R2UR", "U*", "LDL/STL", "BSSY", "SHFL")


@dataclass
class Block:
    """A run of instructions: a role's code or a loop's body."""
    name: str
    opcodes: List[str] = field(default_factory=list)

    def counts(self) -> Dict[str, int]:
        base = [op.split(".")[0] for op in self.opcodes]
        return {"instructions": len(base), "HGMMA": base.count("HGMMA"), "R2UR": base.count("R2UR"),
                "U*": sum(op.startswith("U") for op in base), "LDL/STL": base.count("LDL") + base.count("STL"),
                "BSSY": base.count("BSSY"), "SHFL": base.count("SHFL")}


def function_text(sass: str, function: str) -> List[str]:
    """The lines of ``function``'s .text section in nvdisasm's output."""
    lines, inside = [], False
    for line in sass.splitlines():
        if line.startswith(".text."):
            inside = line.rstrip(":") == f".text.{function}"
            continue
        if inside:
            lines.append(line)
    if not lines:
        raise ValueError(f"no function {function!r} in the disassembly")
    return lines


def analyse(lines: List[str], min_loop: int = 20) -> Dict[str, Block]:
    """Role blocks ("setup", "consumer", "producer") and each role's loops of ``min_loop`` or more
    instructions, innermost (shortest) first: "<role> loop 1", "<role> loop 2", ...  A loop runs from a
    label to the last backward branch to it, and belongs to the role of its first instruction; branches
    after the last EXIT are ptxas's out-of-line retries of barrier waits, which jump back into the code,
    not loops."""
    roles: Dict[str, Block] = {}
    role, ops, role_at, labels, branches = "setup", [], [], {}, []
    for line in lines:
        label = LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(ops)
            continue
        m = INSTRUCTION.search(line)
        if not m:
            continue
        opcode = m.group(3)
        if opcode.startswith("USETMAXREG"):
            role = "producer" if "DEALLOC" in opcode else "consumer"
        ops.append(opcode)
        role_at.append(role)
        roles.setdefault(role, Block(role)).opcodes.append(opcode)
        target = TARGET.search(line)
        if opcode.startswith("BRA") and target and target.group(1) in labels:
            branches.append((labels[target.group(1)], len(ops)))  # [head, branch]: a backward branch
    last_exit = max((i for i, op in enumerate(ops) if op == "EXIT"), default=len(ops))
    ends: Dict[int, int] = {}  # a loop's head and its last back edge (a `continue` is another edge to it)
    for start, end in branches:
        if end <= last_exit:
            ends[start] = max(end, ends.get(start, end))
    spans = sorted(((start, end) for start, end in ends.items() if end - start >= min_loop),
                   key=lambda span: span[1] - span[0])
    for start, end in spans:
        number = 1 + sum(name.startswith(f"{role_at[start]} loop") for name in roles)
        roles[f"{role_at[start]} loop {number}"] = Block(f"{role_at[start]} loop {number}", ops[start:end])
    return roles


def disassemble(cubin: Path, nvdisasm: str) -> str:
    return subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


def find_nvdisasm(given: Optional[str]) -> str:
    candidates = [given, os.environ.get("NVDISASM"), shutil.which("nvdisasm"), "/usr/local/cuda/bin/nvdisasm"]
    try:  # the pip wheel's binary
        import nvidia.cu13 as cu13  # type: ignore
        candidates.append(str(Path(cu13.__path__[0]) / "bin" / "nvdisasm"))
    except ImportError:
        pass
    for c in candidates:
        if c and Path(c).is_file():
            return c
    raise SystemExit("nvdisasm not found: install CUDA's, or `pip install nvidia-cuda-nvdisasm`, or pass --nvdisasm")


def table(new: Dict[str, Block], old: Optional[Dict[str, Block]]) -> str:
    header = ["block", "instructions", *COUNTED]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    counted_new = {name: block.counts() for name, block in new.items()}
    counted_old = {name: block.counts() for name, block in (old or {}).items()}
    for name in sorted(set(new) | set(old or {})):
        cells = []
        for key in header[1:]:
            a = counted_new[name][key] if name in new else "-"
            cells.append(f"{a}" if old is None else f"{counted_old[name][key] if name in old else '-'} -> {a}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin", type=Path)
    ap.add_argument("--function", help="default: the cubin's file name without .cubin (an instance's main kernel)")
    ap.add_argument("--against", type=Path, help="an older build of the same kernel, shown as old -> new")
    ap.add_argument("--nvdisasm")
    args = ap.parse_args(argv)
    tool = find_nvdisasm(args.nvdisasm)
    function = args.function or args.cubin.name.removesuffix(".cubin")
    new = analyse(function_text(disassemble(args.cubin, tool), function))
    old = analyse(function_text(disassemble(args.against, tool), function)) if args.against else None
    print(table(new, old))
    return 0


if __name__ == "__main__":
    sys.exit(main())
