"""flashgen: ahead-of-time built fused attention kernels, shipped as cubins.

The package follows the pipeline: ``spec`` (kernel families, declared once) ->
``generator`` (one .cu per instance) -> ``build`` (ninja + nvcc -> cubins and a
manifest) -> ``runtime`` (select and launch).  Importing it touches neither the
GPU nor the compiler.
"""

__version__ = "0.1.0"

from flashgen.errors import UnsupportedError  # noqa: E402

_RUNTIME = ("attention_forward", "attention_backward", "explain", "block_mask", "BlockMask", "packed_offsets",
            "PackedOffsets", "set_kernel_path", "use_tuning_table")


def __getattr__(name):
    # The runtime imports CuPy; keep `import flashgen` (and the build CLI) free of it.
    if name in _RUNTIME:
        from flashgen import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")


__all__ = ["UnsupportedError", *_RUNTIME]
