"""numba kernels over the same packed layout as the C extension (quant_pack): the fallback where the C extension
is not built, and the baseline the C kernels were measured against (docs/benchmarks.md).

numba has no fast fp16 path, so the fp16 d/m of each chunk are converted once per matrix into fp32 arrays
(cached on first use; exact). Decode (T <= 4) uses per-block partial sums vectorized across the 32 rows of a
tile; larger T dequantizes one tile into an fp32 panel and runs a row-blocked loop (LLVM vectorizes over rows).
"""

from __future__ import annotations

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
