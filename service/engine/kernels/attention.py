"""Causal grouped-query attention of one sequence's new queries over its context (prefill chunks): compiled where
the extension is built (no score matrix; every row as decode attention computes it, csrc/attention.c), else
numpy with BLAS score matrices.

threads: 1 runs the compiled kernel on the calling thread, 0 on the kernels' pool (threads.ThreadPolicy).
"""

from __future__ import annotations

import numpy as np

from build_engine.packing import aligned_empty
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KVLayer

_C = BACKEND.ext

# numpy: causal attention is computed in chunks of this many query rows, so a long prefill never materializes
# the whole [queries, keys] score square and each chunk only reads the keys it can see.
ATTENTION_QUERY_CHUNK = 256


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int) -> np.ndarray:
    """Grouped-query attention of one sequence's new queries over its whole context.

    q: [n, H, hd] new queries (already scaled by 1/sqrt(hd)), the last n positions of the context
    k, v: [ctx, KV, hd] keys and values of positions 0 .. ctx - 1
    returns [n, H * hd]
    """
    if _C is None:
        return causal_attention_numpy(q, k, v)
    n, heads, hd = q.shape
    ctx, kv_heads, _ = k.shape
    q, k, v = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v))
    out = aligned_empty((n, heads * hd), np.float32)  # [n, H * hd]
    _C.attention(q, k, v, out, n, ctx, heads, kv_heads, hd, threads)
    return out


def paged_causal_attention(q: np.ndarray, kv: KVLayer, table: np.ndarray, ctx: int, threads: int) -> np.ndarray:
    """causal_attention over a sequence's blocks of a layer's cache (k, v [num_blocks, block_size, KV, hd] of its
    stored type): read in place by the compiled kernel, each query row computed as decode attention computes
    that position's query (csrc/attention.c); without the extension, gathered into float32 copies first.

    q: [n, H, hd] the last n of ctx positions; table: int64 block ids covering ctx keys; returns [n, H * hd]"""
    if _C is None:
        k, v = kv.dense(table, ctx)  # [ctx, KV, hd] float32
        return causal_attention_numpy(q, k, v)
    n, heads, hd = q.shape
    num_blocks, block_size, kv_heads, _ = kv.k.shape
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = aligned_empty((n, heads * hd), np.float32)  # [n, H * hd]
    table = np.ascontiguousarray(table, dtype=np.int64)
    args = (n, ctx, heads, kv_heads, hd, block_size, num_blocks, threads, kv.fmt.code)
    _C.paged_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, table, out, *args)
    return out


def causal_attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """causal_attention in numpy (BLAS score matrices, query chunks): the fallback without the C extension."""
    n, n_heads, head_dim = q.shape
    ctx, n_kv, _ = k.shape
    group = n_heads // n_kv
    # query head h uses kv head h // group; rows of qg are (query i, group member g) -> i * group + g
    qg = q.reshape(n, n_kv, group, head_dim).transpose(1, 0, 2, 3).reshape(n_kv, n * group, head_dim)
    kt = k.transpose(1, 2, 0)  # [KV, hd, ctx]
    vt = v.transpose(1, 0, 2)  # [KV, ctx, hd]
    out = np.empty((n_kv, n * group, head_dim), dtype=np.float32)  # [KV, n*G, hd]
    first_pos = ctx - n  # position of query 0
    for start in range(0, n, ATTENTION_QUERY_CHUNK):
        stop = min(n, start + ATTENTION_QUERY_CHUNK)
        visible = first_pos + stop  # keys 0 .. visible - 1 can be seen by some query of this chunk
        scores = qg[:, start * group : stop * group] @ kt[:, :, :visible]  # [KV, rows, visible]
        if stop - start > 1 or visible > first_pos + start + 1:
            q_pos = np.repeat(np.arange(first_pos + start, first_pos + stop), group)  # [rows]
            masked = np.arange(visible)[None, :] > q_pos[:, None]  # [rows, visible]
            if masked.any():
                scores[:, masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[:, start * group : stop * group] = scores @ vt[:, :visible]
    return out.reshape(n_kv, n, group, head_dim).transpose(1, 0, 2, 3).reshape(n, n_heads * head_dim)
