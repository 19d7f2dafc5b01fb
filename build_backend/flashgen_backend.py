"""PEP 517 backend: setuptools, plus the cubins a wheel ships.

``build_wheel`` first runs ``flashgen build`` from this source tree for the
targets in ``FLASHGEN_ARCHS`` (default below), optionally filtered by
``FLASHGEN_KERNELS`` and with PTX for the newest target when ``FLASHGEN_PTX=1``
(or ``--config-settings=--ptx``), and copies the manifest and cubins into
``flashgen/kernels/`` as package data.  Editable installs and sdists carry no
kernels and need no CUDA tooling.

Default targets: sm80 and sm90a.  An sm80 cubin runs on every 8.x GPU (A100,
A10, RTX 30xx/40xx, L4, L40); sm90a covers H100/H200 natively, with
flashgen's own wgmma family (sm_90a code runs on 9.0 only, which is every
Hopper part).  Blackwell and
later get PTX with FLASHGEN_PTX=1, or a wheel built with FLASHGEN_ARCHS=...,sm100,sm120.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (re-exported hooks)
    build_editable,
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "flashgen" / "kernels"
DEFAULT_ARCHS = "sm80,sm90a"
BUILD_TOOLING = ["numpy>=1.22", "click>=8.0", "rich>=13.0", "jinja2>=3.0", "ninja>=1.11",
                 "nvidia-cutlass==4.2.0.0", "nvidia-curand>=10.4"]
PIP_NVCC = ["nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-runtime"]


def get_requires_for_build_wheel(config_settings=None):
    extra = PIP_NVCC if os.environ.get("FLASHGEN_NVCC_FROM_PIP") == "1" else []
    return _setuptools.get_requires_for_build_wheel(config_settings) + BUILD_TOOLING + extra


def _stage_kernels(config_settings) -> None:
    archs = os.environ.get("FLASHGEN_ARCHS", DEFAULT_ARCHS)
    ptx = os.environ.get("FLASHGEN_PTX") == "1" or "--ptx" in (config_settings or {})
    kernels = os.environ.get("FLASHGEN_KERNELS", "")
    # One build directory per selection, so a filtered wheel never inherits an earlier build's entries.
    digest = hashlib.sha256(f"{archs}|{kernels}|{ptx}".encode()).hexdigest()[:12]
    out = ROOT / "build" / "wheel-kernels" / digest
    cmd = [sys.executable, "-m", "flashgen", "build", "--arch", archs, "--out", str(out)]
    if kernels:
        cmd += ["--kernels", kernels]
    if ptx:
        cmd.append("--ptx")
    print("flashgen backend:", " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    # Ship exactly what this build's manifest lists: no logs, no ninja state.
    manifest = json.loads((out / "manifest.json").read_text())
    shutil.rmtree(KERNELS, ignore_errors=True)
    for entry in manifest["kernels"]:
        for rec in entry["targets"].values():
            for key in ("cubin", "ptx"):
                if key in rec:
                    (KERNELS / rec[key]).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(out / rec[key], KERNELS / rec[key])
    shutil.copy2(out / "manifest.json", KERNELS / "manifest.json")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _stage_kernels(config_settings)
    try:
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    finally:
        shutil.rmtree(KERNELS, ignore_errors=True)  # keep the tree (and later sdists) kernel-free
