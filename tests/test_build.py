"""Real builds with nvcc: cubins, the manifest, incremental rebuilds, failures.

CI compiles one forward and one backward instance (about 15 s on 2 cores).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time

import pytest
from click.testing import CliRunner

from flashgen import generator
from flashgen.build import manifest
from flashgen.build.cubin import cubin_sm, sha256_file
from flashgen.build.graph import CUBIN_FLAGS, NVCC_FLAGS, include_dirs, render_ninja
from flashgen.build.runner import select_jobs
from flashgen.cli import main
from flashgen.spec import default_kernels

pytestmark = pytest.mark.nvcc

# f32: plain 8.x targets build example 41's f16/bf16 tiers only at kMaxK 65536 (the sm80 pair serves them).
FWD = "mem_eff_fwd_f32_aligned_q64x64_k64_bias_sm80"
# With dropout, so the Philox shim is compiled too.
BWD = "mem_eff_bwd_f32_aligned_b64x64_k64_dropout_sm80"
SM86_OPTIN_SMEM = 101376  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm86/sm89


def _kernel(name):
    return next(k for k in default_kernels() if k.name == name)


def _build(*args):
    return CliRunner().invoke(main, ["build", *args], catch_exceptions=False)


def build_private_copy(root, names, *expect):
    """``names`` built for sm80 from a private copy of their sources under ``root`` (tests may touch
    them); each of ``expect`` is in the build's output.  Returns (build directory, instances directory)."""
    instances = root / "instances"
    for name in names:
        kernel = _kernel(name)
        for rel in (generator.source_path(kernel), generator.abi_header_path(kernel.FAMILY)):
            (instances / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(generator.INSTANCES_DIR / rel, instances / rel)
    out = root / "out"
    result = _build("--arch", "sm80", "--kernels", ",".join(names), "--out", str(out),
                    "--instances", str(instances), "-j", "2")
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert all(e in output for e in expect), result.output
    return out, instances


@pytest.fixture(scope="module")
def built(toolchain, tmp_path_factory):
    """FWD and BWD built for sm80 from a private copy of their sources."""
    return build_private_copy(tmp_path_factory.mktemp("build"), (FWD, BWD), "2 of 2 binaries ready (2 compiled)")


def _entries(out):
    return {e["name"]: e for e in manifest.read(out / "manifest.json")["kernels"]}


def test_manifest_describes_each_cubin(built, toolchain):
    out, _ = built
    data = manifest.read(out / "manifest.json")
    assert data["toolchain"] == {"flashgen": data["toolchain"]["flashgen"], "nvcc": toolchain.nvcc_version,
                                 "cutlass": toolchain.cutlass_version}
    entries = _entries(out)
    assert sorted(entries) == sorted([FWD, BWD])
    for name, entry in entries.items():
        kernel = _kernel(name)
        assert entry["params"] == kernel.params and entry["symbol"] == name
        rec = entry["targets"]["sm80"]
        cubin = out / rec["cubin"]
        assert sha256_file(cubin) == rec["sha256"] and cubin.stat().st_size == rec["size"]
        assert cubin_sm(cubin) == "sm_80"
        assert 0 < rec["registers"] <= 255 and rec["stack_frame"] >= 0
        assert rec["spill_stores"] >= 0 and rec["spill_loads"] >= 0
        c = rec["constants"]
        assert [*c] == [x.name for x in kernel.CONSTANTS]
        assert c["params_bytes"] == kernel.params_dtype().itemsize  # the ABI, as the compiler sees it
        assert rec["shared_memory_dynamic"] == c["shared_memory_bytes"] > 0
        assert rec["threads_per_block"] == c["threads_per_block"]
        assert c["max_k"] == kernel.max_k


def test_constants_come_from_the_compiled_template(built):
    out, _ = built
    fwd = _entries(out)[FWD]["targets"]["sm80"]["constants"]
    assert (fwd["queries_per_block"], fwd["keys_per_block"]) == (64, 64)
    assert fwd["threads_per_block"] == 32 * fwd["warps_per_block"] == 128  # 64*64 / (32*32) warps
    assert fwd["supports_bias"] == 1 and fwd["supports_dropout"] == 0 and fwd["lse_row_alignment"] == 32
    bwd = _entries(out)[BWD]["targets"]["sm80"]["constants"]
    assert (bwd["block_i"], bwd["block_j"]) == (64, 64) and bwd["threads_per_block"] == 128
    # f32 keeps dK/dV out of registers and takes delta from the caller (the spec's f32 rule)
    assert bwd["apply_dropout"] == 1 and bwd["output_in_registers"] == 0 and bwd["kernel_computes_delta"] == 0
    assert bwd["optimal_alignment"] == 4 and bwd["minimum_alignment"] == 4
    assert bwd["shared_memory_bytes"] <= SM86_OPTIN_SMEM  # the one f32 tile serves every 8.x part


def test_noop_rebuild_is_fast_and_compiles_nothing(built):
    out, instances = built
    start = time.monotonic()
    result = _build("--arch", "sm80", "--kernels", f"{FWD},{BWD}", "--out", str(out), "--instances", str(instances))
    assert result.exit_code == 0, result.output
    assert "(0 compiled)" in result.output
    assert time.monotonic() - start < 3.0


def test_changing_one_source_rebuilds_exactly_that_kernel(built):
    out, instances = built
    before = _entries(out)[BWD]["targets"]["sm80"]["sha256"]
    src = instances / generator.source_path(_kernel(FWD))
    src.touch()
    result = _build("--arch", "sm80", "--kernels", f"{FWD},{BWD}", "--out", str(out), "--instances", str(instances))
    assert result.exit_code == 0, result.output
    assert "(1 compiled)" in result.output and f"{FWD} (sm80)" in result.output
    assert _entries(out)[BWD]["targets"]["sm80"]["sha256"] == before


def test_changing_a_family_abi_header_rebuilds_that_family(built):
    out, instances = built
    before = _entries(out)[BWD]["targets"]["sm80"]["sha256"]
    (instances / generator.abi_header_path(_kernel(FWD).FAMILY)).touch()  # nvcc's depfile lists it
    result = _build("--arch", "sm80", "--kernels", f"{FWD},{BWD}", "--out", str(out), "--instances", str(instances))
    assert result.exit_code == 0, result.output
    assert "(1 compiled)" in result.output and f"{FWD} (sm80)" in result.output
    assert _entries(out)[BWD]["targets"]["sm80"]["sha256"] == before


def test_flag_or_toolchain_change_makes_every_cubin_dirty(built, toolchain):
    out, instances = built
    jobs = select_jobs([_kernel(FWD), _kernel(BWD)], ["sm80"], instances)

    def dry_run(tc, launcher=None):
        (out / "build.ninja").write_text(render_ninja(jobs, tc, launcher=launcher))
        dry = subprocess.run([str(tc.ninja), "-C", str(out), "-n"], capture_output=True, text=True)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        return dry.stdout

    assert "ninja: no work to do" in dry_run(toolchain)
    assert "[2/2]" in dry_run(toolchain, launcher="env")  # a launcher (or any flag) changes the command
    upgraded = dataclasses.replace(toolchain, cutlass_version="9.9.9")
    assert "[2/2]" in dry_run(upgraded)  # same paths, new CUTLASS: rebuild everything
    dry_run(toolchain)  # restore the real graph so later tests see an up-to-date tree


def test_building_a_subset_keeps_the_other_entries(built):
    out, instances = built
    result = _build("--arch", "sm80", "--kernels", FWD, "--out", str(out), "--instances", str(instances))
    assert result.exit_code == 0, result.output
    assert sorted(_entries(out)) == sorted([FWD, BWD])


def test_list_shows_the_build(built):
    out, _ = built
    result = CliRunner().invoke(main, ["list", "--build-dir", str(out), "--kernels", f"{FWD},{BWD}", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows[BWD]["targets"]["sm80"]["registers"] == _entries(out)[BWD]["targets"]["sm80"]["registers"]
    table = CliRunner().invoke(main, ["list", "--build-dir", str(out), "--kernels", BWD])
    assert BWD in table.output and "sm80" in table.output


def test_broken_template_fails_cleanly_and_keeps_its_log(toolchain, tmp_path, monkeypatch):
    templates = tmp_path / "templates"
    shutil.copytree(generator.TEMPLATES, templates)
    t = templates / "mem_eff.cu.j2"
    t.write_text(t.read_text() + '{% if family == "mem_eff_bwd" %}this_is_not_cpp;{% endif %}\n')
    monkeypatch.setattr(generator, "TEMPLATES", templates)
    instances = tmp_path / "instances"
    generator.write(instances, [_kernel(FWD), _kernel(BWD)])
    out = tmp_path / "out"
    result = _build("--arch", "sm80", "--kernels", f"{FWD},{BWD}", "--out", str(out), "--instances", str(instances))
    assert result.exit_code == 1
    log = out / "sm80" / f"{BWD}.log"
    assert f"FAILED {BWD} (sm80): log {log}" in " ".join(result.output.split())
    assert "1 kernel(s) failed to build" in result.output
    assert "this_is_not_cpp" in log.read_text()
    assert not (out / "sm80" / f"{BWD}.cubin").exists()
    assert sorted(_entries(out)) == [FWD]  # the good kernel still built and is recorded


def test_kernel_built_outside_its_arch_range_traps_with_a_message(toolchain, tmp_path):
    sm75 = next(k for k in default_kernels() if k.FAMILY == "mem_eff_fwd" and k.arch == "sm75")
    src = generator.INSTANCES_DIR / generator.source_path(sm75)
    cubin = tmp_path / "wrong.cubin"
    cmd = [str(toolchain.nvcc), *NVCC_FLAGS, *CUBIN_FLAGS, *(f"-I{d}" for d in include_dirs(toolchain)),
           "-gencode=arch=compute_80,code=sm_80", "-o", str(cubin), str(src)]
    subprocess.run(cmd, check=True, capture_output=True)
    data = cubin.read_bytes()
    assert b"refuses to run" in data and sm75.name.encode() in data


def test_an_earlier_manifest_keeps_only_kernels_this_flashgen_still_describes(tmp_path):
    """A later `flashgen build` into the same directory carries earlier entries on -- except ones
    whose params no longer make a kernel of that name (a family changed its axes) or that were
    built for another Params layout (or before manifests recorded it), which the runtime would
    refuse to load and a rebuild could never replace."""
    current = next(k for k in default_kernels() if k.FAMILY == "sm90_bwd")
    (tmp_path / "a.cubin").write_bytes(b"a")
    target = {"sm90a": {"cubin": "a.cubin", "sha256": sha256_file(tmp_path / "a.cubin")}}
    stale_params = {k: v for k, v in current.params.items() if k not in ("band", "softcap")}
    abi = current.abi_digest()
    old = {"toolchain": {"nvcc": "x"}, "kernels": [
        {"name": current.name, "family": current.FAMILY, "params": current.params, "abi": abi, "targets": target},
        {"name": "sm90_bwd_f16_k64_q128x128_s2_causal_sm90a", "family": "sm90_bwd",
         "params": dict(stale_params, causal=True), "abi": abi, "targets": target},
        {"name": "renamed", "family": current.FAMILY, "params": current.params, "abi": abi, "targets": target},
        {"name": current.name, "family": current.FAMILY, "params": current.params, "abi": "0" * 16,
         "targets": target},
        {"name": current.name, "family": current.FAMILY, "params": current.params, "targets": target},
        {"name": "someone_elses", "family": "not_a_flashgen_family", "params": {"x": 1}, "targets": target},
    ]}
    kept = manifest.surviving_entries(tmp_path, old, {"nvcc": "x"})
    assert sorted(kept) == sorted([current.name, "someone_elses"])
    assert kept[current.name]["abi"] == abi  # neither later entry of that name replaced it
