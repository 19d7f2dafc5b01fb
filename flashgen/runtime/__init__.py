"""The CuPy runtime: registry (find and load cubins) -> select -> launch."""
from flashgen.runtime.api import attention_backward, attention_forward, explain
from flashgen.runtime.block_masks import BlockMask, block_mask
from flashgen.runtime.packed import PackedOffsets, packed_offsets
from flashgen.runtime.registry import Registry, default_registry, set_kernel_path
from flashgen.runtime.tuning import use_table as use_tuning_table

__all__ = ["attention_forward", "attention_backward", "explain", "block_mask", "BlockMask", "packed_offsets",
           "PackedOffsets", "Registry", "default_registry", "set_kernel_path", "use_tuning_table"]
