"""Tuning tables: measured kernel tiles and key-split policies per shape bucket, per device.

``flashgen tune`` times every kernel tile that can serve a bucket (and, for
the backward, every key-split policy) on one GPU and writes a table keyed by
that GPU's name and compute capability.  The runtime uses the table that
matches the device it runs on: the one installed with ``use_table`` (or named
by ``FLASHGEN_TUNING``), else one shipped in ``flashgen/tuning/``.  Where no
table or no entry matches, or the tuned tile cannot serve a call (dropout,
alignment), selection falls back to the families' priority order.
``FLASHGEN_TUNING=off`` turns tables off.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from flashgen.atomic import atomic_write_text
from flashgen.errors import UnsupportedError
from flashgen.runtime import plans
from flashgen.runtime.arch import DeviceInfo
from flashgen.spec import FAMILIES

# 2: a tile names its head-dim tier (max_k) too.  Schema-1 tiles of the Hopper and Ampere families did not,
# so a tile timed on one tier's kernel could select another's (the H200 table's bf16 d128 backward tile ran
# the k192 kernel at 0.45x the priority order's speed).
SCHEMA = 2
SHIPPED = Path(__file__).resolve().parents[1] / "tuning"
# How many blocks share one (batch, head)'s keys in the backward (select.num_splits_key):
#   auto: one when batch*heads fills the GPU, else one per key block;  one: never split;
#   key_blocks: one per key block;  wave: just enough to fill one wave of resident blocks.
SPLIT_POLICIES = ("auto", "one", "key_blocks", "wave")
_HEAD_DIM_TIERS = (32, 64, 96, 128, 192, 256)  # every family's tiers: a bucket is never served by two tiers


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class Bucket:
    """The shape class a choice is made for: every call in a bucket gets the same choice."""

    family: str
    dtype: str
    head_dim: int  # smallest of _HEAD_DIM_TIERS covering both head dims, else 0 (larger)
    causal: bool
    seqlen: int  # max(M, N) rounded up to a power of two
    batch_heads: int  # batch * heads rounded up to a power of two
    # query heads per key/value head rounded up to a power of two, backward families only; 1 in the forward.
    # A backward block owns a key/value head's keys for its whole group (sm90_bwd) or the group's dK/dV are
    # summed after it, so a tile measured on multi-head calls says little of grouped ones (H200, bf16 d128
    # causal 1k: the table's tile ran 1.03x the priority order at group 4 and 0.96x at group 8, three runs).
    # `flashgen tune --group N` measures a group's own buckets; a grouped backward with no entry of its
    # group takes the priority order.
    group: int = 1

    @classmethod
    def of(cls, family: str, dtype: str, head_dim: int, head_dim_value: int, causal: bool, num_queries: int,
           num_keys: int, batch_heads: int, group: int = 1) -> "Bucket":
        k = max(head_dim, head_dim_value)
        tier = next((t for t in _HEAD_DIM_TIERS if t >= k), 0)
        grouped = _pow2_ceil(max(group, 1)) if FAMILIES[family].DIRECTION == "bwd" else 1
        return cls(family, dtype, tier, bool(causal), _pow2_ceil(max(num_queries, num_keys, 1)),
                   _pow2_ceil(max(batch_heads, 1)), grouped)


@dataclass(frozen=True)
class Choice:
    tile: Tuple[Tuple[str, object], ...]  # (axis, value) over the family's TUNED_AXES
    splits: str = "auto"

    def matches(self, spec) -> bool:
        return all(getattr(spec, axis) == value for axis, value in self.tile)


def tile_of(spec) -> Tuple[Tuple[str, object], ...]:
    return tuple((axis, getattr(spec, axis)) for axis in type(spec).TUNED_AXES)


@dataclass
class Table:
    device_name: str
    cc: int
    entries: Dict[Bucket, Choice]
    measured: dict  # how it was measured (command, versions, times): for people, not the runtime
    source: str = "<memory>"

    def to_json(self) -> dict:
        rows = []
        for b, c in sorted(self.entries.items(), key=lambda item: tuple(str(v) for v in vars(item[0]).values())):
            rows.append(dict(vars(b), tile=dict(c.tile), splits=c.splits))
        return {"schema": SCHEMA, "device": {"name": self.device_name, "cc": self.cc},
                "measured": self.measured, "entries": rows}

    @classmethod
    def from_json(cls, data: dict, source: str) -> "Table":
        def bad(why):
            return ValueError(f"tuning table {source}: {why}; re-run `flashgen tune` to write a new one")

        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise bad(f"schema {data.get('schema') if isinstance(data, dict) else None!r}, "
                      f"this flashgen reads {SCHEMA}")
        try:
            entries = {}
            for row in data["entries"]:
                family = row["family"]
                axes = FAMILIES[family].TUNED_AXES
                tile = tuple((axis, row["tile"][axis]) for axis in axes)
                if row["splits"] not in SPLIT_POLICIES:
                    raise bad(f"unknown split policy {row['splits']!r}")
                bucket = Bucket(family, row["dtype"], int(row["head_dim"]), bool(row["causal"]), int(row["seqlen"]),
                                int(row["batch_heads"]), int(row.get("group", 1)))  # tables before groups: 1
                entries[bucket] = Choice(tile, row["splits"])
            return cls(str(data["device"]["name"]), int(data["device"]["cc"]), entries, data.get("measured", {}),
                       source)
        except (KeyError, TypeError) as e:
            raise bad(f"malformed entry ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path) -> "Table":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"tuning table {path}: cannot read it ({e})") from None
        return cls.from_json(data, str(path))

    def save(self, path) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_json(), indent=1) + "\n")


VARIABLE = "FLASHGEN_TUNING"  # a table's path, or "off": none at all


def tables_off() -> bool:
    """Whether ``FLASHGEN_TUNING=off`` turns every table off (the priority order everywhere)."""
    return os.environ.get(VARIABLE, "").lower() == "off"


_override: Optional[Table] = None
_lock = threading.Lock()
_shipped: Optional[list] = None


def use_table(table) -> None:
    """Use ``table`` (a Table, or the path of one ``flashgen tune`` wrote) on the GPUs it was
    measured on, instead of the shipped tables; None: back to them."""
    global _override
    if table is not None and not isinstance(table, Table):
        table = Table.load(table)
    with _lock:
        _override = table
    plans.clear()  # plans hold the kernel and split count chosen under the old table


def _shipped_tables() -> list:
    global _shipped
    if _shipped is None:
        _shipped = [Table.load(p) for p in sorted(SHIPPED.glob("*.json"))]
    return _shipped


def table_for(device: DeviceInfo) -> Optional[Table]:
    """The table measured on a GPU like ``device`` (same name and compute capability), if any."""
    if tables_off():
        return None
    setting = os.environ.get(VARIABLE, "")
    if _override is not None:
        tables = [_override]
    elif setting:
        tables = [_env_table(setting)]
    else:
        tables = []
    tables += _shipped_tables()
    return next((t for t in tables if t.device_name == device.name and t.cc == device.cc), None)


_env_tables: Dict[str, Table] = {}


def _env_table(path: str) -> Table:
    if path not in _env_tables:
        _env_tables[path] = Table.load(path)
    return _env_tables[path]


def choice(device: DeviceInfo, bucket: Bucket) -> Optional[Choice]:
    table = table_for(device)
    return table.entries.get(bucket) if table is not None else None


def report(device: DeviceInfo, registry) -> List[str]:
    """What ``flashgen doctor`` says of tuning on ``device``: the table that applies, or why none does, and
    the entries whose tile no built kernel of the bucket's family and dtype has: they select nothing, so
    the priority order serves those buckets (a table measured on another build)."""
    if tables_off():
        return ["tuning: off (FLASHGEN_TUNING=off): the priority order everywhere"]
    try:
        table = table_for(device)
    except ValueError as e:  # FLASHGEN_TUNING names a table that cannot be read
        return [f"tuning: {e}"]
    if table is None:
        return [f"tuning: no table for {device.name} (sm_{device.cc}): the priority order; `flashgen tune` "
                "measures one"]
    lines = [f"tuning: {table.source}, {len(table.entries)} buckets"]
    for b, c in table.entries.items():
        try:
            kernels = registry.for_device(b.family, device)
        except UnsupportedError:
            kernels = []
        if not any(k.spec.dtype == b.dtype and c.matches(k.spec) for k in kernels):
            tile = ", ".join(f"{axis} {value}" for axis, value in c.tile)
            lines.append(f"  no built kernel has the tile of {b.family} {b.dtype} d{b.head_dim}"
                         f"{' causal' if b.causal else ''} {b.seqlen} tokens ({tile}): priority order there")
    return lines
