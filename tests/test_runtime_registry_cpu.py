"""The runtime's arch rules and its registry over fake manifests, without a GPU and without CuPy
(tests/runtime_fakes.py writes the manifests and fake cubins)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flashgen.build import manifest
from flashgen.build.cubin import sha256_file
from flashgen.errors import UnsupportedError
from flashgen.runtime import registry
from flashgen.runtime.arch import best_target, runs_on
from flashgen.runtime.registry import PACKAGE_KERNELS, Registry, search_path

from runtime_fakes import (
    A100, B200, BWD_PRIORITY, FWD_SMEM, H100, RTX3090, RTX4090, T4, bwd, constants, fwd, write_build,
)

pytestmark = pytest.mark.usefixtures("cupy_is_never_imported", "block_cupy")


# === arch rules ===========================================================================

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


# === registry =============================================================================

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


@pytest.mark.parametrize("abi", [None, "0123456789abcdef"])
def test_a_kernel_built_for_another_params_layout_is_refused(tmp_path, abi):
    """A manifest entry records the digest of the Params layout its kernel was compiled against;
    one from another layout (a field moved, same size: the launch would write fields where the
    kernel reads others) or from before digests were recorded must be rebuilt, not launched."""
    k = bwd(max_k=64)
    write_build(tmp_path, [(k, {"sm90": constants(k, 44288)})])
    path = tmp_path / manifest.MANIFEST_NAME
    data = json.loads(path.read_text())
    assert data["kernels"][0]["abi"] == k.abi_digest()
    assert Registry([tmp_path]).binaries  # as written: loads
    if abi is None:
        del data["kernels"][0]["abi"]
    else:
        data["kernels"][0]["abi"] = abi
    path.write_text(json.dumps(data))
    with pytest.raises(manifest.ManifestError, match="rebuild it with this version") as e:
        Registry([tmp_path])
    assert str(path) in str(e.value) and k.name in str(e.value) and k.abi_digest() in str(e.value)


def test_params_layout_digests_follow_every_field_and_only_the_layout():
    """The digest is a function of the fields' names, types and offsets and the size: stable for a
    family, different between families, and changed by moving one field."""
    from flashgen.spec.mem_eff_fwd import MemEffFwd
    from flashgen.spec.sm90_bwd import Sm90Bwd

    assert Sm90Bwd.abi_digest() == Sm90Bwd.abi_digest() and Sm90Bwd.abi_digest() != MemEffFwd.abi_digest()
    fields = Sm90Bwd.ABI
    swapped = fields[:1] + (fields[2], fields[1]) + fields[3:]  # two fields trade places
    moved = type("Moved", (Sm90Bwd,), {"ABI": swapped})
    assert moved.params_dtype().itemsize == Sm90Bwd.params_dtype().itemsize  # the same size ...
    assert moved.abi_digest() != Sm90Bwd.abi_digest()  # ... another layout


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
