"""The runtime's backward workspace size equals CUTLASS's own ``Params::workspace_size()``.

A host program compiled from the same headers prints the kernel's constants
(the expressions the spec bakes into each cubin) and ``workspace_size()`` for
a set of shapes; the Python formula, fed only those constants, must agree.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flashgen.build.graph import include_dirs
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


def test_workspace_formula_matches_cutlass(tmp_path: Path):
    report = probe_toolchain()
    if not report.ok():
        pytest.skip("no complete toolchain")
    tc = report.toolchain()
    src = tmp_path / "probe.cu"
    src.write_text(_probe_source(KERNELS))
    exe = tmp_path / "probe"
    subprocess.run([str(tc.nvcc), "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG",
                    *(f"-I{d}" for d in include_dirs(tc)), "-o", str(exe), str(src)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    for i, kernel in enumerate(KERNELS):
        values = [int(v) for v in next(l for l in out if l.startswith(f"K{i} ")).split()[1:]]
        constants = dict(zip((c.name for c in kernel.CONSTANTS), values))
        binary = KernelBinary(kernel, "sm80", Path("/dev/null"), "", constants, {})
        expected = [int(l.split()[1]) for l in out if l.startswith(f"W{i} ")]
        got = [workspace_bytes(binary, B, H, M, N, K, Kv, S) for B, H, M, N, K, Kv, S in SHAPES]
        assert got == expected, kernel.name
        assert any(expected), kernel.name  # the comparison is not vacuous
