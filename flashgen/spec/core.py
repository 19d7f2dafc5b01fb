"""The vocabulary every kernel family is declared in.

A family is one frozen dataclass whose fields are the template parameters
(the *axes*).  Its class attributes say which values each axis takes, which
combinations are pruned and why (:class:`Rule`), how the runtime ranks the
survivors (``priority``), and what the compiled kernel looks like from Python
(its ``Params`` layout, :class:`Field`, and the compile-time constants the
runtime needs, :class:`Constant`).  Everything else -- generated sources,
build graph, manifest, dispatch -- is derived from that one declaration.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import re
from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, Iterator, List, Optional, Tuple

import numpy as np

# Arch tags are CUTLASS's `cutlass::arch::SmXY`; each runs on a half-open range
# of compute capabilities (major * 10 + minor).  An sm80-tag kernel uses only
# Ampere instructions, which every later architecture executes.
ARCH_TAGS: Dict[str, Tuple[int, int]] = {
    "sm75": (75, 80),
    "sm80": (80, 130),
    "sm90a": (90, 91),  # arch-specific: wgmma, setmaxnreg; runs on 9.0 only
}

DTYPES = {
    "f32": "float",
    "f16": "cutlass::half_t",
    "bf16": "cutlass::bfloat16_t",
}

# C++ member types used in the Params structs -> NumPy type codes.
_CTYPES = {
    "ptr": "<u8",
    "bool": "?",
    "i8": "<i1",
    "u8": "<u1",
    "i16": "<i2",
    "i32": "<i4",
    "u32": "<u4",
    "i64": "<i8",
    "u64": "<u8",
    "f32": "<f4",
    "tensor_map": "V128",  # CUtensorMap: 128 opaque bytes, alignas(128) in cuda.h (params_dtype places it)
}


@dataclass(frozen=True)
class Rule:
    """Drops every candidate for which ``applies`` is true, for ``reason``."""

    reason: str
    applies: Callable[["KernelSpec"], bool]


@dataclass(frozen=True)
class Field:
    """One member of a kernel's ``Params`` struct, in declaration order.

    ``name`` is the C++ member; nested members are dotted
    (``rng_engine_inputs.seed``) and become ``rng_engine_inputs_seed`` in NumPy, array
    elements subscripted (``mod_stride[1][2]``: ``mod_stride_1_2``).
    """

    name: str
    ctype: str

    @property
    def numpy_name(self) -> str:
        return re.sub(r"\W+", "_", self.name).strip("_")


@dataclass(frozen=True)
class Constant:
    """A compile-time value the runtime needs, as a C++ expression over ``Kernel``.

    Each instance bakes these into its cubin (``<symbol>_meta``); the build
    reads them back into the manifest, so no number is typed twice.
    """

    name: str
    expr: str


def params_dtype(abi: Tuple[Field, ...]) -> np.dtype:
    """The NumPy structured dtype that mirrors ``Params`` (C alignment rules; a ``CUtensorMap`` is
    alignas(128), so it sits at a 128-byte offset and a struct holding one rounds up to 128)."""
    names, formats, offsets, end, align = [], [], [], 0, 1
    for f in abi:
        fmt = np.dtype(_CTYPES[f.ctype])
        field_align = 128 if f.ctype == "tensor_map" else fmt.alignment
        at = -(-end // field_align) * field_align
        names.append(f.numpy_name)
        formats.append(fmt)
        offsets.append(at)
        end, align = at + fmt.itemsize, max(align, field_align)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": -(-end // align) * align})


def cpp_bool(value: bool) -> str:
    return "true" if value else "false"


def target_cc(target: str) -> int:
    """``sm80``/``sm_80``/``sm_90a``/``compute90`` -> 80/80/90/90 (compute capability * 10 + minor)."""
    digits = target.lower()
    for prefix in ("compute_", "compute", "sm_", "sm"):
        if digits.startswith(prefix):
            digits = digits[len(prefix):]
            break
    digits = digits.rstrip("a")
    if not digits.isdigit():
        raise ValueError(f"not an SM target: {target!r} (expected e.g. sm80, sm_86, sm90a)")
    return int(digits)


def normalize_target(target: str) -> str:
    """Spell a target the one way flashgen uses in names and paths: ``sm80``, ``sm90a``."""
    suffix = "a" if target.lower().endswith("a") else ""
    return f"sm{target_cc(target)}{suffix}"


@dataclass(frozen=True)
class KernelSpec:
    """Base of every family.  Subclasses are frozen dataclasses of axis values."""

    FAMILY: ClassVar[str]
    DIRECTION: ClassVar[str]  # "fwd" or "bwd": which public function the family's runtime serves
    TEMPLATE: ClassVar[str]
    HEADER: ClassVar[str]
    AXES: ClassVar[Dict[str, Tuple]]
    RULES: ClassVar[Tuple[Rule, ...]]
    ABI: ClassVar[Tuple[Field, ...]]
    CONSTANTS: ClassVar[Tuple[Constant, ...]]
    # Axes whose values a compile job shares: kernels equal on them build as one translation unit
    # into one cubin, parsing their common template instantiations once.  None: a job per kernel.
    BUILD_GROUP: ClassVar[Optional[Tuple[str, ...]]] = None

    # --- what subclasses define -------------------------------------------
    @property
    def name(self) -> str:
        """The extern "C" entry symbol, also the file stem of source and cubin."""
        raise NotImplementedError

    @property
    def priority(self) -> Tuple:
        """Sort key: the runtime tries kernels in ascending order, first fit wins."""
        raise NotImplementedError

    @property
    def cpp_type(self) -> str:
        """The CUTLASS template instantiation this kernel compiles."""
        raise NotImplementedError

    # --- derived ------------------------------------------------------------
    @property
    def meta_symbol(self) -> str:
        """The ``__constant__`` array holding ``CONSTANTS`` in the cubin."""
        return f"{self.name}_meta"

    @property
    def build_unit(self) -> str:
        """The compile job (and cubin stem) this kernel builds in: its own name, or with
        ``BUILD_GROUP`` the family's name and those axes' values, which no kernel name takes."""
        if self.BUILD_GROUP is None:
            return self.name
        return "_".join([self.FAMILY, *(str(getattr(self, axis)) for axis in self.BUILD_GROUP), "unit"])

    @property
    def params(self) -> Dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def cc_range(self) -> Tuple[int, int]:
        return ARCH_TAGS[self.arch]  # type: ignore[attr-defined]

    def runs_on(self, target: str) -> bool:
        """Whether machine code for ``target`` should be built from this kernel."""
        lo, hi = self.cc_range
        return lo <= target_cc(target) < hi

    @classmethod
    def candidates(cls) -> Iterator["KernelSpec"]:
        """Every point of the axes' cross product, pruned or not."""
        names = list(cls.AXES)
        for values in itertools.product(*(cls.AXES[n] for n in names)):
            yield cls(**dict(zip(names, values)))

    def pruned_by(self) -> Optional[Rule]:
        """The first rule that removes this candidate, or None if it is kept."""
        return next((r for r in self.RULES if r.applies(self)), None)

    @classmethod
    def default_set(cls) -> List["KernelSpec"]:
        """The kept kernels, in dispatch priority order."""
        return sorted((k for k in cls.candidates() if k.pruned_by() is None), key=lambda k: k.priority)

    @classmethod
    def params_dtype(cls) -> np.dtype:
        return params_dtype(cls.ABI)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def abi_digest(cls) -> str:
        """A digest of the ``Params`` layout (every field's name, type and offset, and the size): the
        generated ABI header holds the compiled struct to this layout, the manifest records it per
        kernel, and the registry refuses a kernel built for another one (a field moved at the same
        size would otherwise be read at its old offset)."""
        dtype = cls.params_dtype()
        layout = [(f.name, f.ctype, dtype.fields[f.numpy_name][1]) for f in cls.ABI] + [dtype.itemsize]
        return hashlib.sha256(repr(layout).encode()).hexdigest()[:16]
