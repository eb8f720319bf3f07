"""Batch-invariant attention: a query's output is the same bits whatever else runs with it.

Decode attention (csrc/decode_attention.c) alone vs in a batch of 16 sequences of other lengths, at contexts
long enough for its key spans to run as separate tasks (3000 keys), whatever the pool's size; a sequence's rows
(a verify step's) worked on together vs each alone; a prefill row
(csrc/attention.c, paged and contiguous) vs the decode call for the same position; every KV stored type; every
kernel ISA the CPU runs (AVX-512, AVX2, portable C: the kernel_isa fixture, forced dispatch). The numba decode
kernel (the fallback) alone vs in a batch.
Equality is np.array_equal, never allclose.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.kernels.attention import causal_attention, paged_causal_attention
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KV_FORMATS, KVCache, KVLayer
from service.engine.kernels.ops import write_kv
from service.engine.kernels.paged_attention import DecodeAttention

needs_ext = pytest.mark.skipif(BACKEND.ext is None, reason="the compiled kernels extension is not built")
H, KV, HD, BS = 9, 3, 64, 16  # SmolLM2's heads
LENS = [3000, 1, 17, 255, 256, 257, 511, 1024, 1500, 2999, 40, 700, 2048, 90, 1300, 600]  # a batch of 16
NUM_BLOCKS = sum(-(-n // BS) for n in LENS) + 8


def filled_cache(dtype: str, seed: int = 0) -> tuple[KVLayer, list[np.ndarray]]:
    """One layer's cache of `dtype` holding random K, V for every sequence of LENS (shuffled blocks), written
    through the KV-write kernel; the block tables."""
    rng = np.random.default_rng(seed)
    cache = KVCache(1, NUM_BLOCKS, BS, KV, HD, dtype)
    ids = rng.permutation(NUM_BLOCKS)
    tables, used = [], 0
    for n in LENS:
        tables.append(ids[used : used + -(-n // BS)].astype(np.int64))
        used += len(tables[-1])
    layer = cache.layer(0)
    for n, table in zip(LENS, tables, strict=True):
        qkv = rng.standard_normal((n, H + 2 * KV, HD), dtype=np.float32)  # only the K and V heads are written
        slots = (table[np.arange(n) // BS] * BS + np.arange(n) % BS).astype(np.int64)
        write_kv(layer, qkv, slots, H)
    return layer, tables


def decode(kv: KVLayer, q: np.ndarray, tables: list[np.ndarray], lens: list[int], threads: int, kind: str = "c"):
    attn = DecodeAttention(kind)
    return attn(q, kv, attn.prepare(tables, np.array(lens, np.int64)), threads)  # [B, H, HD]


def queries(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, H, HD), dtype=np.float32) / np.float32(8.0)


@needs_ext
@pytest.mark.parametrize("dtype", list(KV_FORMATS))
@pytest.mark.parametrize("threads", [0, 1], ids=["pool", "1-thread"])
def test_decode_row_is_the_same_alone_and_in_a_batch_of_16(dtype: str, threads: int, kernel_isa) -> None:
    kv, tables = filled_cache(dtype)
    q = queries(len(LENS))
    batch = decode(kv, q, tables, LENS, threads)
    for b in (0, 3, 4, 5, 9, 15):  # 3000 keys (12 spans), span edges 255 / 256 / 257, 2999, 600
        alone = decode(kv, q[b : b + 1], [tables[b]], [LENS[b]], threads)
        assert np.array_equal(alone[0], batch[b]), (dtype, b, LENS[b])
    pair = decode(kv, q[[0, 9]], [tables[0], tables[9]], [LENS[0], LENS[9]], threads)
    assert np.array_equal(pair, batch[[0, 9]])


@needs_ext
@pytest.mark.parametrize("dtype", list(KV_FORMATS))
@pytest.mark.parametrize("threads", [0, 1], ids=["pool", "1-thread"])
def test_a_sequences_rows_in_one_call_are_each_the_row_alone(dtype: str, threads: int, kernel_isa) -> None:
    """A verify step's rows (one sequence's blocks, each row one key more than the one before) run as a group whose
    spans are worked on together (cut into smaller units when the pool would be short of tasks); each row's output
    is the bits of that row alone, with many groups and single rows in the same call too."""
    kv, tables = filled_cache(dtype)
    for seq, first, m in ((0, 2990, 9), (5, 249, 9), (8, 1022, 5), (7, 1, 2)):  # 12 spans; crossing 256, 1024
        lens = [first + i for i in range(m)]
        q = queries(m, seed=seq + 2)
        together = decode(kv, q, [tables[seq]] * m, lens, threads)
        for i in range(m):
            alone = decode(kv, q[i : i + 1], [tables[seq]], [lens[i]], threads)
            assert np.array_equal(alone[0], together[i]), (dtype, seq, lens[i])
    # 8 groups of 3 rows and 4 single rows: a task per unit of rows
    seqs, singles = [0, 2, 3, 6, 7, 9, 11, 13], [1, 4, 10, 15]
    rows = [(s, LENS[s] - 2 + i) for s in seqs for i in range(3)] + [(s, LENS[s]) for s in singles]
    q = queries(len(rows), seed=7)
    mixed = decode(kv, q, [tables[s] for s, _ in rows], [n for _, n in rows], threads)
    for i, (s, n) in enumerate(rows):
        assert np.array_equal(decode(kv, q[i : i + 1], [tables[s]], [n], threads)[0], mixed[i]), (dtype, s, n)


@needs_ext
def test_decode_does_not_depend_on_the_pool_size() -> None:
    """Whether the key spans run as separate tasks (an idle pool) or in turn inside a task: the same bits."""
    kv, tables = filled_cache("float32")
    q = queries(len(LENS))
    before = BACKEND.ext.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 16):
            BACKEND.ext.set_num_threads(n)
            outs.append(decode(kv, q[:1], tables[:1], LENS[:1], 0))
            outs.append(decode(kv, q, tables, LENS, 0)[:1])
    finally:
        BACKEND.ext.set_num_threads(before)
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])


@needs_ext
@pytest.mark.parametrize("dtype", list(KV_FORMATS))
@pytest.mark.parametrize("threads", [0, 1], ids=["pool", "1-thread"])
@pytest.mark.parametrize("rows", [(2960, 3000), (0, 40), (200, 300), (250, 262)], ids=str)
def test_prefill_row_equals_the_decode_call_for_its_position(dtype: str, threads: int, rows: tuple, kernel_isa) -> None:
    """A chunk of queries at positions rows[0] .. rows[1] - 1 of sequence 0 (3000 keys): row i of the paged
    prefill kernel is bitwise the decode kernel's output for a query at that position (keys 0 .. position)."""
    kv, tables = filled_cache(dtype)
    start, stop = rows
    q = queries(stop - start, seed=stop)
    prefill = paged_causal_attention(q, kv, tables[0], stop, threads).reshape(stop - start, H, HD)
    for i in range(0, stop - start, 7):
        alone = decode(kv, q[i : i + 1], tables[:1], [start + i + 1], threads)
        assert np.array_equal(prefill[i], alone[0]), (dtype, start + i)
    # and as one row of the whole decode batch
    lens = [start + 1, *LENS[1:]]
    qb = queries(len(LENS))
    qb[0] = q[0]
    assert np.array_equal(prefill[0], decode(kv, qb, tables, lens, threads)[0])


@needs_ext
def test_contiguous_prefill_equals_the_paged_one_and_decode(kernel_isa) -> None:
    kv, tables = filled_cache("float32")
    k, v = kv.dense(tables[0], 600)  # [600, KV, HD]
    q = queries(20, seed=5)
    contiguous = causal_attention(q, k, v, 0)
    assert np.array_equal(contiguous, paged_causal_attention(q, kv, tables[0], 600, 1))
    last = decode(kv, q[-1:], tables[:1], [600], 0)
    assert np.array_equal(contiguous[-1], last[0].reshape(-1))


@pytest.mark.skipif(BACKEND.numba is None, reason="numba is not installed")
def test_numba_decode_row_is_the_same_alone_and_in_a_batch() -> None:
    rng = np.random.default_rng(3)
    k = rng.standard_normal((NUM_BLOCKS, BS, KV, HD), dtype=np.float32)
    v = rng.standard_normal((NUM_BLOCKS, BS, KV, HD), dtype=np.float32)
    none = np.zeros(0, np.float32)
    kv = KVLayer(k, v, none, none, KV_FORMATS["float32"])
    _, tables = filled_cache("float32")
    q = queries(len(LENS))
    batch = decode(kv, q, tables, LENS, 1, kind="numba")
    for b in (0, 1, 9):
        assert np.array_equal(decode(kv, q[b : b + 1], [tables[b]], [LENS[b]], 1, kind="numba")[0], batch[b])
