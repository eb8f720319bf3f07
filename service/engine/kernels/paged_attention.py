"""Decode attention that reads the paged KV cache in place: the C kernel where the extension is built, else numba.

A per-sequence numpy loop spends most of a large decode step gathering blocks into contiguous copies and
calling tiny BLAS kernels (docs/benchmarks.md). These kernels walk each sequence's block table directly.
The C one (csrc/decode_attention.c) reads the cache's stored type (kv_cache.py) and cuts each query's keys into
spans at fixed positions (batch invariant: the same bits alone or in a batch, and as a prefill row); its tasks
run over the kernels' pool in quantized engines and on the calling thread next to OpenBLAS's pool
(threads.ThreadPolicy); the query heads of one KV head share every K/V load. The numba one
(numba_kernels.decode_attention) is single-threaded, float32 only, each sequence alone (batch invariant too).
Without either (BACKEND.decode_attention == "numpy") the runner gathers and calls attention.py instead.
"""

from __future__ import annotations

import numpy as np

from build_engine.packing import aligned_empty
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KVLayer


class DecodeAttention:
    """Single-query attention for many sequences at once; the per-step inputs are prepared once per step.

    kind: "c" (the extension) or "numba" (the runner passes BACKEND.decode_attention)."""

    def __init__(self, kind: str) -> None:
        if kind not in ("c", "numba"):
            raise ValueError(f"decode attention kind {kind!r}: 'c' or 'numba'")
        if kind == "c" and BACKEND.ext is None:
            raise RuntimeError("the compiled kernels extension is not built")
        if kind == "numba" and BACKEND.numba is None:
            raise RuntimeError("numba is not installed")
        self.kind = kind

    @staticmethod
    def prepare(block_tables: list[np.ndarray], seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flatten the block tables of the decode sequences (done once per step, used by every layer)."""
        tables = np.concatenate(block_tables) if block_tables else np.zeros(0, np.int64)  # [sum blocks]
        starts = np.zeros(len(block_tables) + 1, dtype=np.int64)  # [B + 1]
        np.cumsum([len(t) for t in block_tables], out=starts[1:])
        return tables, starts, np.ascontiguousarray(seq_lens, dtype=np.int64)

    def __call__(self, q: np.ndarray, kv: KVLayer, prepared: tuple, threads: int) -> np.ndarray:
        """q: [B, H, hd] -> [B, H, hd]; kv: a layer's cache; threads: 1 = the calling thread, 0 = the kernels'
        pool (C only)."""
        tables, starts, lens = prepared
        q = np.ascontiguousarray(q)
        out = aligned_empty(q.shape, np.float32)  # [B, H, hd]
        if self.kind == "c":
            B, H, hd = q.shape
            nb, bs, n_kv, _ = kv.k.shape
            args = (B, H, n_kv, hd, bs, nb, threads, kv.fmt.code)
            BACKEND.ext.decode_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, tables, starts, lens, out, *args)
        else:
            if kv.fmt.name != "float32":
                raise ValueError(f"the numba decode attention reads a float32 KV cache, not {kv.fmt.name}")
            BACKEND.numba.decode_attention(q, kv.k, kv.v, tables, starts, lens, out)
        return out
