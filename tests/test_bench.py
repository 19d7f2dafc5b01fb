"""The benchmark's bookkeeping (the timings themselves need a GPU: see BENCHMARKS.md)."""
from __future__ import annotations

import sys

from click.testing import CliRunner

from flashgen import bench
from flashgen.cli import main


def test_default_grid_is_the_issue_grid():
    grid = bench.default_grid()
    assert len(grid) == 2 * 2 * 2 * 6  # dtypes x head dims x causal x seqlens
    for p in grid:
        assert p.batch * p.seqlen == 16384 and p.heads * p.head_dim == 2048


def test_flops_follow_flashattention_convention():
    p = bench.Point("f16", 128, False, 2, 16, 4096)
    fwd = 4 * 2 * 16 * 4096 * 4096 * 128
    assert bench.flops(p, "fwd") == fwd and bench.flops(p, "bwd") == 2.5 * fwd
    causal = bench.Point("f16", 128, True, 2, 16, 4096)
    assert bench.flops(causal, "fwd") == fwd / 2


def test_bench_without_torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    result = CliRunner().invoke(main, ["bench"])
    assert result.exit_code == 1 and "needs torch" in result.output


def test_tune_without_cupy_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    result = CliRunner().invoke(main, ["tune", "--seqlen", "512"])
    assert result.exit_code == 1 and "needs CuPy and a CUDA GPU" in result.output
