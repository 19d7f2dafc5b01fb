"""Write the ``build.ninja`` that compiles kernel instances into cubins.

Ninja decides what is out of date: nvcc's depfiles cover every header an
instance includes (CUTLASS, curand, flashgen's own), the command line covers
the flags, and a toolchain stamp in the command covers an nvcc or CUTLASS
upgrade at the same path.  Each job writes ``<cubin>.tmp.<pid>`` and renames
it only when nvcc succeeded, so an interrupted build never leaves a truncated
cubin with a fresh timestamp, and a compiler left running by a killed build
cannot write into the file a rerun is producing.

A family that declares ``BUILD_GROUP`` compiles the kernels of one group as one
translation unit: a small ``<target>/<unit>.cu`` in the build directory that
includes their instance sources, compiled into one cubin.  CuTe kernels spend most
of their compile time instantiating templates that such kernels share: on two cores,
the 16 ``sm80_fwd`` kernels take 83 s as one unit against 379 s of jobs one a kernel,
the 26 ``sm80_bwd`` ones 194 s against 785 s.  (Example 41's kernels gain little: their
time goes to optimizing each kernel.)  The manifest records each kernel's cubin, so
nothing downstream depends on one kernel per file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from flashgen.spec.core import KernelSpec, target_cc
from flashgen.toolchain import Toolchain

CSRC = Path(__file__).resolve().parents[1] / "csrc"

NVCC_FLAGS = (
    "-std=c++17",
    "--expt-relaxed-constexpr",  # std::tuple in the Philox shim, CUTLASS's constexpr helpers
    "-DNDEBUG",                  # the kernels' device asserts cost registers and time
)
CUBIN_FLAGS = ("-cubin", "--resource-usage")  # ptxas prints registers, spills and stack frame into the log
PTX_FLAGS = ("-ptx",)


@dataclass(frozen=True)
class Job:
    """One kernel compiled for one target: SASS (``sm80``) or PTX (``compute90``)."""

    kernel: KernelSpec
    target: str  # normalized, e.g. "sm80", "sm90a" or "compute90"
    source: Path
    unit: str = ""  # the compile job and cubin stem; left empty: the kernel's own (see name_units)

    def __post_init__(self):
        if not self.unit:
            object.__setattr__(self, "unit", self.kernel.build_unit)

    @property
    def is_ptx(self) -> bool:
        return self.target.startswith("compute")

    @property
    def grouped(self) -> bool:
        return self.unit != self.kernel.name

    @property
    def output(self) -> str:
        """Path relative to the build directory."""
        return f"{self.target}/{self.unit}.{'ptx' if self.is_ptx else 'cubin'}"

    @property
    def log(self) -> str:
        return f"{self.target}/{self.unit}.log"

    @property
    def compiled_source(self) -> str:
        """What nvcc compiles: the instance source, or the unit's source in the build directory."""
        return f"{self.target}/{self.unit}.cu" if self.grouped else str(self.source)

    @property
    def gencode(self) -> str:
        arch = f"{target_cc(self.target)}{'a' if self.target.endswith('a') else ''}"
        code = f"compute_{arch}" if self.is_ptx else f"sm_{arch}"
        return f"-gencode=arch=compute_{arch},code={code}"


def include_dirs(tc: Toolchain) -> List[Path]:
    return [CSRC, CSRC / "aten_shim", tc.cutlass_include, tc.cutlass_example41, tc.curand_include]


def toolchain_stamp(tc: Toolchain) -> str:
    return f"nvcc-{tc.nvcc_version}_cutlass-{tc.cutlass_version}"


def _escape(path: object) -> str:
    """Ninja path escaping ($, space and colon are special in build lines)."""
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def name_units(jobs: Iterable[Job]) -> List[Job]:
    """``jobs`` with each grouped one's unit named for what it compiles: the family's unit name
    when it holds every kernel the family builds for that target, else that name and a digest of
    its members.  A build of a few kernels then writes a cubin of its own, and never one that an
    earlier full build's manifest entries still point to."""
    jobs = list(jobs)
    members: Dict[tuple, List[str]] = {}
    for j in jobs:
        members.setdefault((j.target, j.kernel.build_unit), []).append(j.kernel.name)
    names: Dict[tuple, str] = {}
    for j in jobs:
        key = (j.target, j.kernel.build_unit)
        if key not in names:
            unit, built = key[1], sorted(members[key])
            if unit != j.kernel.name and set(built) != {k.name for k in type(j.kernel).default_set()
                                                          if k.build_unit == unit and k.runs_on(j.target)}:
                unit += "_" + hashlib.sha256("|".join(built).encode()).hexdigest()[:8]
            names[key] = unit
    return [dataclasses.replace(j, unit=names[(j.target, j.kernel.build_unit)]) for j in jobs]


def units(jobs: Iterable[Job]) -> Dict[str, List[Job]]:
    """Jobs by output, largest unit first: ninja starts ready jobs in the order of build.ninja, and a
    build on few cores ends no earlier than its longest job does."""
    by_output: Dict[str, List[Job]] = {}
    for job in jobs:
        by_output.setdefault(job.output, []).append(job)
    return dict(sorted(by_output.items(), key=lambda item: -len(item[1])))


def unit_sources(jobs: Iterable[Job]) -> Dict[str, str]:
    """The source of each unit of several kernels, by path relative to the build directory: an
    include of every member's instance (each instance keeps its names in its own namespace)."""
    out = {}
    for members in units(jobs).values():
        if members[0].grouped:
            includes = sorted(f'#include "{j.source}"\n' for j in members)
            out[members[0].compiled_source] = (f"// Written by `flashgen build`: the kernels of {members[0].unit} "
                                               "compiled as one translation unit.\n" + "".join(includes))
    return out


def render_ninja(jobs: Iterable[Job], tc: Toolchain, launcher: Optional[str] = None,
                 unit_depth: Optional[int] = None) -> str:
    """The build file; with ``unit_depth``, units of several kernels (gigabytes of cicc each) run in
    a pool of that many at once, beside however many one-kernel jobs ``-j`` allows."""
    q = shlex.quote
    lines = [
        "# Written by `flashgen build` on every run; do not edit.",
        "ninja_required_version = 1.10",
        f"nvcc = {q(str(tc.nvcc))}",
        f"launcher = {launcher or ''}",
        f"stamp = {toolchain_stamp(tc)}",
        "flags = " + " ".join(NVCC_FLAGS),
        "includes = " + " ".join(q(f"-I{d}") for d in include_dirs(tc)),
        "",
    ]
    if unit_depth is not None:
        lines += ["pool units", f"  depth = {unit_depth}", ""]
    for rule, flags in (("cubin", CUBIN_FLAGS), ("ptx", PTX_FLAGS)):
        lines += [
            f"rule {rule}",
            # $out.tmp.<shell pid> ($$$$ is the shell's $$): an nvcc left running by a killed build
            # never writes into the file a rerun is compiling, and each rename is atomic
            f"  command = FLASHGEN_TOOLCHAIN=$stamp $launcher $nvcc $flags {' '.join(flags)} $includes $gencode"
            " -MD -MF $out.d -MT $out -o $out.tmp.$$$$ $in > $log 2>&1 && mv -f $out.tmp.$$$$ $out"
            " || { rm -f $out.tmp.$$$$; exit 1; }",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = $kernel $target",
            "",
        ]
    for output, (job, *_) in units(jobs).items():
        lines += [
            f"build {_escape(output)}: {'ptx' if job.is_ptx else 'cubin'} {_escape(job.compiled_source)}",
            f"  gencode = {job.gencode}",
            f"  log = {q(job.log)}",
            f"  kernel = {job.unit}",
            f"  target = {job.target}",
            *(["  pool = units"] if job.grouped and unit_depth is not None else []),
        ]
    return "\n".join(lines) + "\n"
