"""Compile instances into cubins with ninja and nvcc, and describe them in a manifest."""
