"""``sm80_bwd``: flashgen's own Ampere-class backward (``flashgen/csrc/flashgen/sm80_bwd.h``).

Template: ``flashgen::sm80::BwdKernel<Element, kHeadDim, kBlockM, kBlockN, kWarps, kBias, kDropout>`` -- eight
warps (four in 32-key CTAs) with mma.sync, ldmatrix and cp.async.  One CTA per ``block_n`` keys
of one (sequence, k/v head) keeps K and V in shared memory and walks every query head of the k/v
head's group and every query block of ``block_m`` rows it meets, Q, dO, lse, delta and dS
double-buffered (dS single in the 4-warp tile at head dim 256, which two would take past 99 KB).
Each warp owns 16 keys (32 in a 128-key CTA) and half of each query block; dK and dV stay in
registers (where they and S^T and dP^T would exceed 192 registers, split by columns between
the two warps of the same keys, which trade P^T and dS^T through shared memory); dQ goes into a
float32 accumulator by reductions, a warp's whole 128-byte lines (float4 ones from sm_90 on).
Each instance holds three entry points, launched in order on one stream, with the contract of
``sm90_bwd``:

* ``<name>_prep``: grid (ceil(M / block_m), heads, batch or sequences), ``aux_threads``
  threads -- delta, the lse in log2, zeroed dQ accumulator and counters;
* ``<name>``: grid (ceil(N / block_n), k/v heads, batch or sequences), ``threads_per_block``
  threads, ``shared_memory_bytes`` of dynamic shared memory;
* ``<name>_convert``: grid as prep -- dQ from the fp32 accumulator.

The workspace is ``sm90_bwd``'s (lse_log2, delta, the dQ accumulator [.., rows_padded,
max_k] as tiles of block_m rows, each in the order the kernel adds it, counters), so the runtime
shares its layout.  Inputs are read by 16-byte cp.async: pointers, strides and the head dim must
be multiples of 8 elements; a head dim below the tier reads zeros past its own.  Masks,
soft-capping, grouped-query k/v heads and packed batches are run-time options through the same
fields as ``sm80_fwd``.  The code is Ampere instructions only: built for plain targets from sm80
on (a plain sm90 build lets an H100/H200 run it), not for sm90a, where ``sm90_bwd`` serves every
call this one could.

A ``bias`` instance reads the bias as ``sm80_fwd``'s do (``bias_ptr``, ``bias_stride_b/h/m``) and,
where ``dbias_ptr`` is not null, writes dS (the gradient of the biased score, in the input dtype)
into dbias [B, H, M, N] (rows of ``dbias_row_stride`` elements, packed otherwise) at every (query,
key) its CTAs visit, as ``sm90_bwd``'s do; the rest is the caller's.  No dbias with soft-capping
(the runtime refuses it: the buffer dbias leaves from holds dS times tanh's slope).  A step's bias
tile lands in the dS^T buffer the step writes later, so a bias instance has its plain twin's tile
and shared memory (it needs the two dS^T buffers).  No packed batches.

A ``dropout`` instance redraws the mask of ``sm80_fwd``'s dropout twin -- the rule of
``flashgen/csrc/flashgen/dropout.h``, so ``sm90_fwd``'s too -- from the same ``dropout_*`` fields at
the end of ``Params``: dV = (P o mask)^T dO / (1 - p) and dS = P o (dP o mask / (1 - p) - delta).
"""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.spec.core import DTYPES, Constant, Field, KernelSpec, Rule, cpp_bool, normalize_target, target_cc
from flashgen.spec.contract import (BACKWARD_BATCH_STRIDE_FIELDS, BACKWARD_POINTER_FIELDS, BACKWARD_SHAPE_FIELDS,
                                     DROPOUT_FIELDS)

KB = 1024
SM86_SHARED = 99 * KB   # what an sm86/sm89 block may opt into
A100_SHARED = 163 * KB  # an A100 block's (a Hopper one: 227 KB)
WIDE_KEYS_MAX_K = 128   # 128-key CTAs up to this head dim (see RULES)


def shared_bytes(max_k: int, block_m: int, block_n: int, warps: int = 8) -> int:
    """BwdKernel::kSharedBytes: K and V, double-buffered Q and dO, dS (double-buffered, except in a
    4-warp CTA that two buffers would take past 99 KB), double-buffered lse and delta (tests compare
    it with the value the build reads back from the cubin)."""
    def total(ds_buffers):
        return 2 * (2 * block_n * max_k + 4 * block_m * max_k + ds_buffers * block_m * block_n) + 4 * 4 * block_m
    return total(1) if warps == 4 and total(2) > SM86_SHARED else total(2)


def query_step(max_k: int, block_n: int, warps: int, budget: int) -> int:
    """The larger of the query steps 64 and 32 whose tile fits ``budget`` bytes (32 if neither does)."""
    return 64 if shared_bytes(max_k, 64, block_n, warps) <= budget else 32


def key_warps(block_n: int) -> int:
    """The template's warps for a CTA of ``block_n`` keys: two query halves of block_n / 16 warps
    of 16 keys, or of 4 warps of 32 keys in a 128-key CTA."""
    return 2 * (4 if block_n == 128 else block_n // 16)


@dataclass(frozen=True)
class Sm80Bwd(KernelSpec):
    arch: str
    dtype: str
    max_k: int    # head-dim tier; smaller head dims (multiples of 8) read zeros past theirs
    block_m: int  # query rows per step
    block_n: int  # keys per CTA: 16 per warp of each query half (32 in a 128-key CTA)
    warps: int    # 8; 4 for 32-key CTAs, sm86/sm89's tile past head dim 128
    bias: bool    # an additive attention bias, and dbias, compiled in (BwdKernel::kBias)
    dropout: bool  # the forward's Philox dropout mask, redrawn (BwdKernel::kDropout)

    FAMILY = "sm80_bwd"
    DIRECTION = "bwd"
    TEMPLATE = "sm80_bwd.cu.j2"
    HEADER = "flashgen/sm80_bwd.h"
    KERNEL = "flashgen::sm80::BwdKernel"
    FLAGS = ("bias", "dropout")  # boolean axes: named in the instance name when set, template parameters in this order
    BUILD_GROUP = ("arch",)  # one compile job a target: the kernels share most CuTe instantiations (see graph.py)
    AXES = {
        "arch": ("sm80",),
        "dtype": ("f16", "bf16"),
        "max_k": (64, 128, 192, 256),
        "block_m": (32, 64, 128),
        "block_n": (32, 64, 128),
        "warps": (4, 8),
        "bias": (False, True),
        "dropout": (False, True),
    }
    TUNED_AXES = ("max_k", "block_m", "block_n", "warps")
    # Per head-dim tier one tile for the shared memory of an A100 or Hopper block, and one within
    # sm86/sm89's 99 KB where that one is larger: selection skips a tile a device cannot hold.
    RULES = (
        Rule("the template's warps: two query halves of 16-key warps (32-key in 128-key CTAs), so 8 warps "
             "take 64 or 128 keys, 4 warps 32",
             lambda k: k.warps != key_warps(k.block_n)),
        Rule("128-query steps only at head dim 64 with 128 keys, no bias or dropout (162 KB: A100, Hopper; dK and "
             "dV split by columns): more registers or shared memory spill or do not fit",
             lambda k: k.block_m == 128 and (k.max_k != 64 or k.block_n != 128 or k.bias or k.dropout)),
        Rule("128-key CTAs take 64-query steps: 32 queries halve the work per load and barrier",
             lambda k: k.block_n == 128 and k.block_m == 32),
        Rule("128-key CTAs up to head dim 128: past it a warp's dK and dV of 32 keys (192+ registers a thread) "
             "spill",
             lambda k: k.block_n == 128 and k.max_k > WIDE_KEYS_MAX_K),
        Rule("64-key CTAs only where the 128-key one exceeds sm86/sm89's 99 KB (head dim 128 on): they "
             "read Q and dO twice as often per key",
             lambda k: k.block_n == 64 and shared_bytes(k.max_k, 64, 128) <= SM86_SHARED),
        Rule("64-key CTAs take the larger query step that fits: 99 KB where a 128-key CTA serves A100s "
             "(head dim 128), an A100's 163 KB past it",
             lambda k: k.block_n == 64 and k.block_m != query_step(
                 k.max_k, 64, 8, SM86_SHARED if k.max_k <= WIDE_KEYS_MAX_K else A100_SHARED)),
        Rule("4-warp CTAs only where no 8-warp tile fits sm86/sm89's 99 KB (past head dim 128): half the "
             "warps to hide each load and barrier",
             lambda k: k.warps == 4 and shared_bytes(k.max_k, 32, 64) <= SM86_SHARED),
        Rule("4-warp CTAs take the larger query step within 99 KB: 32 (64 queries need 129 KB at head dim 192)",
             lambda k: k.warps == 4 and k.block_m != query_step(k.max_k, 32, 4, SM86_SHARED)),
        Rule("bias on tiers 64 and 128 only, as sm80_fwd's (each instance is a build job of the sm80 set's 6-minute "
             "budget); larger head dims with a bias stay on example 41",
             lambda k: k.bias and k.max_k > 128),
        Rule("dropout on tiers 64 and 128, the forward's twins (as the sm90 pair): each instance is a build job, "
             "and Philox beside tiers 192/256's tight registers is unmeasured",
             lambda k: k.dropout and k.max_k > 128),
        Rule("bias and dropout not built together, as in sm80_fwd: such calls stay on example 41",
             lambda k: k.bias and k.dropout),
    )

    def runs_on(self, target: str) -> bool:
        """Plain targets from sm80 on (sm80 SASS covers 8.0-8.9, a plain sm90 build Hopper); not
        sm90a, where sm90_bwd serves every call this family could."""
        return not normalize_target(target).endswith("a") and 80 <= target_cc(target) < 130

    @property
    def name(self) -> str:
        warps = "" if self.warps == 8 else f"_w{self.warps}"  # (the 8-warp names predate the axis)
        flags = [flag for flag in self.FLAGS if getattr(self, flag)]
        return "_".join([self.FAMILY, self.dtype, f"k{self.max_k}", f"q{self.block_m}x{self.block_n}{warps}",
                         *flags, self.arch])

    @property
    def priority(self) -> tuple:
        # the smallest head-dim tier that fits, then the larger tile: a GPU whose blocks cannot
        # opt into its shared memory (sm86/sm89) skips it with the reason and takes the next
        return (tuple(DTYPES).index(self.dtype), self.bias, self.dropout, self.max_k, -self.block_m * self.block_n,
                -self.warps)

    @property
    def cpp_type(self) -> str:
        flags = "".join(f", {cpp_bool(getattr(self, flag))}" for flag in self.FLAGS)
        return f"{self.KERNEL}<{DTYPES[self.dtype]}, {self.max_k}, {self.block_m}, {self.block_n}, {self.warps}{flags}>"

    # `flashgen::sm80::BwdParams`
    ABI = (
        Field("q_ptr", "ptr"),
        Field("k_ptr", "ptr"),
        Field("v_ptr", "ptr"),
        *BACKWARD_POINTER_FIELDS,
        Field("q_stride_b", "i64"),
        Field("k_stride_b", "i64"),
        Field("v_stride_b", "i64"),
        *BACKWARD_BATCH_STRIDE_FIELDS,
        Field("q_stride_m", "i32"),
        Field("q_stride_h", "i32"),
        Field("k_stride_m", "i32"),
        Field("k_stride_h", "i32"),
        Field("v_stride_m", "i32"),
        Field("v_stride_h", "i32"),
        *BACKWARD_SHAPE_FIELDS,
        Field("bias_ptr", "ptr"),
        Field("bias_stride_b", "i64"),
        Field("bias_stride_h", "i64"),
        Field("bias_stride_m", "i32"),
        *DROPOUT_FIELDS,
    )

    CONSTANTS = (
        Constant("threads_per_block", "Kernel::kThreads"),
        Constant("min_blocks_per_sm", "Kernel::kMinBlocksPerSm"),
        Constant("shared_memory_bytes", "Kernel::kSharedBytes"),
        Constant("block_m", "Kernel::kBlockM"),
        Constant("block_n", "Kernel::kBlockN"),
        Constant("max_k", "Kernel::kHeadDim"),
        Constant("alignment", "16 / sizeof(Kernel::Element)"),
        Constant("params_bytes", "sizeof(flashgen::sm80::BwdParams)"),
        Constant("aux_threads", "Kernel::kAuxThreads"),  # prep and convert
    )
