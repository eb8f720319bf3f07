"""numba kernels: the fallback where the C extension is not built (backend.py), and the baseline the C kernels
were measured against (docs/kernels.md). Importing this module fails where numba is missing.

Quantized matmul, over the same packed layout as the C extension (build_engine/packing.py): numba has no fast
fp16 path, so the fp16 d/m of each chunk are converted once per matrix into fp32 arrays (cached on first use;
exact); per-block partial sums vectorized across the 32 rows of a tile.

Decode attention over the paged KV cache (paged_attention.py), single-threaded: OpenMP (parallel) numba kernels
stall next to OpenBLAS's threads by ~8 ms a call.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
from numba import njit, prange

from build_engine.packing import TILE_ROWS, PackedMatrix, chunk_fields

# id(data) -> (weakref to data, d, m) with d, m fp32 [n_tiles, n_blocks, 32]; the weakref guards against a
# reused id after the matrix was freed
_SCALES: dict[int, tuple[weakref.ref, np.ndarray, np.ndarray]] = {}


def scales_f32(w: PackedMatrix) -> tuple[np.ndarray, np.ndarray]:
    """fp32 copies of the fp16 d and m of every chunk (exact), made once per matrix."""
    key = id(w.data)
    s = _SCALES.get(key)
    if s is None or s[0]() is not w.data:
        _, d16, m16 = chunk_fields(w)
        d = np.ascontiguousarray(d16, dtype=np.float32)
        m = np.ascontiguousarray(m16, dtype=np.float32) if m16 is not None else np.zeros_like(d)
        for k in [k for k, v in _SCALES.items() if v[0]() is None]:
            del _SCALES[k]
        s = _SCALES[key] = (weakref.ref(w.data), d, m)
    return s[1], s[2]


@njit(cache=True, nogil=True, fastmath=False)
def _q4_tiles(data, d, m, x, sx, y, t0, t1):  # pragma: no cover - compiled
    # data: uint8 [nt, nb, 640]; d, m: f32 [nt, nb, 32]; x: f32 [T, K]; sx: f32 [T, nb]; y: f32 [T, nt*32]
    T = x.shape[0]
    nb = data.shape[1]
    tl = np.empty(32, np.float32)
    th = np.empty(32, np.float32)
    acc = np.empty(32, np.float32)
    for n in range(T):
        for t in range(t0, t1):
            acc[:] = 0.0
            for b in range(nb):
                tl[:] = 0.0
                th[:] = 0.0
                for j in range(16):
                    xl = x[n, 32 * b + j]
                    xh = x[n, 32 * b + j + 16]
                    base = 32 * j
                    for r in range(32):
                        q = data[t, b, base + r]
                        tl[r] += np.float32(q & 15) * xl
                        th[r] += np.float32(q >> 4) * xh
                s = sx[n, b]
                for r in range(32):
                    acc[r] += d[t, b, r] * (tl[r] + th[r]) + m[t, b, r] * s
            for r in range(32):
                y[n, 32 * t + r] = acc[r]


@njit(cache=True, nogil=True, fastmath=False)
def _q8_tiles(data, d, x, y, t0, t1):  # pragma: no cover - compiled
    # data: uint8 [nt, nb, 1088] (qs as int8); d: f32 [nt, nb, 32]; x: f32 [T, K]; y: f32 [T, nt*32]
    T = x.shape[0]
    nb = data.shape[1]
    tq = np.empty(32, np.float32)
    acc = np.empty(32, np.float32)
    for n in range(T):
        for t in range(t0, t1):
            acc[:] = 0.0
            for b in range(nb):
                tq[:] = 0.0
                for j in range(32):
                    xv = x[n, 32 * b + j]
                    base = 32 * j
                    for r in range(32):
                        q = np.int32(data[t, b, base + r])
                        q = q - 256 if q > 127 else q
                        tq[r] += np.float32(q) * xv
                for r in range(32):
                    acc[r] += d[t, b, r] * tq[r]
            for r in range(32):
                y[n, 32 * t + r] = acc[r]


@njit(cache=True, nogil=True, parallel=True)
def _q4_par(data, d, m, x, sx, y, nthreads):  # pragma: no cover - compiled
    nt = data.shape[0]
    for i in prange(nthreads):
        _q4_tiles(data, d, m, x, sx, y, i * nt // nthreads, (i + 1) * nt // nthreads)


@njit(cache=True, nogil=True, parallel=True)
def _q8_par(data, d, x, y, nthreads):  # pragma: no cover - compiled
    nt = data.shape[0]
    for i in prange(nthreads):
        _q8_tiles(data, d, x, y, i * nt // nthreads, (i + 1) * nt // nthreads)


def matmul(x: np.ndarray, w: PackedMatrix, y: np.ndarray, nthreads: int = 1) -> None:
    """y[T, rows] = x[T, cols] @ W.T (x fp32 C-contiguous)."""
    T = x.shape[0]
    nt = w.n_tiles
    d, m = scales_f32(w)
    yp = y if w.rows == nt * TILE_ROWS else np.empty((T, nt * TILE_ROWS), np.float32)  # [T, padded rows]
    if w.kind == "q4":
        sx = x.reshape(T, -1, 32).sum(axis=2, dtype=np.float32)  # [T, nb] block sums
        if nthreads > 1:
            _q4_par(w.data, d, m, x, sx, yp, nthreads)
        else:
            _q4_tiles(w.data, d, m, x, sx, yp, 0, nt)
    else:
        if nthreads > 1:
            _q8_par(w.data, d, x, yp, nthreads)
        else:
            _q8_tiles(w.data, d, x, yp, 0, nt)
    if yp is not y:
        y[...] = yp[:, : w.rows]


@njit(cache=True, fastmath=True, nogil=True)
def decode_attention(q, k_cache, v_cache, tables, table_starts, seq_lens, out):  # pragma: no cover - compiled
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
