"""Find built kernels and load them, lazily and once.

Manifests come from an explicit directory, from ``FLASHGEN_KERNEL_PATH``
(os.pathsep-separated) and from the installed package's ``kernels/``
directory, in that order; the first manifest that lists a kernel for a target
wins.  A cubin's sha256 is checked the first time it is loaded; its module is
loaded once per (cubin, device) and cached, so the hot path touches neither
the disk nor the compiler.
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from flashgen.build import manifest
from flashgen.build.cubin import sha256_file
from flashgen.errors import UnsupportedError
from flashgen.runtime.arch import DeviceInfo, best_target, is_ptx
from flashgen.spec import FAMILIES
from flashgen.spec.core import KernelSpec, target_cc

PACKAGE_KERNELS = Path(__file__).resolve().parents[1] / "kernels"


@dataclass(frozen=True)
class KernelBinary:
    """One kernel compiled for one target, as a manifest describes it."""

    spec: KernelSpec
    target: str
    path: Path  # a cubin, or PTX for a "computeXY" target
    sha256: str
    constants: Dict[str, int] = field(compare=False, hash=False)
    record: dict = field(compare=False, hash=False, repr=False)
    # the manifest's record of a score mod compiled in (name, expression, digest: spec/score_mods.record)
    score_mod: Optional[dict] = field(default=None, compare=False, hash=False, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_ptx(self) -> bool:
        return is_ptx(self.target)


def search_path(explicit: Optional[Sequence[Path]] = None) -> List[Path]:
    paths = [Path(p) for p in (explicit or [])]
    paths += [Path(p) for p in os.environ.get("FLASHGEN_KERNEL_PATH", "").split(os.pathsep) if p]
    paths.append(PACKAGE_KERNELS)
    return paths


class Registry:
    """Every kernel binary on the search path, and the modules loaded from them."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = [Path(p) for p in paths]
        self.binaries: Dict[Tuple[str, str], KernelBinary] = {}  # (kernel name, target) -> binary
        for directory in self.paths:
            path = directory / manifest.MANIFEST_NAME
            if not path.exists():
                continue
            for entry in manifest.read(path)["kernels"]:
                cls = FAMILIES.get(entry["family"])
                if cls is None:  # a family this flashgen does not know: leave it alone
                    continue
                try:
                    spec = cls(**entry["params"])
                except TypeError:
                    raise manifest.ManifestError(
                        f"{path}: kernel {entry['name']}: its params do not match this flashgen's "
                        f"{cls.FAMILY} spec; rebuild it with this version") from None
                if manifest.stale_layout(entry):
                    raise manifest.ManifestError(
                        f"{path}: kernel {entry['name']} was built for "
                        f"{'another' if entry.get('abi') else 'an unrecorded'} {cls.FAMILY} Params layout "
                        f"(this flashgen's is {cls.abi_digest()}): the runtime would write its fields where the "
                        f"kernel does not read them; rebuild it with this version")
                for target, rec in entry["targets"].items():
                    missing = [c.name for c in cls.CONSTANTS if c.name not in rec.get("constants", {})]
                    if missing:
                        raise manifest.ManifestError(f"{path}: {entry['name']} ({target}) lacks constants "
                                                     f"{', '.join(missing)}; rebuild it with this version")
                    self.binaries.setdefault((spec.name, target), KernelBinary(
                        spec, target, directory / manifest.binary_path(rec), rec["sha256"], rec["constants"], rec,
                        entry.get("score_mod")))
        self._modules: Dict[Tuple[Path, int], tuple] = {}  # (cubin, device) -> (module, {entry: function})
        self._lock = threading.Lock()
        self._warned_ptx = False

    def targets(self) -> List[str]:
        return sorted({t for _, t in self.binaries}, key=lambda t: (target_cc(t), t))

    def for_device(self, family: str, device: DeviceInfo) -> List[KernelBinary]:
        """The family's kernels loadable on ``device`` (best target each), in priority order.

        Raises UnsupportedError naming the device, what the package has and
        the build command that would fix it when nothing can run there.
        """
        by_kernel: Dict[str, List[str]] = {}
        for (name, target), b in self.binaries.items():
            if b.spec.FAMILY == family:
                by_kernel.setdefault(name, []).append(target)
        chosen = []
        for name, targets in by_kernel.items():
            target = best_target(targets, device.cc)
            if target is not None:
                chosen.append(self.binaries[(name, target)])
        if not chosen:
            have = ", ".join(self.targets()) or "none"
            where = ", ".join(str(p) for p in self.paths)
            raise UnsupportedError(
                f"no {family} kernel can run on GPU {device.index} ({device.name}, sm_{device.cc}); "
                f"kernels found for: {have} (searched {where}). Build them with "
                f"`flashgen build --arch {device.sm}` and put the output directory on FLASHGEN_KERNEL_PATH")
        return sorted(chosen, key=lambda b: b.spec.priority)

    def function(self, binary: KernelBinary, device: int, entry: str = ""):
        """The kernel's entry point ``<name><entry>`` as a CuPy function on ``device``; the
        module is loaded on first use (the backward families have ``_prep`` and ``_convert`` too),
        once for every kernel its cubin holds (a family's ``BUILD_GROUP`` shares one cubin)."""
        key = (binary.path, device)
        loaded = self._modules.get(key)
        if loaded is None:
            with self._lock:
                loaded = self._modules.get(key)
                if loaded is None:
                    loaded = self._modules[key] = self._load(binary, device)
        module, functions = loaded
        symbol = binary.spec.name + entry
        fn = functions.get(symbol)
        if fn is None:
            with self._lock:
                fn = functions.get(symbol)
                if fn is None:
                    fn = functions[symbol] = self._entry(module, binary, device, symbol)
        return fn

    def verify(self, binary: KernelBinary) -> None:
        """Refuse a binary that is missing or differs from its manifest (before CuPy sees it)."""
        if not binary.path.is_file():
            raise UnsupportedError(f"{binary.path}: listed in its manifest but missing; rebuild it")
        actual = sha256_file(binary.path)
        if actual != binary.sha256:
            raise UnsupportedError(f"{binary.path}: sha256 {actual} does not match its manifest "
                                   f"({binary.sha256}); the file is corrupt or was replaced; rebuild it")

    def _load(self, binary: KernelBinary, device: int):
        self.verify(binary)
        import cupy

        if binary.is_ptx and not self._warned_ptx:
            self._warned_ptx = True
            warnings.warn(f"flashgen: no SASS for GPU {device}; the driver is compiling PTX ({binary.target}) "
                          f"at load time, which is slow once and may run slower; build for this GPU's arch",
                          stacklevel=4)
        with cupy.cuda.Device(device):
            module = cupy.RawModule(path=str(binary.path))
        return module, {}  # the module stays referenced for as long as its functions are cached

    @staticmethod
    def _entry(module, binary: KernelBinary, device: int, symbol: str):
        """One entry point; the kernel's main one opted into its dynamic shared memory."""
        import cupy

        with cupy.cuda.Device(device):
            fn = module.get_function(symbol)
            smem = binary.constants["shared_memory_bytes"]
            if symbol == binary.spec.name and smem > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = smem
        return fn


_default: Optional[Registry] = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The registry over the default search path, built on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Registry(search_path())
    return _default


def set_kernel_path(*paths: Path) -> Registry:
    """Use these build directories first (then FLASHGEN_KERNEL_PATH, then the package's)."""
    global _default
    with _default_lock:
        _default = Registry(search_path(list(paths)))
    return _default
