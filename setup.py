"""The native engine's compiled kernels (service/engine/kernels/csrc/*.c); everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the kernels fall back to numba
(service/engine/kernels/backend.py chooses; BACKEND.name says which matmuls run). No -march flags: the AVX-512
and AVX2/FMA/F16C code is compiled with target attributes and chosen at run time by a CPU check, so one binary
runs on any x86-64 CPU (portable C where AVX2 is missing).
"""

from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("service/engine/kernels/csrc")
# -fvisibility=hidden: calls between the files are direct calls inside the module (only PyInit is exported)
FLAGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "service.engine.kernels._kernels",
            sources=sorted(str(p) for p in CSRC.glob("*.c")),
            depends=sorted(str(p) for p in CSRC.glob("*.h")),
            extra_compile_args=FLAGS,
            extra_link_args=["-pthread", "-lm"],
            optional=True,
        )
    ],
)
