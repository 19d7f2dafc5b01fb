"""``mem_eff_fwd``: the forward ``AttentionKernel`` of CUTLASS example 41.

Template: ``AttentionKernel<scalar_t, ArchTag, isAligned, kQueriesPerBlock,
kKeysPerBlock, kMaxK, kSupportsDropout, kSupportsBias>`` from
``kernel_forward.h``.  Launch: block (32, warps, 1), grid
(ceil(M / queries_per_block), heads, batch), dynamic shared memory
``sizeof(SharedStorage)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.spec.core import DTYPES, Constant, Field, KernelSpec, Rule, cpp_bool, normalize_target, target_cc

_TILES = ((64, 64), (32, 128))


def left_to_sm80_families(kernel: KernelSpec, target: str) -> bool:
    """Whether ``target`` (a plain one from sm80 on, where sm80_fwd/sm80_bwd take the aligned f16/bf16
    calls they can) leaves this example-41 kernel nothing worth a build job: f16/bf16 below kMaxK
    65536.  What the sm80 pair does not take -- bias with dropout, bias or dropout past head dim 128,
    a bias with packed batches, misaligned inputs -- runs on the kMaxK 65536 kernels, and the default
    sm80 set builds within its 6 minutes on two cores."""
    plain = not normalize_target(target).endswith("a")
    return plain and target_cc(target) >= 80 and kernel.dtype != "f32" and kernel.max_k < 65536


@dataclass(frozen=True)
class MemEffFwd(KernelSpec):
    arch: str
    dtype: str
    aligned: bool
    queries_per_block: int
    keys_per_block: int
    max_k: int
    dropout: bool
    bias: bool

    FAMILY = "mem_eff_fwd"
    DIRECTION = "fwd"
    TEMPLATE = "mem_eff.cu.j2"
    HEADER = "kernel_forward.h"
    AXES = {
        "arch": ("sm75", "sm80"),  # Turing and Ampere code, which later GPUs run too
        "dtype": tuple(DTYPES),
        "aligned": (True, False),
        "queries_per_block": (32, 64, 128),
        "keys_per_block": (64, 128),
        "max_k": (32, 64, 96, 128, 65536),
        "dropout": (False, True),
        "bias": (False, True),
    }
    # The tile a tuning table may choose per shape bucket; the other axes follow from the call.
    TUNED_AXES = ("queries_per_block", "keys_per_block", "max_k")
    RULES = (
        Rule("CUTLASS has no bf16 tensor-core MMA before sm80",
             lambda k: k.dtype == "bf16" and k.arch == "sm75"),
        Rule("bias is a run-time null-pointer branch; a no-bias copy would double the set for nothing",
             lambda k: not k.bias),
        Rule("only the 64x64 and 32x128 tiles are kept: the wider ones spend occupancy without a measured win",
             lambda k: (k.queries_per_block, k.keys_per_block) not in _TILES),
        Rule("the code depends on kMaxK only through kMaxK <= keys per block, so tiers 32 and 96 duplicate 64 and 128",
             lambda k: k.max_k in (32, 96)),
        Rule("64x64 is the small-head tile: beyond kMaxK 64 its output no longer stays in registers",
             lambda k: k.keys_per_block == 64 and k.max_k > 64),
        Rule("32x128 is the large-head tile: for kMaxK <= 64, 64x64 keeps twice the queries per block",
             lambda k: k.keys_per_block == 128 and k.max_k <= 64),
        Rule("misaligned inputs get one catch-all kernel (32x128, kMaxK 65536): a correctness fallback, not a fast path",
             lambda k: not k.aligned and k.max_k != 65536),
    )

    def runs_on(self, target: str) -> bool:
        return super().runs_on(target) and not left_to_sm80_families(self, target)

    @property
    def name(self) -> str:
        parts = [self.FAMILY, self.dtype, "aligned" if self.aligned else "unaligned",
                 f"q{self.queries_per_block}x{self.keys_per_block}", f"k{self.max_k}"]
        parts += ["dropout"] if self.dropout else []
        parts += ["bias"] if self.bias else []
        return "_".join(parts + [self.arch])

    @property
    def priority(self) -> tuple:
        # Within one dtype and arch: aligned before unaligned, kernels without
        # dropout support before those with it, the smallest kMaxK that fits,
        # then the larger query tile.
        return (tuple(DTYPES).index(self.dtype), -self.cc_range[0], not self.aligned, self.dropout,
                self.max_k, -self.queries_per_block, -self.keys_per_block, not self.bias)

    @property
    def cpp_type(self) -> str:
        return (f"AttentionKernel<{DTYPES[self.dtype]}, cutlass::arch::{self.arch.capitalize()}, "
                f"{cpp_bool(self.aligned)}, {self.queries_per_block}, {self.keys_per_block}, {self.max_k}, "
                f"{cpp_bool(self.dropout)}, {cpp_bool(self.bias)}>")

    # `AttentionKernel::Params` (kernel_forward.h, built with HAS_PYTORCH so that
    # the Philox seed and offset travel in `rng_engine_inputs`).
    ABI = (
        Field("query_ptr", "ptr"),
        Field("key_ptr", "ptr"),
        Field("value_ptr", "ptr"),
        Field("attn_bias_ptr", "ptr"),
        Field("seqstart_q_ptr", "ptr"),
        Field("seqstart_k_ptr", "ptr"),
        Field("seqlen_k_ptr", "ptr"),
        Field("causal_diagonal_offset", "u32"),
        Field("output_ptr", "ptr"),
        Field("output_accum_ptr", "ptr"),
        Field("logsumexp_ptr", "ptr"),
        Field("scale", "f32"),
        Field("head_dim", "i32"),
        Field("head_dim_value", "i32"),
        Field("num_queries", "i32"),
        Field("num_keys", "i32"),
        Field("num_keys_absolute", "i32"),
        Field("custom_mask_type", "u8"),
        Field("q_strideM", "i32"),
        Field("k_strideM", "i32"),
        Field("v_strideM", "i32"),
        Field("bias_strideM", "i32"),
        Field("o_strideM", "i32"),
        Field("q_strideH", "i32"),
        Field("k_strideH", "i32"),
        Field("v_strideH", "i32"),
        Field("bias_strideH", "i64"),
        Field("q_strideB", "i64"),
        Field("k_strideB", "i64"),
        Field("v_strideB", "i64"),
        Field("bias_strideB", "i64"),
        Field("num_batches", "i32"),
        Field("num_heads", "i32"),
        Field("use_dropout", "bool"),
        Field("dropout_batch_head_rng_offset", "u64"),
        Field("dropout_prob", "f32"),
        Field("rng_engine_inputs.seed", "u64"),
        Field("rng_engine_inputs.offset", "u64"),
    )

    CONSTANTS = (
        Constant("threads_per_block", "Kernel::kNumThreads"),
        Constant("warps_per_block", "Kernel::kNumWarpsPerBlock"),
        Constant("min_blocks_per_sm", "Kernel::kMinBlocksPerSm"),
        Constant("queries_per_block", "Kernel::kQueriesPerBlock"),
        Constant("keys_per_block", "Kernel::kKeysPerBlock"),
        Constant("max_k", "Kernel::kMaxK"),
        Constant("shared_memory_bytes", "sizeof(Kernel::SharedStorage)"),
        Constant("alignment_q", "Kernel::kAlignmentQ"),
        Constant("alignment_k", "Kernel::kAlignmentK"),
        Constant("alignment_v", "Kernel::kAlignmentV"),
        Constant("lse_row_alignment", "Kernel::kAlignLSE"),
        Constant("needs_output_accum_buffer", "Kernel::kNeedsOutputAccumulatorBuffer"),
        Constant("supports_dropout", "Kernel::kSupportsDropout"),
        Constant("supports_bias", "Kernel::kSupportsBias"),
        Constant("params_bytes", "sizeof(Kernel::Params)"),
    )
