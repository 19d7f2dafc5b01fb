"""Write the ``build.ninja`` that compiles kernel instances into cubins.

Ninja decides what is out of date: nvcc's depfiles cover every header an
instance includes (CUTLASS, curand, flashgen's own), the command line covers
the flags, and a toolchain stamp in the command covers an nvcc or CUTLASS
upgrade at the same path.  Each job writes ``<cubin>.tmp.<pid>`` and renames
it only when nvcc succeeded, so an interrupted build never leaves a truncated
cubin with a fresh timestamp, and a compiler left running by a killed build
cannot write into the file a rerun is producing.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

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

    @property
    def is_ptx(self) -> bool:
        return self.target.startswith("compute")

    @property
    def output(self) -> str:
        """Path relative to the build directory."""
        return f"{self.target}/{self.kernel.name}.{'ptx' if self.is_ptx else 'cubin'}"

    @property
    def log(self) -> str:
        return f"{self.target}/{self.kernel.name}.log"

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


def render_ninja(jobs: Iterable[Job], tc: Toolchain, launcher: Optional[str] = None) -> str:
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
    for job in jobs:
        lines += [
            f"build {_escape(job.output)}: {'ptx' if job.is_ptx else 'cubin'} {_escape(job.source)}",
            f"  gencode = {job.gencode}",
            f"  log = {q(job.log)}",
            f"  kernel = {job.kernel.name}",
            f"  target = {job.target}",
        ]
    return "\n".join(lines) + "\n"
