"""Render one CUDA source per kernel instance into ``instances/<family>/``.

The output is a pure function of the family declarations and the template:
byte-for-byte the same on every machine, so it is checked in and
``flashgen generate --check`` can tell when it is stale.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List

import jinja2

from flashgen.atomic import atomic_write_text
from flashgen.spec.core import KernelSpec

TEMPLATES = Path(__file__).parent / "templates"
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


def render(kernel: KernelSpec, env: jinja2.Environment = None) -> str:
    env = env or _environment()
    dtype = kernel.params_dtype()
    abi = [AbiField(f.name, dtype.fields[f.numpy_name][1], dtype.fields[f.numpy_name][0].itemsize)
           for f in kernel.ABI]
    cc_lo, cc_hi = kernel.cc_range
    return env.get_template(kernel.TEMPLATE).render(
        kernel=kernel, family=kernel.FAMILY, header=kernel.HEADER, abi=abi,
        params_size=dtype.itemsize, constants=kernel.CONSTANTS, cc_lo=cc_lo, cc_hi=cc_hi,
    )


def expected_sources(kernels: Iterable[KernelSpec]) -> Dict[str, str]:
    """Relative path -> file content, for every kernel."""
    env = _environment()
    return {source_path(k): render(k, env) for k in kernels}


def _existing(out_dir: Path, families: Iterable[str]) -> List[str]:
    return sorted(str(p.relative_to(out_dir)) for fam in families for p in (out_dir / fam).glob("*.cu"))


def check(out_dir: Path, kernels: List[KernelSpec]) -> Dict[str, str]:
    """Relative path -> 'stale' | 'missing' | 'extra' for every file that differs."""
    expected = expected_sources(kernels)
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
    expected = expected_sources(kernels)
    for rel, status in changes.items():
        if status == "extra":
            (out_dir / rel).unlink()
        else:
            atomic_write_text(out_dir / rel, expected[rel])
    return changes
