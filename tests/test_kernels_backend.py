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
    environ = {k: v for k, v in os.environ.items() if k not in ("LLM_QUANT_KERNELS", "QUANT_KERNELS_GENERIC")}
    out = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)  # fmt: skip
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LLM_QUANT_KERNELS": "numba"}, "numba numba numba"),
        ({"LLM_QUANT_KERNELS": "numpy"}, "numpy numpy numba"),  # decode attention keeps numba
        ({"QUANT_KERNELS_GENERIC": "1"}, "c-generic numba c"),
    ],
    ids=["numba", "numpy", "generic"],
)
def test_environment_switches(env: dict[str, str], expected: str) -> None:
    if BACKEND.numba is None:
        pytest.skip("numba is not installed")
    if "QUANT_KERNELS_GENERIC" in env and BACKEND.ext is None:
        pytest.skip("the compiled kernels extension is not built")
    assert _choice(**env) == expected
