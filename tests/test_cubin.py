"""Tests for flashgen.build.cubin: constants, SM target and ptxas resource usage read back from builds."""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess

import pytest

from flashgen.build.cubin import (
    EM_CUDA,
    ResourceUsage,
    cubin_sm,
    list_symbols,
    parse_resource_usage,
    read_int64_array,
    read_symbol,
    sha256_file,
)

KERNEL_CU = r"""
extern "C" __constant__ long long k_meta[] = {128, -3, 1LL << 40};
extern "C" __constant__ long long k_more[] = {-1, 0, 7, 9223372036854775807LL};
__device__ long long scratch[4];  // no initializer: lands in a NOBITS section

__device__ __noinline__ float helper(float a, int n) {  // a device function with its own properties block
  float loc[32];
  for (int i = 0; i < 32; i++) loc[i] = a * i;
  return loc[n & 31] + a;
}

extern "C" __global__ void k(float* x) {
  __shared__ long long s[64];  // 512 bytes of static shared memory
  s[threadIdx.x & 63] = k_meta[threadIdx.x % 3] + k_more[threadIdx.x & 3];
  __syncthreads();
  x[threadIdx.x] = s[63 - (threadIdx.x & 63)] + helper(x[0], threadIdx.x);
  scratch[threadIdx.x & 3] = (long long)x[1];
}

extern "C" __global__ void hungry(float* x, int n) {  // spills under -maxrregcount=32
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; i++) acc[i] = x[i * n + threadIdx.x];
  for (int j = 0; j < n; j++) {
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = acc[i] * acc[(i + j) & 63] + 1.f;
  }
#pragma unroll
  for (int i = 0; i < 64; i++) x[i * n + threadIdx.x] = acc[i];
}
"""


def _nvcc() -> str:
    found = shutil.which("nvcc")
    if found:
        return found
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    pytest.skip("nvcc not found (neither on PATH nor at /usr/local/cuda/bin/nvcc)")


def _compile(tmp_dir, arch: str, extra=()):
    """Compile KERNEL_CU for one target; return (cubin path, ptxas log)."""
    nvcc = _nvcc()
    src = tmp_dir / "k.cu"
    src.write_text(KERNEL_CU)
    out = tmp_dir / f"k_{arch}.cubin"
    virt = arch.replace("sm_", "compute_")
    cmd = [nvcc, "-cubin", "-gencode", f"arch={virt},code={arch}", "--resource-usage", *extra,
           "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def sm80(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("sm80"), "sm_80", ["-maxrregcount=32"])


# ---------------------------------------------------------------- constants from real cubins


@pytest.mark.nvcc
def test_read_int64_array_returns_the_compiled_values(sm80):
    cubin, _ = sm80
    assert read_int64_array(cubin, "k_meta") == [128, -3, 1 << 40]
    assert read_int64_array(cubin, "k_more") == [-1, 0, 7, 2**63 - 1]
    assert read_symbol(cubin, "k_meta") == struct.pack("<3q", 128, -3, 1 << 40)
    symbols = list_symbols(cubin)
    assert symbols["k_meta"] == (".nv.constant3", 24)
    assert symbols["k_more"] == (".nv.constant3", 32)


@pytest.mark.nvcc
def test_absent_and_nobits_symbols_raise(sm80):
    cubin, _ = sm80
    with pytest.raises(ValueError, match="k_missing") as info:
        read_int64_array(cubin, "k_missing")
    assert str(cubin) in str(info.value)
    with pytest.raises(ValueError, match="scratch.*NOBITS"):
        read_symbol(cubin, "scratch")
    with pytest.raises(ValueError, match="no object symbol 'k'"):  # a FUNC symbol is not data
        read_symbol(cubin, "k")


@pytest.mark.nvcc
@pytest.mark.parametrize("keep", [0.5, -8])
def test_truncated_cubin_raises_naming_the_file(sm80, tmp_path, keep):
    data = sm80[0].read_bytes()
    cut = tmp_path / "cut.cubin"
    cut.write_bytes(data[: int(len(data) * keep)] if keep > 0 else data[:keep])
    with pytest.raises(ValueError, match="truncated") as info:
        read_int64_array(cut, "k_meta")
    assert str(cut) in str(info.value)
    with pytest.raises(ValueError, match="truncated"):
        cubin_sm(cut)


@pytest.mark.nvcc
def test_cubin_sm_sm80(sm80):
    assert cubin_sm(sm80[0]) == "sm_80"


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "sm_120a"])
def test_cubin_sm_other_targets(tmp_path, arch):
    cubin, _ = _compile(tmp_path, arch)
    assert cubin_sm(cubin) == arch
    assert read_int64_array(cubin, "k_meta") == [128, -3, 1 << 40]


@pytest.mark.nvcc
def test_relocatable_cubin(tmp_path):
    """-rdc cubins give variables symbol type STT_LOPROC and .nv.global a processor-specific type.

    nvcc 13 drops --resource-usage under -rdc ("final resource allocation is not done"), so the
    ptxas report needs -Xptxas -v there.
    """
    cubin, log = _compile(tmp_path, "sm_80", ["-rdc=true", "-Xptxas", "-v"])
    assert read_int64_array(cubin, "k_meta") == [128, -3, 1 << 40]
    with pytest.raises(ValueError, match="scratch.*NOBITS"):
        read_symbol(cubin, "scratch")
    assert set(parse_resource_usage(log)) == {"k", "hungry"}


# ---------------------------------------------------------------- malformed files (no nvcc needed)


def _elf(e_flags=0x6005004, abi=8, machine=EM_CUDA, ei_class=2, tkinfo=b"", sym_size=16):
    """A minimal ELF64 with .shstrtab, .strtab, .symtab, .nv.constant3 (k_meta) and an optional tkinfo note."""
    payload = struct.pack("<2q", 5, -6)
    names = [b"", b".shstrtab", b".strtab", b".symtab", b".nv.constant3"] + ([b".note.nv.tkinfo"] if tkinfo else [])
    shstr = b"\0".join(names) + b"\0"
    name_off = [shstr.index(n + b"\0") if n else 0 for n in names]
    strtab = b"\0k_meta\0"
    symtab = bytes(24) + struct.pack("<IBBHQQ", 1, 0x01, 0, 4, 0, sym_size)  # LOCAL OBJECT in section 4
    blobs = [b"", shstr, strtab, symtab, payload] + ([tkinfo] if tkinfo else [])
    types = [0, 3, 3, 2, 1] + ([7] if tkinfo else [])
    body, offsets = b"", []
    for blob in blobs:
        offsets.append(64 + len(body))
        body += blob + bytes(-len(blob) % 8)
    shoff = 64 + len(body)
    headers = b"".join(
        struct.pack("<IIQQQQIIQQ", name_off[i], types[i], 0, 0, offsets[i] if i else 0, len(blobs[i]),
                    2 if types[i] == 2 else 0, 0, 1, 24 if types[i] == 2 else 0)
        for i in range(len(blobs)))
    ident = b"\x7fELF" + bytes([ei_class, 1, 1, 0x41, abi]) + bytes(7)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, 0, 0, shoff, e_flags, 64, 56, 0, 64,
                                 len(blobs), 1)
    return header + body + headers


def test_synthetic_elf_reads(tmp_path):
    path = tmp_path / "x.cubin"
    path.write_bytes(_elf())
    assert read_int64_array(path, "k_meta") == [5, -6]
    assert cubin_sm(path) == "sm_80"


@pytest.mark.parametrize("abi,e_flags,tkinfo,expected", [
    (7, 0x500550, b"", "sm_80"),            # CUDA 11.8 / 12.9 ptxas, sm_80
    (7, 0x5A0D5A, b"", "sm_90a"),           # CUDA 12.9 ptxas, sm_90a: 0x800 marks 'a'
    (7, 0x4B054B, b"", "sm_75"),
    (8, 0x600640A, b"", "sm_100a"),         # CUDA 12.9 ptxas, sm_100a: 0x8 marks 'a'
    (8, 0x6005A04, b"", "sm_90"),           # CUDA 13.0: sm_90 and sm_90a share e_flags ...
    (8, 0x6005A04, b"\0-arch sm_90a -m 64 \0", "sm_90a"),  # ... so the note decides
    (8, 0x6006402, b"\0-arch sm_100f -m 64 \0", "sm_100f"),
    (8, 0x6007802, b"\0-arch sm_90a -m 64 \0", "sm_120"),  # a note for another SM is ignored
])
def test_cubin_sm_decodes_both_e_flags_layouts(tmp_path, abi, e_flags, tkinfo, expected):
    path = tmp_path / "x.cubin"
    path.write_bytes(_elf(e_flags=e_flags, abi=abi, tkinfo=tkinfo))
    assert cubin_sm(path) == expected


@pytest.mark.parametrize("data,message", [
    (b"#include <cuda.h>\n" * 8, "not an ELF file"),
    (b"", "not an ELF file"),
    (b"\x7fELF\x02\x01", "truncated"),
    (_elf(ei_class=1), "ELF class 1"),
    (_elf(machine=62), "not EM_CUDA"),
    (_elf()[:-10], "truncated"),
])
def test_malformed_files_raise_naming_the_file(tmp_path, data, message):
    path = tmp_path / "bad.cubin"
    path.write_bytes(data)
    for call in (lambda: read_symbol(path, "k_meta"), lambda: cubin_sm(path)):
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert str(path) in str(info.value)


def test_symbol_past_its_section_raises(tmp_path):
    path = tmp_path / "bad.cubin"
    path.write_bytes(_elf(sym_size=24))  # the section holds 16 bytes
    with pytest.raises(ValueError, match="k_meta.*runs past section .nv.constant3"):
        read_symbol(path, "k_meta")


# ---------------------------------------------------------------- ptxas resource usage


@pytest.mark.nvcc
def test_parse_real_resource_usage(sm80):
    _, log = sm80
    usage = parse_resource_usage(log)
    assert set(usage) == {"k", "hungry"}  # the device function `helper` is not an entry
    k = usage["k"]
    assert k.target == "sm_80" and 0 < k.registers <= 32
    assert k.shared_static == 512 and k.barriers >= 1
    hungry = usage["hungry"]
    assert hungry.registers <= 32 and hungry.spill_stores > 0 and hungry.spill_loads > 0
    assert hungry.stack_frame > 0


SAMPLE_LOG = """\
k.cu(3): warning #20044-D: extern declaration of the entity scratch is treated as a static definition
Remark: The warnings can be suppressed with "-diag-suppress <warning-number>"
ptxas info    : Overriding maximum register limit 256 for 'spilly' with  32 of maxrregcount option
ptxas warning : Registers are spilled to local memory in function 'spilly', 1392 bytes spill stores, 1536 bytes spill loads
ptxas info    : 13259 bytes gmem, 104 bytes cmem[3], 136 bytes cmem[4]
ptxas info    : Compiling entry function 'fwd_test' for 'sm_80'
ptxas info    : Function properties for fwd_test
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 122 registers, used 1 barriers, 592 bytes cmem[0]
ptxas info    : Compile time = 185.221 ms
ptxas info    : Compiling entry function 'smem_kernel' for 'sm_80'
ptxas info    : Function properties for _Z6helperfi
    136 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Function properties for smem_kernel
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Function properties for _Z7helper2v
    64 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 16 bytes cumulative stack size, 4096 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 2.351 ms
ptxas info    : Compiling entry function 'no_barriers' for 'sm_80'
ptxas info    : Function properties for no_barriers
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'spilly' for 'sm_80'
ptxas info    : Function properties for spilly
    1216 bytes stack frame, 1392 bytes spill stores, 1536 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 1216 bytes cumulative stack size, 364 bytes cmem[0]
ptxas info    : Compile time = 30.579 ms
ptxas info    : Function properties for _Z6helperfi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 9 registers, used 0 barriers, 360 bytes cmem[0]
/usr/include/c++/13/bits/stl_algo.h: note: some gcc noise
"""


def test_parse_sample_log_exactly():
    assert parse_resource_usage(SAMPLE_LOG) == {
        "fwd_test": ResourceUsage(122, 0, 0, 0, 0, 1, "sm_80"),
        "smem_kernel": ResourceUsage(40, 16, 0, 0, 4096, 1, "sm_80"),
        "no_barriers": ResourceUsage(16, 0, 0, 0, 0, 0, "sm_80"),
        "spilly": ResourceUsage(32, 1216, 1392, 1536, 0, 0, "sm_80"),
    }


# ptxas 11.8 (-c): no "used N barriers" at all, and a device function's block before any entry.
CUDA11_LOG = """\
ptxas info    : 0 bytes gmem, 24 bytes cmem[3]
ptxas info    : Function properties for _Z6helperfi
    136 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'plain' for 'sm_80'
ptxas info    : Function properties for plain
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'smem_k' for 'sm_80'
ptxas info    : Function properties for smem_k
    128 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, 4096 bytes smem, 360 bytes cmem[0]
"""


def test_parse_cuda11_style_log():
    assert parse_resource_usage(CUDA11_LOG) == {
        "plain": ResourceUsage(8, 0, 0, 0, 0, 0, "sm_80"),
        "smem_k": ResourceUsage(32, 128, 0, 0, 4096, 0, "sm_80"),
    }


def test_parse_multi_target_log():
    log = SAMPLE_LOG + SAMPLE_LOG.replace("'sm_80'", "'sm_90a'").replace("Used 122", "Used 128")
    with pytest.raises(ValueError, match="fwd_test.*target="):
        parse_resource_usage(log)
    assert parse_resource_usage(log, target="sm_90a")["fwd_test"] == ResourceUsage(128, 0, 0, 0, 0, 1, "sm_90a")
    assert parse_resource_usage(log, target="sm_80")["fwd_test"].registers == 122


def test_parse_noise_only_and_incomplete_logs():
    assert parse_resource_usage("nvcc warning : something\nptxas info    : 0 bytes gmem\n") == {}
    cut = SAMPLE_LOG.split("ptxas info    : Used 122")[0]
    with pytest.raises(ValueError, match="fwd_test.*Used N registers"):
        parse_resource_usage(cut)
    no_frame = "ptxas info    : Compiling entry function 'e' for 'sm_80'\nptxas info    : Used 8 registers\n"
    with pytest.raises(ValueError, match="'e'.*stack frame"):
        parse_resource_usage(no_frame)


def test_sha256_file_streams(tmp_path):
    path = tmp_path / "blob.bin"
    data = os.urandom(10_000)
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert sha256_file(path, chunk_size=7) == hashlib.sha256(data).hexdigest()
