"""The native engine's compiled kernels (service/engine/kernels/csrc/); everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the kernels fall back to numba
(service/engine/kernels/backend.py chooses; BACKEND.name says which matmuls run). No -march flags: the
AVX2/FMA/F16C code is chosen at run time by a CPU check, so one binary runs on any x86-64 CPU (portable C where
AVX2 is missing).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "service.engine.kernels._kernels",
            sources=["service/engine/kernels/csrc/_kernels.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-Wall", "-Wno-unused-parameter"],
            extra_link_args=["-pthread", "-lm"],
            optional=True,
        )
    ],
)
