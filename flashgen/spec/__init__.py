"""Kernel families, each declared once: axes, pruning rules, priority, ABI, constants."""
from __future__ import annotations

import fnmatch
from typing import Dict, List, Optional, Sequence, Type

from flashgen.spec import score_mods
from flashgen.spec.core import KernelSpec
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.spec.mem_eff_fwd import MemEffFwd
from flashgen.spec.sm80_bwd import Sm80Bwd
from flashgen.spec.sm80_fwd import Sm80Fwd
from flashgen.spec.sm90_bwd import Sm90Bwd
from flashgen.spec.sm90_fwd import Sm90Fwd

# The one list of families, in dispatch order: the runtime asks a call's families in this
# order (runtime/families) and runs the first that accepts it, so the fastest come first.
FAMILIES: Dict[str, Type[KernelSpec]] = {cls.FAMILY: cls for cls in (Sm90Fwd, Sm90Bwd, Sm80Fwd, Sm80Bwd, MemEffFwd, MemEffBwd)}


def family(name: str) -> Type[KernelSpec]:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown kernel family {name!r}; known: {', '.join(FAMILIES)}") from None


def default_kernels() -> List[KernelSpec]:
    """Every family's default set, family by family, each in priority order."""
    return [k for cls in FAMILIES.values() for k in cls.default_set()]


def mod_kernels(names: Sequence[str]) -> List[KernelSpec]:
    """The instances of declared score mods ``names`` (``score_mods.declare``) in every family with a
    score_mod axis, on the tiles and options of the default set's ALiBi; none for the mods the
    default set builds already."""
    names = [n for n in names if n not in score_mods.DEFAULT_SCORE_MODS]
    return [k for cls in FAMILIES.values() if "score_mod" in cls.AXES
            for k in score_mods.kernels_with(names, cls.default_set())]


def parse_globs(pattern: Optional[str]) -> List[str]:
    return [p.strip() for p in (pattern or "").split(",") if p.strip()]


def matches(name: str, globs: Sequence[str]) -> bool:
    """The one kernel-filter language (--kernels, FLASHGEN_KERNELS): comma-separated
    fnmatch globs over kernel names, any may match; no globs match everything."""
    return not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)
