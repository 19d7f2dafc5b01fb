"""What flashgen's two Hopper families (``sm90_fwd``, ``sm90_bwd``) share: the same template
parameters, the same naming, and machine code for ``sm_90a`` only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flashgen.spec.core import DTYPES, KernelSpec, cpp_bool, normalize_target


@dataclass(frozen=True)
class Sm90Tile(KernelSpec):
    arch: str
    dtype: str
    max_k: int    # head-dim tier; smaller head dims (multiples of 8) read zeros past theirs
    block_m: int  # query rows per CTA (forward) or per step (backward)
    block_n: int  # key rows per step (forward) or per CTA (backward)
    stages: int   # depth of the TMA ring
    causal: bool

    KERNEL: ClassVar[str]  # the C++ class template, e.g. flashgen::sm90::FwdKernel
    TUNED_AXES = ("block_m", "block_n", "stages")

    def runs_on(self, target: str) -> bool:
        """Only the arch-specific sm_90a target has wgmma; plain sm90 (and PTX) builds skip it."""
        return normalize_target(target) == "sm90a"

    @property
    def name(self) -> str:
        parts = [self.FAMILY, self.dtype, f"k{self.max_k}", f"q{self.block_m}x{self.block_n}", f"s{self.stages}"]
        parts += ["causal"] if self.causal else []
        return "_".join(parts + [self.arch])

    @property
    def cpp_type(self) -> str:
        return (f"{self.KERNEL}<{DTYPES[self.dtype]}, {self.max_k}, {self.block_m}, {self.block_n}, "
                f"{self.stages}, {cpp_bool(self.causal)}>")
