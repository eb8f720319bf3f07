"""The paged numpy runner equals a naive contiguous-KV forward pass, for random mixed batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from build_engine.builder import build
from build_engine.tiny import write_tiny_checkpoint
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KV_FORMATS
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner
from tests.naive_llama import NaiveLlama

MAX_REL_ERR = 1e-4
VARIANTS = {
    "tied_gqa": {},
    "untied_mqa": {"tie_word_embeddings": False, "num_attention_heads": 4, "num_key_value_heads": 1},
    "untied_mha": {"tie_word_embeddings": False, "num_attention_heads": 2, "num_key_value_heads": 2},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), seed=7, **VARIANTS[request.param])


def _runner(
    checkpoint: Path,
    tmp: Path,
    block_size: int,
    num_blocks: int,
    decode: str = BACKEND.decode_attention,
    kv_cache_dtype: str = "float32",
) -> NumpyRunner:
    out = tmp / f"engine-bs{block_size}"
    if not out.exists():
        build(str(checkpoint), out, {"kv_block_size": block_size, "max_seq_len": 512}, progress=False)
    return NumpyRunner(out, num_kv_blocks=num_blocks, decode_attention=decode, kv_cache_dtype=kv_cache_dtype)


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("decode", ["c", "numba", "numpy"], ids=lambda d: f"{d}-decode")
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_matches_naive_for_random_mixed_batches(
    checkpoint: Path, tmp_path: Path, block_size: int, decode: str
) -> None:
    if decode == "numba" and BACKEND.numba is None:
        pytest.skip("numba is not installed")
    if decode == "c" and BACKEND.ext is None:
        pytest.skip("the compiled kernels extension is not built (LLM_QUANT_KERNELS, or no compiler)")
    rng = np.random.default_rng(block_size)
    vocab = 267
    lengths = rng.integers(1, 90, size=6)  # each sequence's total tokens (prompt + "decoded")
    prompt_lens = [int(rng.integers(1, n + 1)) for n in lengths]
    seqs = [rng.integers(0, vocab, size=n).tolist() for n in lengths]
    blocks_needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_needed) + 3
    runner = _runner(checkpoint, tmp_path, block_size, num_blocks, decode)
    assert (runner.decode_attention.kind if runner.decode_attention else "numpy") == decode
    pool = rng.permutation(num_blocks).tolist()  # shuffled block ids, handed out in that order
    tables = [[pool.pop() for _ in range(k)] for k in blocks_needed]
    naive = NaiveLlama(checkpoint)
    expected = [naive.forward(s) for s in seqs]  # [n, vocab] per sequence
    arrival = rng.integers(0, 6, size=len(seqs))  # step at which each sequence joins
    done = [0] * len(seqs)
    step, checked = 0, 0
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        chunks, members = [], []
        for i, s in enumerate(seqs):
            if arrival[i] > step or done[i] == len(s):
                continue
            if done[i] < prompt_lens[i]:  # prefill: a random chunk of the remaining prompt
                n = int(rng.integers(1, prompt_lens[i] - done[i] + 1))
            else:  # decode: one token
                n = 1
            chunks.append(SeqChunk(s[done[i] : done[i] + n], done[i], tables[i]))
            members.append(i)
        if chunks:
            order = rng.permutation(len(chunks))  # batch order must not matter
            batch = ForwardBatch.from_chunks([chunks[j] for j in order], block_size)
            logits = runner.execute(batch)
            for row, j in enumerate(order):
                i = members[j]
                done[i] += len(chunks[j].token_ids)
                assert _rel_err(logits[row], expected[i][done[i] - 1]) <= MAX_REL_ERR, (i, done[i])
                checked += 1
        step += 1
    assert checked >= len(seqs)


def test_long_prefill_uses_chunked_causal_attention(checkpoint: Path, tmp_path: Path) -> None:
    """A 300-token prompt in one step crosses the attention query-chunk boundary (256)."""
    runner = _runner(checkpoint, tmp_path, 16, 20)
    ids = np.random.default_rng(3).integers(0, 267, size=300).tolist()
    logits = runner.execute(ForwardBatch.from_chunks([SeqChunk(ids, 0, list(range(20)))], 16))
    assert _rel_err(logits[0], NaiveLlama(checkpoint).forward(ids)[-1]) <= MAX_REL_ERR


# the largest relative logit error of a narrower KV cache against the float32 one on the tiny models (measured
# worst of the three shapes and decode kinds: 1.4e-4, 1.1e-3, 3.2e-3)
KV_DTYPE_REL_ERR = {"float16": 1e-3, "bfloat16": 1e-2, "int8": 2e-2}


@pytest.mark.parametrize("decode", ["c", "numba", "numpy"], ids=lambda d: f"{d}-decode")
@pytest.mark.parametrize("dtype", sorted(KV_DTYPE_REL_ERR))
def test_narrow_kv_cache_stays_near_float32(checkpoint: Path, tmp_path: Path, dtype: str, decode: str) -> None:
    """A prompt in two prefill chunks, then decodes: the logits of a float16 / bfloat16 / int8 cache near the
    float32 cache's (numba has no narrow kernel: that runner gathers and converts, decode kind numpy)."""
    if (decode == "numba" and BACKEND.numba is None) or (decode == "c" and BACKEND.ext is None):
        pytest.skip(f"no {decode} decode attention here")
    ids = np.random.default_rng(4).integers(0, 267, size=60).tolist()
    table = list(range(8))[::-1]
    steps = [SeqChunk(ids[:40], 0, table), SeqChunk(ids[40:50], 40, table)]
    steps += [SeqChunk([t], 50 + i, table) for i, t in enumerate(ids[50:])]
    runners = [_runner(checkpoint, tmp_path, 16, 8, decode, d) for d in ("float32", dtype)]
    assert runners[1].kv_cache.k.dtype == KV_FORMATS[dtype].storage
    if decode == "numba":
        assert runners[1].decode_attention is None  # gathers instead
    worst = 0.0
    for chunk in steps:
        exact, narrow = (r.execute(ForwardBatch.from_chunks([chunk], 16)) for r in runners)
        worst = max(worst, _rel_err(narrow[0], exact[0]))
    assert 0 < worst <= KV_DTYPE_REL_ERR[dtype]


def test_block_table_too_short_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.from_chunks([SeqChunk([1] * 20, 0, [0])], 16)


def test_slot_mapping_follows_block_table() -> None:
    batch = ForwardBatch.from_chunks([SeqChunk([5, 6, 7], 3, [9, 2]), SeqChunk([8], 0, [4])], 4)
    # tokens at positions 3, 4, 5 of a table [9, 2] -> block 9 offset 3, block 2 offsets 0 and 1
    assert batch.slot_mapping.tolist() == [9 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 4 * 4 + 0]
    assert batch.positions.tolist() == [3, 4, 5, 0]
    assert batch.query_start_loc.tolist() == [0, 3, 4]
    assert batch.seq_lens.tolist() == [6, 1]
