"""The commands through click's test runner: list, doctor, and build's refusals."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from flashgen import generator
from flashgen.build import manifest
from flashgen.cli import main
from flashgen.spec import default_kernels


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(autouse=True)
def nothing_built(tmp_path, monkeypatch):
    """No ./build/kernels and no kernels installed with the package: `list` shows the spec."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("flashgen.runtime.registry.PACKAGE_KERNELS", tmp_path / "no-package-kernels")


def test_list_json_has_every_kernel():
    result = run("list", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == [k.name for k in default_kernels()]
    assert {r["family"] for r in rows} == {"mem_eff_fwd", "mem_eff_bwd", "sm90_fwd", "sm90_bwd", "sm80_fwd",
                                                  "sm80_bwd"}


def test_list_filters_combine():
    rows = json.loads(run("list", "--json", "--family", "mem_eff_bwd", "--dtype", "bf16", "--max-k", "128").output)
    assert sorted(r["name"] for r in rows) == sorted([
        "mem_eff_bwd_bf16_aligned_b128x128_k128_preload_sm80",
        "mem_eff_bwd_bf16_aligned_b128x64_k128_preload_sm80",
        "mem_eff_bwd_bf16_aligned_b128x128_k128_preload_dropout_sm80",
        "mem_eff_bwd_bf16_aligned_b128x64_k128_preload_dropout_sm80",
        "mem_eff_bwd_bf16_aligned_b128x128_k128_preload_blockaligned_sm80",
        "mem_eff_bwd_bf16_aligned_b128x64_k128_preload_blockaligned_sm80",
    ])
    sm75 = json.loads(run("list", "--json", "--arch", "sm_75").output)
    assert sm75 and all(r["params"]["arch"] == "sm75" for r in sm75)
    assert len(json.loads(run("list", "--json", "--arch", "sm86").output)) == 30 + 16 + 28  # example 41 (f32; f16/bf16 at kMaxK 65536), sm80_fwd and sm80_bwd
    globbed = json.loads(run("list", "--json", "--kernels", "*unaligned*dropout*").output)
    assert globbed and all("unaligned" in r["name"] and "dropout" in r["name"] for r in globbed)


def test_list_table_counts_instances_per_family():
    result = run("list")
    assert result.exit_code == 0
    assert "mem_eff_fwd: 40 kernels" in result.output and "mem_eff_bwd: 56 kernels" in result.output
    assert "sm80_fwd: 16 kernels" in result.output and "sm80_bwd: 28 kernels" in result.output
    assert "nothing built" in result.output


def test_list_rejects_unknown_family():
    result = run("list", "--family", "flash3")
    assert result.exit_code == 1 and "unknown family 'flash3'" in result.output


def one_built_kernel(tmp_path, abi="current"):
    """A build directory holding one pretend cubin of the first default kernel, its manifest entry
    recording ``abi`` (the family's Params layout digest by default): (kernel, cubin path)."""
    k = default_kernels()[0]
    cubin = tmp_path / "sm80" / f"{k.name}.cubin"
    cubin.parent.mkdir(exist_ok=True)
    cubin.write_bytes(b"\x7fELF pretend cubin")
    record = {"cubin": f"sm80/{k.name}.cubin", "sha256": __import__("hashlib").sha256(cubin.read_bytes()).hexdigest(),
              "size": cubin.stat().st_size, "shared_memory_dynamic": 1, "threads_per_block": 128,
              "min_blocks_per_sm": 1, "registers": 1, "spill_stores": 0, "spill_loads": 0, "constants": {}}
    entry = {"name": k.name, "family": k.FAMILY, "params": k.params,
             "abi": k.abi_digest() if abi == "current" else abi, "targets": {"sm80": record}}
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": manifest.SCHEMA_VERSION,
                                                         "toolchain": {}, "kernels": [entry]}))
    return k, cubin


def test_list_reports_tampered_binaries(tmp_path):
    k, cubin = one_built_kernel(tmp_path)
    ok = run("list", "--build-dir", str(tmp_path), "--json")
    assert ok.exit_code == 0 and json.loads(ok.output)[0]["targets"]["sm80"]["verified"] == "ok"
    cubin.write_bytes(b"\x7fELF tampered")
    bad = CliRunner().invoke(main, ["list", "--build-dir", str(tmp_path), "--json"])
    assert bad.exit_code == 1
    assert json.loads(bad.stdout)[0]["targets"]["sm80"]["verified"] == "mismatch"
    assert f"FAILED CHECK {k.name} (sm80): mismatch" in bad.stderr


@pytest.mark.parametrize("abi", ["0" * 16, None])
def test_list_fails_kernels_built_for_another_params_layout(tmp_path, abi):
    """A kernel whose manifest entry records another Params layout (or none) is one the runtime
    refuses: list says so and exits 1, naming the rebuild."""
    k, _ = one_built_kernel(tmp_path, abi)
    result = CliRunner().invoke(main, ["list", "--build-dir", str(tmp_path), "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)[0]["targets"]["sm80"]["verified"] == "stale layout, rebuild"
    assert f"FAILED CHECK {k.name} (sm80): stale layout, rebuild" in result.stderr


def test_list_refuses_bad_manifests(tmp_path):
    (tmp_path / "manifest.json").write_text('{"schema_version": 1, "kern')
    result = run("list", "--build-dir", str(tmp_path))
    assert result.exit_code == 1 and str(tmp_path / "manifest.json") in result.output
    assert "not valid JSON" in result.output
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": manifest.SCHEMA_VERSION + 1}))
    result = run("list", "--build-dir", str(tmp_path))
    assert result.exit_code == 1 and "newer than this flashgen" in result.output


def test_build_without_nvcc_says_what_to_install(monkeypatch):
    monkeypatch.setenv("FLASHGEN_NVCC", "/nonexistent/nvcc")
    result = run("build", "--arch", "sm80")
    assert result.exit_code == 1
    assert "FLASHGEN_NVCC" in result.output and "/nonexistent/nvcc" in result.output


def test_build_requires_an_arch():
    result = run("build")
    assert result.exit_code == 2 and "--arch" in result.output


def test_doctor_reports_every_component():
    result = run("doctor")
    for component in ("nvcc", "cutlass", "example41", "curand", "ninja"):
        assert component in result.output
    assert result.exit_code in (0, 1)
    assert (result.exit_code == 0) == ("missing" not in result.output)


@pytest.mark.nvcc
def test_build_rejects_targets_nvcc_cannot_compile_for():
    result = run("build", "--arch", "sm80,sm_70")
    if "missing" in result.output:
        pytest.skip("no toolchain")
    assert result.exit_code == 1 and "cannot compile for sm_70" in result.output


@pytest.mark.nvcc
def test_build_with_nothing_selected_says_so(tmp_path):
    result = run("build", "--arch", "sm80", "--kernels", "no_such_kernel*", "--out", str(tmp_path))
    if "missing" in result.output:
        pytest.skip("no toolchain")
    assert result.exit_code == 1 and "no kernel matches" in result.output


@pytest.mark.nvcc
def test_build_of_a_kernel_for_a_target_it_skips_names_the_targets_it_builds_for(tmp_path):
    """An f16 example-41 tier below kMaxK 65536 is built for sm90a only (the sm80 pair serves plain
    targets): asked for sm80, the error says so instead of only that nothing matched."""
    name = "mem_eff_fwd_f16_aligned_q64x64_k64_bias_sm80"
    result = run("build", "--arch", "sm80", "--kernels", name, "--out", str(tmp_path))
    if "missing" in result.output:
        pytest.skip("no toolchain")
    assert result.exit_code == 1
    assert f"1 kernel(s) match the filters, none builds for it ({name} builds for sm90a)" in " ".join(
        result.output.split())


@pytest.mark.nvcc
@pytest.mark.parametrize("edited", ["source", "abi header"])
def test_build_refuses_stale_sources(tmp_path, edited):
    k = next(k for k in default_kernels() if k.runs_on("sm80"))
    instances = tmp_path / "instances"
    (instances / k.FAMILY).mkdir(parents=True)
    source, header = generator.source_path(k), generator.abi_header_path(k.FAMILY)
    for rel in (source, header):
        shutil.copy(generator.INSTANCES_DIR / rel, instances / rel)
    stale = instances / (source if edited == "source" else header)
    stale.write_text("// edited by hand\n")
    result = run("build", "--arch", "sm80", "--kernels", k.name, "--instances", str(instances),
                 "--out", str(tmp_path / "out"))
    if "missing" in result.output:
        pytest.skip("no toolchain")
    assert result.exit_code == 1
    assert "out of date" in result.output and "flashgen generate" in result.output
    assert f"stale: {stale}" in result.output


def test_importing_flashgen_imports_neither_torch_nor_cupy_nor_build_tooling():
    code = ("import sys, flashgen, flashgen.cli, flashgen.runtime.registry; "
            "print(*(m in sys.modules for m in ('torch', 'cupy', 'rich', 'jinja2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"] * 4
