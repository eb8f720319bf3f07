"""Decode attention that reads the paged KV cache in place: the C kernel where the extension is built, else numba.

A per-sequence numpy loop spends most of a large decode step gathering blocks into contiguous copies and
calling tiny BLAS kernels (docs/benchmarks.md). These kernels walk each sequence's block table directly.
The C one (service/engine/quant/_kernels.c: decode_attention) splits (sequence, KV head) tasks over the kernels'
pool in quantized engines and runs on the calling thread next to OpenBLAS's pool (runners/kernels.py:
attention_threads); the query heads of one KV head share every K/V load. The numba one is single-threaded:
OpenMP (parallel) numba kernels stall next to OpenBLAS's threads by ~8 ms a call.
Without either, the runner falls back to the numpy path (HAVE_COMPILED is False).
"""

from __future__ import annotations

import math

import numpy as np

from service.engine.quant import kernels as quant
from service.engine.runners.kernels import attention_threads

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAVE_NUMBA = False

    def njit(*args, **kwargs):  # type: ignore[no-redef]
        return lambda fn: fn


HAVE_COMPILED = HAVE_NUMBA or quant.extension() is not None


@njit(cache=True, fastmath=True, nogil=True)
def _decode_attention(q, k_cache, v_cache, tables, table_starts, seq_lens, out):  # pragma: no cover - compiled
    # q: [B, H, hd] one query per sequence (scaled); k_cache, v_cache: [num_blocks, bs, KV, hd] of one layer
    # tables: flat block ids, sequence b's table at tables[table_starts[b]:table_starts[b + 1]]
    # seq_lens: [B] keys visible to each query; out: [B, H, hd]
    n_seqs, n_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    group = n_heads // k_cache.shape[2]
    max_ctx = 1
    for b in range(n_seqs):
        max_ctx = max(max_ctx, seq_lens[b])
    scores = np.empty((n_heads, max_ctx), dtype=np.float32)
    acc = np.empty((n_heads, head_dim), dtype=np.float32)
    for b in range(n_seqs):
        ctx = seq_lens[b]
        t0 = table_starts[b]
        for j in range(ctx):  # one pass over the keys, each cache row [KV, hd] read once, in place
            blk = tables[t0 + j // block_size]
            off = j % block_size
            for h in range(n_heads):
                s = np.float32(0.0)
                for d in range(head_dim):
                    s += q[b, h, d] * k_cache[blk, off, h // group, d]
                scores[h, j] = s
        for h in range(n_heads):  # softmax per head
            m = scores[h, 0]
            for j in range(1, ctx):
                m = max(m, scores[h, j])
            total = np.float32(0.0)
            for j in range(ctx):
                e = math.exp(scores[h, j] - m)
                scores[h, j] = e
                total += e
            inv = np.float32(1.0) / total
            for j in range(ctx):
                scores[h, j] *= inv
            for d in range(head_dim):
                acc[h, d] = 0.0
        for j in range(ctx):  # one pass over the values
            blk = tables[t0 + j // block_size]
            off = j % block_size
            for h in range(n_heads):
                p = scores[h, j]
                for d in range(head_dim):
                    acc[h, d] += p * v_cache[blk, off, h // group, d]
        for h in range(n_heads):
            for d in range(head_dim):
                out[b, h, d] = acc[h, d]


class DecodeAttention:
    """Single-query attention for many sequences at once; the per-step inputs are prepared once per step.

    use_c: the C kernel (default where the extension is built), else the numba one."""

    def __init__(self, use_c: bool | None = None) -> None:
        self._c = quant.extension() if use_c or use_c is None else None
        if use_c and self._c is None:
            raise RuntimeError("the compiled kernels extension is not built")
        if self._c is None and not HAVE_NUMBA:
            raise RuntimeError("neither the compiled kernels extension nor numba is available")

    @staticmethod
    def prepare(block_tables: list[np.ndarray], seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flatten the block tables of the decode sequences (done once per step, used by every layer)."""
        tables = np.concatenate(block_tables) if block_tables else np.zeros(0, np.int64)  # [sum blocks]
        starts = np.zeros(len(block_tables) + 1, dtype=np.int64)  # [B + 1]
        np.cumsum([len(t) for t in block_tables], out=starts[1:])
        return tables, starts, np.ascontiguousarray(seq_lens, dtype=np.int64)

    def __call__(self, q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, prepared: tuple) -> np.ndarray:
        """q: [B, H, hd] -> [B, H, hd]."""
        tables, starts, lens = prepared
        q = np.ascontiguousarray(q)
        out = np.empty_like(q)  # [B, H, hd]
        if self._c is not None:
            B, H, hd = q.shape
            nb, bs, kv, _ = k_layer.shape
            self._c.decode_attention(q, k_layer, v_layer, tables, starts, lens, out, B, H, kv, hd, bs, nb,
                                     attention_threads())  # fmt: skip
        else:
            _decode_attention(q, k_layer, v_layer, tables, starts, lens, out)
        return out
