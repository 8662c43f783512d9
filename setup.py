"""Builds the fused host optimizer kernel (host/l2l_host_kernel.c) as l2l_hw/_host_kernel*.so.

Everything else is in pyproject.toml. The library has no Python API of its own: the CPU
EPS loads it with ctypes (l2l_hw/eps/host_kernel.py) and passes tensors by pointer, so
neither torch nor Python headers are needed to build it.
"""
from setuptools import Extension, setup

# -ffp-contract=off: GCC contracts mul+add into FMA, even between intrinsics, unless told
# not to; the update rule is one rounding per operation on every ISA path.
# -fno-fast-math: IEEE semantics (NaN, Inf, subnormals, no reassociation).
# No -march: each ISA path carries its own target attribute and is chosen at run time.
HOST_CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
               "-fvisibility=hidden", "-pthread"]

setup(
    ext_modules=[
        Extension(
            "l2l_hw._host_kernel",
            sources=["host/l2l_host_kernel.c"],
            extra_compile_args=HOST_CFLAGS,
            extra_link_args=["-pthread"],
        )
    ]
)
