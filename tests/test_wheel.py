"""A wheel built by the PEP 517 backend, installed into a fresh venv with no source tree in sight.

Builds a wheel for sm80 with two kernels (plus their PTX), installs it, lists
its kernels with their sha256 check, and checks that a tampered cubin is
reported.  Needs nvcc and network access to PyPI for the build and install
environments (CI has both); about two minutes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import venv
from pathlib import Path
from urllib.parse import urlparse

import pytest

from flashgen.toolchain import probe_toolchain

pytestmark = pytest.mark.nvcc

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ["mem_eff_fwd_f32_aligned_q64x64_k64_bias_sm80", "mem_eff_bwd_f32_aligned_b64x64_k64_sm80"]


def _index_reachable() -> bool:
    """Whether pip's package index (PIP_INDEX_URL, else PyPI) answers: the build and install
    environments download setuptools and the runtime's dependencies."""
    index = urlparse(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"))
    port = index.port or (80 if index.scheme == "http" else 443)
    try:
        socket.create_connection((index.hostname or "pypi.org", port), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    if not probe_toolchain().ok():
        pytest.skip("no complete toolchain")
    if not _index_reachable():
        pytest.skip("no network access to the package index (pip builds and installs the wheel from it)")
    tmp = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, FLASHGEN_ARCHS="sm80", FLASHGEN_KERNELS=",".join(KERNELS), FLASHGEN_PTX="1")
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp / "dist"), str(ROOT)],
                   env=env, check=True, capture_output=True, text=True)
    wheel, = (tmp / "dist").glob("*.whl")
    venv.create(tmp / "venv", with_pip=True)
    bin_dir = tmp / "venv" / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", str(wheel)], env=env, check=True,
                   capture_output=True, text=True, cwd=tmp)
    return wheel, bin_dir, tmp


def _run(bin_dir, tmp, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLASHGEN_KERNEL_PATH")}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=tmp, env=env, capture_output=True, text=True)


def test_wheel_is_tagged_for_what_it_depends_on(installed):
    wheel, _, _ = installed
    assert wheel.name.startswith("flashgen-") and "-py3-none-manylinux2014_" in wheel.name
    print(f"wheel: {wheel.name}, {wheel.stat().st_size / 1024:.0f} KiB")


def test_installed_package_lists_its_kernels_verified(installed):
    _, bin_dir, tmp = installed
    where = _run(bin_dir, tmp, "python", "-c", "import flashgen; print(flashgen.__file__)")
    assert str(tmp / "venv") in where.stdout  # the wheel, not this checkout
    result = _run(bin_dir, tmp, "flashgen", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert sorted(rows) == sorted(KERNELS)
    for row in rows.values():
        assert sorted(row["targets"]) == ["compute80", "sm80"]
        assert all(rec["verified"] == "ok" for rec in row["targets"].values())
        assert row["targets"]["compute80"]["constants"] == row["targets"]["sm80"]["constants"]


def test_installed_package_carries_the_shipped_tuning_tables(installed):
    _, bin_dir, tmp = installed
    code = ("from flashgen.runtime import tuning; "
            "print(sorted((t.device_name, t.cc, len(t.entries)) for t in tuning._shipped_tables()))")
    result = _run(bin_dir, tmp, "python", "-c", code)
    assert result.returncode == 0, result.stderr
    assert "('NVIDIA H200', 90," in result.stdout


def test_tampered_cubin_is_reported(installed):
    _, bin_dir, tmp = installed
    package = Path(_run(bin_dir, tmp, "python", "-c", "import flashgen; print(flashgen.__file__)").stdout.strip()).parent
    cubin = package / "kernels" / "sm80" / f"{KERNELS[1]}.cubin"
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    result = _run(bin_dir, tmp, "flashgen", "list", "--json")
    assert result.returncode == 1
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows[KERNELS[1]]["targets"]["sm80"]["verified"] == "mismatch"
    assert rows[KERNELS[0]]["targets"]["sm80"]["verified"] == "ok"
    assert f"{KERNELS[1]} (sm80): mismatch" in result.stderr
