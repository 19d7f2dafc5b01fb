"""Fakes for the runtime's host-side tests: devices as cudaGetDeviceProperties reports them, kernel
specs with the constants a real build reads back from its cubins, build directories with manifests
and fake cubins, CuPy-like arrays, and the kernel set selection is tested over.  Nothing here imports
CuPy; tests/conftest.py has the fixtures (the set's build directory and registry, and CuPy blocked).
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from flashgen.build import manifest
from flashgen.runtime import registry, validate
from flashgen.runtime.arch import DeviceInfo
from flashgen.runtime.select import Request
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.spec.mem_eff_fwd import MemEffFwd


# --- fake devices (numbers as cudaGetDeviceProperties reports them) -----------------------

H100 = DeviceInfo(index=0, name="NVIDIA H100 80GB HBM3", cc=90, multiprocessors=132, shared_memory_optin=232448)
RTX3090 = DeviceInfo(index=1, name="NVIDIA GeForce RTX 3090", cc=86, multiprocessors=82, shared_memory_optin=101376)
A100 = DeviceInfo(index=0, name="NVIDIA A100-SXM4-80GB", cc=80, multiprocessors=108, shared_memory_optin=166912)
RTX4090 = DeviceInfo(index=0, name="NVIDIA GeForce RTX 4090", cc=89, multiprocessors=128, shared_memory_optin=101376)
T4 = DeviceInfo(index=2, name="Tesla T4", cc=75, multiprocessors=40, shared_memory_optin=65536)
B200 = DeviceInfo(index=3, name="NVIDIA B200", cc=100, multiprocessors=148, shared_memory_optin=232448)


# --- fake kernels and manifests ------------------------------------------------------------

def bwd(dtype="f16", aligned=True, dropout=False, preload=None, block_i=64, block_j=64, max_k=64, arch="sm80"):
    if preload is None:  # what the default set does: preload where dK/dV stay in registers on sm80
        preload = dtype != "f32" and max_k <= block_i
    return MemEffBwd(arch=arch, dtype=dtype, aligned=aligned, dropout=dropout, preload=preload,
                     block_i=block_i, block_j=block_j, max_k=max_k, block_aligned=False)


def fwd(dtype="f16", aligned=True, queries=64, keys=64, max_k=64, dropout=False, arch="sm80"):
    return MemEffFwd(arch=arch, dtype=dtype, aligned=aligned, queries_per_block=queries, keys_per_block=keys,
                     max_k=max_k, dropout=dropout, bias=True)


def hopper_constants(spec):
    """Every constant an sm90_fwd / sm90_bwd spec declares, as a build of it reads them back (FwdKernel's
    kServedKeyBlocks: 16 for an unmasked staged instance; BwdKernel's kMinQueries: 1024 for 80-query steps,
    kZeroesHiddenDbias: 1 for band bias instances, kAddsDbias: 1 for bias instances)."""
    known = dict(threads_per_block=384, min_blocks_per_sm=1, shared_memory_bytes=200 * 1024, block_m=spec.block_m,
                 block_n=spec.block_n, max_k=spec.max_k, stages=spec.stages, box_cols=64, swizzle_bytes=128,
                 alignment=8, params_bytes=type(spec).params_dtype().itemsize, aux_threads=128, mask_rows=128,
                 staged_max_key_blocks=16 if getattr(spec, "staged_o", False) and not spec.band else 0,
                 min_queries=1024 if spec.block_m == 80 else 0,
                 zeroes_hidden_dbias=int(getattr(spec, "bias", False) and spec.band),
                 adds_dbias=int(getattr(spec, "bias", False)))
    return {c.name: known[c.name] for c in type(spec).CONSTANTS}


def constants(spec, smem, **overrides):
    """Every constant the spec declares, with the values a real build reads back from the cubin."""
    half = spec.dtype != "f32"
    if isinstance(spec, MemEffBwd):
        in_rf = half and spec.max_k <= spec.block_i
        tile = (spec.block_i, spec.block_j)
        known = dict(
            threads_per_block=spec.block_i * spec.block_j // 32,
            min_blocks_per_sm={(64, 64): 3 if half else 2, (128, 64): 1, (128, 128): 0}[tile],
            block_i=spec.block_i, block_j=spec.block_j, max_k=spec.max_k,
            optimal_alignment=8 if half else 4, minimum_alignment=4,
            output_in_registers=int(in_rf), kernel_computes_delta=int(half), enable_split_keys=1,
            needs_accum_grad_q=1, needs_accum_grad_k=int(half and not in_rf),
            needs_accum_grad_v=int(half and not in_rf),
            grad_q_temp_storage_bytes=spec.block_i * spec.block_j * 4 + 16, grad_q_block_n=spec.block_j,
            apply_dropout=int(spec.dropout))
    else:
        align = 8 if half and spec.aligned else 4
        known = dict(
            threads_per_block=128, warps_per_block=4, min_blocks_per_sm=4 if half else 3,
            queries_per_block=spec.queries_per_block, keys_per_block=spec.keys_per_block, max_k=spec.max_k,
            alignment_q=align, alignment_k=align, alignment_v=1, lse_row_alignment=32,
            needs_output_accum_buffer=int(half and spec.max_k > spec.keys_per_block),
            supports_dropout=int(spec.dropout), supports_bias=int(spec.bias))
    known.update(shared_memory_bytes=smem, params_bytes=type(spec).params_dtype().itemsize)
    known.update(overrides)
    return {c.name: known[c.name] for c in type(spec).CONSTANTS}


def write_build(directory: Path, kernels, schema_version=manifest.SCHEMA_VERSION, extra_entries=()):
    """A build directory like `flashgen build` leaves: fake cubins (or PTX) and their manifest.

    ``kernels``: (spec, {target: constants}) pairs; a ``computeXY`` target gets a PTX record.
    Returns {(name, target): path of the fake file}.
    """
    directory.mkdir(parents=True, exist_ok=True)
    entries, files = {}, {}
    for spec, targets in kernels:
        entry = {"name": spec.name, "family": spec.FAMILY, "params": spec.params, "abi": spec.abi_digest(),
                 "symbol": spec.name, "meta_symbol": spec.meta_symbol, "targets": {}}
        for target, consts in targets.items():
            kind = "ptx" if target.startswith("compute") else "cubin"
            rel = f"{target}/{spec.name}.{kind}"
            path = directory / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f"fake {kind}: {spec.name} for {target} in {directory}\n".encode())
            record = {kind: rel, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                      "size": path.stat().st_size}
            if kind == "cubin":
                record.update(registers=128, spill_stores=0, spill_loads=0, stack_frame=0, shared_memory_static=0)
            record.update(shared_memory_dynamic=consts["shared_memory_bytes"],
                          threads_per_block=consts["threads_per_block"],
                          min_blocks_per_sm=consts["min_blocks_per_sm"], constants=consts)
            entry["targets"][target] = record
            files[(spec.name, target)] = path
        entries[spec.name] = entry
    for e in extra_entries:
        entries[e["name"]] = e
    data = {"schema_version": schema_version,
            "toolchain": {"flashgen": "0.1.0", "nvcc": "13.0.88", "cutlass": "4.2.0.0"},
            "kernels": [entries[name] for name in sorted(entries)]}
    (directory / manifest.MANIFEST_NAME).write_text(json.dumps(data, indent=1) + "\n")
    return files


# The backward kernels selection is tested over, with the shared memory an sm80 build reports.
F16_K64 = bwd(max_k=64)
F16_K128_BIG = bwd(block_i=128, block_j=128, max_k=128)
F16_K128 = bwd(block_i=128, block_j=64, max_k=128)
F16_K65536 = bwd(max_k=65536)
F16_K64_DROP = bwd(max_k=64, dropout=True)
F16_K128_DROP = bwd(block_i=128, block_j=64, max_k=128, dropout=True)
F16_K65536_DROP = bwd(max_k=65536, dropout=True)
F16_UNALIGNED = bwd(aligned=False, max_k=65536)
F32_K64 = bwd(dtype="f32", max_k=64)
F32_K65536 = bwd(dtype="f32", max_k=65536)
BWD_SMEM = {F16_K64: 44288, F16_K128_BIG: 154112, F16_K128: 91648, F16_K65536: 34048, F16_K64_DROP: 52480,
            F16_K128_DROP: 96768, F16_K65536_DROP: 34048, F16_UNALIGNED: 34048, F32_K64: 53504, F32_K65536: 67840}
# The order the spec ranks them in, written out by hand: f32 first (DTYPES order), then aligned before
# unaligned, no dropout before dropout, the smaller kMaxK first, the larger tile first.
BWD_PRIORITY = [F32_K64, F32_K65536, F16_K64, F16_K128_BIG, F16_K128, F16_K65536,
                F16_K64_DROP, F16_K128_DROP, F16_K65536_DROP, F16_UNALIGNED]

FWD_K64 = fwd(max_k=64)
FWD_K128 = fwd(queries=32, keys=128, max_k=128)
FWD_K64_DROP = fwd(max_k=64, dropout=True)
FWD_UNALIGNED = fwd(aligned=False, queries=32, keys=128, max_k=65536)
FWD_SMEM = {FWD_K64: 18944, FWD_K128: 42496, FWD_K64_DROP: 18944, FWD_UNALIGNED: 51200}


def req(dtype="f16", head_dim=64, head_dim_value=None, alignment=8, dropout=False, device=H100,
        family="mem_eff_bwd", bias=False, seq_multiples=(0, 0)):
    return Request(family, dtype, head_dim, head_dim if head_dim_value is None else head_dim_value,
                   alignment, dropout, bias, device, seq_multiples)


def binary(reg, spec, target="sm90"):
    return reg.binaries[(spec.name, target)]


def fake_binary(spec, smem=40000, **overrides):
    """A registry entry for ``spec`` on sm90 with the constants a build reads back (no file behind it)."""
    return registry.KernelBinary(spec, "sm90", Path("x.cubin"), "0" * 64, constants(spec, smem, **overrides), {})


K64 = fake_binary(F16_K64)            # 64x64, dQ only in the workspace, 3 blocks/SM
K128 = fake_binary(F16_K128)          # 128x64, dQ only, 1 block/SM
K128_BIG = fake_binary(F16_K128_BIG)  # 128x128, dQ only, kMinBlocksPerSm 0
ACCUM = fake_binary(F16_K65536)       # 64x64, dQ, dK and dV in the workspace, 3 blocks/SM



# --- fake arrays and calls ------------------------------------------------------------------

class FakeArray:
    """Just the attributes the validation helpers read off a CuPy array."""

    def __init__(self, shape, dtype=np.float16, strides=None, ptr=0x7F2A00000000, device=0):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        if strides is None:  # C-contiguous, in elements
            strides, step = [], 1
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= max(n, 1)
        self.strides = tuple(s * self.itemsize for s in strides)  # bytes, like CuPy
        self.device = SimpleNamespace(id=device)
        self.data = SimpleNamespace(ptr=ptr, device_id=device)


def qkv(B=2, M=5, N=7, H=3, K=64, Kv=None, dtype=np.float16):
    Kv = K if Kv is None else Kv
    return FakeArray((B, M, H, K), dtype), FakeArray((B, N, H, K), dtype), FakeArray((B, N, H, Kv), dtype)



def fake_call(direction="fwd", bias=None, **options):
    """A validated Call over FakeArrays (what a family's refusal reads)."""
    q, k, v = options.pop("arrays", None) or qkv()
    c = validate.problem(q, k, v, options.get("causal"), None, options.get("dropout_p", 0.0), options.get("seed"), 0,
                         None, None, window=options.get("window"), softcap=options.get("softcap", 0.0))
    extra = {"out": FakeArray(q.shape), "grad_out": FakeArray(q.shape)} if direction == "bwd" else {}
    return validate.Call(direction, c, q, k, v, bias, options, None, **extra)


class Tensor:
    """A stand-in torch tensor of int32 offsets, for a stand-in ``torch`` module (CI has no torch):
    what host_offsets reads of one -- identity, ``_version`` (bumped by in-place writes), ``is_cuda``."""

    is_cuda = False

    def __init__(self, *values):
        self.values, self._version = np.array(values, np.int32), 0

    def add_(self, n):
        self.values += n
        self._version += 1

    def numpy(self):
        return self.values


class InferenceTensor(Tensor):
    """A stand-in inference-mode tensor: it has no version counter."""

    @property
    def _version(self):
        raise RuntimeError("Inference tensors do not track version counter.")

    @_version.setter
    def _version(self, value):
        pass
