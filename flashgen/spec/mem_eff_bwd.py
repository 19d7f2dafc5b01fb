"""``mem_eff_bwd``: the backward ``AttentionBackwardKernel`` of CUTLASS example 41.

Template: ``AttentionBackwardKernel<ArchTag, scalar_t, kIsAligned,
kApplyDropout, kPreload, kBlockSizeI, kBlockSizeJ, kMaxK,
kKeysQueriesAlignedToBlockSize>`` from ``kernel_backward.h``.  Launch: block
(threads, 1, 1), grid (num_splits_key, heads, batch), dynamic shared memory
``sizeof(SharedStorage)``; f16/bf16 kernels compute delta = rowsum(dO * O)
themselves into a [B, H, M] float buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.spec.core import DTYPES, Constant, Field, KernelSpec, Rule, cpp_bool
from flashgen.spec.mem_eff_fwd import left_to_sm80_families


def _half(k) -> bool:
    return k.dtype != "f32"


@dataclass(frozen=True)
class MemEffBwd(KernelSpec):
    arch: str
    dtype: str
    aligned: bool
    dropout: bool
    preload: bool
    block_i: int
    block_j: int
    max_k: int
    block_aligned: bool

    FAMILY = "mem_eff_bwd"
    DIRECTION = "bwd"
    TEMPLATE = "mem_eff.cu.j2"
    HEADER = "kernel_backward.h"
    AXES = {
        "arch": ("sm75", "sm80"),  # Turing and Ampere code, which later GPUs run too
        "dtype": tuple(DTYPES),
        "aligned": (True, False),
        "dropout": (False, True),
        "preload": (False, True),
        "block_i": (64, 128),
        "block_j": (64, 128),
        "max_k": (32, 64, 96, 128, 65536),
        "block_aligned": (False, True),
    }
    # The tile and pipeline a tuning table may choose per shape bucket; the other axes follow from the call.
    TUNED_AXES = ("block_i", "block_j", "max_k", "preload")
    RULES = (
        Rule("CUTLASS has no bf16 tensor-core MMA before sm80",
             lambda k: k.dtype == "bf16" and k.arch == "sm75"),
        Rule("the template's static_assert: preload needs f16/bf16, sm80 and dK/dV in registers (kMaxK <= block I)",
             lambda k: k.preload and not (_half(k) and k.arch == "sm80" and k.max_k <= k.block_i)),
        Rule("block-aligned variants (no bounds checks; the runtime uses them only when M % I == N % J == 0 "
             "without cu_seqlens) only for the training fast path: aligned f16/bf16 sm80 preload kernels, no dropout",
             lambda k: k.block_aligned and not (k.aligned and k.preload and not k.dropout)),
        Rule("misaligned inputs get one catch-all kernel (64x64, kMaxK 65536): a correctness fallback, not a fast path",
             lambda k: not k.aligned and (k.block_i, k.block_j, k.max_k) != (64, 64, 65536)),
        Rule("sm75 allows 64 KB of shared memory per block: 64x64 is the tile that fits every dtype",
             lambda k: k.arch == "sm75" and (k.block_i, k.block_j) != (64, 64)),
        Rule("a 64x128 tile costs the shared memory of 128x64 but cannot keep dK/dV of larger heads in registers",
             lambda k: (k.block_i, k.block_j) == (64, 128)),
        Rule("f32 never keeps dK/dV in registers whatever the tile: one 64x64 kernel for kMaxK 64 and one for 65536",
             lambda k: k.dtype == "f32" and ((k.block_i, k.block_j) != (64, 64) or k.max_k not in (64, 65536))),
        Rule("kMaxK 65536 accumulates dK/dV in the workspace: 64x64 keeps shared memory and workspace smallest",
             lambda k: k.max_k == 65536 and (k.block_i, k.block_j) != (64, 64)),
        Rule("where dK/dV fit in registers on sm80 (f16/bf16), preloading the next MMA is faster and still fits",
             lambda k: _half(k) and k.arch == "sm80" and k.max_k <= k.block_i and not k.preload),
        Rule("kMaxK 32 only pays off with preload (sm80 f16/bf16); elsewhere the kMaxK 64 kernel covers it",
             lambda k: k.max_k == 32 and not k.preload),
        Rule("f16/bf16 with kMaxK <= 64: 64-row blocks already keep dK/dV in registers; 128 rows only add shared memory",
             lambda k: _half(k) and k.max_k <= 64 and k.block_i == 128),
        Rule("f16/bf16 with 64 < kMaxK <= 128 use 128-row blocks so that dK/dV stay in registers",
             lambda k: _half(k) and 64 < k.max_k <= 128 and k.block_i == 64),
        Rule("128x128 needs ~160 KB of shared memory (sm80/sm87/sm9x): kept only for kMaxK 128, "
             "with 128x64 as the sm86/sm89/sm12x fallback and the kMaxK 96 tile",
             lambda k: (k.block_i, k.block_j) == (128, 128) and k.max_k != 128),
    )

    def runs_on(self, target: str) -> bool:
        return super().runs_on(target) and not left_to_sm80_families(self, target)

    @property
    def name(self) -> str:
        parts = [self.FAMILY, self.dtype, "aligned" if self.aligned else "unaligned",
                 f"b{self.block_i}x{self.block_j}", f"k{self.max_k}"]
        parts += ["preload"] if self.preload else []
        parts += ["dropout"] if self.dropout else []
        parts += ["blockaligned"] if self.block_aligned else []
        return "_".join(parts + [self.arch])

    @property
    def priority(self) -> tuple:
        # Within one dtype and arch: block-aligned specialisations first (when
        # they apply), aligned before unaligned, no dropout before dropout, the
        # smallest kMaxK that fits, then the larger tile (the runtime skips a
        # tile whose shared memory exceeds the device's limit), preload first.
        return (tuple(DTYPES).index(self.dtype), -self.cc_range[0], not self.block_aligned,
                not self.aligned, self.dropout, self.max_k, -self.block_i, -self.block_j,
                not self.preload)

    @property
    def cpp_type(self) -> str:
        return (f"AttentionBackwardKernel<cutlass::arch::{self.arch.capitalize()}, {DTYPES[self.dtype]}, "
                f"{cpp_bool(self.aligned)}, {cpp_bool(self.dropout)}, {cpp_bool(self.preload)}, "
                f"{self.block_i}, {self.block_j}, "
                f"{self.max_k}, {cpp_bool(self.block_aligned)}>")

    # `AttentionBackwardKernel::Params` (kernel_backward.h, built with
    # HAS_PYTORCH so that the Philox seed and offset travel in `rng_engine_inputs`).
    ABI = (
        Field("query_ptr", "ptr"),
        Field("key_ptr", "ptr"),
        Field("value_ptr", "ptr"),
        Field("bias_ptr", "ptr"),
        Field("logsumexp_ptr", "ptr"),
        Field("output_ptr", "ptr"),
        Field("grad_output_ptr", "ptr"),
        Field("delta_ptr", "ptr"),
        Field("cu_seqlens_q_ptr", "ptr"),
        Field("cu_seqlens_k_ptr", "ptr"),
        Field("grad_query_ptr", "ptr"),
        Field("grad_key_ptr", "ptr"),
        Field("grad_value_ptr", "ptr"),
        Field("grad_bias_ptr", "ptr"),
        Field("workspace", "ptr"),
        Field("workspace_gv", "ptr"),
        Field("workspace_gq", "ptr"),
        Field("scale", "f32"),
        Field("head_dim", "i32"),
        Field("head_dim_value", "i32"),
        Field("num_queries", "i32"),
        Field("num_keys", "i32"),
        Field("num_heads", "i32"),
        Field("custom_mask_type", "u8"),
        Field("q_strideM", "i32"),
        Field("k_strideM", "i32"),
        Field("v_strideM", "i32"),
        Field("bias_strideM", "i32"),
        Field("gO_strideM", "i32"),
        Field("gB_strideM", "i32"),
        Field("gQKV_strideM_multiplier", "i8"),
        Field("rng_engine_inputs.seed", "u64"),
        Field("rng_engine_inputs.offset", "u64"),
        Field("dropout_batch_head_rng_offset", "u64"),
        Field("dropout_prob", "f32"),
        Field("o_strideH", "i64"),
        Field("q_strideH", "i32"),
        Field("k_strideH", "i32"),
        Field("v_strideH", "i32"),
        Field("bias_strideH", "i64"),
        Field("o_strideB", "i64"),
        Field("q_strideB", "i64"),
        Field("k_strideB", "i64"),
        Field("v_strideB", "i64"),
        Field("bias_strideB", "i64"),
        Field("lse_strideB", "i64"),
        Field("lse_strideH", "i64"),
        Field("delta_strideB", "i64"),
        Field("delta_strideH", "i64"),
        Field("num_batches", "i32"),
        Field("num_splits_key", "i16"),
        Field("gO_strideB", "i64"),
        Field("gQ_strideB", "i64"),
        Field("gK_strideB", "i64"),
        Field("gV_strideB", "i64"),
        Field("gB_strideB", "i64"),
        Field("gO_strideH", "i64"),
        Field("gQ_strideH", "i64"),
        Field("gK_strideH", "i64"),
        Field("gV_strideH", "i64"),
        Field("gB_strideH", "i64"),
    )

    CONSTANTS = (
        Constant("threads_per_block", "Kernel::kNumThreads"),
        Constant("min_blocks_per_sm", "Kernel::kMinBlocksPerSm"),
        Constant("block_i", "Kernel::kBlockSizeI"),
        Constant("block_j", "Kernel::kBlockSizeJ"),
        Constant("max_k", "Kernel::kMaxK"),
        Constant("shared_memory_bytes", "sizeof(Kernel::SharedStorage)"),
        Constant("optimal_alignment", "Kernel::kOptimalAlignement"),
        Constant("minimum_alignment", "Kernel::kMinimumAlignment"),
        Constant("output_in_registers", "Kernel::kOutputInRF"),
        Constant("kernel_computes_delta", "Kernel::kKernelComputesDelta"),
        Constant("enable_split_keys", "Kernel::kEnableSplitKeys"),
        Constant("needs_accum_grad_q", "Kernel::kNeedsAccumGradQ"),
        Constant("needs_accum_grad_k", "Kernel::kNeedsAccumGradK"),
        Constant("needs_accum_grad_v", "Kernel::kNeedsAccumGradV"),
        Constant("grad_q_temp_storage_bytes", "sizeof(Kernel::GradQTempStorage)"),
        Constant("grad_q_block_n", "Kernel::MatmulGradQ::ThreadblockShape::kN"),
        Constant("apply_dropout", "Kernel::kApplyDropout"),
        Constant("params_bytes", "sizeof(Kernel::Params)"),
    )
