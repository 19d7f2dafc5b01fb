"""Families with a BUILD_GROUP compile a group's kernels as one translation unit into one cubin.

The CPU tests check how units are named and written; the nvcc ones build a real two-kernel
unit of sm80_fwd (about 30 s on one core) and check what the manifest and rebuilds make of it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from flashgen import generator
from flashgen.build import manifest
from flashgen.build.cubin import parse_resource_usage, sha256_file
from flashgen.build.graph import render_ninja, unit_sources
from flashgen.build import runner
from flashgen.build.runner import select_jobs
from flashgen.cli import main
from flashgen.spec import default_kernels
from flashgen.spec.sm80_bwd import Sm80Bwd
from flashgen.spec.sm80_fwd import Sm80Fwd
from test_build import build_private_copy

PLAIN = "sm80_fwd_bf16_k64_q128x128_s4_sm80"
BIAS = "sm80_fwd_bf16_k64_q128x64_s4_bias_sm80"


def _kernel(name):
    return next(k for k in default_kernels() if k.name == name)


def test_a_full_group_takes_the_family_unit_name_and_a_subset_a_digest_of_its_members(tmp_path):
    fwd = Sm80Fwd.default_set()
    full = select_jobs(fwd, ["sm80"], tmp_path)
    assert {j.unit for j in full} == {"sm80_fwd_sm80_unit"}
    assert {j.output for j in full} == {"sm80/sm80_fwd_sm80_unit.cubin"}
    pair = select_jobs([_kernel(PLAIN), _kernel(BIAS)], ["sm80"], tmp_path)
    one = select_jobs([_kernel(PLAIN)], ["sm80"], tmp_path)
    assert len({j.unit for j in pair}) == 1 and pair[0].unit.startswith("sm80_fwd_sm80_unit_")
    assert one[0].unit.startswith("sm80_fwd_sm80_unit_") and one[0].unit != pair[0].unit
    # other targets and PTX are units of their own; ungrouped families keep one job a kernel
    both = select_jobs(fwd, ["sm80", "sm86"], tmp_path, ptx=True)
    assert {j.output for j in both} == {"sm80/sm80_fwd_sm80_unit.cubin", "sm86/sm80_fwd_sm80_unit.cubin",
                                        "compute86/sm80_fwd_sm80_unit.ptx"}
    mem_eff = next(k for k in default_kernels() if k.FAMILY == "mem_eff_fwd" and k.runs_on("sm80"))
    assert [j.unit for j in select_jobs([mem_eff], ["sm80"], tmp_path)] == [mem_eff.name]


def test_a_unit_source_includes_each_member_once_and_ninja_gets_one_edge_per_unit(tmp_path, toolchain_stub):
    kernels = [*Sm80Bwd.default_set(), *Sm80Fwd.default_set()]
    jobs = select_jobs(kernels, ["sm80"], tmp_path / "instances")
    sources = unit_sources(jobs)
    assert sorted(sources) == ["sm80/sm80_bwd_sm80_unit.cu", "sm80/sm80_fwd_sm80_unit.cu"]
    for rel, text in sources.items():
        members = [j for j in jobs if j.compiled_source == rel]
        for j in members:
            assert text.count(f'#include "{j.source}"') == 1
        assert text.count("#include") == len(members) == len({j.kernel.name for j in members})
    mem_eff = next(k for k in default_kernels() if k.FAMILY == "mem_eff_bwd" and k.runs_on("sm80"))
    ninja = render_ninja([*select_jobs([mem_eff], ["sm80"], tmp_path), *jobs], toolchain_stub)
    edges = [line for line in ninja.splitlines() if line.startswith("build ")]
    assert len(edges) == 3
    # largest unit first (ninja starts jobs in file order): the backward's 28 kernels, the forward's 16, then one
    assert "sm80_bwd_sm80_unit" in edges[0] and "sm80_fwd_sm80_unit" in edges[1] and mem_eff.name in edges[2]


@pytest.mark.parametrize("available_gb,depth", [(21, 2), (12, 1), (4, 1), (None, 2)])
def test_units_compile_as_many_at_once_as_free_memory_holds(monkeypatch, tmp_path, toolchain_stub, available_gb,
                                                            depth):
    """The 28-kernel sm80_bwd unit peaks near 8.6 GB: a 24 GB machine compiles both sm80 units at
    once, a smaller one one at a time (in a ninja pool), while one-kernel jobs keep -j."""
    monkeypatch.setattr(runner, "_available_bytes", lambda: None if available_gb is None else available_gb << 30)
    mem_eff = next(k for k in default_kernels() if k.FAMILY == "mem_eff_fwd" and k.runs_on("sm80"))
    jobs = select_jobs([*Sm80Bwd.default_set(), *Sm80Fwd.default_set(), mem_eff], ["sm80"], tmp_path)
    assert runner.unit_parallelism(jobs) == depth
    ninja = render_ninja(jobs, toolchain_stub, unit_depth=depth)
    assert f"pool units\n  depth = {depth}\n" in ninja
    edges = ninja.split("\nbuild ")[1:]
    assert [("pool = units" in e) for e in edges] == [True, True, False]
    assert runner.unit_parallelism(select_jobs([mem_eff], ["sm80"], tmp_path)) is None


def test_a_kernel_in_a_unit_keeps_its_names_to_itself():
    """Units include several instances: each keeps its aliases and macros in its own scope."""
    for name in (PLAIN, BIAS, "sm80_bwd_f16_k64_q64x128_sm80"):
        text = (generator.INSTANCES_DIR / generator.source_path(_kernel(name))).read_text()
        body = text.split(f"namespace {name}_instance {{", 1)[1]
        assert "using Kernel" in body and body.rstrip().endswith(f"}}  // namespace {name}_instance")
        assert "template struct" not in text  # an explicit instantiation may appear only once per unit
        assert ("#define FLASHGEN_RUN" in body) == ("#undef FLASHGEN_RUN" in body)


@pytest.fixture
def toolchain_stub():
    from types import SimpleNamespace

    return SimpleNamespace(nvcc=Path("/usr/bin/nvcc"), nvcc_version="0", cutlass_version="0",
                           cutlass_include=Path("/i"), cutlass_example41=Path("/e"), curand_include=Path("/c"))


def _build(*args):
    return CliRunner().invoke(main, ["build", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def unit_built(toolchain, tmp_path_factory):
    """PLAIN and BIAS (one unit) built for sm80 from a private copy of their sources."""
    return build_private_copy(tmp_path_factory.mktemp("units"), (PLAIN, BIAS), "2 of 2 binaries ready (1 compiled)",
                              "1 nvcc job, units of 2 kernels among them (minutes each)")


def _entries(out):
    return {e["name"]: e["targets"]["sm80"] for e in manifest.read(out / "manifest.json")["kernels"]}


@pytest.mark.nvcc
def test_one_cubin_holds_both_kernels_each_with_its_own_constants_and_registers(unit_built):
    out, _ = unit_built
    plain, bias = _entries(out)[PLAIN], _entries(out)[BIAS]
    assert plain["cubin"] == bias["cubin"] and plain["sha256"] == bias["sha256"] == sha256_file(out / plain["cubin"])
    report = parse_resource_usage((out / plain["cubin"]).with_suffix(".log").read_text())
    for name, rec in ((PLAIN, plain), (BIAS, bias)):
        kernel = _kernel(name)
        c = rec["constants"]
        assert (c["block_m"], c["block_n"], c["max_k"], c["stages"]) == (kernel.block_m, kernel.block_n,
                                                                         kernel.max_k, kernel.stages)
        assert c["params_bytes"] == kernel.params_dtype().itemsize
        assert rec["registers"] == report[name].registers > 0
    assert bias["shared_memory_dynamic"] >= plain["shared_memory_dynamic"]  # the bias tile lives beside K and V


@pytest.mark.nvcc
def test_touching_one_member_recompiles_its_unit_and_nothing_else(unit_built):
    out, instances = unit_built
    again = _build("--arch", "sm80", "--kernels", f"{PLAIN},{BIAS}", "--out", str(out), "--instances", str(instances))
    assert again.exit_code == 0 and "(0 compiled)" in again.output, again.output
    (instances / generator.source_path(_kernel(BIAS))).touch()
    touched = _build("--arch", "sm80", "--kernels", f"{PLAIN},{BIAS}", "--out", str(out), "--instances", str(instances))
    assert touched.exit_code == 0 and "(1 compiled)" in touched.output, touched.output


@pytest.mark.nvcc
def test_building_one_member_alone_leaves_the_unit_its_entries_point_to(unit_built):
    out, instances = unit_built
    before = _entries(out)[BIAS]
    result = _build("--arch", "sm80", "--kernels", PLAIN, "--out", str(out), "--instances", str(instances))
    assert result.exit_code == 0, result.output
    after = _entries(out)
    assert after[BIAS] == before and sha256_file(out / before["cubin"]) == before["sha256"]
    assert after[PLAIN]["cubin"] != before["cubin"]  # its own one-kernel unit


@pytest.mark.nvcc
def test_an_instance_still_runs_its_family_abi_checks(toolchain, tmp_path):
    """The instance's sizeof instantiates the ABI header's checks: a Params size the spec does not
    declare stops the compile with the header's message."""
    import subprocess

    from flashgen.build.graph import CUBIN_FLAGS, NVCC_FLAGS, include_dirs

    kernel = _kernel(PLAIN)
    (tmp_path / "sm80_fwd").mkdir()
    source = tmp_path / generator.source_path(kernel)
    source.write_text((generator.INSTANCES_DIR / generator.source_path(kernel)).read_text())
    header = (generator.INSTANCES_DIR / generator.abi_header_path(kernel.FAMILY)).read_text()
    size = kernel.params_dtype().itemsize
    assert f"sizeof(Params) == {size}," in header
    (tmp_path / generator.abi_header_path(kernel.FAMILY)).write_text(
        header.replace(f"sizeof(Params) == {size},", f"sizeof(Params) == {size + 8},"))
    cmd = [str(toolchain.nvcc), *NVCC_FLAGS, *CUBIN_FLAGS, *(f"-I{d}" for d in include_dirs(toolchain)),
           "-gencode=arch=compute_80,code=sm_80", "-o", str(tmp_path / "x.cubin"), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode != 0
    assert "flashgen ABI: sizeof(Params) changed; update flashgen/spec/sm80_fwd.py" in result.stdout + result.stderr
