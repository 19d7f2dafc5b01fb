"""Kernel families, each declared once: axes, pruning rules, priority, ABI, constants."""
from __future__ import annotations

from typing import Dict, List, Type

from flashgen.spec.core import KernelSpec
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.spec.mem_eff_fwd import MemEffFwd

FAMILIES: Dict[str, Type[KernelSpec]] = {cls.FAMILY: cls for cls in (MemEffFwd, MemEffBwd)}


def family(name: str) -> Type[KernelSpec]:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown kernel family {name!r}; known: {', '.join(FAMILIES)}") from None


def default_kernels() -> List[KernelSpec]:
    """Every family's default set, family by family, each in priority order."""
    return [k for cls in FAMILIES.values() for k in cls.default_set()]
