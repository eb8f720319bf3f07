"""y = x @ W.T with W kept as GGUF quant blocks (Q4_0 / Q4_1 / Q8_0) and fp32 activations (never quantized).

The packed layout is made once, at build time, by build_engine.packing.pack_blocks (see its docstring):
    PackedMatrix.data: uint8 [n_tiles, cols // 32, chunk]; 32 output rows per tile, one chunk per block of
    32 input columns (Q4: qs[16][32], d[32] fp16, m[32] fp16; Q8_0: qs[32][32] int8, d[32] fp16).

Paths (all exact: the result is the fp32 GEMV/GEMM over the dequantized matrix up to fp32 summation order):
    T <= 8 rows   "direct": SIMD across the 32 output rows of a tile, per-block fp32 partial sums with d and m
                  applied per block (no dequantized copy at all), up to 4 x rows per pass over the weights
    T > 8 rows    "panel": each tile (32 rows) dequantized into an fp32 panel in L2, 16x6 FMA micro-kernel
                  (a BLAS-like GEMM; as fast as 2-thread OpenBLAS fp32 up to prefill sizes)
    path="blas"   dequantize the whole matrix into a reusable fp32 buffer [cols, rows] and call BLAS
Which kernels run (C, numba over the same layout, or numpy dequantize + BLAS) is BACKEND.matmul (backend.py).

Threads: the C kernels use their own small pool (set_num_threads; default = CPU count), with OpenBLAS at 1
thread (threads.ThreadPolicy).
"""

from __future__ import annotations

import numpy as np

from build_engine.packing import PackedMatrix, aligned_empty, dequantize_packed
from service.engine.kernels.backend import BACKEND

KIND_ID = {"q4": 0, "q8_0": 1}
PATH_ID = {"auto": 0, "direct": 1, "panel": 2}
DIRECT_MAX_ROWS = 8  # "auto": rows of x up to which the C side uses the direct kernel (its DIRECT_MAX_N)
# rows of x from which "auto" switches to dequantize + BLAS. Measured (docs/kernels.md): the panel kernel on our own
# 2-thread pool matches 2-thread OpenBLAS at 512 rows (0.97x) and beats it at 128 (1.2x), while dequantize +
# BLAS is 0.87-0.91x, so auto never takes it (and OpenBLAS can stay at 1 thread); kept for explicit path="blas".
PREFILL_ROWS = 1 << 62

_C = BACKEND.ext if BACKEND.matmul == "c" else None  # the extension, where it does the matmuls


def set_num_threads(n: int) -> None:
    """Threads used by the C kernels, the calling thread included."""
    if BACKEND.ext is not None:
        BACKEND.ext.set_num_threads(int(n))


def matmul(x: np.ndarray, w: PackedMatrix, out: np.ndarray | None = None, path: str = "auto") -> np.ndarray:
    """x @ W.T. x: fp32 [T, cols] (or [cols]); returns fp32 [T, rows] (or [rows]).

    out: optional C-contiguous fp32 [T, rows] to write into. path: "auto", "direct" (no dequantization, any T,
    4 rows per pass), "panel" (tile dequantized into cache + FMA micro-kernel), "blas" (dequantize + BLAS).
    """
    if x.ndim == 1:
        y = matmul(x.reshape(1, -1), w, None if out is None else out.reshape(1, -1), path)
        return y.reshape(w.rows)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    T, cols = x.shape
    if cols != w.cols:
        raise ValueError(f"x has {cols} columns, the matrix {w.cols}")
    if out is None:
        out = aligned_empty((T, w.rows), np.float32)  # [T, rows]
    if path == "blas" or (path == "auto" and T >= PREFILL_ROWS):
        np.matmul(x, dequantize_t(w), out=out)
    elif _C is not None:  # the C side checks dtype, contiguity and sizes of x and out
        _C.matmul(KIND_ID[w.kind], w.data, w.rows, cols, x, T, out, PATH_ID[path])
    else:
        fallback_matmul(x, w, out)
    return out


_DEQ_BUF: dict[str, np.ndarray] = {}  # reusable fp32 buffer for the prefill path (grown to the largest matrix)


def dequantize_t(w: PackedMatrix, out: np.ndarray | None = None) -> np.ndarray:
    """fp32 W.T [cols, rows], written into a reusable buffer unless `out` is given (valid until the next call)."""
    if out is None:
        buf = _DEQ_BUF.get("buf")
        if buf is None or buf.size < w.rows * w.cols:
            buf = _DEQ_BUF["buf"] = np.empty(w.rows * w.cols, dtype=np.float32)
        out = buf[: w.rows * w.cols].reshape(w.cols, w.rows)
    if _C is not None:
        _C.dequantize_t(KIND_ID[w.kind], w.data, w.rows, w.cols, out)
    else:
        out[...] = dequantize_packed(w).T
    return out


def fallback_matmul(x: np.ndarray, w: PackedMatrix, y: np.ndarray) -> None:
    """y = x @ W.T without the extension: numba over the packed layout, or numpy dequantize + BLAS."""
    if BACKEND.matmul_fallback == "numba":
        BACKEND.numba.matmul(x, w, y)
    else:
        np.matmul(x, dequantize_packed(w).T, out=y)
