"""Tests for flashgen.toolchain: the search order, the parsing, and the fix-it messages."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from flashgen import toolchain as tc
from flashgen.errors import ToolchainError

FAKE_NVCC = """#!/bin/sh
case "$1" in
  --version) echo "nvcc: NVIDIA (R) Cuda compiler driver"
             echo "Cuda compilation tools, release {major}, V{version}";;
  --list-gpu-code) printf 'sm_80\\nsm_90\\nsm_90a\\nsm_120\\n';;
  *) exit 2;;
esac
"""


def write_exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_nvcc(path: Path, version: str = "12.9.41") -> Path:
    major = version.rsplit(".", 1)[0]
    return write_exe(path, FAKE_NVCC.format(major=major, version=version))


@pytest.fixture
def bare(tmp_path, monkeypatch):
    """No toolkit and no pip packages anywhere: every locator points at empty dirs."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(tc, "_DEFAULT_CUDA", empty / "cuda")
    monkeypatch.setattr(tc, "_nvidia_dirs", lambda: [empty / "nvidia"])
    monkeypatch.setattr(tc, "_cutlass_package_dir", lambda: None)
    monkeypatch.setattr(tc, "_ninja_pip_bin", lambda: None)
    return empty


def test_real_probe_finds_everything():
    report = tc.probe_toolchain()
    if isinstance(report.items["nvcc"], tc.Missing) and "nvcc not found" in \
            report.items["nvcc"].message:
        pytest.skip("no nvcc on this machine")
    if tc._cutlass_package_dir() is None:
        pytest.skip("the build extra is not installed here (no nvidia-cutlass), e.g. a GPU runner")
    assert list(report.items) == ["nvcc", "cutlass", "example41", "curand", "ninja"]
    assert report.ok(), report.missing()
    chain = tc.require_toolchain()
    assert re.fullmatch(r"13\.0\.\d+", chain.nvcc_version)
    assert "sm_80" in chain.nvcc_archs and "sm_90" in chain.nvcc_archs
    assert (chain.cutlass_include / "cutlass" / "cutlass.h").is_file()
    assert (chain.cutlass_example41 / "kernel_forward.h").is_file()
    assert (chain.curand_include / "curand_kernel.h").is_file()
    assert chain.cutlass_version == "4.2.0.0"
    assert chain.ninja.is_file() and chain.ninja_version


def test_flashgen_nvcc_missing_file_does_not_fall_through(tmp_path):
    fake_nvcc(tmp_path / "cuda" / "bin" / "nvcc")
    nope = tmp_path / "no" / "nvcc"
    env = {"FLASHGEN_NVCC": str(nope), "CUDA_HOME": str(tmp_path / "cuda"), "PATH": ""}
    item = tc.probe_toolchain(env).items["nvcc"]
    assert isinstance(item, tc.Missing)
    assert "FLASHGEN_NVCC" in item.message and str(nope) in item.message


def test_flashgen_nvcc_fake_script_is_parsed(tmp_path):
    nvcc = fake_nvcc(tmp_path / "my-nvcc", "13.7.123")
    report = tc.probe_toolchain({"FLASHGEN_NVCC": str(nvcc), "PATH": ""})
    assert report.items["nvcc"] == tc.Found(nvcc, "13.7.123", "FLASHGEN_NVCC")
    assert report.nvcc_archs == ("sm_80", "sm_90", "sm_90a", "sm_120")


@pytest.mark.parametrize("winner", ["CUDA_HOME", "CUDA_PATH", "PATH", "default", "pip"])
def test_search_order(tmp_path, bare, monkeypatch, winner):
    """Each source wins over every source after it in the documented order."""
    order = ["CUDA_HOME", "CUDA_PATH", "PATH", "default", "pip"]
    roots = {name: tmp_path / name for name in order}
    monkeypatch.setattr(tc, "_DEFAULT_CUDA", roots["default"])
    monkeypatch.setattr(tc, "_nvidia_dirs", lambda: [roots["pip"] / "nvidia"])
    env = {"PATH": ""}
    for name in order[order.index(winner):]:
        bin_dir = roots["pip"] / "nvidia" / "cu13" / "bin" if name == "pip" else roots[name] / "bin"
        fake_nvcc(bin_dir / "nvcc")
        if name in ("CUDA_HOME", "CUDA_PATH"):
            env[name] = str(roots[name])
        elif name == "PATH":
            env["PATH"] = str(bin_dir)
    expected_source = {"default": str(roots["default"]), "pip": "pip nvidia-cuda-nvcc"}
    item = tc.probe_toolchain(env).items["nvcc"]
    assert isinstance(item, tc.Found)
    assert item.source == expected_source.get(winner, winner)
    assert str(item.path).startswith(str(roots[winner]))


def test_cu12_pip_nvcc_layout_is_accepted(tmp_path, bare, monkeypatch):
    monkeypatch.setattr(tc, "_nvidia_dirs", lambda: [tmp_path / "nvidia"])
    nvcc = fake_nvcc(tmp_path / "nvidia" / "cuda_nvcc" / "bin" / "nvcc")
    assert tc.probe_toolchain({"PATH": ""}).items["nvcc"] == \
        tc.Found(nvcc, "12.9.41", "pip nvidia-cuda-nvcc")


def test_nothing_anywhere(bare):
    report = tc.probe_toolchain({"PATH": ""})
    assert not report.ok()
    assert [name for name, _ in report.missing()] == list(report.items)
    assert report.nvcc_archs == ()
    nvcc = report.items["nvcc"]
    assert "CUDA toolkit" in nvcc.message and "pip install nvidia-cuda-nvcc" in nvcc.message


def test_broken_nvcc_reports_its_stderr(tmp_path, bare):
    nvcc = write_exe(tmp_path / "nvcc", "#!/bin/sh\necho 'libfoo.so: cannot open' >&2\nexit 1\n")
    item = tc.probe_toolchain({"FLASHGEN_NVCC": str(nvcc), "PATH": ""}).items["nvcc"]
    assert isinstance(item, tc.Missing)
    assert "libfoo.so: cannot open" in item.message and str(nvcc) in item.message


def test_cutlass_not_installed(bare):
    report = tc.probe_toolchain({"PATH": ""})
    for key in ("cutlass", "example41"):
        assert "pip install nvidia-cutlass==4.2.0.0" in report.items[key].message


def test_cutlass_without_example41(tmp_path, bare, monkeypatch):
    pkg = tmp_path / "cutlass_library"
    (pkg / "source" / "include" / "cutlass").mkdir(parents=True)
    (pkg / "source" / "include" / "cutlass" / "cutlass.h").write_text("")
    (pkg / "source" / "include" / "cute").mkdir()
    monkeypatch.setattr(tc, "_cutlass_package_dir", lambda: pkg)
    report = tc.probe_toolchain({"PATH": ""})
    assert isinstance(report.items["cutlass"], tc.Found)
    assert report.items["cutlass"].path == pkg / "source" / "include"
    assert "pip install nvidia-cutlass==4.2.0.0" in report.items["example41"].message


def test_curand_missing(tmp_path, bare):
    nvcc = fake_nvcc(tmp_path / "toolkit" / "bin" / "nvcc")
    item = tc.probe_toolchain({"FLASHGEN_NVCC": str(nvcc), "PATH": ""}).items["curand"]
    assert isinstance(item, tc.Missing)
    assert "pip install nvidia-curand" in item.message


def test_curand_next_to_nvcc_wins_over_pip(tmp_path, bare, monkeypatch):
    nvcc = fake_nvcc(tmp_path / "toolkit" / "bin" / "nvcc")
    toolkit_inc = tmp_path / "toolkit" / "targets" / "x86_64-linux" / "include"
    pip_inc = tmp_path / "nvidia" / "cu13" / "include"
    for inc in (toolkit_inc, pip_inc):
        inc.mkdir(parents=True)
        (inc / "curand_kernel.h").write_text("")
    monkeypatch.setattr(tc, "_nvidia_dirs", lambda: [tmp_path / "nvidia"])
    env = {"FLASHGEN_NVCC": str(nvcc), "PATH": ""}
    assert tc.probe_toolchain(env).items["curand"] == tc.Found(toolkit_inc, "", "CUDA toolkit")
    assert tc.probe_toolchain({"PATH": ""}).items["curand"] == \
        tc.Found(pip_inc, "", "pip nvidia-curand")


def test_ninja_on_path(tmp_path, bare):
    ninja = write_exe(tmp_path / "bin" / "ninja", "#!/bin/sh\necho 1.11.1\n")
    item = tc.probe_toolchain({"PATH": str(tmp_path / "bin")}).items["ninja"]
    assert item == tc.Found(ninja, "1.11.1", "PATH")
    missing = tc.probe_toolchain({"PATH": ""}).items["ninja"]
    assert "pip install ninja" in missing.message


def test_toolchain_raises_with_every_missing_message(bare):
    report = tc.probe_toolchain({"PATH": ""})
    with pytest.raises(ToolchainError) as info:
        report.toolchain()
    text = str(info.value)
    assert len(report.missing()) == 5
    for _, missing in report.missing():
        assert missing.message in text
