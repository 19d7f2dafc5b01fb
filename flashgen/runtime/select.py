"""Pick the kernel for a call: the first in priority order that accepts it.

A kernel accepts a call when its dtype matches, its kMaxK covers the head
dims, dropout is compiled in if asked for, the inputs meet its alignment and
its shared memory fits the device.  Every rejection has a reason, so
``explain`` and the ``UnsupportedError`` message list them all.  Decisions are
cached per request signature; the backward's key-split count and workspace
size are sized per call from the manifest's constants.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from flashgen.errors import UnsupportedError
from flashgen.runtime.arch import DeviceInfo
from flashgen.runtime.registry import KernelBinary, Registry
from flashgen.runtime.tuning import Choice

# Request.num_keys and num_queries are capped here: past it, no kernel's choice depends on the length,
# and the cache of decisions stays small
KEYS_CAP = 1 << 16


@dataclass(frozen=True)
class Request:
    """What a call needs from a kernel; hashable, so decisions can be cached."""

    family: str
    dtype: str
    head_dim: int
    head_dim_value: int
    alignment: int  # largest element alignment every pointer, stride and head dim satisfies
    dropout: bool
    bias: bool
    device: DeviceInfo
    # largest powers of two up to 128 dividing M and N (0, 0 with cu_seqlens): whether a
    # block-aligned kernel (no bounds checks) may serve the call
    seq_multiples: Tuple[int, int] = (0, 0)
    band: bool = False  # a causal mask or sliding window: families that compile it in (sm90) must match
    softcap: bool = False  # soft-capping: families with a softcap axis (sm90_bwd) must match
    # bias compiled in or not (sm90): the kernel's bias axis must match ``bias`` both ways; else a
    # kernel with bias (example 41: a null-pointer branch) also serves calls without one
    compiled_bias: bool = False
    # a block mask's (rows, keys) per block, read by the kernel (sm90_fwd's sparse axis, which must match
    # both ways, on a tile of the same size); None: no block mask, or one served dense
    block_sparse: Optional[Tuple[int, int]] = None
    # keys per sequence (the longest, with cu_seqlens), at most KEYS_CAP; 0: unknown. Kernels whose
    # constant ``staged_max_key_blocks`` is nonzero (sm90_fwd's staged O) serve only calls of at most
    # that many key blocks
    num_keys: int = 0
    # dropout compiled in or not (sm90): the kernel's dropout axis must match ``dropout`` both ways; else a
    # kernel with dropout (example 41: a run-time branch) also serves calls without
    compiled_dropout: bool = False
    # a score mod compiled in (sm90's score_mod axis, which must match both ways) and the digest of the
    # declaration asked for, which the kernel's manifest record must carry (runtime/score_mods.py)
    score_mod: str = ""
    score_mod_digest: str = ""
    # queries per sequence (the longest, with cu_seqlens), at most KEYS_CAP; 0: unknown. Kernels whose
    # constant ``min_queries`` is nonzero (sm90_bwd's 80-query steps) serve only calls of at least that many
    num_queries: int = 0


def seq_multiples(num_queries: int, num_keys: int, varlen: bool) -> Tuple[int, int]:
    if varlen:
        return (0, 0)
    return (math.gcd(num_queries, 128), math.gcd(num_keys, 128))


def required_alignment(binary: KernelBinary) -> int:
    """Elements every pointer, stride and head dim must be a multiple of for this kernel."""
    c = binary.constants
    if "alignment" in c:
        return c["alignment"]
    if binary.spec.FAMILY == "mem_eff_fwd":
        return max(c["alignment_q"], c["alignment_k"])
    return c["optimal_alignment"] if binary.spec.aligned else c["minimum_alignment"]


def mask_block(constants: dict) -> Tuple[int, int]:
    """(queries, keys) of the block-mask blocks a sparse kernel reads: its tile, except where its
    steps are smaller than the mask's rows (sm90_bwd's ``mask_rows``: 64-query steps walk 128-row blocks)."""
    return constants.get("mask_rows", constants["block_m"]), constants["block_n"]


def rejection(binary: KernelBinary, req: Request) -> Optional[str]:
    """Why ``binary`` cannot serve ``req``, or None if it can."""
    spec, c = binary.spec, binary.constants
    if spec.dtype != req.dtype:
        return f"dtype {spec.dtype}, call is {req.dtype}"
    k = max(req.head_dim, req.head_dim_value)
    if c["max_k"] < k:
        return f"kMaxK {c['max_k']} < head dim {k}"
    if req.dropout and not spec.dropout:
        return "built without dropout"
    if req.compiled_dropout and spec.dropout and not req.dropout:
        return "built with dropout (compiled in): a call without it takes a kernel without"
    if req.bias and not getattr(spec, "bias", True):
        return "built without bias"
    if req.compiled_bias and spec.bias and not req.bias:
        return "built with bias (compiled in): a call without one takes a kernel without"
    if getattr(spec, "band", req.band) != req.band:
        return f"built {'with' if spec.band else 'without'} the band mask (causal, sliding window)"
    if getattr(spec, "softcap", req.softcap) != req.softcap:
        return f"built {'with' if spec.softcap else 'without'} soft-capping"
    sparse = getattr(spec, "sparse", req.block_sparse is not None)
    if sparse != (req.block_sparse is not None):
        return f"built {'with' if sparse else 'without'} block-mask lists (sparse)"
    if sparse and mask_block(c) != req.block_sparse:
        return (f"reads {mask_block(c)[0]} x {mask_block(c)[1]} mask blocks; the block mask's are "
                f"{req.block_sparse[0]} x {req.block_sparse[1]}")
    mod = getattr(spec, "score_mod", req.score_mod)
    if mod != req.score_mod:
        return f"built with score mod {mod!r}" if mod else "built without a score mod"
    if mod and (binary.score_mod or {}).get("digest") != req.score_mod_digest:
        return (f"built from another declaration of score mod {mod!r}: its manifest digest is not the one asked "
                "for; rebuild it from your mods file")
    if getattr(spec, "block_aligned", False):
        rows, keys = req.seq_multiples
        if not rows or rows % spec.block_i or keys % spec.block_j:
            return (f"block-aligned: needs M % {spec.block_i} == N % {spec.block_j} == 0 and no cu_seqlens")
    need = required_alignment(binary)
    if req.alignment % need:
        return f"needs {need}-element alignment of pointers, strides and head dims; the call has {req.alignment}"
    served = c.get("staged_max_key_blocks", 0)
    if served and not 0 < req.num_keys <= served * c["block_n"]:
        more = " or more" if req.num_keys >= KEYS_CAP else ""
        keys = f"{req.num_keys}{more}" if req.num_keys else "an unknown number"
        return (f"stores O through shared memory, which pays only for tiles of at most {served} key blocks "
                f"({served * c['block_n']} keys); the call has {keys}")
    least = c.get("min_queries", 0)
    if least and req.num_queries < least:
        queries = f"{req.num_queries}" if req.num_queries else "an unknown number"
        return (f"takes {c['block_m']}-query steps, which pay only from {least} queries a sequence on; the call "
                f"has {queries}")
    smem = c["shared_memory_bytes"]
    if smem > req.device.shared_memory_optin:
        return f"needs {smem} B of shared memory; {req.device.name} allows {req.device.shared_memory_optin} B per block"
    return None


def order(candidates: List[KernelBinary], prefer: Optional[Choice]) -> List[KernelBinary]:
    """The order selection tries ``candidates`` (the registry's priority order) in: a tuning table's
    tile (``prefer``) first, then the rest."""
    if prefer is None:
        return candidates
    return [b for b in candidates if prefer.matches(b.spec)] + [b for b in candidates if not prefer.matches(b.spec)]


class Selector:
    """First-fit selection over a registry, cached per request."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._cache: Dict[Tuple[Request, Optional[Choice]], Optional[KernelBinary]] = {}

    def explain(self, req: Request, prefer: Optional[Choice] = None) -> List[Tuple[str, str, str]]:
        """(kernel, target, verdict) for every candidate, in the order ``find`` tries them (``order``)."""
        rows, chosen = [], None
        for b in order(self.registry.for_device(req.family, req.device), prefer):
            why = rejection(b, req)
            if why is None and chosen is None:
                rows.append((b.name, b.target, "selected"))
                chosen = b
            elif why is None:
                tuned = prefer is not None and prefer.matches(chosen.spec) and not prefer.matches(b.spec)
                rows.append((b.name, b.target, "not tried: the tuning table's tile for this shape was selected "
                             "(FLASHGEN_TUNING=off: the priority order)" if tuned
                             else "not tried: an earlier kernel was selected"))
            else:
                rows.append((b.name, b.target, why))
        return rows

    def find(self, req: Request, prefer: Optional[Choice] = None) -> Optional[KernelBinary]:
        """The first kernel that accepts ``req`` with ``prefer``'s tile (a tuning table's
        choice), else the first that accepts it at all, else None (also when the registry
        has no kernel of the family for the device)."""
        key = (req, prefer)
        if key in self._cache:
            return self._cache[key]
        try:
            candidates = self.registry.for_device(req.family, req.device)
        except UnsupportedError:
            candidates = []
        found = next((b for b in order(candidates, prefer) if rejection(b, req) is None), None)
        self._cache[key] = found
        return found

    def select(self, req: Request, prefer: Optional[Choice] = None) -> KernelBinary:
        """``find``, or an UnsupportedError listing every candidate and why it was rejected."""
        found = self.find(req, prefer)
        if found is not None:
            return found
        listing = "\n".join(f"  {name} ({target}): {why}" for name, target, why in self.explain(req, prefer))
        hint = ""
        if req.alignment < 4:
            hint = ("\nthe example-41 kernels need head dims, strides and pointers that are multiples of 4 "
                    "elements; pad the head dim (and slice the result)")
        raise UnsupportedError(f"no {req.family} kernel accepts {req.dtype}, head dims "
                               f"({req.head_dim}, {req.head_dim_value}), alignment {req.alignment}, "
                               f"dropout={req.dropout} on {req.device.name} (sm_{req.device.cc}):\n{listing}{hint}")


def _align_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def num_splits_key(binary: KernelBinary, batches: int, heads: int, num_keys: int, device: DeviceInfo,
                   head_dim: int = 0, head_dim_value: int = 0, policy: str = "auto") -> int:
    """How many blocks share one (batch, head)'s keys, by ``policy`` (tuning.SPLIT_POLICIES).

    "auto" (no tuning table): when B*H blocks already fill the GPU, one;
    otherwise every key block gets its own block (the dQ contributions meet in
    the workspace): measured on an H200 (BENCHMARKS.md), that beat splitting
    only as far as one wave of resident blocks by 1.4-1.75x at 4k-16k keys
    (f16 backward, 73 -> 128 TFLOP/s at head dim 128, 16k).  When dK/dV also
    go through the workspace its size grows with the split count, so it is
    capped, and the kernel sizes that part in 32-bit arithmetic
    (``workspace_elements_gk/gv``): splits * align(N, J) * align(K, I) must
    fit an int32.
    """
    c = binary.constants
    if not c["enable_split_keys"] or policy == "one":
        return 1
    resident = device.multiprocessors * max(1, c["min_blocks_per_sm"])
    if policy == "auto" and batches * heads >= resident:
        return 1
    splits = max(1, math.ceil(num_keys / c["block_j"]))
    if policy == "wave":
        splits = min(splits, max(1, math.ceil(resident / (batches * heads))))
    if c["needs_accum_grad_k"] or c["needs_accum_grad_v"]:
        splits = min(splits, max(1, 200 // (batches * heads)))
        per_split = _align_up(num_keys, c["block_j"]) * _align_up(max(head_dim, head_dim_value, 1), c["block_i"])
        splits = min(splits, max(1, (2**31 - 1) // per_split))
    return max(1, min(splits, 32767))


def workspace_bytes(binary: KernelBinary, batches: int, heads: int, num_queries: int, num_keys: int,
                    head_dim: int, head_dim_value: int, splits: int) -> int:
    """Bytes of float workspace the backward needs; mirrors ``Params::workspace_size()``.

    Every constant comes from the cubin; tests compare this with the C++
    function on the same shapes.
    """
    c = binary.constants
    bi, bj = c["block_i"], c["block_j"]
    gk = splits * _align_up(num_keys, bj) * _align_up(head_dim, bi) if c["needs_accum_grad_k"] else 0
    gv = splits * _align_up(num_keys, bj) * _align_up(head_dim_value, bi) if c["needs_accum_grad_v"] else 0
    gq = 0
    if c["needs_accum_grad_q"]:
        blocks = math.ceil(num_queries / bi)
        cols = math.ceil(head_dim / c["grad_q_block_n"])
        gq = blocks * cols * c["grad_q_temp_storage_bytes"] // 4
    return batches * heads * _align_up(gk + gv + gq, 4) * 4
