"""The runtime's backward workspace size equals CUTLASS's own ``Params::workspace_size()``.

A host program compiled from the same headers prints the kernel's constants
(the expressions the spec bakes into each cubin) and ``workspace_size()`` for
a set of shapes; the Python formula, fed only those constants, must agree.

That host program, unlike the cubin builds, puts the prelude's curand handling
through the host compiler, so the prelude is also compiled here against every
curand header version within reach (see test_prelude_with_each_curand_header).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from flashgen import toolchain
from flashgen.build.cubin import list_symbols
from flashgen.build.graph import CSRC, include_dirs
from flashgen.runtime.registry import KernelBinary
from flashgen.runtime.select import workspace_bytes
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.toolchain import probe_toolchain

pytestmark = pytest.mark.nvcc

KERNELS = [
    MemEffBwd("sm80", "f16", True, False, True, 128, 64, 128, False),     # dK/dV in registers
    MemEffBwd("sm80", "bf16", True, True, False, 64, 64, 65536, False),   # dK/dV in the workspace
    MemEffBwd("sm80", "f32", True, False, False, 64, 64, 64, False),      # f32: accumulates in place
]
SHAPES = [  # batches, heads, M, N, K, Kv, splits
    (1, 1, 1, 1, 8, 8, 1),
    (2, 3, 129, 1000, 64, 64, 4),
    (4, 16, 1000, 129, 128, 40, 1),
    (1, 2, 77, 300, 320, 256, 5),
]


def _probe_source(kernels) -> str:
    lines = ['#include "flashgen/mem_eff_prelude.h"', '#include "kernel_backward.h"', "int main() {"]
    for i, k in enumerate(kernels):
        consts = ", ".join(f"(long long)({c.expr})" for c in k.CONSTANTS)
        lines += [f"  {{ using Kernel = {k.cpp_type};", f"    long long c[] = {{{consts}}};",
                  f'    printf("K{i}");', "    for (long long v : c) printf(\" %lld\", v);", '    printf("\\n");']
        for B, H, M, N, K, Kv, S in SHAPES:
            lines += ["    { Kernel::Params p;",
                      f"      p.num_batches = {B}; p.num_heads = {H}; p.num_queries = {M}; p.num_keys = {N};",
                      f"      p.head_dim = {K}; p.head_dim_value = {Kv}; p.num_splits_key = {S};",
                      f'      printf("W{i} %lld\\n", (long long)p.workspace_size()); }}']
        lines.append("  }")
    return "\n".join(lines + ["  return 0;", "}"]) + "\n"



def _toolchain_or_skip():
    """nvcc, CUTLASS and curand as a build would use them, or a skip where this machine lacks one."""
    report = probe_toolchain()
    if not report.ok():
        pytest.skip("no complete toolchain")
    return report.toolchain()


def test_workspace_formula_matches_cutlass(tmp_path: Path):
    tc = _toolchain_or_skip()
    src = tmp_path / "probe.cu"
    src.write_text(_probe_source(KERNELS))
    exe = tmp_path / "probe"
    build = subprocess.run([str(tc.nvcc), "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG",
                            *(f"-I{d}" for d in include_dirs(tc)), "-o", str(exe), str(src)],
                           capture_output=True, text=True)
    assert build.returncode == 0, f"the probe did not compile (curand from {tc.curand_include}):\n{build.stderr}"
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    for i, kernel in enumerate(KERNELS):
        values = [int(v) for v in next(l for l in out if l.startswith(f"K{i} ")).split()[1:]]
        constants = dict(zip((c.name for c in kernel.CONSTANTS), values))
        binary = KernelBinary(kernel, "sm80", Path("/dev/null"), "", constants, {})
        expected = [int(l.split()[1]) for l in out if l.startswith(f"W{i} ")]
        got = [workspace_bytes(binary, B, H, M, N, K, Kv, S) for B, H, M, N, K, Kv, S in SHAPES]
        assert got == expected, kernel.name
        assert any(expected), kernel.name  # the comparison is not vacuous


# --- the prelude's curand handling, against each curand header version --------

# The line by which curand 10.4.5 and later make the XORWOW tables optional; older
# headers (10.4.0, the CUDA 13.0 toolkit's, to 10.4.4) define the tables always.
_TABLE_FILTER = "#if !defined(CURAND_TABLE_INCLUDE_FILTER) || defined(CURAND_TABLE_INCLUDE_FILTER_XORWOW)"
_CURAND_ENV = "FLASHGEN_TEST_CURAND_INCLUDES"  # more curand include dirs to try, os.pathsep-separated

PHILOX_SOURCE = """#include "flashgen/mem_eff_prelude.h"
#include <curand_kernel.h>
__global__ void philox(unsigned long long seed, unsigned long long offset, float4* out) {
  curandStatePhilox4_32_10_t state;
  curand_init(seed, threadIdx.x, offset, &state);
  out[threadIdx.x] = curand_uniform4(&state);
}
int main() { return 0; }
"""


def _curand_header_dirs(tc: toolchain.Toolchain) -> list[Path]:
    """The build's curand include dir, the toolkit's, pip's, and those named in $FLASHGEN_TEST_CURAND_INCLUDES."""
    root = tc.nvcc.resolve().parent.parent
    candidates = [tc.curand_include, root / "include", *sorted(root.glob("targets/*/include"))]
    candidates += [d / sub / "include" for d in toolchain._nvidia_dirs() for sub in ("cu13", "curand")]
    candidates += [Path(p) for p in os.environ.get(_CURAND_ENV, "").split(os.pathsep) if p]
    found: dict[Path, Path] = {}
    for d in candidates:
        if (d / "curand_kernel.h").is_file() and (d / "curand_precalc.h").is_file():
            found.setdefault(d.resolve(), d)
    return list(found.values())


def _has_table_filter(curand: Path) -> bool:
    return "defined(CURAND_TABLE_INCLUDE_FILTER)" in (curand / "curand_precalc.h").read_text()


def _without_table_filter(src: Path, dst: Path) -> Path:
    """A copy of ``src``'s curand headers as they were before CURAND_TABLE_INCLUDE_FILTER: tables always defined."""
    dst.mkdir(parents=True)
    for header in src.glob("curand*.h"):
        shutil.copyfile(header, dst / header.name)
    precalc = dst / "curand_precalc.h"
    precalc.write_text(precalc.read_text().replace(_TABLE_FILTER, "#if 1"))
    if _has_table_filter(dst):
        pytest.fail(f"{src / 'curand_precalc.h'} spells its table filter other than {_TABLE_FILTER!r}: update the test")
    return dst


def _nvcc(tc: toolchain.Toolchain, curand: Path, *args: str) -> subprocess.CompletedProcess:
    # curand's dir goes first: a toolkit that has curand headers of its own adds them after every -I
    includes = [curand, CSRC, tc.cutlass_include]
    return subprocess.run([str(tc.nvcc), "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG",
                           *(f"-I{d}" for d in includes), *args], capture_output=True, text=True)


def test_prelude_with_each_curand_header(tmp_path: Path):
    """Host and device builds both work with every curand header, and no cubin keeps the XORWOW tables.

    A header without the table filter (CUDA 13.0's toolkit) is made from a newer one where none is
    installed, which is what the workspace probe above met on a machine whose toolkit has curand.
    """
    tc = _toolchain_or_skip()
    dirs = _curand_header_dirs(tc)
    assert dirs, f"no curand_precalc.h next to {tc.curand_include / 'curand_kernel.h'}"
    variants = [(str(d), d) for d in dirs]
    variants += [(f"{d}, its table filter removed", _without_table_filter(d, tmp_path / f"unfiltered{i}"))
                 for i, d in enumerate(dirs) if _has_table_filter(d)]
    src = tmp_path / "philox.cu"
    src.write_text(PHILOX_SOURCE)
    problems = []
    for i, (name, curand) in enumerate(variants):
        host = _nvcc(tc, curand, "-o", str(tmp_path / f"philox{i}"), str(src))
        if host.returncode != 0:
            problems.append(f"host build against {name} failed:\n{host.stderr}")
        cubin = tmp_path / f"philox{i}.cubin"
        dev = _nvcc(tc, curand, "-cubin", "-arch=sm_80", "-o", str(cubin), str(src))
        if dev.returncode != 0:
            problems.append(f"cubin build against {name} failed:\n{dev.stderr}")
            continue
        if "20044" in dev.stderr:  # "extern declaration ... treated as a static definition": zeroed tables
            problems.append(f"cubin build against {name} warns:\n{dev.stderr}")
        tables = {k: v for k, v in list_symbols(cubin).items() if "xorwow" in k.lower()}
        if tables:
            problems.append(f"the cubin built against {name} keeps curand's XORWOW tables: {tables}")
    assert not problems, "\n".join(problems)


def test_prelude_refuses_xorwow(tmp_path: Path):
    """A kernel that did use XORWOW would find no tables: its build fails instead of drawing from zeros."""
    tc = _toolchain_or_skip()
    src = tmp_path / "xorwow.cu"
    src.write_text(PHILOX_SOURCE.replace("curandStatePhilox4_32_10_t", "curandStateXORWOW_t")
                   .replace("curand_uniform4(&state)", "make_float4(curand_uniform(&state), 0, 0, 0)"))
    dev = _nvcc(tc, tc.curand_include, "-cubin", "-arch=sm_80", "-o", str(tmp_path / "xorwow.cubin"), str(src))
    assert dev.returncode != 0
    assert "flashgen_curand_xorwow_tables_are_not_compiled_in" in dev.stderr + dev.stdout
