"""This machine's two ceilings, each measured one way (the startup gauge, the benchmarks and the docs all use these):

    gemm_gflops()       fp32 GEMM rate: an n x n x n product
    read_bandwidth_gbs  read bandwidth: an fp32 GEMV, [rows, 1024] @ [1024], over a matrix of at least 4x the
                        last-level cache (so every byte comes from DRAM, none from a cache a smaller buffer fits in)

Both run BLAS on its default threads (OPENBLAS_NUM_THREADS, else every core): a ceiling is the machine's, not one
engine's pool, and no engine runs more threads than that. Both report the best of `runs` timed calls after one
warm-up call, not the median: a ceiling is the best the machine was seen to do, and on a shared box the other
tenants only ever make a call slower. The service's startup gauge takes fewer runs (measure_ceilings(quick=True)),
the same method and the same buffer rule.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from service.engine.kernels.threads import default_blas_threads
from service.telemetry import Ceilings

logger = logging.getLogger(__name__)

GEMV_COLS = 1024  # the matrix's row length: 4 KiB rows, the vector stays in L1
LLC_FALLBACK_BYTES = 64 << 20  # when neither sysfs nor sysconf reports a cache size: a large server L3
MIN_READ_BYTES = 256 << 20  # never less than this, whatever cache size is reported


def best_time(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """The fastest of `runs` timed calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(max(1, runs)):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_gflops(runs: int = 5, n: int = 2048) -> float:
    """fp32 GEMM rate of an n x n x n product, best of `runs` (BLAS on its default threads)."""
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
    with default_blas_threads():
        return 2 * n**3 / best_time(lambda: a @ b, runs) / 1e9


def _size(text: str) -> int:
    """sysfs cache sizes: '491520K', '32M', '2048'."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu") -> int:
    """The machine's last-level cache in bytes: the highest-level data or unified cache in sysfs, summed over its
    distinct instances (one per socket or CCX, told apart by shared_cpu_list); else sysconf's LEVEL3 (getconf
    LEVEL3_CACHE_SIZE); else LLC_FALLBACK_BYTES (64 MiB)."""
    instances: dict[tuple[int, str], int] = {}  # (level, shared_cpu_list) -> size
    for index in glob.glob(f"{sysfs}/cpu[0-9]*/cache/index[0-9]*"):
        try:
            p = Path(index)
            if p.joinpath("type").read_text().strip() == "Instruction":
                continue
            key = (int(p.joinpath("level").read_text()), p.joinpath("shared_cpu_list").read_text().strip())
            instances[key] = _size(p.joinpath("size").read_text())
        except (OSError, ValueError):
            continue
    if instances:
        top = max(level for level, _ in instances)
        return sum(size for (level, _), size in instances.items() if level == top)
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        size = 0
    return size if size > 0 else LLC_FALLBACK_BYTES


def read_buffer_bytes(llc_bytes: int | None = None) -> int:
    """The read-bandwidth buffer: 4x the last-level cache (at least MIN_READ_BYTES), in whole GEMV_COLS rows."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    row = GEMV_COLS * 4
    return -(-max(4 * llc, MIN_READ_BYTES) // row) * row


def read_bandwidth_gbs(runs: int = 5, nbytes: int | None = None) -> float:
    """Read bandwidth in GB/s: the best of `runs` fp32 GEMVs over a [rows, GEMV_COLS] matrix of `nbytes` (default:
    read_buffer_bytes(), 4x the last-level cache), BLAS on its default threads. The matrix is written first (an
    untouched np.zeros would map every page to the one zero page, and the GEMV would read the cache)."""
    nbytes = read_buffer_bytes() if nbytes is None else nbytes
    matrix = np.empty((max(1, nbytes // (GEMV_COLS * 4)), GEMV_COLS), np.float32)
    matrix.fill(1.0)
    vector = np.ones(GEMV_COLS, np.float32)
    with default_blas_threads():
        return matrix.nbytes / best_time(lambda: matrix @ vector, runs) / 1e9


def read_method(runs: int) -> str:
    """How read_bandwidth_gbs measured, for reports: 'fp32 GEMV [N,1024] over 1.97 GB (4x the 480 MiB LLC) ...'."""
    llc = last_level_cache_bytes()
    return (
        f"fp32 GEMV [N,{GEMV_COLS}] over {read_buffer_bytes(llc) / 1e9:.2f} GB (>= 4x the {llc >> 20} MiB "
        f"last-level cache), BLAS on its default threads, best of {runs}"
    )


def measure_ceilings(quick: bool = True) -> Ceilings:
    """quick (the startup gauge): a 1024^3 GEMM and the GEMV read, best of 3 each; else the benchmarks' (2048^3,
    best of 5). The read's buffer is the same either way: 4x the last-level cache, allocated for the measurement
    and freed after it."""
    runs = 3 if quick else 5
    start = time.perf_counter()
    ceilings = Ceilings(gemm_gflops(runs, n=1024 if quick else 2048), read_bandwidth_gbs(runs))
    logger.info("ceilings in %.1f s; read bandwidth: %s", time.perf_counter() - start, read_method(runs))
    return ceilings


def main() -> None:
    """`python -m service.engine.roofline`: the startup gauge's measurement in a process of its own (the server
    runs it after SERVING, so its 4x-LLC buffer and its BLAS threads are never the engine's); prints JSON."""
    c = measure_ceilings(quick=True)
    print(json.dumps({"gemm_gflops": c.gemm_gflops, "read_gbytes_per_s": c.read_gbytes_per_s}))


if __name__ == "__main__":
    main()
