"""Only the wheel tag lives here; everything else is in pyproject.toml.

A flashgen wheel holds Python code and cubins: nothing depends on the Python
ABI (py3-none), but the cubins and the CuPy runtime are built and tested for
Linux, so the wheel says so (manylinux2014_<machine>: it links against no
system library at all).  A platform tag is also what cibuildwheel expects.
"""
import platform
import sys

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel


class CubinWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        plat = f"manylinux2014_{platform.machine()}" if sys.platform.startswith("linux") else super().get_tag()[2]
        return "py3", "none", plat


setup(cmdclass={"bdist_wheel": CubinWheel})
