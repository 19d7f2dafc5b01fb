"""flashgen: ahead-of-time built fused attention kernels, shipped as cubins.

The package follows the pipeline: ``spec`` (kernel families, declared once) ->
``generator`` (one .cu per instance) -> ``build`` (ninja + nvcc -> cubins and a
manifest) -> ``runtime`` (select and launch).  Importing it touches neither the
GPU nor the compiler.
"""

__version__ = "0.1.0"
