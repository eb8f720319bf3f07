"""The kernels' one choice (service/engine/kernels/backend.py): the extension loaded is the kernels package's own
build, and the two environment switches pick the implementations they document, in a fresh interpreter each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import service.engine.kernels
from service.engine.kernels.backend import BACKEND

ROOT = Path(__file__).resolve().parent.parent


def test_the_extension_is_the_kernels_package_build() -> None:
    """An in-place build elsewhere (the old service/engine/quant/) must never be the one that runs."""
    if BACKEND.ext is None:
        pytest.skip("the compiled kernels extension is not built")
    assert BACKEND.ext.__name__ == "service.engine.kernels._kernels"
    assert Path(BACKEND.ext.__file__).parent == Path(service.engine.kernels.__file__).parent


def _choice(**env: str) -> str:
    code = (
        "from service.engine.kernels.backend import BACKEND as B; print(B.name, B.matmul_fallback, B.decode_attention)"
    )
    skip = ("LLM_QUANT_KERNELS", "QUANT_KERNELS_GENERIC", "QUANT_KERNELS_ISA")
    environ = {k: v for k, v in os.environ.items() if k not in skip}
    out = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)  # fmt: skip
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LLM_QUANT_KERNELS": "numba"}, "numba numba numba"),
        ({"LLM_QUANT_KERNELS": "numpy"}, "numpy numpy numba"),  # decode attention keeps numba
        ({"QUANT_KERNELS_GENERIC": "1"}, "c-generic numba c"),
        ({"QUANT_KERNELS_ISA": "generic"}, "c-generic numba c"),
        ({"QUANT_KERNELS_ISA": "avx2"}, "c-avx2 numba c"),
        ({"QUANT_KERNELS_ISA": "avx512"}, "c-avx512 numba c"),
    ],
    ids=["numba", "numpy", "generic", "isa-generic", "isa-avx2", "isa-avx512"],
)
def test_environment_switches(env: dict[str, str], expected: str) -> None:
    if BACKEND.numba is None:
        pytest.skip("numba is not installed")
    if ("QUANT_KERNELS_GENERIC" in env or "QUANT_KERNELS_ISA" in env) and BACKEND.ext is None:
        pytest.skip("the compiled kernels extension is not built")
    isa = env.get("QUANT_KERNELS_ISA", "generic")
    if isa not in BACKEND.ext.isas():
        pytest.skip(f"this CPU does not run {isa}")
    assert _choice(**env) == expected


def test_an_isa_the_cpu_lacks_is_refused_by_name() -> None:
    if BACKEND.ext is None:
        pytest.skip("the compiled kernels extension is not built")
    with pytest.raises(ValueError, match="isa must be"):
        BACKEND.ext.force_isa("sse9")
    assert BACKEND.ext.isa() == BACKEND.ext.isas()[0]  # unchanged: the CPU's best
