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
If the C extension is missing (no compiler at install time), a numba kernel over the same layout is used, and
without numba a numpy dequantize + BLAS. `backend()` says which one is active.

Threads: the C kernels use their own small pool (set_num_threads; default = CPU count). Run them with OpenBLAS
at 1 thread (openblas_threads(1)); switch BLAS to 2 threads only around long prefill GEMMs.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterator

import numpy as np

from build_engine.packing import QK, TILE_ROWS, PackedMatrix, chunk_fields, dequantize_packed

# LLM_QUANT_KERNELS=numba|numpy skips the C extension (tests of the fallbacks); QUANT_KERNELS_GENERIC=1 keeps
# the extension but forces its portable C path instead of AVX2.
FORCED = os.environ.get("LLM_QUANT_KERNELS", "")
_qk = None
if FORCED not in ("numba", "numpy"):
    try:
        from service.engine.quant import _kernels as _qk  # the C extension (built by setup.py at install)
    except ImportError:  # pragma: no cover - only where the extension was not built (no compiler)
        _qk = None


def _numba_importable() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return FORCED != "numpy"


# The portable C matmul (a CPU without AVX2/FMA/F16C) is ~8x slower than single-threaded numba (docs/kernels.md),
# so there numba does the matmuls unless QUANT_KERNELS_GENERIC=1 asks for the portable C on purpose.
_C_MATMUL = _qk is not None and (
    _qk.isa() == "avx2" or os.environ.get("QUANT_KERNELS_GENERIC", "0") != "0" or not _numba_importable()
)

KIND_ID = {"q4": 0, "q8_0": 1}
PATH_ID = {"auto": 0, "direct": 1, "panel": 2}
DIRECT_MAX_ROWS = 8  # "auto": rows of x up to which the C side uses the direct kernel (its DIRECT_MAX_N)
# rows of x from which "auto" switches to dequantize + BLAS. Measured (docs/kernels.md): the panel kernel on our own
# 2-thread pool matches 2-thread OpenBLAS at 512 rows (0.97x) and beats it at 128 (1.2x), while dequantize +
# BLAS is 0.87-0.91x, so auto never takes it (and OpenBLAS can stay at 1 thread); kept for explicit path="blas".
PREFILL_ROWS = 1 << 62


def backend() -> str:
    """The matmul kernels in use: 'c-avx2', 'c-generic', 'numba' or 'numpy'."""
    if _C_MATMUL:
        return "c-" + _qk.isa()
    return "numba" if _numba_kernels() is not None else "numpy"


def set_num_threads(n: int) -> None:
    """Threads used by the C kernels, the calling thread included."""
    if _qk is not None:
        _qk.set_num_threads(int(n))


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
        out = np.empty((T, w.rows), dtype=np.float32)  # [T, rows]
    if path == "blas" or (path == "auto" and T >= PREFILL_ROWS):
        np.matmul(x, dequantize_t(w), out=out)
    elif _C_MATMUL:  # the C side checks dtype, contiguity and sizes of x and out
        _qk.matmul(KIND_ID[w.kind], w.data, w.rows, cols, x, T, out, PATH_ID[path])
    else:
        _fallback_matmul(x, w, out)
    return out


def extension():
    """The compiled kernels module (service/engine/quant/_kernels.c), or None where it was not built."""
    return _qk


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int = 0) -> np.ndarray | None:
    """Causal grouped-query attention of one sequence in C (online softmax, AVX2 where the CPU has it), or None
    without the C extension. q: [n, H, hd] scaled queries, the last n positions; k, v: [ctx, KV, hd];
    returns [n, H * hd]. threads: 1 = the calling thread only, else the kernels' pool."""
    if _qk is None or not hasattr(_qk, "attention"):
        return None
    n, heads, hd = q.shape
    ctx, kv_heads, _ = k.shape
    q, k, v = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v))
    out = np.empty((n, heads * hd), dtype=np.float32)  # [n, H * hd]
    _qk.attention(q, k, v, out, n, ctx, heads, kv_heads, hd, threads)
    return out


def paged_attention(
    q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, table: np.ndarray, ctx: int, threads: int = 0
) -> np.ndarray | None:
    """causal attention of one sequence read in place from a layer's paged cache (k_layer, v_layer:
    [num_blocks, block_size, KV, hd]) through its block table (int64, covering ctx keys); None where the
    compiled AVX2 path cannot run (the caller gathers the blocks and calls attention())."""
    if _qk is None or not hasattr(_qk, "paged_attention"):
        return None
    n, heads, hd = q.shape
    num_blocks, block_size, kv_heads, _ = k_layer.shape
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty((n, heads * hd), dtype=np.float32)  # [n, H * hd]
    table = np.ascontiguousarray(table, dtype=np.int64)
    args = (n, ctx, heads, kv_heads, hd, block_size, num_blocks, threads)
    return out if _qk.paged_attention(q, k_layer, v_layer, table, out, *args) else None


_DEQ_BUF: dict[str, np.ndarray] = {}  # reusable fp32 buffer for the prefill path (grown to the largest matrix)


def dequantize_t(w: PackedMatrix, out: np.ndarray | None = None) -> np.ndarray:
    """fp32 W.T [cols, rows], written into a reusable buffer unless `out` is given (valid until the next call)."""
    if out is None:
        buf = _DEQ_BUF.get("buf")
        if buf is None or buf.size < w.rows * w.cols:
            buf = _DEQ_BUF["buf"] = np.empty(w.rows * w.cols, dtype=np.float32)
        out = buf[: w.rows * w.cols].reshape(w.cols, w.rows)
    if _C_MATMUL:
        _qk.dequantize_t(KIND_ID[w.kind], w.data, w.rows, w.cols, out)
    else:
        out[...] = dequantize_packed(w).T
    return out


# ------------------------------------------------------------------------------------------------------------
# Fallbacks (no C extension): numba over the same packed layout, else numpy.

_NUMBA: dict[str, object] = {}


def _numba_kernels():
    if "k" in _NUMBA:
        return _NUMBA["k"]
    if FORCED == "numpy":
        _NUMBA["k"] = None
        return None
    try:
        from service.engine.quant import numba_kernels as k
    except ImportError:
        k = None
    _NUMBA["k"] = k
    return k


def _fallback_matmul(x: np.ndarray, w: PackedMatrix, y: np.ndarray) -> None:
    k = _numba_kernels()
    if k is None:
        np.matmul(x, dequantize_packed(w).T, out=y)
    else:
        k.matmul(x, w, y)


# ------------------------------------------------------------------------------------------------------------
# OpenBLAS thread control without threadpoolctl (a ctypes call costs < 1 us; threadpool_limits ~400 us).

_OPENBLAS: list = []


def _openblas_lib():
    """(set_num_threads, get_num_threads) of numpy's OpenBLAS, or (None, None)."""
    if not _OPENBLAS:
        found = (None, None)
        libs_dir = os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs")
        for path in glob.glob(os.path.join(libs_dir, "libscipy_openblas*.so")) + glob.glob(
            os.path.join(libs_dir, "libopenblas*.so*")
        ):
            lib = ctypes.CDLL(path)
            for prefix, suffix in (("scipy_openblas_", "64_"), ("scipy_openblas_", ""), ("openblas_", "")):
                setter, getter = (getattr(lib, f"{prefix}{op}_num_threads{suffix}", None) for op in ("set", "get"))
                if setter is not None:
                    found = (setter, getter)
                    break
            if found[0] is not None:
                break
        _OPENBLAS.append(found)
    return _OPENBLAS[0]


# OpenBLAS's own choice at start-up (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else the CPU count)
DEFAULT_BLAS_THREADS = int(os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or 0) or (
    os.cpu_count() or 1
)


def openblas_threads(n: int) -> bool:
    """Set numpy's OpenBLAS thread count; False if numpy's BLAS is not a findable OpenBLAS."""
    setter, _ = _openblas_lib()
    if setter is None:
        return False
    setter(ctypes.c_int(int(n)))
    return True


@contextlib.contextmanager
def default_blas_threads() -> Iterator[None]:
    """OpenBLAS on its start-up thread count inside the block (the machine's ceilings are measured so, whatever
    thread setup a loaded engine chose), the previous count restored after it."""
    _, getter = _openblas_lib()
    before = int(getter()) if getter is not None else None
    openblas_threads(DEFAULT_BLAS_THREADS)
    try:
        yield
    finally:
        if before is not None:
            openblas_threads(before)


__all__ = [
    "QK",
    "TILE_ROWS",
    "PackedMatrix",
    "backend",
    "chunk_fields",
    "default_blas_threads",
    "dequantize_t",
    "matmul",
    "openblas_threads",
    "set_num_threads",
]
