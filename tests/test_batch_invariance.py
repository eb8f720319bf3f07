"""Batch-invariant numerics: a row's result is bitwise the same whatever else shares the step.

- The quantized matmul: each x row's output is bitwise identical alone, in any batch of up to 40 rows, on the
  direct and block-panel paths, on every kernel ISA this CPU runs (forced dispatch); the SIMD ISAs (AVX-512,
  AVX2) equal each other bitwise (one canonical order, csrc/matmul.c), the portable C path equals itself.
- The model runner on the default SmolLM2 engine: a sequence's logits alone equal its logits in a decode step of
  16 sequences of other lengths, and a token's logits as the last row of a multi-token (prefill chunk) step
  equal its logits as a one-token decode step.
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest

from build_engine.packing import PackedMatrix, dequantize_packed, pack_blocks
from service.engine.kernels import matmul as kernels
from service.engine.kernels.backend import BACKEND

ISAS = tuple(BACKEND.ext.isas()) if BACKEND.ext is not None and BACKEND.matmul == "c" else ()
ROWS = 40  # rows of x: past the direct path (8), several micro-kernel passes (6 and 3 rows) and a remainder


@pytest.fixture(params=ISAS or ["no-extension"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    if not ISAS:
        pytest.skip("the compiled kernels extension does not run the matmuls here (LLM_QUANT_KERNELS, no compiler)")
    assert BACKEND.ext.force_isa(request.param) == request.param
    yield request.param
    BACKEND.ext.force_isa("best")


def _packed(fmt: str, rows: int, cols: int, seed: int) -> PackedMatrix:
    a = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)  # [rows, cols]
    raw = gguf.quants.quantize(a, getattr(gguf.GGMLQuantizationType, fmt.upper()))
    return pack_blocks(raw, fmt, cols)


# rows not a multiple of 32 (a partial last tile); cols of 3 and 18 blocks (SmolLM2's 576)
MATRICES = [("q4_1", 100, 96), ("q4_0", 72, 576), ("q8_0", 130, 576)]


@pytest.mark.parametrize(("fmt", "rows", "cols"), MATRICES, ids=str)
def test_matmul_rows_are_batch_invariant(isa: str, fmt: str, rows: int, cols: int) -> None:
    w = _packed(fmt, rows, cols, seed=rows)
    x = np.random.default_rng(cols).standard_normal((ROWS, cols)).astype(np.float32)  # [ROWS, cols]
    full = kernels.matmul(x, w, path="auto")  # [ROWS, rows]
    ref = x.astype(np.float64) @ dequantize_packed(w).T.astype(np.float64)
    assert np.abs(full - ref).max() / np.abs(ref).max() <= 1e-6
    for n in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 33):
        for path in ("auto", "direct", "panel"):
            got = kernels.matmul(x[:n], w, path=path)
            assert np.array_equal(got, full[:n]), (isa, fmt, n, path)
    for i in (0, 11, ROWS - 1):  # a row alone, from the middle and the end of the batch
        assert np.array_equal(kernels.matmul(x[i], w), full[i]), (isa, fmt, i)


@pytest.mark.parametrize(("fmt", "rows", "cols"), MATRICES, ids=str)
def test_simd_isas_compute_the_same_bits(fmt: str, rows: int, cols: int) -> None:
    simd = [i for i in ISAS if i != "generic"]
    if len(simd) < 2:
        pytest.skip(f"this CPU runs {len(simd)} SIMD kernel ISA(s); the comparison needs two")
    w = _packed(fmt, rows, cols, seed=rows + 1)
    x = np.random.default_rng(cols + 1).standard_normal((ROWS, cols)).astype(np.float32)
    out = {}
    try:
        for name in simd:
            BACKEND.ext.force_isa(name)
            out[name] = kernels.matmul(x, w)
    finally:
        BACKEND.ext.force_isa("best")
    first = out[simd[0]]
    for name in simd[1:]:
        assert np.array_equal(out[name], first), (simd[0], name, fmt)
