"""This machine's ceilings: fp32 GEMM rate and read bandwidth (used by the benchmarks and, quickly, at startup)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from service.engine.kernels.threads import default_blas_threads
from service.telemetry import Ceilings


def median_time(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def gemm_gflops(runs: int = 5, n: int = 2048) -> float:
    """fp32 GEMM rate of an n x n x n product (BLAS on its default threads, whatever a loaded engine set)."""
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
    with default_blas_threads():
        return 2 * n**3 / median_time(lambda: a @ b, runs) / 1e9


def read_bandwidth_gbs(runs: int = 5, size_mb: int = 576) -> dict[str, float]:
    """Read bandwidth of a large array: numpy sum on 1 and 2 threads, and BLAS GEMVs (default threads) streaming
    it as a matrix of 1024 columns and of 576 columns (the hidden size of SmolLM2, the shape decode reads)."""
    x = np.random.default_rng(0).random(size_mb * 1024 * 1024 // 4, dtype=np.float32)
    halves = np.split(x, 2)
    wide, narrow = x.reshape(-1, 1024), x[: x.size // 576 * 576].reshape(-1, 576)
    with ThreadPoolExecutor(2) as pool:
        two = median_time(lambda: list(pool.map(np.sum, halves)), runs)
    with default_blas_threads():
        gemv = {
            "gemv_1024": x.nbytes / median_time(lambda: wide @ np.ones(1024, np.float32), runs) / 1e9,
            "gemv_576": narrow.nbytes / median_time(lambda: narrow @ np.ones(576, np.float32), runs) / 1e9,
        }
    return {"sum_1_thread": x.nbytes / median_time(x.sum, runs) / 1e9, "sum_2_threads": x.nbytes / two / 1e9, **gemv}


def measure_ceilings(quick: bool = True) -> Ceilings:
    """quick: about half a second (a 1024^3 GEMM, a 256 MB read); else the benchmarks' full measurement."""
    if quick:
        return Ceilings(gemm_gflops(runs=3, n=1024), max(read_bandwidth_gbs(runs=3, size_mb=256).values()))
    return Ceilings(gemm_gflops(), max(read_bandwidth_gbs().values()))
