"""Which cubin runs on which GPU, by the CUDA rules.

SASS for ``sm_XY`` runs on devices of the same major version with minor >= Y
(sm_80 code runs on 8.6 and 8.9, never on 9.0); arch-specific ``sm_XYa`` code
runs only on X.Y; PTX (``computeXY``) is compiled by the driver for any device
of compute capability >= X.Y.  SASS is preferred over PTX; among SASS targets
the exact one, then the closest lower minor; among PTX the newest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from flashgen.spec.core import target_cc


@dataclass(frozen=True)
class DeviceInfo:
    """What selection needs to know about one GPU; tests build fake ones."""

    index: int
    name: str
    cc: int  # major * 10 + minor, e.g. 90
    multiprocessors: int
    shared_memory_optin: int  # bytes one block may use after opting in

    @property
    def sm(self) -> str:
        return f"sm{self.cc}"


def is_ptx(target: str) -> bool:
    return target.startswith("compute")


def runs_on(target: str, cc: int) -> bool:
    t = target_cc(target)
    if is_ptx(target):
        return t <= cc
    if target.endswith("a"):
        return t == cc
    return t // 10 == cc // 10 and t <= cc


def best_target(targets: Iterable[str], cc: int) -> Optional[str]:
    """The target to load on a device of compute capability ``cc``, or None."""
    usable = [t for t in targets if runs_on(t, cc)]
    # any SASS before PTX; then the closest (highest) capability; arch-specific before plain
    return max(usable, key=lambda t: (not is_ptx(t), target_cc(t), t.endswith("a")), default=None)

