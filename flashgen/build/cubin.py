"""Read facts back out of what nvcc built, so the runtime never re-types them in Python.

Every kernel source defines ``extern "C" __constant__ long long <kernel>_meta[] = {...}``.
nvcc stores its initial bytes in a ``.nv.constant<N>`` section of the cubin (an ELF64,
little-endian file for machine EM_CUDA) under an OBJECT symbol, so the constants a kernel
was really compiled with can be read without a GPU.  ptxas's ``--resource-usage`` report
(the same as ``-Xptxas -v``) gives registers, spills and static shared memory per entry.
Only the standard library is used: this runs on build machines and in CI without CUDA.
"""
from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

StrPath = Union[str, os.PathLike]

EM_CUDA = 190
_SHT_SYMTAB, _SHN_LORESERVE = 2, 0xFF00
# Variable symbols: STT_OBJECT, and STT_LOPROC (13), the type nvcc -rdc gives variables.
_OBJECT_TYPES = (1, 13)
# Sections with no bytes in the file: SHT_NOBITS, and the processor-specific types that
# nvcc -rdc gives .nv.global (LOPROC+7) and .nv.shared.* (LOPROC+10) instead.
_NOBITS_TYPES = (8, 0x70000007, 0x7000000A)


class _Section(NamedTuple):
    name: str
    type: int
    offset: int
    size: int
    link: int


class _Cubin:
    """A cubin's bytes, ELF header fields and section table; every error names the file."""

    def __init__(self, path: StrPath):
        self.path = os.fspath(path)
        with open(path, "rb") as f:
            self.data = data = f.read()
        if data[:4] != b"\x7fELF":
            raise self.error("not an ELF file (no \\x7fELF magic); expected a cubin from `nvcc -cubin`")
        if len(data) < 64:
            raise self.error(f"truncated: {len(data)} bytes, shorter than an ELF64 header")
        if data[4] != 2 or data[5] != 1:
            raise self.error(f"ELF class {data[4]}, byte order {data[5]}; a cubin is ELF64 (2), little-endian (1)")
        (machine,) = struct.unpack_from("<H", data, 18)
        if machine != EM_CUDA:
            raise self.error(f"ELF machine {machine} is not EM_CUDA ({EM_CUDA}): not a cubin")
        self.abi_version = data[8]  # e_ident[EI_ABIVERSION]: selects the e_flags layout
        phoff, shoff, self.flags = struct.unpack_from("<QQI", data, 32)
        phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", data, 54)
        if (shnum and shentsize != 64) or (phnum and phentsize != 56) or shstrndx >= max(shnum, 1):
            raise self.error("corrupt ELF header (unexpected table entry sizes or string table index)")
        for what, off, size in (("section", shoff, shnum * 64), ("program", phoff, phnum * 56)):
            if off + size > len(data):
                raise self.error(f"truncated: {what} header table ends at byte {off + size}, file has {len(data)}")
        raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + 64 * i) for i in range(shnum)]
        names_at = raw[shstrndx][4] if shnum else 0
        self.sections = [_Section(self.cstr(names_at + sh[0]), sh[1], sh[4], sh[5], sh[6]) for sh in raw]

    def error(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what}")

    def cstr(self, off: int) -> str:
        end = self.data.find(b"\0", off)
        if end < 0 or off >= len(self.data):
            raise self.error(f"truncated or corrupt: the string at byte {off} runs past the end")
        return self.data[off:end].decode("utf-8", "replace")

    def contents(self, sec: _Section) -> bytes:
        """A section's bytes; bounds are checked here, for the sections actually read."""
        if sec.offset + sec.size > len(self.data):
            raise self.error(f"truncated: section {sec.name} ends at byte {sec.offset + sec.size}, "
                             f"file has {len(self.data)}")
        return self.data[sec.offset:sec.offset + sec.size]

    def symbols(self) -> Dict[str, Optional[Tuple[int, int, int]]]:
        """name -> (section index, st_value, st_size) of every variable symbol, local or global.

        A name defined twice (e.g. the per-kernel ``_param`` of -rdc cubins) maps to None: ambiguous.
        """
        out: Dict[str, Optional[Tuple[int, int, int]]] = {}
        for symtab in (s for s in self.sections if s.type == _SHT_SYMTAB):
            if symtab.link >= len(self.sections):
                raise self.error("corrupt symbol table (string table index)")
            table, strtab = self.contents(symtab), self.sections[symtab.link]
            self.contents(strtab)
            for st_name, info, _, shndx, value, size in struct.iter_unpack("<IBBHQQ", table[:len(table) // 24 * 24]):
                if info & 0xF in _OBJECT_TYPES:
                    name = self.cstr(strtab.offset + st_name)
                    out[name] = None if name in out else (shndx, value, size)
        return out


def list_symbols(path: StrPath) -> Dict[str, Tuple[str, int]]:
    """Variable symbols of a cubin as name -> (section name, byte size); for messages and debugging."""
    cubin = _Cubin(path)
    secs = cubin.sections
    return {name: (secs[sym[0]].name if sym[0] < len(secs) else f"<shndx {sym[0]:#x}>", sym[2])
            for name, sym in cubin.symbols().items() if sym is not None}


def read_symbol(path: StrPath, name: str) -> bytes:
    """The initial bytes of OBJECT symbol ``name`` (exactly st_size of them), e.g. a ``__constant__`` array."""
    cubin = _Cubin(path)
    symbols = cubin.symbols()
    if name not in symbols:
        raise cubin.error(f"no object symbol {name!r} (object symbols: {', '.join(sorted(symbols)) or 'none'}); "
                          f"is it declared extern \"C\" __constant__ with an initializer?")
    sym = symbols[name]
    if sym is None:
        raise cubin.error(f"symbol {name!r} is defined more than once")
    shndx, value, size = sym
    if shndx == 0 or shndx >= min(_SHN_LORESERVE, len(cubin.sections)):
        raise cubin.error(f"symbol {name!r} is not defined in a section (st_shndx {shndx:#x})")
    sec = cubin.sections[shndx]
    if sec.type in _NOBITS_TYPES:
        raise cubin.error(f"symbol {name!r} lives in NOBITS section {sec.name}, which has no initial bytes "
                          f"in the file (declare it __constant__ with an initializer)")
    if value + size > sec.size:
        raise cubin.error(f"symbol {name!r} ({value}+{size}) runs past section {sec.name}")
    return cubin.contents(sec)[value:value + size]


def read_int64_array(path: StrPath, name: str) -> List[int]:
    """A ``long long name[]`` constant array as Python ints (little-endian, signed 64-bit)."""
    raw = read_symbol(path, name)
    if len(raw) % 8:
        raise ValueError(f"{os.fspath(path)}: symbol {name!r} is {len(raw)} bytes, not a whole number of int64")
    return list(struct.unpack(f"<{len(raw) // 8}q", raw))


def cubin_sm(path: StrPath) -> str:
    """The SM target a cubin was compiled for, e.g. "sm_80", "sm_90a", "sm_100f".

    The number comes from e_flags, whose layout depends on the ELF ABI version (e_ident[8]).
    Found on cubins built by ptxas 11.8, 12.9 and 13.0:
      * ABI 7 (11.8; 12.9 up to sm_90a): SM in bits 0-7, the virtual (PTX) arch in bits 16-23,
        0x800 set for an arch-specific 'a' target: sm_80 0x500550, sm_90a 0x5a0d5a.
      * ABI 8 (12.9 for sm_100 and later; 13.0 for every target): SM in bits 8-15.  12.9 sets
        0x8 for 'a' (sm_100a 0x600640a) but 13.0 does not: sm_90 and sm_90a are both
        0x6005a04, sm_100, sm_100a and sm_100f all 0x6006402, so e_flags cannot tell them apart.
    The 'a'/'f' suffix therefore also comes from the ptxas command line recorded in the
    .note.nv.tkinfo section ("-arch sm_90a") of ABI-8 cubins.  ABI-7 cubins have no such
    note, so there only the 0x800 flag marks 'a'.
    """
    cubin = _Cubin(path)
    if cubin.abi_version >= 8:
        sm, accel = (cubin.flags >> 8) & 0xFF, cubin.flags & 0x8
    else:
        sm, accel = cubin.flags & 0xFF, cubin.flags & 0x800
    if not sm:
        raise cubin.error(f"e_flags {cubin.flags:#x} (ABI {cubin.abi_version}) name no SM")
    suffix = "a" if accel else ""
    for sec in cubin.sections:
        if sec.name == ".note.nv.tkinfo":
            m = re.search(rb"-arch[ =]sm_(\d+)([a-z]?)", cubin.contents(sec))
            if m and int(m.group(1)) == sm:
                suffix = suffix or m.group(2).decode()
    return f"sm_{sm}{suffix}"


@dataclass(frozen=True)
class ResourceUsage:
    """What ptxas reported for one entry function on one target (sizes in bytes)."""

    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    shared_static: int
    barriers: int
    target: str


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"\bUsed (\d+) registers")
_BARRIERS_RE = re.compile(r"\bused (\d+) barriers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_resource_usage(text: str, target: Optional[str] = None) -> Dict[str, ResourceUsage]:
    """Entry name -> ResourceUsage from ptxas's ``-v`` log; every other line is ignored.

    An entry opens at "Compiling entry function 'E' for 'sm_XX'" and closes at its "Used N
    registers" line.  Device functions print their own "Function properties for F" block but
    no such line, before or after the entries (seen with ptxas 13.0 and 11.8, with and without
    -rdc), so a stack/spill line counts only inside the block named after the open entry.
    "used N barriers" and "N bytes smem" are absent when there are none (ptxas 11.8 never
    prints barriers): 0.  A log covering several targets that reports one entry twice with
    different numbers raises ValueError unless ``target`` (e.g. "sm_80") picks one.
    """
    found: List[Tuple[str, ResourceUsage]] = []
    entry: Optional[Tuple[str, str]] = None
    block: Optional[str] = None
    frame: Optional[Tuple[int, ...]] = None
    for line in text.splitlines():
        if m := _ENTRY_RE.search(line):
            if entry:
                raise ValueError(f"ptxas log: entry {entry[0]!r} ({entry[1]}) has no 'Used N registers' line")
            entry, block, frame = (m.group(1), m.group(2)), None, None
        elif m := _PROPS_RE.search(line):
            block = m.group(1)
        elif m := _FRAME_RE.search(line):
            if entry and block == entry[0]:
                frame = tuple(int(g) for g in m.groups())
        elif entry and (m := _USED_RE.search(line)):
            if frame is None:
                raise ValueError(f"ptxas log: entry {entry[0]!r} ({entry[1]}) has no stack frame/spill line")
            barriers, smem = _BARRIERS_RE.search(line), _SMEM_RE.search(line)
            found.append((entry[0], ResourceUsage(
                registers=int(m.group(1)), stack_frame=frame[0], spill_stores=frame[1], spill_loads=frame[2],
                shared_static=int(smem.group(1)) if smem else 0,
                barriers=int(barriers.group(1)) if barriers else 0, target=entry[1])))
            entry = None
    if entry:
        raise ValueError(f"ptxas log: entry {entry[0]!r} ({entry[1]}) has no 'Used N registers' line")
    result: Dict[str, ResourceUsage] = {}
    for name, usage in found:
        if target is not None and usage.target != target:
            continue
        if result.get(name, usage) != usage:
            raise ValueError(f"ptxas log reports {name!r} twice ({result[name].target}, {usage.target}) "
                             f"with different numbers; pass target= to pick one")
        result[name] = usage
    return result


def sha256_file(path: StrPath, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks so memory stays flat however large the cubin."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()
