"""Shared benchmark helpers: machine ceilings, medians, and writing a section of docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def median_time(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def read_bandwidth_gbs(runs: int = 5, size_mb: int = 576) -> dict[str, float]:
    """Read bandwidth of a large array: numpy sum on 1 and 2 threads, and BLAS GEMVs streaming it as a matrix
    of 1024 columns and of 576 columns (the hidden size of SmolLM2, the shape decode reads)."""
    x = np.random.default_rng(0).random(size_mb * 1024 * 1024 // 4, dtype=np.float32)
    halves = np.split(x, 2)
    wide, narrow = x.reshape(-1, 1024), x[: x.size // 576 * 576].reshape(-1, 576)
    with ThreadPoolExecutor(2) as pool:
        two = median_time(lambda: list(pool.map(np.sum, halves)), runs)
    return {
        "sum_1_thread": x.nbytes / median_time(x.sum, runs) / 1e9,
        "sum_2_threads": x.nbytes / two / 1e9,
        "gemv_1024": x.nbytes / median_time(lambda: wide @ np.ones(1024, np.float32), runs) / 1e9,
        "gemv_576": narrow.nbytes / median_time(lambda: narrow @ np.ones(576, np.float32), runs) / 1e9,
    }


def gemm_gflops(runs: int = 5, n: int = 2048) -> float:
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
    return 2 * n**3 / median_time(lambda: a @ b, runs) / 1e9


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, numpy {np.__version__}, Python {platform.python_version()}"


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the block between <!-- name:start --> and <!-- name:end --> in docs/benchmarks.md."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
