"""Generation: deterministic output, the checked-in instances are current, --check catches drift."""
from __future__ import annotations

import shutil
from pathlib import Path

from click.testing import CliRunner

from flashgen import generator
from flashgen.cli import main
from flashgen.spec import FAMILIES, default_kernels
from flashgen.spec.mem_eff_bwd import MemEffBwd


def test_render_is_deterministic_and_self_describing():
    k = MemEffBwd("sm80", "f16", True, True, True, 128, 64, 128, False)
    first, second = generator.render(k), generator.render(k)
    assert first == second and first.endswith("\n")
    assert f"{k.name}(typename Kernel::Params p)" in first
    assert f"using Kernel = {k.cpp_type};" in first
    assert "__CUDA_ARCH__ >= 800 && __CUDA_ARCH__ < 1300" in first
    assert f'flashgen_wrong_arch("{k.name}", 80, 130)' in first
    assert first.count("static_assert") == 1  # the ABI checks live in the family header, run by the one below
    assert '#include "mem_eff_bwd_abi.h"' in first
    assert "static_assert(sizeof(FlashgenAbiCheck_mem_eff_bwd<Kernel::Params>) > 0," in first
    assert f"long long {k.meta_symbol}[]" in first
    for c in MemEffBwd.CONSTANTS:
        assert f"// {c.name}\n" in first


def test_each_family_has_one_abi_header_with_a_check_per_field():
    for name, cls in FAMILIES.items():
        header = (generator.INSTANCES_DIR / generator.abi_header_path(name)).read_text()
        assert header == generator.render_abi_header(cls)
        assert f"struct FlashgenAbiCheck_{name} {{" in header
        assert header.count("static_assert(offsetof(Params,") == len(cls.ABI)
        dtype = cls.params_dtype()
        assert f"static_assert(sizeof(Params) == {dtype.itemsize}," in header
        for field in cls.ABI:
            offset = dtype.fields[field.numpy_name][1]
            assert f"static_assert(offsetof(Params, {field.name}) == {offset} &&" in header
            message = f"flashgen ABI: Params::{field.name} moved or changed size; update flashgen/spec/{name}.py"
            assert f'"{message}"' in header


def test_every_instance_includes_and_instantiates_its_family_header():
    for k in default_kernels():
        source = (generator.INSTANCES_DIR / generator.source_path(k)).read_text()
        assert f'#include "{k.FAMILY}_abi.h"' in source
        # one sizeof instantiates the family's checks (an explicit instantiation could appear only once
        # in a translation unit of several instances)
        assert source.count(f"static_assert(sizeof(FlashgenAbiCheck_{k.FAMILY}<") == 1
        assert source.count("static_assert") == 1 and "template struct" not in source


def test_checked_in_instances_are_current():
    assert generator.check(generator.INSTANCES_DIR, default_kernels()) == {}


def test_cli_check_passes_on_the_repo():
    result = CliRunner().invoke(main, ["generate", "--check"])
    assert result.exit_code == 0, result.output
    assert f"{len(default_kernels())} instance sources and {len(FAMILIES)} ABI headers" in result.output
    assert len(list(generator.INSTANCES_DIR.rglob("*.cu"))) == len(default_kernels())
    assert len(list(generator.INSTANCES_DIR.rglob("*.h"))) == len(FAMILIES)


def _copy_instances(tmp_path: Path) -> Path:
    out = tmp_path / "instances"
    shutil.copytree(generator.INSTANCES_DIR, out)
    return out


def test_check_names_stale_missing_and_extra_files(tmp_path):
    out = _copy_instances(tmp_path)
    kernels = default_kernels()
    stale, missing = (out / generator.source_path(k) for k in kernels[:2])
    stale.write_text(stale.read_text() + "// edited by hand\n")
    missing.unlink()
    extra = out / "mem_eff_fwd" / "leftover_kernel.cu"
    extra.write_text("// an instance the spec no longer generates\n")

    assert generator.check(out, kernels) == {
        generator.source_path(kernels[0]): "stale",
        generator.source_path(kernels[1]): "missing",
        "mem_eff_fwd/leftover_kernel.cu": "extra",
    }
    result = CliRunner().invoke(main, ["generate", "--check", "--out", str(out)])
    assert result.exit_code == 1
    assert f"stale: {stale}" in result.output and f"missing: {missing}" in result.output
    assert f"extra: {extra}" in result.output


def test_check_names_an_edited_or_missing_abi_header(tmp_path):
    out = _copy_instances(tmp_path)
    kernels = default_kernels()
    edited, missing = (out / generator.abi_header_path(name) for name in ("mem_eff_fwd", "sm90_bwd"))
    edited.write_text(edited.read_text().replace(") == 8 &&", ") == 16 &&", 1))
    missing.unlink()

    assert generator.check(out, kernels) == {
        generator.abi_header_path("mem_eff_fwd"): "stale",
        generator.abi_header_path("sm90_bwd"): "missing",
    }
    result = CliRunner().invoke(main, ["generate", "--check", "--out", str(out)])
    assert result.exit_code == 1
    assert f"stale: {edited}" in result.output and f"missing: {missing}" in result.output
    result = CliRunner().invoke(main, ["generate", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert generator.check(out, kernels) == {}


def test_generate_repairs_the_directory(tmp_path):
    out = _copy_instances(tmp_path)
    k = default_kernels()[5]
    (out / generator.source_path(k)).write_text("garbage\n")
    (out / "mem_eff_bwd" / "old.cu").write_text("")
    (out / "mem_eff_bwd" / "old_abi.h").write_text("")
    result = CliRunner().invoke(main, ["generate", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "3 file(s) changed" in result.output
    assert generator.check(out, default_kernels()) == {}
    assert not (out / "mem_eff_bwd" / "old.cu").exists() and not (out / "mem_eff_bwd" / "old_abi.h").exists()
    assert (out / generator.abi_header_path("mem_eff_bwd")).exists()  # removing leftovers spares the header


def test_generate_into_an_empty_directory_writes_every_instance(tmp_path):
    result = CliRunner().invoke(main, ["generate", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted([generator.source_path(k) for k in default_kernels()]
                             + [generator.abi_header_path(name) for name in FAMILIES])
    for rel in written:  # byte-identical to the checked-in copies
        assert (tmp_path / rel).read_bytes() == (generator.INSTANCES_DIR / rel).read_bytes()
