"""Batch-invariant numerics: a row's result is bitwise the same whatever else shares the step.

- The quantized matmul: each x row's output is bitwise identical alone, in any batch of up to 40 rows, on the
  direct and block-panel paths, on every kernel ISA this CPU runs (forced dispatch); the SIMD ISAs (AVX-512,
  AVX2) equal each other bitwise (one canonical order, csrc/matmul.c), the portable C path equals itself.
- The model runner on the default SmolLM2 engine, on each SIMD ISA: a sequence's logits alone equal its logits
  in a decode step of 16 sequences of other lengths, and a token's logits as the last row of a multi-token
  (prefill chunk) step equal its logits as a one-token decode step.
Not invariant: the numpy fallback (dequantize + BLAS, where neither the extension nor numba runs): BLAS picks
its own blocking by shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from build_engine.packing import PackedMatrix, aligned_empty, dequantize_packed, pack_blocks
from service.engine.kernels import matmul as kernels
from service.engine.kernels.backend import BACKEND
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner

ISAS = tuple(BACKEND.ext.isas()) if BACKEND.ext is not None and BACKEND.matmul == "c" else ()
ROWS = 40  # rows of x: past the direct path (8), several micro-kernel passes (6 and 3 rows) and a remainder


@pytest.fixture
def isa(kernel_isa: str) -> str:
    """The matmul tests on each ISA the CPU runs (tests/conftest.py's kernel_isa forces and restores it)."""
    if not ISAS:
        pytest.skip("the compiled kernels extension does not run the matmuls here (LLM_QUANT_KERNELS, no compiler)")
    return kernel_isa


SIMD_ISAS = tuple(i for i in ISAS if i != "generic")


@pytest.fixture(params=SIMD_ISAS or ["no-simd"])
def simd_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The runner-level tests on each SIMD ISA (the portable path is checked at the kernel level: a whole model's
    prefill on it takes minutes)."""
    if not SIMD_ISAS:
        pytest.skip("no SIMD kernel ISA runs here (no AVX2, or no extension)")
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


# rows a multiple of 8 (whole tiles streamed; q4_0's last tile partial, copied)
STREAMED = [("q4_1", 96, 576), ("q4_0", 72, 576), ("q8_0", 64, 96)]


@pytest.mark.parametrize(("fmt", "rows", "cols"), STREAMED, ids=str)
def test_a_prefill_sized_product_is_the_same_bits_streamed_or_copied(isa: str, fmt: str, rows: int, cols: int) -> None:
    """130 rows of x: three sweeps of the block-panel path, whose y goes out with non-temporal stores when the
    output is aligned (aligned_empty, as the runner's) and is copied otherwise; both the rows' bits alone."""
    w = _packed(fmt, rows, cols, seed=rows + 2)
    x = np.random.default_rng(cols + 2).standard_normal((130, cols)).astype(np.float32)  # [130, cols]
    streamed = kernels.matmul(x, w, out=aligned_empty((130, rows), np.float32))
    backing = aligned_empty((130 * rows + 1,), np.float32)
    copied = kernels.matmul(x, w, out=backing[1:].reshape(130, rows))  # 4 bytes past a cache line: not streamed
    assert np.array_equal(streamed, copied)
    ref = x.astype(np.float64) @ dequantize_packed(w).T.astype(np.float64)
    assert np.abs(streamed - ref).max() / np.abs(ref).max() <= 1e-6
    for i in (0, 47, 48, 129):  # rows of each sweep, alone
        assert np.array_equal(kernels.matmul(x[i], w), streamed[i]), (isa, fmt, i)


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


# ---- the model runner on the real default engine ----------------------------------------------------------------
RUNNER_BLOCKS = 512  # 16 tokens each: room for 16 sequences of up to 700 keys (about 350 MB of fp32 KV)


@pytest.fixture(scope="module")
def runner(smollm2_engine_dir: Path) -> NumpyRunner:
    return NumpyRunner(smollm2_engine_dir, num_kv_blocks=RUNNER_BLOCKS)


def _prefill(runner: NumpyRunner, seqs: list[list[int]], tables: list[list[int]]) -> None:
    for ids, table in zip(seqs, tables, strict=True):
        runner.execute(ForwardBatch.from_chunks([SeqChunk(ids, 0, table)], runner.block_size))


@pytest.mark.slow
@pytest.mark.parametrize("context", [100, 700], ids=lambda c: f"{c}-keys")
def test_decode_logits_alone_equal_logits_in_a_batch_of_16(runner: NumpyRunner, context: int, simd_isa: str) -> None:
    rng = np.random.default_rng(context)
    lens = [context] + [int(n) for n in rng.integers(1, context + 1, size=15)]  # the others: other lengths
    seqs = [rng.integers(0, 49152, size=n).tolist() for n in lens]
    sizes = [-(-(n + 1) // runner.block_size) for n in lens]  # blocks for the prompt and the decoded token
    assert sum(sizes) <= RUNNER_BLOCKS
    starts = np.cumsum([0, *sizes])
    tables = [list(range(starts[i], starts[i + 1])) for i in range(16)]
    _prefill(runner, seqs, tables)
    chunks = [SeqChunk([7], n, t) for n, t in zip(lens, tables, strict=True)]
    batched = runner.execute(ForwardBatch.from_chunks(chunks, runner.block_size))  # [16, V]
    alone = runner.execute(ForwardBatch.from_chunks(chunks[:1], runner.block_size))  # [1, V]: rewrites the same KV
    assert np.array_equal(alone[0], batched[0])
    assert np.array_equal(runner.execute(ForwardBatch.from_chunks(chunks[5:6], runner.block_size))[0], batched[5])


@pytest.mark.slow
@pytest.mark.parametrize("context", [40, 700], ids=lambda c: f"{c}-keys")
def test_a_multi_token_step_row_equals_a_one_token_step(runner: NumpyRunner, context: int, simd_isa: str) -> None:
    rng = np.random.default_rng(context + 1)
    ids = rng.integers(0, 49152, size=context + 5).tolist()
    table = list(range(-(-(context + 5) // runner.block_size)))
    # one step of 5 new tokens after `context` (a prefill chunk, or a verification step of 4 drafts) ...
    _prefill(runner, [ids[:context]], [table])
    chunk = runner.execute(ForwardBatch.from_chunks([SeqChunk(ids[context:], context, table)], runner.block_size))
    # ... against the same 5 tokens one decode step each
    for i in range(5):
        step = SeqChunk([ids[context + i]], context + i, table)
        one = runner.execute(ForwardBatch.from_chunks([step], runner.block_size))
    assert np.array_equal(one[0], chunk[0])
