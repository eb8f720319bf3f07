"""The thread policy an engine's kernels run under (a value its runner holds), and OpenBLAS's thread control.

Two pools can run a step: OpenBLAS's (fp32 matmuls) and the C extension's own small pool (quantized matmuls,
prefill and decode attention; csrc/pool.c). Side by side their spinning workers fight for the cores
(docs/kernels.md, "Threads"), so an engine uses one: packed engines the kernels' pool with OpenBLAS on 1 thread,
fp32 engines OpenBLAS on its default threads with the compiled attention on the calling thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

# OpenBLAS's own choice at start-up (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else the CPU count)
DEFAULT_BLAS_THREADS = int(os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or 0) or (
    os.cpu_count() or 1
)


@dataclass(frozen=True, slots=True)
class ThreadPolicy:
    """Which pool each kind of kernel runs on; the runner picks one for its weights and binds it before a run."""

    blas_threads: int  # OpenBLAS's threads (process-wide, set by bind())
    attention_threads: int  # the compiled attention kernels: 1 = the calling thread, 0 = the kernels' pool

    @classmethod
    def for_weights(cls, packed: bool) -> ThreadPolicy:
        """Packed (quantized) weights: matmuls and attention on the kernels' pool, OpenBLAS on one thread;
        fp32 weights: OpenBLAS on its default threads, the compiled attention on the calling thread."""
        return cls(blas_threads=1, attention_threads=0) if packed else cls(DEFAULT_BLAS_THREADS, 1)

    def bind(self) -> None:
        """Set OpenBLAS's thread count to this policy's (a process that runs several engines binds before each)."""
        openblas_threads(self.blas_threads)


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
