"""The runner without the compiled kernels extension: the paged-runner and quantized-weight tests again, in a
fresh interpreter with LLM_QUANT_KERNELS=numpy (norms, RoPE, SiLU, KV writes and prefill attention in numpy,
decode attention in numba or numpy, quantized matmuls as dequantize + BLAS), so every fallback stays exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_runner_tests_pass_without_the_extension() -> None:
    env = {**os.environ, "LLM_QUANT_KERNELS": "numpy"}
    code = "from service.engine.kernels.backend import BACKEND as B; assert B.ext is None and B.name == 'numpy'"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
         "tests/test_paged_runner.py", "tests/test_quantized.py"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
