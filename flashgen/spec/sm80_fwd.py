"""``sm80_fwd``: flashgen's own Ampere-class forward (``flashgen/csrc/flashgen/sm80_fwd.h``).

Template: ``flashgen::sm80::FwdKernel<Element, kHeadDim, kBlockM, kBlockN, kStages, kBias, kDropout>`` --
four warps with mma.sync, ldmatrix and cp.async: each warp owns kBlockM / 4 query rows,
and K and V tiles of kBlockN keys stream through a ring of ``kStages`` single-tile
shared-memory slots.  Launch: block (threads_per_block, 1, 1), grid
(ceil(M / block_m), heads, batch or sequences), dynamic shared memory
``shared_memory_bytes``.  The code uses Ampere instructions only, so it is built for
plain targets from sm80 on (sm80 SASS runs on 8.0 to 8.9; a plain sm90 build lets an
H100/H200 run it), not for the arch-specific sm90a, whose wgmma family (sm90_fwd)
serves every call this one could there.

Inputs are read by 16-byte cp.async: pointers, strides and the head dim must be multiples
of 8 elements; a head dim below the tier's reads zeros past its own (the kernel never
stores those columns).  Masks, soft-capping, grouped-query k/v heads and packed (varlen)
batches are run-time options through the same ``Params`` fields as ``sm90_fwd``
(``band_lo``/``band_hi``/``band_from_end``, ``softcap_in``/``softcap_out``,
``head_group``, ``seqstart_q/k``), and the lse is written like the example-41 forward's:
[B or S, H, rows padded to 32], +inf in the padding, natural log of the scaled scores.

A ``bias`` instance adds a bias [B, H, M, N] (the call's dtype) to the scaled, soft-capped scores
before the mask and the softmax, as ``sm90_fwd``'s do.  It reads it through ``bias_ptr`` and the
element strides ``bias_stride_b``, ``bias_stride_h``, ``bias_stride_m`` (0 for a dim the bias
broadcasts; all multiples of 8, keys contiguous), a tile of block_m rows x block_n keys per key
block, by cp.async with the block's K tile into a ring of its own: ceil(stages / 2) tiles beside Q
and the K/V ring, within the same 80 KB (so a bias tile may take a shallower ring than its plain
twin).  It is compiled in: the plain instances carry no bias ring.  No packed batches.

A ``dropout`` instance drops elements of P after the softmax (the lse and the normalisation are of
the whole P) and scales O by ``dropout_scale`` = 1 / (1 - p), keeping exactly the elements
``sm90_fwd``'s dropout instances keep: the rule of ``flashgen/csrc/flashgen/dropout.h``
(``runtime/dropout.py``), through the same ``dropout_*`` fields at the end of ``Params``.  Each has
a backward twin in ``sm80_bwd`` (same dtype and tier).  Compiled in: the plain instances carry no
Philox code.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.spec.core import DTYPES, Constant, Field, KernelSpec, Rule, cpp_bool, normalize_target, target_cc
from flashgen.spec.contract import DROPOUT_FIELDS, FORWARD_OUTPUT_FIELDS, FORWARD_SHAPE_FIELDS

KB = 1024
# Shared memory a CTA may use so that two fit an A100 SM (164 KB) or an H100 SM (228 KB)
# and one fits the 99 KB an sm86/sm89 block may opt into.
CTA_SHARED_BUDGET = 80 * KB
MAX_RING_SLOTS = 4


def shared_bytes(max_k: int, block_m: int, block_n: int, stages: int, bias: bool = False) -> int:
    """FwdKernel::kSharedBytes: the Q tile, the ring of K/V tiles and, with a bias, its ring of
    ceil(stages / 2) tiles of block_m x block_n (a block's bias lands with its K tile), 16-bit elements."""
    bias_slots = (stages + 1) // 2 if bias else 0
    return 2 * max_k * (block_m + stages * block_n) + 2 * block_m * block_n * bias_slots


def fits_budget(max_k: int, block_m: int, block_n: int, stages: int, bias: bool = False) -> bool:
    """Whether the tile stays within ``CTA_SHARED_BUDGET``: two CTAs an A100/H100 SM, one within 99 KB."""
    return shared_bytes(max_k, block_m, block_n, stages, bias) <= CTA_SHARED_BUDGET


def ring_slots(max_k: int, block_m: int, block_n: int, bias: bool = False) -> int:
    """The ring's slots: as many K/V tiles as fit beside the Q tile (and a bias instance's bias
    tiles) in ``CTA_SHARED_BUDGET``, at most ``MAX_RING_SLOTS`` (a load then has two blocks' work
    to land in; deeper rings are unmeasured) and at least 2 (one K and one V tile)."""
    fitting = [s for s in range(2, MAX_RING_SLOTS + 1) if fits_budget(max_k, block_m, block_n, s, bias)]
    return max(fitting, default=2)


@dataclass(frozen=True)
class Sm80Fwd(KernelSpec):
    arch: str
    dtype: str
    max_k: int    # head-dim tier; smaller head dims (multiples of 8) read zeros past theirs
    block_m: int  # query rows per CTA: 32 per warp (two 16-row MMA tiles), or 16 past head dim 128
    block_n: int  # keys per K/V tile
    stages: int   # ring slots, each one K or one V tile
    bias: bool    # an additive attention bias compiled in (FwdKernel::kBias)
    dropout: bool  # Philox dropout of P compiled in (FwdKernel::kDropout)

    FAMILY = "sm80_fwd"
    DIRECTION = "fwd"
    TEMPLATE = "sm80_fwd.cu.j2"
    HEADER = "flashgen/sm80_fwd.h"
    KERNEL = "flashgen::sm80::FwdKernel"
    FLAGS = ("bias", "dropout")  # boolean axes: named in the instance name when set, template parameters in this order
    BUILD_GROUP = ("arch",)  # one compile job a target: the kernels share most CuTe instantiations (see graph.py)
    AXES = {
        "arch": ("sm80",),
        "dtype": ("f16", "bf16"),
        "max_k": (64, 128, 192, 256),
        "block_m": (64, 128),
        "block_n": (32, 64, 128),
        "stages": (2, 3, 4),
        "bias": (False, True),
        "dropout": (False, True),
    }
    TUNED_AXES = ("max_k", "block_m", "block_n", "stages")
    # One tile per head-dim tier keeps the family's share of the default sm80 build small on two
    # cores (the whole set has a 6-minute budget); every tile fits 80 KB, so each tier has one
    # that sm86/sm89's 99 KB holds.
    RULES = (
        Rule("128-key tiles only for the plain head-dim-64 instance: S is 128 accumulators a thread; beside O's "
             "128 (head dim 128), a bias ring or Philox state, more than its 56 (sm_90) to 84 (sm_80) bytes spill",
             lambda k: k.block_n == 128 and (k.max_k > 64 or k.bias or k.dropout)),
        Rule("the plain head-dim-64 instance takes 128 keys: half the barriers and row-max updates a key that 64 "
             "do; 3-5% faster causal up to 4k tokens (H200, BENCHMARKS.md, session 23)",
             lambda k: k.max_k == 64 and not (k.bias or k.dropout) and k.block_n != 128),
        Rule("128 query rows up to head dim 128: past it O alone (head dim accumulators a thread at 32 rows a "
             "warp) leaves S and the operands too few registers",
             lambda k: k.block_m == 128 and k.max_k > 128),
        Rule("64 query rows only past head dim 128 (and for a bias at 128): 128 rows share each K and V tile "
             "among twice the queries",
             lambda k: k.block_m == 64 and k.max_k <= 128 and not (k.bias and k.max_k == 128)),
        Rule("bias on tiers 64 and 128 only, as sm90_fwd: each instance is a build job of the sm80 set's 6-minute "
             "budget (192 and 256 compile without spills); larger head dims with a bias stay on example 41",
             lambda k: k.bias and k.max_k > 128),
        Rule("a bias at head dim 128 takes 64 query rows: beside its ring 128 rows leave two K/V slots, whose loop "
             "spills (56 bytes on sm_80; 120 without a bias); 64 rows take three in 217 registers",
             lambda k: k.bias and k.max_k == 128 and k.block_m == 128),
        Rule("32-key tiles only where two 64-key slots do not fit beside Q in 80 KB (head dim 256): they "
             "halve the keys per barrier",
             lambda k: k.block_n == 32 and fits_budget(k.max_k, k.block_m, 64, 2)),
        Rule("one ring depth per tile: as many K/V slots as fit beside Q (and a bias ring) in 80 KB (two CTAs "
             "on an A100 or H100 SM, one within sm86/sm89's 99 KB), 2 to 4",
             lambda k: k.stages != ring_slots(k.max_k, k.block_m, k.block_n, k.bias)),
        Rule("the tile within 80 KB: two CTAs on an A100 or H100 SM, one within sm86/sm89's 99 KB",
             lambda k: not fits_budget(k.max_k, k.block_m, k.block_n, k.stages, k.bias)),
        Rule("dropout on tiers 64 and 128, as the sm90 pair and the backward's twins: each instance is a job of "
             "the default build's budget; such calls stay on example 41",
             lambda k: k.dropout and k.max_k > 128),
        Rule("bias and dropout not built together: each instance is a job of the default build's budget; such "
             "calls stay on example 41", lambda k: k.bias and k.dropout),
    )

    def runs_on(self, target: str) -> bool:
        """Plain targets from sm80 on (sm80 SASS covers 8.0-8.9, a plain sm90 build Hopper); not
        sm90a, where sm90_fwd serves every call this family could."""
        return not normalize_target(target).endswith("a") and 80 <= target_cc(target) < 130

    @property
    def name(self) -> str:
        flags = [flag for flag in self.FLAGS if getattr(self, flag)]
        return "_".join([self.FAMILY, self.dtype, f"k{self.max_k}", f"q{self.block_m}x{self.block_n}",
                         f"s{self.stages}", *flags, self.arch])

    @property
    def priority(self) -> tuple:
        # the smallest head-dim tier that fits, then the larger tile (tuning tables pick per bucket)
        return (tuple(DTYPES).index(self.dtype), self.bias, self.dropout, self.max_k, -self.block_m, -self.block_n,
                -self.stages)

    @property
    def cpp_type(self) -> str:
        flags = "".join(f", {cpp_bool(getattr(self, flag))}" for flag in self.FLAGS)
        return f"{self.KERNEL}<{DTYPES[self.dtype]}, {self.max_k}, {self.block_m}, {self.block_n}, {self.stages}{flags}>"

    # `flashgen::sm80::FwdParams`
    ABI = (
        Field("q_ptr", "ptr"),
        Field("k_ptr", "ptr"),
        Field("v_ptr", "ptr"),
        Field("out_ptr", "ptr"),
        Field("lse_ptr", "ptr"),
        Field("seqstart_q", "ptr"),
        Field("seqstart_k", "ptr"),
        Field("q_stride_b", "i64"),
        Field("k_stride_b", "i64"),
        Field("v_stride_b", "i64"),
        Field("out_stride_b", "i64"),
        Field("q_stride_m", "i32"),
        Field("q_stride_h", "i32"),
        Field("k_stride_m", "i32"),
        Field("k_stride_h", "i32"),
        Field("v_stride_m", "i32"),
        Field("v_stride_h", "i32"),
        *FORWARD_OUTPUT_FIELDS,
        *FORWARD_SHAPE_FIELDS,
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
        Constant("stages", "Kernel::kStages"),
        Constant("alignment", "16 / sizeof(Kernel::Element)"),
        Constant("params_bytes", "sizeof(flashgen::sm80::FwdParams)"),
    )
