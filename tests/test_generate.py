"""Generation: deterministic output, the checked-in instances are current, --check catches drift."""
from __future__ import annotations

import shutil
from pathlib import Path

from click.testing import CliRunner

from flashgen import generator
from flashgen.cli import main
from flashgen.spec import default_kernels
from flashgen.spec.mem_eff_bwd import MemEffBwd


def test_render_is_deterministic_and_self_describing():
    k = MemEffBwd("sm80", "f16", True, True, True, 128, 64, 128, False)
    first, second = generator.render(k), generator.render(k)
    assert first == second and first.endswith("\n")
    assert f"{k.name}(typename Kernel::Params p)" in first
    assert f"using Kernel = {k.cpp_type};" in first
    assert "__CUDA_ARCH__ >= 800 && __CUDA_ARCH__ < 1300" in first
    assert f'flashgen_wrong_arch("{k.name}", 80, 130)' in first
    assert first.count("static_assert(offsetof(Kernel::Params,") == len(MemEffBwd.ABI)
    assert f"long long {k.meta_symbol}[]" in first
    for c in MemEffBwd.CONSTANTS:
        assert f"// {c.name}\n" in first


def test_checked_in_instances_are_current():
    assert generator.check(generator.INSTANCES_DIR, default_kernels()) == {}


def test_cli_check_passes_on_the_repo():
    result = CliRunner().invoke(main, ["generate", "--check"])
    assert result.exit_code == 0, result.output
    assert "160 instance sources" in result.output


def _copy_instances(tmp_path: Path) -> Path:
    out = tmp_path / "instances"
    shutil.copytree(generator.INSTANCES_DIR, out)
    return out


def test_check_names_stale_missing_and_extra_files(tmp_path):
    out = _copy_instances(tmp_path)
    kernels = default_kernels()
    stale, missing = (out / generator.source_path(k) for k in kernels[:2])
    stale.write_text(stale.read_text().replace("kMaxK", "kMaxK "))
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


def test_generate_repairs_the_directory(tmp_path):
    out = _copy_instances(tmp_path)
    k = default_kernels()[5]
    (out / generator.source_path(k)).write_text("garbage\n")
    (out / "mem_eff_bwd" / "old.cu").write_text("")
    result = CliRunner().invoke(main, ["generate", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 file(s) changed" in result.output
    assert generator.check(out, default_kernels()) == {}
    assert not (out / "mem_eff_bwd" / "old.cu").exists()


def test_generate_into_an_empty_directory_writes_every_instance(tmp_path):
    result = CliRunner().invoke(main, ["generate", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.cu"))
    assert written == sorted(generator.source_path(k) for k in default_kernels())
    for p in tmp_path.rglob("*.cu"):  # byte-identical to the checked-in copies
        assert p.read_bytes() == (generator.INSTANCES_DIR / p.relative_to(tmp_path)).read_bytes()
