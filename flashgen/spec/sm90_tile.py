"""What flashgen's two Hopper families (``sm90_fwd``, ``sm90_bwd``) share: the same template
parameters, the same naming, and machine code for ``sm_90a`` only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flashgen.spec import score_mods
from flashgen.spec.core import DTYPES, Constant, Field, KernelSpec, Rule, cpp_bool, normalize_target

# The pointers of a flashgen.block_mask's arrays that a sparse instance of either family reads, in the
# order both Params structs hold them (sm90_fwd's lists per query block, sm90_bwd's per key block)
SPARSE_POINTER_FIELDS = tuple(Field(name, "ptr") for name in (
    "sparse_partial_counts", "sparse_partial_blocks", "sparse_full_counts", "sparse_full_blocks", "sparse_tiles",
    "sparse_bits"))
# A score mod's captured tensors (spec/score_mods.py), the last fields of both Params structs: pointer
# and element strides of each, in the declaration's order (flashgen::sm90::kModTensors, kModDims)
MOD_FIELDS = tuple(Field(f"mod_ptr[{i}]", "ptr") for i in range(score_mods.MAX_TENSORS)) + tuple(
    Field(f"mod_stride[{i}][{d}]", "i64") for i in range(score_mods.MAX_TENSORS) for d in range(score_mods.MAX_DIMS))
# The score_mod axis: none, or the default set's built-ins (a mods file adds others: score_mods.kernels_with)
SCORE_MOD_AXIS = ("",) + score_mods.DEFAULT_SCORE_MODS


def score_mod_rules(tiers_reason: str) -> tuple:
    """The rules both Hopper families prune score-mod instances by: head-dim tiers 64 and 128, and
    none of the other compiled-in options (each a build job per mod, and registers beside the mod's)."""
    return (
        Rule(tiers_reason, lambda k: k.score_mod and k.max_k not in (64, 128)),
        Rule("score mods without bias: a bias is a score mod of its own (add it in the mod's expression)",
             lambda k: k.score_mod and k.bias),
        Rule("score mods without block-mask lists: a mod's calls with a block mask are refused",
             lambda k: k.score_mod and k.sparse),
        Rule("score mods without dropout: a mod's calls with dropout are refused",
             lambda k: k.score_mod and k.dropout),
    )

@dataclass(frozen=True)
class Sm90Tile(KernelSpec):
    arch: str
    dtype: str
    max_k: int    # head-dim tier; smaller head dims (multiples of 8) read zeros past theirs
    block_m: int  # query rows per CTA (forward) or per step (backward)
    block_n: int  # key rows per step (forward) or per CTA (backward)
    stages: int   # depth of the TMA ring
    band: bool    # keys limited to a band around the diagonal: causal masks, sliding windows

    # each family declares ``score_mod`` as its last axis: the name of a score mod compiled in ("": none)

    KERNEL: ClassVar[str]  # the C++ class template, e.g. flashgen::sm90::FwdKernel
    # boolean axes, in the order of the template's last arguments; a true one is spelled in the name
    FLAGS: ClassVar[tuple] = ("band",)
    TUNED_AXES = ("max_k", "block_m", "block_n", "stages")  # max_k too: a tile of another tier is another kernel

    def runs_on(self, target: str) -> bool:
        """Only the arch-specific sm_90a target has wgmma; plain sm90 (and PTX) builds skip it."""
        return normalize_target(target) == "sm90a"

    @property
    def name(self) -> str:
        parts = [self.FAMILY, self.dtype, f"k{self.max_k}", f"q{self.block_m}x{self.block_n}", f"s{self.stages}"]
        parts += [flag for flag in self.FLAGS if getattr(self, flag)]
        parts += [f"mod_{self.score_mod}"] if self.score_mod else []
        return "_".join(parts + [self.arch])

    @property
    def cpp_type(self) -> str:
        flags = "".join(f", {cpp_bool(getattr(self, flag))}" for flag in self.FLAGS)
        return (f"{self.KERNEL}<{DTYPES[self.dtype]}, {self.max_k}, {self.block_m}, {self.block_n}, {self.stages}"
                f"{flags}, {score_mods.cpp_type(self.score_mod)}>")

    @property
    def score_mod_functor(self) -> str:
        """The C++ of the score mod's functor, which the source defines before the kernel type ("": none)."""
        return score_mods.functor(self.score_mod)


def tile_constants(params: str) -> tuple:
    """The compile-time constants both Hopper families' runtimes read back from the cubin:
    launch shape, tile, TMA box and swizzle, and the size of ``params`` (the Params struct)."""
    return (
        Constant("threads_per_block", "Kernel::kThreads"),
        Constant("min_blocks_per_sm", "Kernel::kMinBlocksPerSm"),
        Constant("shared_memory_bytes", "Kernel::kSharedBytes"),
        Constant("block_m", "Kernel::kBlockM"),
        Constant("block_n", "Kernel::kBlockN"),
        Constant("max_k", "Kernel::kHeadDim"),
        Constant("stages", "Kernel::kStages"),
        Constant("box_cols", "Kernel::kBoxCols"),
        Constant("swizzle_bytes", "Kernel::kSwizzleBytes"),
        Constant("alignment", "16 / sizeof(Kernel::Element)"),
        Constant("params_bytes", f"sizeof({params})"),
    )
