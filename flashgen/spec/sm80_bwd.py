"""``sm80_bwd``: flashgen's own Ampere-class backward (``flashgen/csrc/flashgen/sm80_bwd.h``).

Template: ``flashgen::sm80::BwdKernel<Element, kHeadDim, kBlockM, kBlockN>`` -- eight warps
with mma.sync, ldmatrix and cp.async.  One CTA per ``block_n`` keys of one (sequence, k/v
head) keeps K and V in shared memory and walks every query head of the k/v head's group and
every query block of ``block_m`` rows it meets, Q, dO, lse, delta and dS double-buffered.  Each
warp owns 16 keys of a 64-key CTA or 32 of a 128-key one, and half of each query block; dK and
dV stay in registers (at head dim 128 with 32 keys, split by columns between the two warps of
the same keys, which trade P^T and dS^T through shared memory); dQ goes into a float32
accumulator by atomics.  Each instance holds three entry points, launched in order on one
stream, with the contract of ``sm90_bwd``:

* ``<name>_prep``: grid (ceil(M / block_m), heads, batch or sequences), ``aux_threads``
  threads -- delta, the lse in log2, zeroed dQ accumulator and counters;
* ``<name>``: grid (ceil(N / block_n), k/v heads, batch or sequences), ``threads_per_block``
  threads, ``shared_memory_bytes`` of dynamic shared memory;
* ``<name>_convert``: grid as prep -- dQ from the fp32 accumulator.

The workspace is ``sm90_bwd``'s (lse_log2, delta, the dQ accumulator [.., rows_padded,
max_k] row-major, counters), so the runtime shares its layout.  Inputs are read by 16-byte
cp.async: pointers, strides and the head dim must be multiples of 8 elements; a head dim
below the tier reads zeros past its own.  Masks, soft-capping, grouped-query k/v heads and
packed batches are run-time options through the same fields as ``sm80_fwd``.  The code is
Ampere instructions only: built for plain targets from sm80 on (a plain sm90 build lets an
H100/H200 run it), not for sm90a, where ``sm90_bwd`` serves every call this one could.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.spec.core import DTYPES, Constant, Field, KernelSpec, Rule, normalize_target, target_cc

KB = 1024
SM86_SHARED = 99 * KB  # what an sm86/sm89 block may opt into; an A100 block 163 KB, a Hopper one 227 KB


def shared_bytes(max_k: int, block_m: int, block_n: int) -> int:
    """BwdKernel::kSharedBytes: K and V, double-buffered Q and dO, double-buffered dS, double-buffered
    lse and delta (tests compare it with the value the build reads back from the cubin)."""
    return 2 * (2 * block_n * max_k + 4 * block_m * max_k + 2 * block_m * block_n) + 4 * 4 * block_m


@dataclass(frozen=True)
class Sm80Bwd(KernelSpec):
    arch: str
    dtype: str
    max_k: int    # head-dim tier; smaller head dims (multiples of 8) read zeros past theirs
    block_m: int  # query rows per step
    block_n: int  # keys per CTA: 16 per warp, so 128 (8 warps x 16) or 64 (4 x 16, each query block halved)

    FAMILY = "sm80_bwd"
    DIRECTION = "bwd"
    TEMPLATE = "sm80_bwd.cu.j2"
    HEADER = "flashgen/sm80_bwd.h"
    KERNEL = "flashgen::sm80::BwdKernel"
    AXES = {
        "arch": ("sm80",),
        "dtype": ("f16", "bf16"),
        "max_k": (64, 128),
        "block_m": (32, 64, 128),
        "block_n": (64, 128),
    }
    TUNED_AXES = ("block_m", "block_n")
    RULES = (
        Rule("128-query steps: S^T and dP^T of 128 queries beside dK and dV spill at head dim 64 (104 bytes on "
             "sm_80); at 128 the tile needs 226 KB, beyond an A100 block",
             lambda k: k.block_m == 128),
        Rule("128-key CTAs take 64-query steps: 32 queries halve the work per load and barrier",
             lambda k: k.block_n == 128 and k.block_m == 32),
        Rule("64-key CTAs only where the 128-key one exceeds sm86/sm89's 99 KB (head dim 128): they read Q "
             "and dO twice as often per key",
             lambda k: k.block_n == 64 and shared_bytes(k.max_k, 64, 128) <= SM86_SHARED),
        Rule("64-key CTAs take 32-query steps: at 64 the double-buffered Q and dO (64 KB) and K, V (32 KB) "
             "exceed 99 KB at head dim 128",
             lambda k: k.block_n == 64 and k.block_m != 32),
    )

    def runs_on(self, target: str) -> bool:
        """Plain targets from sm80 on (sm80 SASS covers 8.0-8.9, a plain sm90 build Hopper); not
        sm90a, where sm90_bwd serves every call this family could."""
        return not normalize_target(target).endswith("a") and 80 <= target_cc(target) < 130

    @property
    def name(self) -> str:
        return "_".join([self.FAMILY, self.dtype, f"k{self.max_k}", f"q{self.block_m}x{self.block_n}", self.arch])

    @property
    def priority(self) -> tuple:
        # the smallest head-dim tier that fits, then the larger tile: a GPU whose blocks cannot
        # opt into its shared memory (sm86/sm89) skips it with the reason and takes the next
        return (tuple(DTYPES).index(self.dtype), self.max_k, -self.block_m * self.block_n)

    @property
    def cpp_type(self) -> str:
        return f"{self.KERNEL}<{DTYPES[self.dtype]}, {self.max_k}, {self.block_m}, {self.block_n}>"

    # `flashgen::sm80::BwdParams`
    ABI = (
        Field("q_ptr", "ptr"),
        Field("k_ptr", "ptr"),
        Field("v_ptr", "ptr"),
        Field("out_ptr", "ptr"),
        Field("dout_ptr", "ptr"),
        Field("lse_ptr", "ptr"),
        Field("lse_log2_ptr", "ptr"),
        Field("delta_ptr", "ptr"),
        Field("dq_accum_ptr", "ptr"),
        Field("dq_counter_ptr", "ptr"),
        Field("dq_ptr", "ptr"),
        Field("dk_ptr", "ptr"),
        Field("dv_ptr", "ptr"),
        Field("seqstart_q", "ptr"),
        Field("seqstart_k", "ptr"),
        Field("q_stride_b", "i64"),
        Field("k_stride_b", "i64"),
        Field("v_stride_b", "i64"),
        Field("out_stride_b", "i64"),
        Field("dout_stride_b", "i64"),
        Field("dq_stride_b", "i64"),
        Field("dkv_stride_b", "i64"),
        Field("q_stride_m", "i32"),
        Field("q_stride_h", "i32"),
        Field("k_stride_m", "i32"),
        Field("k_stride_h", "i32"),
        Field("v_stride_m", "i32"),
        Field("v_stride_h", "i32"),
        Field("out_stride_m", "i32"),
        Field("out_stride_h", "i32"),
        Field("dout_stride_m", "i32"),
        Field("dout_stride_h", "i32"),
        Field("dq_stride_m", "i32"),
        Field("dq_stride_h", "i32"),
        Field("dkv_stride_n", "i32"),
        Field("dkv_stride_h", "i32"),
        Field("lse_stride_b", "i32"),
        Field("lse_stride_h", "i32"),
        Field("num_queries", "i32"),
        Field("num_keys", "i32"),
        Field("num_heads", "i32"),
        Field("head_dim", "i32"),
        Field("head_group", "i32"),
        Field("band_lo", "i32"),
        Field("band_hi", "i32"),
        Field("band_from_end", "i32"),
        Field("rows_padded", "i32"),
        Field("deterministic", "i32"),
        Field("scale", "f32"),
        Field("scale_log2", "f32"),
        Field("softcap_in", "f32"),
        Field("softcap_out", "f32"),
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
