"""The build of IMerge's C data plane (everything else is in pyproject.toml).

``imerge.core._native`` is optional: where no C compiler is found, or the build fails, ``pip install`` still
succeeds, and IMerge moves its bytes in Python (:mod:`imerge.core.native` logs it once).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "imerge.core._native", ["src/imerge/core/_native.c"], optional=True,
    # one rounding per float operation, as torch's kernels round: no contraction into fused multiply-adds
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c11"],
)])
