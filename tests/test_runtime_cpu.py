"""The runtime's host-side logic, without a GPU and without CuPy.

Arch rules, the registry over fake manifests, first-fit selection and its
explanations, the backward's key-split count and workspace size, and the
argument checks that run before anything touches a device.  Manifests
(schema version 1) and fake cubins are written into tmp_path here; the
constants in them come from each spec's CONSTANTS with values like those a
real sm80/sm90 build reads back from its cubins.  Nothing here may import
CuPy: a fixture makes ``import cupy`` fail inside every test.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flashgen.build import manifest
from flashgen.build.cubin import sha256_file
from flashgen.errors import UnsupportedError
from flashgen.runtime import api, arrays, block_fallback, families, limits, registry, select, validate
from flashgen.runtime.families import sm90_common
from flashgen.runtime.arch import DeviceInfo, best_target, runs_on
from flashgen.runtime.block_masks import block_mask
from flashgen.runtime.registry import PACKAGE_KERNELS, Registry, search_path
from flashgen.runtime.select import Request, Selector, num_splits_key, rejection, workspace_bytes
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.spec.mem_eff_fwd import MemEffFwd


@pytest.fixture(scope="module", autouse=True)
def cupy_is_never_imported():
    # Other test modules may have imported CuPy at collection (on GPU machines); this one must not.
    before = sys.modules.get("cupy")
    yield
    assert sys.modules.get("cupy") is before
    if before is None:
        assert "cupy" not in sys.modules


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    """`import cupy` raises ImportError inside every test, even where CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


# --- fake devices (numbers as cudaGetDeviceProperties reports them) -----------------------

H100 = DeviceInfo(index=0, name="NVIDIA H100 80GB HBM3", cc=90, multiprocessors=132, shared_memory_optin=232448)
RTX3090 = DeviceInfo(index=1, name="NVIDIA GeForce RTX 3090", cc=86, multiprocessors=82, shared_memory_optin=101376)
A100 = DeviceInfo(index=0, name="NVIDIA A100-SXM4-80GB", cc=80, multiprocessors=108, shared_memory_optin=166912)
RTX4090 = DeviceInfo(index=0, name="NVIDIA GeForce RTX 4090", cc=89, multiprocessors=128, shared_memory_optin=101376)
T4 = DeviceInfo(index=2, name="Tesla T4", cc=75, multiprocessors=40, shared_memory_optin=65536)
B200 = DeviceInfo(index=3, name="NVIDIA B200", cc=100, multiprocessors=148, shared_memory_optin=232448)


# --- fake kernels and manifests ------------------------------------------------------------

def bwd(dtype="f16", aligned=True, dropout=False, preload=None, block_i=64, block_j=64, max_k=64, arch="sm80"):
    if preload is None:  # what the default set does: preload where dK/dV stay in registers on sm80
        preload = dtype != "f32" and max_k <= block_i
    return MemEffBwd(arch=arch, dtype=dtype, aligned=aligned, dropout=dropout, preload=preload,
                     block_i=block_i, block_j=block_j, max_k=max_k, block_aligned=False)


def fwd(dtype="f16", aligned=True, queries=64, keys=64, max_k=64, dropout=False, arch="sm80"):
    return MemEffFwd(arch=arch, dtype=dtype, aligned=aligned, queries_per_block=queries, keys_per_block=keys,
                     max_k=max_k, dropout=dropout, bias=True)


def hopper_constants(spec):
    """Every constant an sm90_fwd / sm90_bwd spec declares, as a build of it reads them back (FwdKernel's
    kServedKeyBlocks: 16 for an unmasked staged instance; BwdKernel's kMinQueries: 1024 for 80-query steps)."""
    known = dict(threads_per_block=384, min_blocks_per_sm=1, shared_memory_bytes=200 * 1024, block_m=spec.block_m,
                 block_n=spec.block_n, max_k=spec.max_k, stages=spec.stages, box_cols=64, swizzle_bytes=128,
                 alignment=8, params_bytes=type(spec).params_dtype().itemsize, aux_threads=128, mask_rows=128,
                 staged_max_key_blocks=16 if getattr(spec, "staged_o", False) and not spec.band else 0,
                 min_queries=1024 if spec.block_m == 80 else 0)
    return {c.name: known[c.name] for c in type(spec).CONSTANTS}


def constants(spec, smem, **overrides):
    """Every constant the spec declares, with the values a real build reads back from the cubin."""
    half = spec.dtype != "f32"
    if isinstance(spec, MemEffBwd):
        in_rf = half and spec.max_k <= spec.block_i
        tile = (spec.block_i, spec.block_j)
        known = dict(
            threads_per_block=spec.block_i * spec.block_j // 32,
            min_blocks_per_sm={(64, 64): 3 if half else 2, (128, 64): 1, (128, 128): 0}[tile],
            block_i=spec.block_i, block_j=spec.block_j, max_k=spec.max_k,
            optimal_alignment=8 if half else 4, minimum_alignment=4,
            output_in_registers=int(in_rf), kernel_computes_delta=int(half), enable_split_keys=1,
            needs_accum_grad_q=1, needs_accum_grad_k=int(half and not in_rf),
            needs_accum_grad_v=int(half and not in_rf),
            grad_q_temp_storage_bytes=spec.block_i * spec.block_j * 4 + 16, grad_q_block_n=spec.block_j,
            apply_dropout=int(spec.dropout))
    else:
        align = 8 if half and spec.aligned else 4
        known = dict(
            threads_per_block=128, warps_per_block=4, min_blocks_per_sm=4 if half else 3,
            queries_per_block=spec.queries_per_block, keys_per_block=spec.keys_per_block, max_k=spec.max_k,
            alignment_q=align, alignment_k=align, alignment_v=1, lse_row_alignment=32,
            needs_output_accum_buffer=int(half and spec.max_k > spec.keys_per_block),
            supports_dropout=int(spec.dropout), supports_bias=int(spec.bias))
    known.update(shared_memory_bytes=smem, params_bytes=type(spec).params_dtype().itemsize)
    known.update(overrides)
    return {c.name: known[c.name] for c in type(spec).CONSTANTS}


def write_build(directory: Path, kernels, schema_version=manifest.SCHEMA_VERSION, extra_entries=()):
    """A build directory like `flashgen build` leaves: fake cubins (or PTX) and their manifest.

    ``kernels``: (spec, {target: constants}) pairs; a ``computeXY`` target gets a PTX record.
    Returns {(name, target): path of the fake file}.
    """
    directory.mkdir(parents=True, exist_ok=True)
    entries, files = {}, {}
    for spec, targets in kernels:
        entry = {"name": spec.name, "family": spec.FAMILY, "params": spec.params, "symbol": spec.name,
                 "meta_symbol": spec.meta_symbol, "targets": {}}
        for target, consts in targets.items():
            kind = "ptx" if target.startswith("compute") else "cubin"
            rel = f"{target}/{spec.name}.{kind}"
            path = directory / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f"fake {kind}: {spec.name} for {target} in {directory}\n".encode())
            record = {kind: rel, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                      "size": path.stat().st_size}
            if kind == "cubin":
                record.update(registers=128, spill_stores=0, spill_loads=0, stack_frame=0, shared_memory_static=0)
            record.update(shared_memory_dynamic=consts["shared_memory_bytes"],
                          threads_per_block=consts["threads_per_block"],
                          min_blocks_per_sm=consts["min_blocks_per_sm"], constants=consts)
            entry["targets"][target] = record
            files[(spec.name, target)] = path
        entries[spec.name] = entry
    for e in extra_entries:
        entries[e["name"]] = e
    data = {"schema_version": schema_version,
            "toolchain": {"flashgen": "0.1.0", "nvcc": "13.0.88", "cutlass": "4.2.0.0"},
            "kernels": [entries[name] for name in sorted(entries)]}
    (directory / manifest.MANIFEST_NAME).write_text(json.dumps(data, indent=1) + "\n")
    return files


# The backward kernels selection is tested over, with the shared memory an sm80 build reports.
F16_K64 = bwd(max_k=64)
F16_K128_BIG = bwd(block_i=128, block_j=128, max_k=128)
F16_K128 = bwd(block_i=128, block_j=64, max_k=128)
F16_K65536 = bwd(max_k=65536)
F16_K64_DROP = bwd(max_k=64, dropout=True)
F16_K128_DROP = bwd(block_i=128, block_j=64, max_k=128, dropout=True)
F16_K65536_DROP = bwd(max_k=65536, dropout=True)
F16_UNALIGNED = bwd(aligned=False, max_k=65536)
F32_K64 = bwd(dtype="f32", max_k=64)
F32_K65536 = bwd(dtype="f32", max_k=65536)
BWD_SMEM = {F16_K64: 44288, F16_K128_BIG: 154112, F16_K128: 91648, F16_K65536: 34048, F16_K64_DROP: 52480,
            F16_K128_DROP: 96768, F16_K65536_DROP: 34048, F16_UNALIGNED: 34048, F32_K64: 53504, F32_K65536: 67840}
# The order the spec ranks them in, written out by hand: f32 first (DTYPES order), then aligned before
# unaligned, no dropout before dropout, the smaller kMaxK first, the larger tile first.
BWD_PRIORITY = [F32_K64, F32_K65536, F16_K64, F16_K128_BIG, F16_K128, F16_K65536,
                F16_K64_DROP, F16_K128_DROP, F16_K65536_DROP, F16_UNALIGNED]

FWD_K64 = fwd(max_k=64)
FWD_K128 = fwd(queries=32, keys=128, max_k=128)
FWD_K64_DROP = fwd(max_k=64, dropout=True)
FWD_UNALIGNED = fwd(aligned=False, queries=32, keys=128, max_k=65536)
FWD_SMEM = {FWD_K64: 18944, FWD_K128: 42496, FWD_K64_DROP: 18944, FWD_UNALIGNED: 51200}


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    specs = {**BWD_SMEM, **FWD_SMEM}
    write_build(d, [(s, {t: constants(s, smem) for t in ("sm80", "sm90")}) for s, smem in specs.items()])
    return d


@pytest.fixture(scope="module")
def reg(kernel_dir):
    return Registry([kernel_dir])


def req(dtype="f16", head_dim=64, head_dim_value=None, alignment=8, dropout=False, device=H100,
        family="mem_eff_bwd", bias=False, seq_multiples=(0, 0)):
    return Request(family, dtype, head_dim, head_dim if head_dim_value is None else head_dim_value,
                   alignment, dropout, bias, device, seq_multiples)


def binary(reg, spec, target="sm90"):
    return reg.binaries[(spec.name, target)]


# === 1. arch rules ===========================================================================

@pytest.mark.parametrize("target,cc,ok", [
    ("sm80", 80, True), ("sm80", 86, True), ("sm80", 87, True), ("sm80", 89, True),
    ("sm80", 90, False), ("sm80", 75, False), ("sm80", 100, False),
    ("sm86", 86, True), ("sm86", 89, True), ("sm86", 80, False), ("sm86", 90, False),
    ("sm90", 90, True), ("sm90", 89, False), ("sm90", 100, False),
    ("sm90a", 90, True), ("sm90a", 89, False), ("sm90a", 100, False), ("sm90a", 80, False),
    ("sm100", 100, True), ("sm100", 90, False), ("sm100", 120, False),
    ("sm100a", 100, True), ("sm100a", 103, False),
    ("sm120", 120, True), ("sm120", 100, False),
    ("sm75", 75, True), ("sm75", 80, False),
    ("sm_80", 86, True), ("sm_90a", 90, True), ("sm_90a", 80, False),
])
def test_runs_on_follows_the_cuda_binary_compatibility_rules(target, cc, ok):
    assert runs_on(target, cc) is ok


@pytest.mark.parametrize("targets,cc,best", [
    (["sm80", "sm86"], 86, "sm86"),      # exact beats lower minor
    (["sm86", "sm80"], 86, "sm86"),      # whatever the order
    (["sm80", "sm86"], 80, "sm80"),      # sm86 code does not run on 8.0
    (["sm80", "sm86"], 89, "sm86"),      # highest lower minor
    (["sm80", "sm86", "sm90"], 89, "sm86"),
    (["sm80", "sm90"], 87, "sm80"),
    (["sm90", "sm90a"], 90, "sm90a"),    # arch-specific code for exactly this GPU wins the tie
    (["sm90a", "sm90"], 90, "sm90a"),
    (["sm80", "sm90a"], 90, "sm90a"),
    (["sm80", "sm90a", "sm100"], 100, "sm100"),
    (["sm90", "sm90a", "sm100a"], 103, None),
    (["sm80", "sm86"], 90, None),        # nothing fits a newer major
    (["sm90a"], 89, None),
    (["sm80"], 75, None),
    ([], 90, None),
])
def test_best_target_prefers_exact_then_the_closest_lower_minor(targets, cc, best):
    assert best_target(targets, cc) == best
    assert best_target(iter(targets), cc) == best  # any iterable


def test_device_info_spells_its_target():
    assert H100.sm == "sm90" and RTX3090.sm == "sm86" and B200.sm == "sm100"


# PTX (``computeXY``) is JIT-compiled by the driver on any device of capability >= X.Y; SASS wins over it.
@pytest.mark.parametrize("target,cc,ok", [
    ("compute80", 80, True), ("compute80", 86, True), ("compute80", 90, True), ("compute80", 120, True),
    ("compute80", 75, False), ("compute90", 89, False), ("compute90", 90, True), ("compute90", 100, True),
])
def test_ptx_runs_on_every_later_device(target, cc, ok):
    assert runs_on(target, cc) is ok


@pytest.mark.parametrize("targets,cc,best", [
    (["sm90", "compute90"], 90, "sm90"),
    (["compute90", "sm90"], 90, "sm90"),
    (["sm80", "compute80"], 86, "sm80"),          # lower-minor SASS still beats PTX
    (["sm80", "compute90"], 90, "compute90"),     # sm80 SASS cannot run on 9.0
    (["sm90", "compute90"], 100, "compute90"),
    (["compute80", "compute90"], 100, "compute90"),  # the newest PTX
    (["compute90"], 89, None),
])
def test_best_target_prefers_sass_over_ptx(targets, cc, best):
    assert best_target(targets, cc) == best


# === 2. registry =============================================================================

def test_registry_reads_the_manifest_and_resolves_cubins_next_to_it(tmp_path):
    k, f = bwd(max_k=64), fwd(max_k=64)
    cubins = write_build(tmp_path / "a", [(k, {"sm80": constants(k, 44288), "sm90": constants(k, 44288)}),
                                          (f, {"sm90": constants(f, 18944)})])
    r = Registry([tmp_path / "a"])
    assert set(r.binaries) == {(k.name, "sm80"), (k.name, "sm90"), (f.name, "sm90")}
    for (name, target), b in r.binaries.items():
        assert b.name == name and b.target == target
        assert b.path == cubins[(name, target)]
        assert sha256_file(b.path) == b.sha256  # the fake cubin's digest travelled through the manifest
        assert b.constants["shared_memory_bytes"] == b.record["shared_memory_dynamic"]
    assert r.binaries[(k.name, "sm90")].spec == k
    assert r.binaries[(f.name, "sm90")].spec == f
    assert r.targets() == ["sm80", "sm90"]


def test_first_directory_wins_for_the_same_kernel_and_target(tmp_path):
    k, only_b = bwd(max_k=64), bwd(max_k=65536)
    write_build(tmp_path / "a", [(k, {"sm90": constants(k, 11111)})])
    write_build(tmp_path / "b", [(k, {"sm90": constants(k, 22222), "sm80": constants(k, 33333)}),
                                 (only_b, {"sm90": constants(only_b, 34048)})])
    ab = Registry([tmp_path / "a", tmp_path / "b"])
    assert ab.binaries[(k.name, "sm90")].constants["shared_memory_bytes"] == 11111
    assert ab.binaries[(k.name, "sm90")].path.parent.parent == tmp_path / "a"
    # what the first directory lacks still comes from the later ones
    assert ab.binaries[(k.name, "sm80")].constants["shared_memory_bytes"] == 33333
    assert ab.binaries[(k.name, "sm80")].path.parent.parent == tmp_path / "b"
    assert (only_b.name, "sm90") in ab.binaries
    ba = Registry([tmp_path / "b", tmp_path / "a"])
    assert ba.binaries[(k.name, "sm90")].constants["shared_memory_bytes"] == 22222
    assert ba.binaries[(k.name, "sm90")].path.parent.parent == tmp_path / "b"


def test_directories_without_a_manifest_are_skipped(tmp_path):
    k = bwd(max_k=64)
    write_build(tmp_path / "built", [(k, {"sm90": constants(k, 44288)})])
    (tmp_path / "empty").mkdir()
    r = Registry([tmp_path / "empty", tmp_path / "missing", tmp_path / "built"])
    assert list(r.binaries) == [(k.name, "sm90")]
    none = Registry([tmp_path / "empty", tmp_path / "missing"])
    assert none.binaries == {} and none.targets() == []


def test_unknown_families_are_left_alone(tmp_path):
    k = bwd(max_k=64)
    alien = {"name": "flash3_fwd_f16_hdim128_sm90a", "family": "flash3_fwd",
             "params": {"hdim": 128, "tile": [128, 176]}, "symbol": "flash3_fwd_f16_hdim128_sm90a",
             "meta_symbol": "x_meta", "targets": {"sm90a": {"cubin": "sm90a/x.cubin", "sha256": "0" * 64,
                                                             "constants": {"whatever": 1}}}}
    write_build(tmp_path, [(k, {"sm90": constants(k, 44288)})], extra_entries=[alien])
    assert any(e["family"] == "flash3_fwd" for e in manifest.read(tmp_path / manifest.MANIFEST_NAME)["kernels"])
    r = Registry([tmp_path])
    assert list(r.binaries) == [(k.name, "sm90")]
    assert "sm90a" not in r.targets()


def test_for_device_picks_the_best_target_per_kernel(tmp_path):
    everywhere, ampere_only, hopper_only = bwd(max_k=64), bwd(max_k=65536), bwd(block_i=128, block_j=128, max_k=128)
    write_build(tmp_path, [
        (everywhere, {t: constants(everywhere, 44288) for t in ("sm80", "sm86", "sm90", "sm90a")}),
        (ampere_only, {"sm80": constants(ampere_only, 34048)}),
        (hopper_only, {"sm90a": constants(hopper_only, 154112)}),
    ])
    r = Registry([tmp_path])

    def chosen(device):
        return {b.name: b.target for b in r.for_device("mem_eff_bwd", device)}

    assert chosen(A100) == {everywhere.name: "sm80", ampere_only.name: "sm80"}
    assert chosen(RTX3090) == {everywhere.name: "sm86", ampere_only.name: "sm80"}
    assert chosen(RTX4090) == {everywhere.name: "sm86", ampere_only.name: "sm80"}
    assert chosen(H100) == {everywhere.name: "sm90a", hopper_only.name: "sm90a"}
    with pytest.raises(UnsupportedError):
        r.for_device("mem_eff_fwd", H100)  # no forward kernels in this build


def test_for_device_sorts_by_the_spec_priority(reg):
    got = reg.for_device("mem_eff_bwd", H100)
    assert [b.name for b in got] == [k.name for k in BWD_PRIORITY]
    assert all(b.target == "sm90" for b in got)
    assert [b.spec.priority for b in got] == sorted(b.spec.priority for b in got)
    # the manifest lists kernels by name, so the sort did real work
    listed = [e["name"] for e in manifest.read(reg.paths[0] / manifest.MANIFEST_NAME)["kernels"]
              if e["family"] == "mem_eff_bwd"]
    assert listed != [b.name for b in got]
    assert {b.name for b in reg.for_device("mem_eff_fwd", RTX3090)} == {k.name for k in FWD_SMEM}
    assert all(b.target == "sm80" for b in reg.for_device("mem_eff_fwd", RTX3090))


@pytest.mark.parametrize("device", [T4, B200], ids=["sm75", "sm100"])
def test_no_usable_target_names_device_targets_and_the_build_command(reg, device):
    with pytest.raises(UnsupportedError) as e:
        reg.for_device("mem_eff_bwd", device)
    msg = str(e.value)
    assert device.name in msg
    assert f"sm_{device.cc}" in msg
    assert "sm80, sm90" in msg  # what the package has
    assert f"flashgen build --arch sm{device.cc}" in msg
    assert str(reg.paths[0]) in msg


def test_ptx_records_serve_newer_devices(tmp_path):
    k = bwd(max_k=64)
    files = write_build(tmp_path, [(k, {"sm90": constants(k, 44288), "compute90": constants(k, 44288)})])
    r = Registry([tmp_path])
    ptx = r.binaries[(k.name, "compute90")]
    assert ptx.path == files[(k.name, "compute90")] and ptx.path.suffix == ".ptx"
    assert ptx.is_ptx and not r.binaries[(k.name, "sm90")].is_ptx
    assert [b.target for b in r.for_device("mem_eff_bwd", H100)] == ["sm90"]
    assert [b.target for b in r.for_device("mem_eff_bwd", B200)] == ["compute90"]


def test_no_usable_target_lists_ptx_targets_too(tmp_path):
    k = bwd(max_k=64)
    write_build(tmp_path, [(k, {"sm90": constants(k, 44288), "compute90": constants(k, 44288)})])
    r = Registry([tmp_path])
    assert set(r.targets()) == {"sm90", "compute90"}
    with pytest.raises(UnsupportedError) as e:  # PTX for 9.0 does not run on 8.0 either
        r.for_device("mem_eff_bwd", A100)
    assert "compute90" in str(e.value) and "sm90" in str(e.value)
    assert "flashgen build --arch sm80" in str(e.value)


def test_empty_search_path_says_so(tmp_path):
    with pytest.raises(UnsupportedError, match=r"kernels found for: none"):
        Registry([tmp_path]).for_device("mem_eff_fwd", H100)


def test_newer_schema_is_refused_naming_the_file(tmp_path):
    k = bwd(max_k=64)
    write_build(tmp_path, [(k, {"sm90": constants(k, 44288)})], schema_version=manifest.SCHEMA_VERSION + 1)
    with pytest.raises(manifest.ManifestError) as e:
        Registry([tmp_path])
    assert str(tmp_path / manifest.MANIFEST_NAME) in str(e.value)
    assert "newer" in str(e.value) and "upgrade" in str(e.value)


def test_truncated_manifest_is_refused_naming_the_file(tmp_path):
    k = bwd(max_k=64)
    write_build(tmp_path, [(k, {"sm90": constants(k, 44288)})])
    path = tmp_path / manifest.MANIFEST_NAME
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(manifest.ManifestError) as e:
        Registry([tmp_path / "elsewhere", tmp_path])
    assert str(path) in str(e.value)
    assert "JSON" in str(e.value)


def test_search_path_order(monkeypatch, tmp_path):
    a, b, x = tmp_path / "a", tmp_path / "b", tmp_path / "x"
    monkeypatch.delenv("FLASHGEN_KERNEL_PATH", raising=False)
    assert search_path() == [PACKAGE_KERNELS]
    assert search_path([x]) == [x, PACKAGE_KERNELS]
    monkeypatch.setenv("FLASHGEN_KERNEL_PATH", os.pathsep.join([str(a), "", str(b)]))
    assert search_path() == [a, b, PACKAGE_KERNELS]
    assert search_path([x]) == [x, a, b, PACKAGE_KERNELS]
    assert search_path([str(x)]) == [x, a, b, PACKAGE_KERNELS]
    assert PACKAGE_KERNELS == Path(registry.__file__).resolve().parents[1] / "kernels"


def test_env_path_feeds_the_registry(monkeypatch, tmp_path):
    k1, k2 = bwd(max_k=64), bwd(max_k=65536)
    write_build(tmp_path / "explicit", [(k1, {"sm90": constants(k1, 1)})])
    write_build(tmp_path / "env", [(k1, {"sm90": constants(k1, 2)}), (k2, {"sm90": constants(k2, 34048)})])
    monkeypatch.setenv("FLASHGEN_KERNEL_PATH", str(tmp_path / "env"))
    r = Registry(search_path([tmp_path / "explicit"]))
    assert r.binaries[(k1.name, "sm90")].constants["shared_memory_bytes"] == 1  # explicit before env
    assert (k2.name, "sm90") in r.binaries


# === 3. selection ============================================================================

@pytest.mark.parametrize("device,spec,target", [(H100, F16_K128_BIG, "sm90"), (A100, F16_K128_BIG, "sm80"),
                                                (RTX3090, F16_K128, "sm80"), (RTX4090, F16_K128, "sm80")],
                         ids=["H100", "A100", "RTX3090", "RTX4090"])
def test_head_dim_128_takes_the_largest_tile_that_fits(reg, device, spec, target):
    got = Selector(reg).select(req(head_dim=128, device=device))
    assert (got.name, got.target) == (spec.name, target)


def test_explain_says_why_the_big_tile_was_skipped_on_sm86(reg):
    rows = Selector(reg).explain(req(head_dim=128, device=RTX3090))
    assert [name for name, _, _ in rows] == [k.name for k in BWD_PRIORITY]
    verdict = {name: why for name, _, why in rows}
    assert verdict[F16_K128.name] == "selected"
    big = verdict[F16_K128_BIG.name]
    assert "shared memory" in big and "154112" in big and "101376" in big and RTX3090.name in big
    assert "kMaxK 64 < head dim 128" in verdict[F16_K64.name]
    assert "dtype f32" in verdict[F32_K64.name] and "f16" in verdict[F32_K64.name]
    assert verdict[F16_K65536.name].startswith("not tried")  # would fit, but comes later
    assert [why for *_, why in rows].count("selected") == 1


@pytest.mark.parametrize("K,Kv", [(256, 256), (160, 64), (64, 160), (128, 129)])
def test_large_head_dims_take_the_k65536_kernel(reg, K, Kv):
    for device in (H100, RTX3090):
        assert Selector(reg).select(req(head_dim=K, head_dim_value=Kv, device=device)).spec == F16_K65536


def test_small_head_dim_takes_the_k64_kernel(reg):
    for K in (1, 8, 63, 64):
        assert Selector(reg).select(req(head_dim=K)).spec == F16_K64
    assert Selector(reg).select(req(head_dim=65)).spec == F16_K128_BIG


def test_alignment_4_skips_the_aligned_kernels(reg):
    sel = Selector(reg)
    r = req(head_dim=64, alignment=4)
    assert sel.select(r).spec == F16_UNALIGNED
    verdict = {name: why for name, _, why in sel.explain(r)}
    for k in (F16_K64, F16_K128_BIG, F16_K128, F16_K65536):
        assert "needs 8-element alignment" in verdict[k.name] and "has 4" in verdict[k.name]
    assert verdict[F16_UNALIGNED.name] == "selected"
    assert select.required_alignment(binary(reg, F16_K64)) == 8
    assert select.required_alignment(binary(reg, F16_UNALIGNED)) == 4
    # f32 kernels only ever need 4 elements (16 bytes)
    assert sel.select(req(dtype="f32", head_dim=64, alignment=4)).spec == F32_K64


@pytest.mark.parametrize("K,spec", [(64, F16_K64_DROP), (128, F16_K128_DROP), (200, F16_K65536_DROP)])
def test_dropout_requests_skip_kernels_without_dropout(reg, K, spec):
    sel = Selector(reg)
    r = req(head_dim=K, dropout=True)
    assert sel.select(r).spec == spec
    verdict = {name: why for name, _, why in sel.explain(r)}
    for k in (F16_K64, F16_K128_BIG, F16_K128, F16_K65536, F16_UNALIGNED):
        if k.max_k >= K:
            assert verdict[k.name] == "built without dropout"
    assert rejection(binary(reg, F16_K64), req(head_dim=64, dropout=True)) == "built without dropout"
    assert rejection(binary(reg, F16_K64_DROP), req(head_dim=64, dropout=False)) is None


def test_dtype_mismatch_is_a_rejection(reg):
    assert rejection(binary(reg, F32_K64), req(dtype="f16")) == "dtype f32, call is f16"
    assert rejection(binary(reg, F16_K64), req(dtype="f32")) == "dtype f16, call is f32"
    assert Selector(reg).select(req(dtype="f32", head_dim=64)).spec == F32_K64
    assert Selector(reg).select(req(dtype="f32", head_dim=100)).spec == F32_K65536
    with pytest.raises(UnsupportedError) as e:
        Selector(reg).select(req(dtype="bf16"))
    assert str(e.value).count("dtype f16, call is bf16") == 8
    assert str(e.value).count("dtype f32, call is bf16") == 2


def test_rejection_reasons_each_name_their_limit(reg):
    b = binary(reg, F16_K128_BIG)
    assert rejection(b, req(head_dim=128)) is None
    assert rejection(b, req(head_dim=128, head_dim_value=136)) == "kMaxK 128 < head dim 136"
    assert "4-element" not in rejection(b, req(head_dim=128, alignment=4))
    tiny = DeviceInfo(0, "tiny", 90, 1, 154111)
    assert rejection(b, req(head_dim=128, device=tiny)) == \
        "needs 154112 B of shared memory; tiny allows 154111 B per block"
    assert rejection(b, req(head_dim=128, device=DeviceInfo(0, "exact", 90, 1, 154112))) is None


def test_nothing_fits_lists_every_candidate_and_hints_at_padding(reg):
    r = req(head_dim=64, alignment=2, device=RTX3090)
    with pytest.raises(UnsupportedError) as e:
        Selector(reg).select(r)
    msg = str(e.value)
    assert "mem_eff_bwd" in msg and "alignment 2" in msg and RTX3090.name in msg and "sm_86" in msg
    lines = msg.splitlines()
    for name, target, why in Selector(reg).explain(r):
        assert why != "selected"
        assert f"  {name} ({target}): {why}" in lines
    assert sum(1 for line in lines if line.startswith("  mem_eff_bwd_")) == len(BWD_PRIORITY)
    assert "pad the head dim" in msg
    # a call that fails for another reason gets no padding hint
    with pytest.raises(UnsupportedError) as e:
        Selector(reg).select(req(dtype="bf16"))
    assert "pad" not in str(e.value)


def test_explain_marks_exactly_one_selected(reg):
    sel = Selector(reg)
    for r in (req(head_dim=64), req(head_dim=128, device=RTX3090), req(head_dim=512, dropout=True),
              req(alignment=4), req(dtype="f32", head_dim=32)):
        rows = sel.explain(r)
        verdicts = [why for *_, why in rows]
        assert verdicts.count("selected") == 1
        chosen = rows[verdicts.index("selected")]
        assert (chosen[0], chosen[1]) == (sel.select(r).name, sel.select(r).target)
        # everything before the chosen one was rejected for a reason
        assert all(not v.startswith("not tried") for v in verdicts[:verdicts.index("selected")])
    assert [why for *_, why in sel.explain(req(alignment=2))].count("selected") == 0


def test_decisions_are_cached_per_request(reg, monkeypatch):
    sel = Selector(reg)
    first = sel.select(req(head_dim=128))
    again = sel.select(req(head_dim=128))  # an equal, separately built request
    assert again is first

    def gone(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(reg, "for_device", gone)
    assert sel.select(req(head_dim=128)) is first
    with pytest.raises(AssertionError, match="cache"):
        sel.select(req(head_dim=128, device=RTX3090))  # a different device is a different request


def test_forward_selection(reg):
    sel = Selector(reg)
    fam = dict(family="mem_eff_fwd", bias=True)
    assert sel.select(req(head_dim=64, **fam)).spec == FWD_K64
    assert sel.select(req(head_dim=100, **fam)).spec == FWD_K128
    assert sel.select(req(head_dim=300, **fam)).spec == FWD_UNALIGNED
    assert sel.select(req(head_dim=64, alignment=4, **fam)).spec == FWD_UNALIGNED
    assert sel.select(req(head_dim=64, dropout=True, **fam)).spec == FWD_K64_DROP
    assert select.required_alignment(binary(reg, FWD_K64)) == 8
    assert select.required_alignment(binary(reg, FWD_UNALIGNED)) == 4


@pytest.mark.parametrize("M,N,varlen,expected", [
    (256, 256, False, (128, 128)),
    (256, 192, False, (128, 64)),
    (200, 256, False, (8, 128)),
    (7, 1, False, (1, 1)),
    (256, 256, True, (0, 0)),  # cu_seqlens: the kernels see per-sequence lengths
])
def test_seq_multiples(M, N, varlen, expected):
    assert select.seq_multiples(M, N, varlen) == expected


def test_block_aligned_kernels_only_serve_block_multiples(tmp_path):
    aligned_twin = MemEffBwd(arch="sm80", dtype="f16", aligned=True, dropout=False, preload=True, block_i=128,
                             block_j=64, max_k=128, block_aligned=True)
    general = bwd(block_i=128, block_j=64, max_k=128)
    write_build(tmp_path, [(s, {"sm90": constants(s, 91648)}) for s in (general, aligned_twin)])
    sel = Selector(Registry([tmp_path]))
    assert sel.select(req(head_dim=128, seq_multiples=(128, 64))).spec == aligned_twin  # first in priority
    assert sel.select(req(head_dim=128, seq_multiples=(128, 128))).spec == aligned_twin
    for multiples in ((64, 128), (128, 32), (0, 0)):  # M % 128, N % 64 or varlen: the general kernel
        r = req(head_dim=128, seq_multiples=multiples)
        assert sel.select(r).spec == general
        assert "block-aligned: needs M % 128 == N % 64 == 0" in rejection(binary(Registry([tmp_path]), aligned_twin),
                                                                             r)


# === 4. split keys and workspace =============================================================

def _bin(spec, smem=40000, **overrides):
    return registry.KernelBinary(spec, "sm90", Path("x.cubin"), "0" * 64, constants(spec, smem, **overrides), {})


K64 = _bin(F16_K64)            # 64x64, dQ only in the workspace, 3 blocks/SM
K128 = _bin(F16_K128)          # 128x64, dQ only, 1 block/SM
K128_BIG = _bin(F16_K128_BIG)  # 128x128, dQ only, kMinBlocksPerSm 0
ACCUM = _bin(F16_K65536)       # 64x64, dQ, dK and dV in the workspace, 3 blocks/SM


def test_constants_are_what_the_fixture_claims():
    assert (K64.constants["needs_accum_grad_k"], K64.constants["needs_accum_grad_v"]) == (0, 0)
    assert (ACCUM.constants["needs_accum_grad_k"], ACCUM.constants["needs_accum_grad_v"]) == (1, 1)
    assert K128_BIG.constants["min_blocks_per_sm"] == 0


@pytest.mark.parametrize("b,bh,expected", [
    (K64, 396, 1),       # 132 SMs * 3 blocks: B*H already fills the GPU
    (K64, 400, 1),
    (K64, 5000, 1),
    (K64, 395, 16384),   # one block short of a full wave: every key block gets a block
    (K64, 1, 16384),     # 2^20 keys / 64
    (K128, 132, 1),      # 1 block/SM
    (K128, 131, 16384),
    (K128_BIG, 1, 8192),  # 2^20 keys / 128; kMinBlocksPerSm 0 still counts one block per SM
    (K128_BIG, 200, 1),
])
def test_split_keys_fill_the_device(b, bh, expected):
    assert num_splits_key(b, bh, 1, 1 << 20, H100) == expected
    assert num_splits_key(b, 1, bh, 1 << 20, H100) == expected  # only B*H matters


@pytest.mark.parametrize("N,expected", [(1, 1), (64, 1), (65, 2), (1000, 16), (1024, 16), (1025, 17)])
def test_split_keys_never_exceed_the_key_blocks(N, expected):
    assert num_splits_key(K64, 1, 1, N, H100) == expected
    assert num_splits_key(ACCUM, 1, 1, N, H100) == expected
    assert num_splits_key(K128_BIG, 1, 1, N, H100) == min(expected, math.ceil(N / 128))


def test_split_keys_follow_the_device():
    # 100 (batch, head) pairs fill an RTX 3090 (82 SMs, 1 block each) but not an H100 (132)
    assert num_splits_key(K128, 100, 1, 4096, RTX3090) == 1
    assert num_splits_key(K128, 100, 1, 4096, H100) == 64  # 4096 keys / 64


@pytest.mark.parametrize("bh,capped", [
    (1, 200),   # 200 // 1 caps the dK/dV workspace
    (2, 100),
    (20, 10),   # 200 // 20
    (150, 1),   # 200 // 150 = 1
    (300, 1),   # 200 // 300 = 0 -> still one block per (batch, head)
])
def test_split_keys_are_capped_when_dk_dv_use_the_workspace(bh, capped):
    # N = 2^16 keys: the int32 workspace cap (below) allows 511 splits at head dim 64, so it never binds here
    assert num_splits_key(ACCUM, bh, 1, 1 << 16, H100, 64, 64) == capped
    assert num_splits_key(K64, bh, 1, 1 << 16, H100) == 1024  # no dK/dV workspace: no cap


def test_split_keys_keep_the_kernels_int32_workspace_offsets():
    # workspace_elements_gk/gv = splits * align(N, 64) * align(K, 64) is int32 in the kernel
    assert num_splits_key(ACCUM, 1, 1, 1 << 20, H100, 256, 256) == (2**31 - 1) // ((1 << 20) * 256)  # 7
    assert num_splits_key(ACCUM, 1, 1, 1 << 20, H100) == (2**31 - 1) // ((1 << 20) * 64)             # 31


def test_split_keys_disabled_means_one():
    off = _bin(F16_K64, enable_split_keys=0)
    for bh, n in ((1, 1 << 20), (8, 4096), (1000, 64)):
        assert num_splits_key(off, bh, 1, n, H100) == 1
    assert num_splits_key(_bin(F16_K65536, enable_split_keys=0), 1, 1, 1 << 20, H100) == 1


def test_split_keys_fit_the_int16_field():
    big = DeviceInfo(0, "huge", 90, 100000, 232448)
    assert num_splits_key(K64, 1, 1, 1 << 30, big) == 32767


# Params::workspace_size() = B * H * align_up(gk + gv + gq, 4) * sizeof(float), with
#   gk = splits * align_up(N, J) * align_up(K, I)    if kNeedsAccumGradK else 0
#   gv = splits * align_up(N, J) * align_up(Kv, I)   if kNeedsAccumGradV else 0
#   gq = ceil(M / I) * ceil(K, GradQ tile N) * sizeof(GradQTempStorage) / sizeof(float)
@pytest.mark.parametrize("b,shape,splits,expected", [
    # 128x64, dQ only: gq = ceil(100/128)=1 * ceil(96/64)=2 * 32784/4 = 16392; 2*3*16392*4
    (K128, (2, 3, 100, 70, 96, 80), 1, 393408),
    (K128, (2, 3, 100, 70, 96, 80), 5, 393408),  # no dK/dV in the workspace: splits do not matter
    # 128x64: M and K exact multiples: 2 blocks * 2 cols * 8196 = 32784; 1*1*32784*4
    (K128, (1, 1, 256, 256, 128, 128), 1, 131136),
    # 128x128 (GradQ tile 128): 3 blocks * 1 col * 65552/4 = 49164; 2*4*49164*4
    (K128_BIG, (2, 4, 300, 200, 128, 128), 2, 1573248),
    # 64x64 with dK/dV: gk = 3*128*64 = 24576 (K=40 -> 64), gv = 3*128*128 = 49152 (Kv=72 -> 128),
    # gq = ceil(130/64)=3 * ceil(40/64)=1 * 16400/4 = 12300; sum 86028; 1*2*86028*4
    (ACCUM, (1, 2, 130, 70, 40, 72), 3, 688224),
    # same with one split: 8192 + 16384 + 12300 = 36876; 1*2*36876*4
    (ACCUM, (1, 2, 130, 70, 40, 72), 1, 295008),
    # 64x64 with dK/dV, exact multiples: gk = gv = 2*128*64 = 16384, gq = 2*1*4100 = 8200; 3*1*40968*4
    (ACCUM, (3, 1, 128, 128, 64, 64), 2, 491616),
    # 64x64 dQ only, M = 1: gq = 1 * ceil(65/64)=2 * 4100 = 8200; 1*1*8200*4
    (K64, (1, 1, 1, 1, 65, 65), 1, 32800),
])
def test_workspace_matches_params_workspace_size(b, shape, splits, expected):
    B, H, M, N, K, Kv = shape
    assert workspace_bytes(b, B, H, M, N, K, Kv, splits) == expected


def test_workspace_rounds_each_batch_head_to_16_bytes():
    # Synthetic GradQTempStorage of 16404 B (real ones are multiples of 16) so that the
    # per-(batch, head) element count is not a multiple of 4: 1 * 1 * 16404 / 4 = 4101 -> 4104.
    odd = _bin(F16_K64, grad_q_temp_storage_bytes=16404)
    assert workspace_bytes(odd, 1, 1, 64, 64, 64, 64, 1) == 4104 * 4
    assert workspace_bytes(odd, 2, 3, 64, 64, 64, 64, 1) == 2 * 3 * 4104 * 4
    # C++ multiplies before dividing by sizeof(float): 3 * 16402 / 4 = 12301 -> 12304 (not 3 * 4100)
    odder = _bin(F16_K64, grad_q_temp_storage_bytes=16402)
    assert workspace_bytes(odder, 1, 1, 3 * 64, 64, 64, 64, 1) == 12304 * 4


def test_no_accumulation_means_no_workspace():
    none = _bin(F16_K64, needs_accum_grad_q=0, needs_accum_grad_k=0, needs_accum_grad_v=0)
    assert workspace_bytes(none, 4, 8, 1000, 1000, 64, 64, 4) == 0


# === 5. validation without a GPU =============================================================

class FakeArray:
    """Just the attributes the validation helpers read off a CuPy array."""

    def __init__(self, shape, dtype=np.float16, strides=None, ptr=0x7F2A00000000, device=0):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        if strides is None:  # C-contiguous, in elements
            strides, step = [], 1
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= max(n, 1)
        self.strides = tuple(s * self.itemsize for s in strides)  # bytes, like CuPy
        self.device = SimpleNamespace(id=device)
        self.data = SimpleNamespace(ptr=ptr, device_id=device)


def qkv(B=2, M=5, N=7, H=3, K=64, Kv=None, dtype=np.float16):
    Kv = K if Kv is None else Kv
    return FakeArray((B, M, H, K), dtype), FakeArray((B, N, H, K), dtype), FakeArray((B, N, H, Kv), dtype)


def common(q, k, v, causal=None, scale=None, dropout_p=0.0, seed=None, offset=0):
    return validate.problem(q, k, v, causal, scale, dropout_p, seed, offset, None, None)


def test_valid_inputs():
    q, k, v = qkv(B=2, M=5, N=7, H=3, K=64, Kv=32)
    c = common(q, k, v)
    assert isinstance(c, validate.Problem)
    assert (c.B, c.M, c.N, c.H, c.K, c.Kv) == (2, 5, 7, 3, 64, 32)
    assert (c.dtype, c.device, c.mask, c.dropout_p, c.seed, c.offset) == ("f16", 0, 0, 0.0, 0, 0)
    assert c.scale == pytest.approx(1 / 8)
    assert (c.seqstart_q, c.seqstart_k, c.batches) == (None, None, 2)
    q, k, v = qkv(K=80, Kv=64, dtype=np.float32)
    c = common(q, k, v, causal="bottom_right", dropout_p=0.25, seed=2**64 - 1, offset=7)
    assert c.scale == pytest.approx(1 / math.sqrt(80))  # from K, not Kv
    assert (c.dtype, c.mask, c.dropout_p, c.seed, c.offset) == ("f32", 2, 0.25, 2**64 - 1, 7)
    assert common(q, k, v, causal="top_left", scale=0.5).scale == 0.5
    assert common(q, k, v, causal="top_left").mask == 1
    assert common(q, k, v, seed=np.uint64(3), offset=np.int64(5)).seed == 3
    assert common(*qkv(M=0, N=0)).M == 0  # empty sequences are valid (no launch)


@pytest.mark.parametrize("window,causal,M,N,band", [
    (None, "top_left", 5, 7, (-2**30, 0)),
    (None, "bottom_right", 5, 7, (-2**30, 2)),
    ((3, None), None, 5, 7, (-3, 2**30)),
    ((None, 4), None, 5, 7, (-2**30, 4)),
    ((3, 4), "bottom_right", 5, 7, (2 - 3, 2)),  # the causal mask caps the right side at the diagonal
    ((0, 0), None, 5, 7, (0, 0)),
    ((2**40, 2**40), None, 5, 7, (-2**30, 2**30)),  # clamped to the kernels' unbounded
])
def test_window_becomes_the_kernels_band(window, causal, M, N, band):
    c = validate.problem(*qkv(M=M, N=N), causal, None, 0.0, None, 0, None, None, window=window)
    assert sm90_common.band(c) == band + (0,)
    # packed batches: top-left bounds, and the kernels shift each sequence onto its own diagonal
    packed = dataclasses.replace(c, seqstart_q="offsets", seqstart_k="offsets")
    top_left = sm90_common.band(dataclasses.replace(c, mask=validate.MASKS["top_left"] if causal else 0))
    assert sm90_common.band(packed) == top_left[:2] + (int(causal == "bottom_right"),)


def test_window_and_softcap_are_checked():
    q, k, v = qkv()
    c = validate.problem(q, k, v, None, None, 0.0, None, 0, None, None, window=[None, None], softcap=0)
    assert (c.window, c.softcap) == (None, 0.0), "a window without limits is no window"
    assert validate.problem(q, k, v, None, None, 0.0, None, 0, None, None, window=(np.int64(3), None)).window == (3, None)
    for bad, error in (((1,), TypeError), ((1, 2, 3), TypeError), (5, TypeError), ((1.5, 2), TypeError),
                       ((True, 2), TypeError), ((-1, 2), ValueError), ((2, -3), ValueError)):
        with pytest.raises(error, match="window"):
            validate.problem(q, k, v, None, None, 0.0, None, 0, None, None, window=bad)
    for bad, error in (("5", TypeError), (True, TypeError), (None, TypeError), (-1.0, ValueError),
                       (float("inf"), ValueError), (float("nan"), ValueError)):
        with pytest.raises(error, match="softcap"):
            validate.problem(q, k, v, None, None, 0.0, None, 0, None, None, softcap=bad)
    c = validate.problem(q, k, v, None, 0.25, 0.0, None, 0, None, None, softcap=10)
    fields = sm90_common.band_fields(c)
    assert (fields["softcap_in"], fields["softcap_out"]) == (0.025, 40.0)
    assert "softcap_in" not in sm90_common.band_fields(common(q, k, v)), "0 (off) unless asked for"


def fake_call(direction="fwd", bias=None, **options):
    """A validated Call over FakeArrays (what a family's refusal reads)."""
    q, k, v = options.pop("arrays", None) or qkv()
    c = validate.problem(q, k, v, options.get("causal"), None, options.get("dropout_p", 0.0), options.get("seed"), 0,
                         None, None, window=options.get("window"), softcap=options.get("softcap", 0.0))
    extra = {"out": FakeArray(q.shape), "grad_out": FakeArray(q.shape)} if direction == "bwd" else {}
    return validate.Call(direction, c, q, k, v, bias, options, None, **extra)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_families_refuse_with_the_reason_and_dispatch_lists_them_all(direction, monkeypatch):
    """Each family says what a call needs that it lacks; with none left, the error names them in order."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: T4)  # older than every own family's GPU
    serving = families.serving(direction)
    assert [f.name for f in serving] == [f"sm90_{direction}", f"sm80_{direction}", f"mem_eff_{direction}"], \
        "the spec's order"
    hopper, example41 = serving[0], serving[-1]
    windowed = fake_call(direction, window=(4, 4), softcap=3.0)
    assert example41.refusal(windowed).startswith("no sliding window or soft-capping")
    assert "compute-capability 9.0" in hopper.refusal(windowed) and "Tesla T4 (sm_75)" in hopper.refusal(windowed)
    with pytest.raises(UnsupportedError, match=rf"(?s)no kernel family serves this call:\n  sm90_{direction}: .*9\.0.*"
                                               rf"\n  sm80_{direction}: .*8\.0 or newer.*sm_75\)"
                                               rf"\n  mem_eff_{direction}: no sliding window"):
        families.dispatch(windowed)
    assert example41.refusal(fake_call(direction)) is None
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    assert hopper.unfit(fake_call(direction)) is None
    padded_bias = FakeArray((2, 3, 5, 7), strides=(3 * 5 * 8, 5 * 8, 8, 1))  # as validation leaves it
    assert hopper.unfit(fake_call(direction, bias=padded_bias)) is None, "bias instances take it"
    for call, why in ((fake_call(direction, arrays=qkv(dtype=np.float32)), "float32"),
                      (fake_call(direction, arrays=qkv(K=64, Kv=32)), "equal q/v head dims only; the call has 64 and 32"),
                      (fake_call(direction, arrays=(FakeArray((2, 5, 3, 64), ptr=0x7F2A00000008),) + qkv()[1:]),
                       "TMA cannot read q: its address is not 16-byte aligned")):
        assert why in hopper.unfit(call)
    if direction == "bwd":  # explain's backward call has no out or grad_out yet; a real one is checked too
        assert hopper.unfit(dataclasses.replace(fake_call("bwd"), out=None, grad_out=None)) is None
        skewed = dataclasses.replace(fake_call("bwd"), grad_out=FakeArray((2, 5, 3, 64), ptr=0x7F2A00000004))
        assert hopper.unfit(skewed) == "TMA cannot read grad_out: its address is not 16-byte aligned (4 bytes off)"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_block_mask_call_itself_goes_only_to_families_that_read_block_masks(direction, monkeypatch):
    """The call with its block mask: the families that do not read block masks refuse it, saying why, and
    sm90_fwd/sm90_bwd, which read them, refuse this one's bias; example 41 would take it as any call with a
    bias.  (The dense fallback, block_fallback.dense_call, leaves the mask out of the call it dispatches,
    so whichever family takes its bias serves it: test_block_mask_gpu.py.)"""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    padded_bias = FakeArray((2, 3, 5, 7), strides=(3 * 5 * 8, 5 * 8, 8, 1))
    mask = block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, device="cpu")
    call = dataclasses.replace(fake_call(direction, bias=padded_bias), block_mask=mask)
    *own, example41 = families.serving(direction)
    for family in own:
        expected = "a block mask with attn_bias" if family.reads_block_masks else "no block masks (until"
        assert family.unfit(call).startswith(expected), family
    assert [f.name for f in own if f.reads_block_masks] == [f"sm90_{direction}"]
    assert example41.refusal(call) is None


def test_the_dense_fallback_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(block_fallback, "_warned", False)
    with pytest.warns(UserWarning, match=r"^flashgen: block_mask runs dense \(the mask becomes an additive .* slow"):
        block_fallback.warn_once()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block_fallback.warn_once()  # no second warning


@pytest.mark.parametrize("which,shapes,match", [
    ("batch", ((2, 5, 3, 64), (3, 7, 3, 64), (2, 7, 3, 64)), r"batch sizes differ: q 2, k 3, v 2"),
    ("batch", ((2, 5, 3, 64), (2, 7, 3, 64), (1, 7, 3, 64)), r"batch sizes differ: q 2, k 2, v 1"),
    ("seq", ((2, 5, 3, 64), (2, 7, 3, 64), (2, 8, 3, 64)), r"k and v have different sequence lengths: 7 and 8"),
    ("heads", ((2, 5, 3, 64), (2, 7, 4, 64), (2, 7, 3, 64)), r"head counts differ: q 3, k 4, v 3"),
    ("heads", ((2, 5, 3, 64), (2, 7, 3, 64), (2, 7, 1, 64)), r"head counts differ: q 3, k 3, v 1"),
    ("head dim", ((2, 5, 3, 64), (2, 7, 3, 32), (2, 7, 3, 64)), r"q and k head dims differ: 64 and 32"),
])
def test_mismatched_shapes(which, shapes, match):
    with pytest.raises(ValueError, match=match):
        common(*(FakeArray(s) for s in shapes))


def test_dtype_mix_and_unsupported_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^k has dtype float32, expected float16 like q$"):
        common(q, FakeArray(k.shape, np.float32), v)
    with pytest.raises(TypeError, match=r"^v has dtype float64, expected float16 like q$"):
        common(q, k, FakeArray(v.shape, np.float64))
    for bad in (np.float64, np.int8, np.complex64):
        with pytest.raises(TypeError) as e:
            common(FakeArray(q.shape, bad), FakeArray(k.shape, bad), FakeArray(v.shape, bad))
        msg = str(e.value)
        assert msg.startswith(f"q has dtype {np.dtype(bad)}")
        assert "float32" in msg and "float16" in msg and "bfloat16" in msg
    assert arrays.dtype_name(np.float16) == "f16" and arrays.dtype_name(np.float32) == "f32"
    assert arrays.dtype_name(np.float64) is None


def test_inputs_on_different_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^k is on GPU 1, q is on GPU 0$"):
        common(q, FakeArray(k.shape, device=1), v)
    with pytest.raises(ValueError, match=r"^v is on GPU 0, q is on GPU 2$"):
        common(FakeArray(q.shape, device=2), FakeArray(k.shape, device=2), v)


def test_last_dim_must_be_contiguous():
    q, k, v = qkv(B=1, M=4, N=4, H=2, K=8)
    strided = FakeArray(k.shape, strides=(128, 32, 16, 2))  # every other element
    with pytest.raises(ValueError, match=r"^k must have a contiguous last \(head_dim\) dimension; its stride is 2"):
        common(q, strided, v)
    with pytest.raises(ValueError, match=r"^q must have a contiguous"):
        common(FakeArray(q.shape, strides=(64, 16, 8, 2)), k, v)
    # permuted outer dims are fine, and a head dim of 1 has no stride to speak of
    common(FakeArray(q.shape, strides=(8, 16, 64, 1)), k, v)
    common(*qkv(K=1), scale=1.0)
    validate.check_bmhk("x", FakeArray((1, 4, 2, 1), strides=(8, 2, 1, 99)))


def test_check_bmhk_names_the_argument():
    x = FakeArray((2, 5, 3, 64))
    validate.check_bmhk("grad_out", x, np.dtype(np.float16), 0)
    with pytest.raises(ValueError, match=r"^grad_out must be 4-D \[batch, seq, heads, head_dim\]; "
                                         r"got shape \(5, 3, 64\)$"):
        validate.check_bmhk("grad_out", FakeArray((5, 3, 64)))
    with pytest.raises(TypeError, match=r"^out has dtype float16, expected float32"):
        validate.check_bmhk("out", x, np.dtype(np.float32), 0)
    with pytest.raises(ValueError, match=r"^out is on GPU 0, q is on GPU 1$"):
        validate.check_bmhk("out", x, np.dtype(np.float16), 1)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_inputs_must_be_4d(which):
    arrays = dict(zip("qkv", qkv()))
    arrays[which] = FakeArray(arrays[which].shape[1:])
    with pytest.raises(ValueError, match=rf"^{which} must be 4-D"):
        common(arrays["q"], arrays["k"], arrays["v"])


@pytest.mark.parametrize("B,H", [(0, 3), (2, 0), (0, 0)])
def test_empty_batch(B, H):
    with pytest.raises(ValueError, match=rf"^empty batch: batch={B}, heads={H}$"):
        common(*qkv(B=B, H=H))


@pytest.mark.parametrize("K,Kv", [(0, 64), (64, 0), (0, 0)])
def test_head_dim_zero(K, Kv):
    with pytest.raises(ValueError, match=rf"^head dims must be >= 1; got {K} and {Kv}$"):
        common(*qkv(K=K, Kv=Kv))


@pytest.mark.parametrize("causal", ["causal", "TOP_LEFT", "lower_right", True, False, 1])
def test_bad_causal(causal):
    with pytest.raises(ValueError, match=r"^causal must be None, 'top_left' or 'bottom_right'; got "):
        common(*qkv(), causal=causal)


@pytest.mark.parametrize("p", [1.0, 1, -0.1, "0.5", None, float("nan"), float("inf"), True])
def test_bad_dropout_p(p):
    with pytest.raises(ValueError, match=r"^dropout_p must be in \[0, 1\); got "):
        common(*qkv(), dropout_p=p, seed=1)


def test_dropout_needs_a_seed():
    with pytest.raises(ValueError, match=r"^dropout_p > 0 needs an explicit seed"):
        common(*qkv(), dropout_p=0.1)
    assert common(*qkv(), dropout_p=0.1, seed=0).dropout_p == pytest.approx(0.1)


@pytest.mark.parametrize("name,value", [("seed", -1), ("seed", 2**64), ("seed", 1.5), ("seed", "7"),
                                        ("offset", -1), ("offset", 2**64), ("offset", None), ("offset", 2.0)])
def test_bad_seed_or_offset(name, value):
    kwargs = dict(seed=1, offset=0, dropout_p=0.1)
    kwargs[name] = value
    with pytest.raises(ValueError, match=rf"^{name} must be an integer in \[0, 2\*\*64\); got "):
        common(*qkv(), **kwargs)


def test_cu_seqlens_must_come_in_pairs():
    q, k, v = qkv(B=1)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        validate.problem(q, k, v, None, None, 0.0, None, 0, [0, 5], None)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        validate.problem(q, k, v, None, None, 0.0, None, 0, None, [0, 7])


F16 = np.float16
_P = 0x7F2A00000000  # 256-byte aligned, like every CuPy allocation


@pytest.mark.parametrize("ptr_bytes,expected", [(0, 8), (16, 8), (8, 4), (24, 4), (4, 2), (12, 2), (2, 1),
                                                (6, 1), (1, 1), (3, 1)])
def test_alignment_of_pointers(ptr_bytes, expected):
    x = FakeArray((2, 16, 4, 64), F16, ptr=_P + ptr_bytes)
    assert arrays.alignment([FakeArray((2, 16, 4, 64), F16, ptr=_P), x], (64, 64)) == expected


def test_alignment_of_f32_pointers_counts_elements():
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 32)], (8,)) == 8
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 16)], (8,)) == 4
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 8)], (8,)) == 2
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 4)], (8,)) == 1
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 2)], (8,)) == 1


@pytest.mark.parametrize("strides,expected", [
    ((2048, 256, 64, 1), 8),   # contiguous [2, 8, 4, 64]
    ((4096, 260, 64, 1), 4),   # padded rows: 260 = 4 * 65
    ((4096, 256, 66, 1), 2),   # head stride 66
    ((4097, 256, 64, 1), 1),   # odd batch stride
])
def test_alignment_of_strides(strides, expected):
    x = FakeArray((2, 8, 4, 64), F16, strides=strides)
    assert arrays.alignment([x], (64, 64)) == expected


def test_alignment_ignores_strides_of_size_one_dims():
    # batch of 1 and 1 head: their strides are never multiplied by anything but 0
    x = FakeArray((1, 8, 1, 64), F16, strides=(12345, 64, 3, 1))
    assert arrays.alignment([x], (64, 64)) == 8
    y = FakeArray((2, 8, 1, 64), F16, strides=(12345, 64, 3, 1))
    assert arrays.alignment([y], (64, 64)) == 1
    z = FakeArray((1, 1, 2, 64), F16, strides=(7, 7, 64, 1))
    assert arrays.alignment([z], (64, 64)) == 8


@pytest.mark.parametrize("dims,expected", [((64, 64), 8), ((64, 36), 4), ((64, 6), 2), ((63, 64), 1)])
def test_alignment_of_head_dims(dims, expected):
    x = FakeArray((1, 8, 1, 64), F16, strides=(512, 64, 64, 1))
    assert arrays.alignment([x], dims) == expected


def test_check_int32():
    limits.check_int32(q_strideM=2**31 - 1, num_keys=0, k_strideH=-(2**31 - 1))
    with pytest.raises(ValueError, match=r"^num_keys = 2147483648 does not fit the kernel's 32-bit field"):
        limits.check_int32(q_strideM=64, num_keys=2**31)
    with pytest.raises(ValueError, match=r"^v_strideM = "):
        limits.check_int32(v_strideM=2**40)


# === no CuPy anywhere ========================================================================

def test_importing_the_runtime_loads_no_cupy():
    code = ("import sys, flashgen, flashgen.runtime, flashgen.runtime.api, flashgen.runtime.select; "
            "flashgen.UnsupportedError; assert 'cupy' not in sys.modules, 'cupy imported'")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


def test_runtime_needs_cupy_only_at_call_time():
    # with `import cupy` blocked, the public entry points say what to install
    with pytest.raises(UnsupportedError, match="needs CuPy"):
        api.attention_forward(*qkv())
    with pytest.raises(UnsupportedError, match="needs CuPy"):
        api.explain(*qkv())
    assert sys.modules.get("cupy") is None  # still the block, never a module
