"""``manifest.json``: what a build directory holds, next to the cubins.

One entry per kernel, with its family, parameters, ``Params`` layout digest and entry symbol, and per
target the cubin's path, sha256 and size, what ptxas reported (registers,
spills, stack frame) and the constants read back from the cubin itself
(threads, shared memory, tile sizes, workspace sizing, ...).  The runtime
trusts nothing else, so the file is written atomically and carries a schema
version that readers check.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

from flashgen import __version__
from flashgen.atomic import atomic_write_text
from flashgen.build.cubin import parse_resource_usage, read_int64_array, sha256_file
from flashgen.build.graph import Job
from flashgen.errors import FlashgenError
from flashgen.spec import FAMILIES, score_mods
from flashgen.spec.core import target_cc

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


class ManifestError(FlashgenError):
    """A manifest that cannot be trusted; the message names the file."""


def describe(build_dir: Path, job: Job, built: Dict[str, dict]) -> dict:
    """The manifest's per-target record for one freshly built cubin or PTX file.

    PTX has no symbols to read back and no ptxas report until the driver
    compiles it, so its record carries the constants of the SASS built from
    the same source for the same architecture (``built``: this kernel's
    records so far).
    """
    if job.is_ptx:
        twin = built.get(f"sm{target_cc(job.target)}")
        if twin is None:
            raise ManifestError(f"{job.output}: no SASS for sm{target_cc(job.target)} to take its constants from")
        path = build_dir / job.output
        return {"ptx": job.output, "sha256": sha256_file(path), "size": path.stat().st_size,
                **{k: twin[k] for k in ("shared_memory_dynamic", "threads_per_block", "min_blocks_per_sm",
                                        "constants")}}
    cubin = build_dir / job.output
    values = read_int64_array(cubin, job.kernel.meta_symbol)
    names = [c.name for c in job.kernel.CONSTANTS]
    if len(values) != len(names):
        raise ManifestError(f"{cubin}: {job.kernel.meta_symbol} holds {len(values)} values, "
                            f"the spec declares {len(names)}; regenerate and rebuild")
    constants = dict(zip(names, values))
    log = build_dir / job.log
    usage = parse_resource_usage(log.read_text(errors="replace")).get(job.kernel.name)
    if usage is None:
        raise ManifestError(f"{log}: no ptxas resource report for {job.kernel.name}")
    return {
        "cubin": job.output,
        "sha256": sha256_file(cubin),
        "size": cubin.stat().st_size,
        "registers": usage.registers,
        "spill_stores": usage.spill_stores,
        "spill_loads": usage.spill_loads,
        "stack_frame": usage.stack_frame,
        "shared_memory_static": usage.shared_static,
        "shared_memory_dynamic": constants["shared_memory_bytes"],
        "threads_per_block": constants["threads_per_block"],
        "min_blocks_per_sm": constants["min_blocks_per_sm"],
        "constants": constants,
    }


def kernel_record(job: Job) -> dict:
    """A kernel's entry; one with a score mod records the mod's declaration and digest (the runtime
    runs it only for that declaration)."""
    k = job.kernel
    mod = getattr(k, "score_mod", "")
    return {"name": k.name, "family": k.FAMILY, "params": k.params, "abi": k.abi_digest(), "symbol": k.name,
            "meta_symbol": k.meta_symbol, **({"score_mod": score_mods.record(mod)} if mod else {}), "targets": {}}


def toolchain_record(nvcc_version: str, cutlass_version: str) -> dict:
    return {"flashgen": __version__, "nvcc": nvcc_version, "cutlass": cutlass_version}


def make(toolchain: dict, kernels: Dict[str, dict]) -> dict:
    return {"schema_version": SCHEMA_VERSION, "toolchain": toolchain,
            "kernels": [kernels[name] for name in sorted(kernels)]}


def write(build_dir: Path, manifest: dict) -> Path:
    path = build_dir / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    return path


def read(path: Path) -> dict:
    """Load and check a manifest; every failure names the file and what to do."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest here; run `flashgen build` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e}); the build was interrupted or the file was "
                            "damaged; rerun `flashgen build`") from None
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int):
        raise ManifestError(f"{path}: no schema_version; not a flashgen manifest")
    if data["schema_version"] > SCHEMA_VERSION:
        raise ManifestError(f"{path}: schema version {data['schema_version']} is newer than this flashgen "
                            f"understands ({SCHEMA_VERSION}); upgrade flashgen")
    if data["schema_version"] < SCHEMA_VERSION:
        raise ManifestError(f"{path}: schema version {data['schema_version']} is older than "
                            f"{SCHEMA_VERSION}; rebuild with this flashgen")
    return data


def surviving_entries(build_dir: Path, old: dict, toolchain: dict) -> Dict[str, dict]:
    """Entries of an earlier manifest worth keeping: same toolchain, cubin intact, and a
    kernel this flashgen's family still describes under the same name.

    Lets `flashgen build --arch sm80` and then `--arch sm90` into one directory
    end with a manifest that lists both; an entry from before a family changed
    its axes (one the runtime would refuse to load) is dropped, not carried on.
    """
    if old.get("toolchain") != toolchain:
        return {}
    kept: Dict[str, dict] = {}
    for entry in old.get("kernels", []):
        if not _describes(entry):
            continue
        targets = {t: rec for t, rec in entry.get("targets", {}).items()
                   if (build_dir / binary_path(rec)).is_file()
                   and sha256_file(build_dir / binary_path(rec)) == rec["sha256"]}
        if targets:
            kept[entry["name"]] = dict(entry, targets=targets)
    return kept


def _describes(entry: dict) -> bool:
    """Whether this flashgen's family of ``entry`` makes a kernel of the same name from its params,
    with the same ``Params`` layout (families it does not know are left alone, as the runtime
    leaves them)."""
    cls = FAMILIES.get(entry.get("family"))
    if cls is None:
        return True
    try:
        return cls(**entry.get("params", {})).name == entry.get("name") and not stale_layout(entry)
    except TypeError:
        return False


def stale_layout(entry: dict) -> bool:
    """Whether ``entry``'s kernel was built for another ``Params`` layout than this flashgen's family
    of it has (or before manifests recorded it): the runtime refuses such a kernel.  False for a
    family this flashgen does not know."""
    cls = FAMILIES.get(entry.get("family"))
    return cls is not None and entry.get("abi") != cls.abi_digest()


def binary_path(record: dict) -> str:
    """The file a target record describes, relative to its build directory."""
    return record.get("cubin") or record["ptx"]
