"""The compiled all-decode step (kernels/decode_step.py, csrc/decode_step.c) against the runner's Python loop.

Both run the same kernels in the same order, so a step's logits and the KV it writes are bitwise the same, on
the default SmolLM2 engine (packed q4_1 + q8_0), for every KV cache type, for decode rows at contexts across the
attention's 256-key spans and for the rows of a speculative verify step; steps with a longer prefill chunk take
the Python loop either way. Bad arguments to the entry points are refused before any kernel runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.engine.kernels.backend import BACKEND
from service.engine.kernels.matmul import KIND_ID
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner

pytestmark = pytest.mark.skipif(
    BACKEND.ext is None or BACKEND.matmul != "c" or BACKEND.decode_attention != "c",
    reason="the compiled kernels extension does not run here (no compiler, or LLM_QUANT_KERNELS)",
)

BLOCKS = 24  # per sequence: 384 keys, past one 256-key span
LENGTHS = (5, 37, 300)  # prompts of the three sequences (the verify one decodes from the second)


def _runners(engine: Path, kv_cache_dtype: str) -> dict[bool, NumpyRunner]:
    return {
        fused: NumpyRunner(engine, 3 * BLOCKS, kv_cache_dtype=kv_cache_dtype, fuse_decode=fused)
        for fused in (True, False)
    }


def _tables() -> list[list[int]]:
    return [list(range(b * BLOCKS, (b + 1) * BLOCKS))[::-1] for b in range(3)]  # blocks out of order


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_fused_decode_steps_equal_the_python_loop(smollm2_engine_dir: Path, kv_cache_dtype: str) -> None:
    runners = _runners(smollm2_engine_dir, kv_cache_dtype)
    assert runners[True].decode_layers is not None and runners[False].decode_layers is None
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 40000, n)] for n in LENGTHS]
    tables = _tables()
    steps = [
        # three decode rows
        [SeqChunk([11], LENGTHS[0], tables[0]), SeqChunk([12], LENGTHS[1], tables[1]), SeqChunk([13], 300, tables[2])],
        # a decode row and a verify step of 6 rows (each row sees one key more)
        [SeqChunk([14], LENGTHS[0] + 1, tables[0]), SeqChunk([21, 22, 23, 24, 25, 26], LENGTHS[1] + 1, tables[1])],
    ]
    logits, caches = {}, {}
    for fused, r in runners.items():
        for p, table in zip(prompts, tables, strict=True):  # prefill: the Python loop for both
            r.execute(ForwardBatch.from_chunks([SeqChunk(p, 0, table)], r.block_size))
        outs = []
        for chunks in steps:
            verify = [1] if len(chunks[1].token_ids) > 1 else []  # a verify step samples each of its rows
            outs.append(r.execute(ForwardBatch.from_chunks(chunks, r.block_size, all_rows=verify)))
        logits[fused], caches[fused] = outs, r.kv_cache
    for a, b in zip(logits[True], logits[False], strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)
    assert logits[True][1].shape[0] == 7
    for name in ("k", "v", "k_scale", "v_scale"):
        assert np.array_equal(getattr(caches[True], name), getattr(caches[False], name))


def test_a_step_with_a_prefill_chunk_takes_the_python_loop(smollm2_engine_dir: Path, monkeypatch) -> None:
    r = NumpyRunner(smollm2_engine_dir, 2 * BLOCKS)
    calls = []
    monkeypatch.setattr(r, "decode_layers", lambda *a: calls.append(a) or pytest.fail("fused call"))
    tables = _tables()
    r.execute(ForwardBatch.from_chunks([SeqChunk(list(range(100, 140)), 0, tables[0])], r.block_size))
    assert calls == []


def test_entry_points_refuse_bad_arguments(smollm2_engine_dir: Path) -> None:
    r = NumpyRunner(smollm2_engine_dir, 2 * BLOCKS)
    kv, ext, model = r.kv_cache, BACKEND.ext, r.decode_layers.model
    D = r.config.arch.hidden_size
    x = np.zeros((1, D), np.float32)
    nb, bs = kv.k.shape[1:3]

    def call(positions=(3,), slots=(3,), tables=(0,), lens=(4,), k=kv.k, x=x, threads=0):
        tables, starts = np.asarray(tables, np.int64), np.asarray([0, len(tables)], np.int64)
        args = (np.asarray(positions, np.int64), np.asarray(slots, np.int64), k, kv.v, kv.k_scale, kv.v_scale)
        ext.decode_layers(model, x, r.rope, *args, tables, starts, np.asarray(lens, np.int64), 1, r.rope.shape[1],
                          nb, bs, kv.fmt.code, threads)  # fmt: skip

    call()  # a valid call runs
    with pytest.raises(ValueError, match="slot"):
        call(slots=(nb * bs,))
    with pytest.raises(ValueError, match="block id"):
        call(tables=(nb,))
    with pytest.raises(ValueError, match="position"):
        call(positions=(r.rope.shape[1],))
    with pytest.raises(ValueError, match="do not fit"):
        call(lens=(bs + 1,))
    with pytest.raises(ValueError, match="the model's cache"):
        call(k=kv.k[:1])
    with pytest.raises(ValueError, match="too small"):
        call(x=np.zeros((1, D - 1), np.float32))
    with pytest.raises(ValueError, match="out of range"):
        call(threads=2)
    with pytest.raises(TypeError, match="decode_model"):
        ext.decode_layers(object(), x)
    w = r.layers[0]
    mats = [(m.data, KIND_ID[m.kind]) for m in (w.qkv, w.o, w.gate_up)] + [(w.down.data[:1], KIND_ID[w.down.kind])]
    spec = (*(a for m in mats for a in m), None, None, 0.0)
    arch = r.config.arch
    with pytest.raises(ValueError, match="layer 0 down"):
        ext.decode_model([spec], D, r.n_heads, r.n_kv_heads, r.head_dim, arch.intermediate_size, 1e-5)


def test_the_python_loop_where_the_compiled_step_does_not_apply(
    smollm2_engine_dir: Path, tiny_engine_dir: Path
) -> None:
    tiny = NumpyRunner(tiny_engine_dir, 8)  # a float32 engine: BLAS matmuls
    assert not tiny.packed and tiny.decode_layers is None
    if BACKEND.numba is not None:  # the numba decode attention: not the extension's
        assert NumpyRunner(smollm2_engine_dir, 8, decode_attention="numba").decode_layers is None
    assert NumpyRunner(smollm2_engine_dir, 8, fuse_decode=False).decode_layers is None
