"""Find the compiler, headers and build executor that ``flashgen build`` needs.

``flashgen doctor`` prints a :class:`ToolchainReport`; the build calls
:func:`require_toolchain`.  Probing never raises for a missing component:
every component gets either a :class:`Found` or a :class:`Missing` whose
message says where we looked and the exact command that fixes it, so the
user sees every problem at once instead of one per attempt.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence, cast

from flashgen.errors import ToolchainError

CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"  # the release flashgen is tested with
_DEFAULT_CUDA = Path("/usr/local/cuda")
_TIMEOUT_S = 60


@dataclass(frozen=True)
class Found:
    """One component that was found."""

    path: Path
    version: str  # "" when not applicable
    source: str  # how it was found, e.g. "CUDA_HOME" or "pip nvidia-curand"


@dataclass(frozen=True)
class Missing:
    """One component that was not found."""

    message: str  # what was looked for, where, and the exact command that fixes it


@dataclass(frozen=True)
class Toolchain:
    """Everything the build needs; only built when nothing is missing."""

    nvcc: Path
    nvcc_version: str
    nvcc_source: str
    nvcc_archs: tuple[str, ...]
    cutlass_include: Path
    cutlass_example41: Path
    cutlass_version: str
    curand_include: Path
    ninja: Path
    ninja_version: str


@dataclass(frozen=True)
class ToolchainReport:
    """The outcome of a probe: keys "nvcc", "cutlass", "example41", "curand", "ninja"."""

    items: dict[str, Found | Missing]
    nvcc_archs: tuple[str, ...]

    def ok(self) -> bool:
        return not self.missing()

    def missing(self) -> list[tuple[str, Missing]]:
        return [(k, v) for k, v in self.items.items() if isinstance(v, Missing)]

    def toolchain(self) -> Toolchain:
        """The found toolchain; raises ToolchainError naming every missing item."""
        missing = self.missing()
        if missing:
            lines = "\n".join(f"  - {name}: {m.message}" for name, m in missing)
            raise ToolchainError(f"flashgen build cannot run; missing:\n{lines}")
        it = cast("dict[str, Found]", self.items)
        return Toolchain(
            nvcc=it["nvcc"].path, nvcc_version=it["nvcc"].version,
            nvcc_source=it["nvcc"].source, nvcc_archs=self.nvcc_archs,
            cutlass_include=it["cutlass"].path, cutlass_example41=it["example41"].path,
            cutlass_version=it["cutlass"].version, curand_include=it["curand"].path,
            ninja=it["ninja"].path, ninja_version=it["ninja"].version,
        )


# --- search locations; small functions so that tests can monkeypatch them ---

def _nvidia_dirs() -> list[Path]:
    """Directories of the ``nvidia`` namespace package that NVIDIA's pip wheels share."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _cutlass_package_dir() -> Path | None:
    """Directory of ``cutlass_library``, found without importing it (slow, side effects)."""
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _ninja_pip_bin() -> Path | None:
    """The ninja executable shipped by the ``ninja`` pip package, if installed."""
    try:
        import ninja
    except ImportError:
        return None
    return Path(ninja.BIN_DIR) / "ninja"


# --- probing -----------------------------------------------------------------

class _RunError(Exception):
    """A tool could not be run; the message says why, including its stderr."""


def _run(cmd: Sequence[str], env: Mapping[str, str]) -> str:
    try:
        proc = subprocess.run(list(cmd), env=dict(env), capture_output=True,
                              text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _RunError(f"`{' '.join(cmd)}` could not run: {exc}") from None
    if proc.returncode != 0:
        raise _RunError(f"`{' '.join(cmd)}` exited with {proc.returncode}: "
                        f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _is_exe(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _find_nvcc(env: Mapping[str, str]) -> tuple[Path, str] | Missing:
    """The first nvcc in the documented search order, with the name of its source."""
    explicit = env.get("FLASHGEN_NVCC")
    if explicit:
        if _is_exe(Path(explicit)):
            return Path(explicit), "FLASHGEN_NVCC"
        return Missing(f"FLASHGEN_NVCC={explicit} is not an executable file; point it "
                       "at nvcc or unset it to search CUDA_HOME, PATH and /usr/local/cuda")
    candidates: list[tuple[Path | None, str]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        candidates.append((Path(env[var]) / "bin" / "nvcc" if env.get(var) else None, var))
    on_path = shutil.which("nvcc", path=env.get("PATH", ""))
    candidates.append((Path(on_path) if on_path else None, "PATH"))
    candidates.append((_DEFAULT_CUDA / "bin" / "nvcc", str(_DEFAULT_CUDA)))
    for d in _nvidia_dirs():  # cu13 wheels share nvidia/cu13; cu12 ones use nvidia/cuda_nvcc
        for sub in ("cu13", "cuda_nvcc"):
            candidates.append((d / sub / "bin" / "nvcc", "pip nvidia-cuda-nvcc"))
    for path, source in candidates:
        if path is not None and _is_exe(path):
            return path, source
    looked = ", ".join(str(p) if p else f"{src} (none)" for p, src in candidates)
    return Missing(f"nvcc not found (looked at: {looked}). Install the CUDA toolkit "
                   "(13.0 is tested) and set CUDA_HOME, or `pip install nvidia-cuda-nvcc`")


def _probe_nvcc(env: Mapping[str, str]) -> tuple[Found | Missing, tuple[str, ...]]:
    found = _find_nvcc(env)
    if isinstance(found, Missing):
        return found, ()
    path, source = found
    try:
        version_out = _run([str(path), "--version"], env)
        archs_out = _run([str(path), "--list-gpu-code"], env)
    except _RunError as exc:
        return Missing(f"nvcc at {path} (from {source}) does not work: {exc}"), ()
    version = re.search(r"release \S+, V(\d+(?:\.\d+)+)", version_out)
    archs = tuple(re.findall(r"^\s*(sm_\w+)\s*$", archs_out, re.MULTILINE))
    if not version or not archs:
        return Missing(f"nvcc at {path} (from {source}) gave unexpected output for "
                       f"--version/--list-gpu-code: {(version_out + archs_out).strip()!r}"), ()
    return Found(path, version.group(1), source), archs


def _probe_cutlass() -> tuple[Found | Missing, Found | Missing]:
    """CUTLASS include dir and example 41 (the fused attention kernels) from the pip wheel."""
    fix = f"`pip install {CUTLASS_PIN}` (or `pip install 'flashgen[build]'`)"
    pkg = _cutlass_package_dir()
    if pkg is None:
        msg = "Python package cutlass_library (pip nvidia-cutlass) is not installed"
        return Missing(f"{msg}; run {fix}"), Missing(f"CUTLASS example 41: {msg}; run {fix}")
    try:
        version = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    include = pkg / "source" / "include"
    ex41 = pkg / "source" / "examples" / "41_fused_multi_head_attention"
    if (include / "cutlass" / "cutlass.h").is_file() and (include / "cute").is_dir():
        inc_item: Found | Missing = Found(include, version, "pip nvidia-cutlass")
    else:
        inc_item = Missing(f"{include} lacks cutlass/cutlass.h or cute/; run {fix}")
    if all((ex41 / h).is_file() for h in ("kernel_forward.h", "kernel_backward.h")):
        ex_item: Found | Missing = Found(ex41, version, "pip nvidia-cutlass")
    else:
        ex_item = Missing(f"{ex41} lacks kernel_forward.h or kernel_backward.h; run {fix}")
    return inc_item, ex_item


def _probe_curand(nvcc: Path | None) -> Found | Missing:
    """curand_kernel.h, which the CUTLASS kernels include unconditionally."""
    candidates: list[tuple[Path, str]] = []
    if nvcc is not None:
        root = nvcc.resolve().parent.parent
        for inc in [root / "include", *sorted(root.glob("targets/*/include"))]:
            candidates.append((inc, "CUDA toolkit"))
    for d in _nvidia_dirs():  # cu13 wheels share nvidia/cu13; cu12 ones use nvidia/curand
        for sub in ("cu13", "curand"):
            candidates.append((d / sub / "include", "pip nvidia-curand"))
    for inc, source in candidates:
        if (inc / "curand_kernel.h").is_file():
            return Found(inc, "", source)
    looked = ", ".join(str(p) for p, _ in candidates) or "no toolkit or nvidia pip dirs"
    return Missing(f"curand_kernel.h not found (looked in {looked}); "
                   "run `pip install nvidia-curand`")


def _probe_ninja(env: Mapping[str, str]) -> Found | Missing:
    pip_bin = _ninja_pip_bin()
    on_path = shutil.which("ninja", path=env.get("PATH", ""))
    if pip_bin is not None and _is_exe(pip_bin):
        path, source = pip_bin, "pip ninja"
    elif on_path:
        path, source = Path(on_path), "PATH"
    else:
        return Missing("ninja not found (no pip package ninja, none on PATH); "
                       "run `pip install ninja`")
    try:
        return Found(path, _run([str(path), "--version"], env).strip(), source)
    except _RunError as exc:
        return Missing(f"ninja at {path} does not work: {exc}; run `pip install ninja`")


def probe_toolchain(env: Mapping[str, str] | None = None) -> ToolchainReport:
    """Look for every component; never raises for a missing one."""
    env = os.environ if env is None else env
    nvcc, archs = _probe_nvcc(env)
    cutlass, example41 = _probe_cutlass()
    curand = _probe_curand(nvcc.path if isinstance(nvcc, Found) else None)
    items: dict[str, Found | Missing] = {
        "nvcc": nvcc, "cutlass": cutlass, "example41": example41,
        "curand": curand, "ninja": _probe_ninja(env),
    }
    return ToolchainReport(items, archs)


def require_toolchain(env: Mapping[str, str] | None = None) -> Toolchain:
    """The toolchain for a build, or ToolchainError listing everything missing."""
    return probe_toolchain(env).toolchain()
