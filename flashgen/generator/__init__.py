"""Render one CUDA source per kernel instance into ``instances/<family>/``.

Beside them goes one ``<family>_abi.h`` per family holding the family's
``Params`` ABI checks, so the checks live once instead of in every source;
each instance includes it (found next to the ``.cu``, no include flag
needed) and instantiates it for its own ``Params``.

The output is a pure function of the family declarations and the template:
byte-for-byte the same on every machine, so it is checked in and
``flashgen generate --check`` can tell when it is stale.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Type

import jinja2

from flashgen.atomic import atomic_write_text
from flashgen.spec.core import KernelSpec

TEMPLATES = Path(__file__).parent / "templates"
ABI_TEMPLATE = "abi.h.j2"
# The checked-in instances live beside the package in a source checkout.
INSTANCES_DIR = Path(__file__).resolve().parents[2] / "instances"


@dataclass(frozen=True)
class AbiField:
    name: str
    offset: int
    size: int


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def source_path(kernel: KernelSpec) -> str:
    """Path of the kernel's source relative to the instances directory."""
    return f"{kernel.FAMILY}/{kernel.name}.cu"


def _abi_header_name(family: str) -> str:
    return f"{family}_abi.h"


def abi_header_path(family: str) -> str:
    """Path of the family's ABI header relative to the instances directory: in the
    family's own directory, where its sources' ``#include "..."`` looks first."""
    return f"{family}/{_abi_header_name(family)}"


def _abi_fields(family: Type[KernelSpec]) -> List[AbiField]:
    dtype = family.params_dtype()
    return [AbiField(f.name, dtype.fields[f.numpy_name][1], dtype.fields[f.numpy_name][0].itemsize)
            for f in family.ABI]


def render(kernel: KernelSpec, env: jinja2.Environment = None) -> str:
    env = env or _environment()
    cc_lo, cc_hi = kernel.cc_range
    return env.get_template(kernel.TEMPLATE).render(
        kernel=kernel, family=kernel.FAMILY, header=kernel.HEADER, abi_header=_abi_header_name(kernel.FAMILY),
        constants=kernel.CONSTANTS, cc_lo=cc_lo, cc_hi=cc_hi,
    )


def render_abi_header(family: Type[KernelSpec], env: jinja2.Environment = None) -> str:
    """The family's shared header: one static_assert per ABI field, plus layout and size."""
    env = env or _environment()
    return env.get_template(ABI_TEMPLATE).render(
        family=family.FAMILY, abi=_abi_fields(family), params_size=family.params_dtype().itemsize,
    )


def expected_files(kernels: Iterable[KernelSpec]) -> Dict[str, str]:
    """Relative path -> file content: every kernel's source and its family's ABI header."""
    env = _environment()
    kernels = list(kernels)
    families = {k.FAMILY: type(k) for k in kernels}
    files = {abi_header_path(name): render_abi_header(cls, env) for name, cls in sorted(families.items())}
    files.update((source_path(k), render(k, env)) for k in kernels)
    return files


def _existing(out_dir: Path, families: Iterable[str]) -> List[str]:
    """Every generated-looking file (sources and headers) in the families' directories."""
    return sorted(str(p.relative_to(out_dir)) for fam in families for pattern in ("*.cu", "*.h")
                  for p in (out_dir / fam).glob(pattern))


def check(out_dir: Path, kernels: List[KernelSpec]) -> Dict[str, str]:
    """Relative path -> 'stale' | 'missing' | 'extra' for every file that differs."""
    expected = expected_files(kernels)
    problems = {}
    for rel, text in expected.items():
        path = out_dir / rel
        if not path.exists():
            problems[rel] = "missing"
        elif path.read_bytes() != text.encode("utf-8"):
            problems[rel] = "stale"
    for rel in _existing(out_dir, {k.FAMILY for k in kernels}):
        if rel not in expected:
            problems[rel] = "extra"
    return dict(sorted(problems.items()))


def write(out_dir: Path, kernels: List[KernelSpec]) -> Dict[str, str]:
    """Bring ``out_dir`` in line with ``kernels``; returns what changed (as ``check`` names it)."""
    changes = check(out_dir, kernels)
    expected = expected_files(kernels)
    for rel, status in changes.items():
        if status == "extra":
            (out_dir / rel).unlink()
        else:
            atomic_write_text(out_dir / rel, expected[rel])
    return changes
