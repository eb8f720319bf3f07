"""Small named numpy kernels of the Llama forward pass (llama2.c style: one job each, shapes in comments)."""

from __future__ import annotations

import numpy as np

from build_engine.packing import PackedMatrix, dequantize_rows
from service.engine.quant import kernels as quant

# The compiled kernels (norms, RoPE, SiLU, KV writes, attention; service/engine/quant/_kernels.c) where the
# extension is built; every function below falls back to numpy without it. One C call replaces 3-6 numpy passes,
# which is most of a decode step's non-matmul time.
_C = quant.extension()

# Causal attention is computed in chunks of this many query rows, so a long prefill never materializes the
# whole [queries, keys] score square and each chunk only reads the keys it can see.
ATTENTION_QUERY_CHUNK = 256


# OpenBLAS handles 2-6 row GEMMs badly (2-4 rows cost about twice a 1-row GEMV of the whole matrix); one GEMV
# per row is faster there, the later rows reading the matrix from cache (benchmarks: docs/benchmarks.md).
SMALL_BATCH_GEMV_ROWS = 6


def linear(x: np.ndarray, w: np.ndarray | PackedMatrix) -> np.ndarray:
    """x @ w.T for a weight stored [out_features, in_features]: fp32 through BLAS (which reads it transposed, no
    copy), quantized blocks through the quant kernels (exact: fp32 activations, blocks widened in registers)."""
    # x: [T, in] -> [T, out]
    if isinstance(w, PackedMatrix):
        return quant.matmul(x, w)
    if 1 < x.shape[0] <= SMALL_BATCH_GEMV_ROWS:
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)  # [T, out]
        for i in range(x.shape[0]):
            np.matmul(x[i], w.T, out=out[i])
        return out
    return x @ w.T


def rms_normalize(x: np.ndarray, eps: float, gain: np.ndarray | None = None) -> np.ndarray:
    """x / rms(x) per row, times the gain [D] when given (fp32 engines fold it into the next matmul instead)."""
    # x: [T, D]
    if _C is not None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)  # [T, D]
        _C.rmsnorm(x, gain, eps, out, x.shape[0], x.shape[1])
        return out
    ms = np.einsum("td,td->t", x, x) / np.float32(x.shape[1])  # [T]
    inv = (1.0 / np.sqrt(ms + np.float32(eps)))[:, None]  # [T, 1]
    return x * inv if gain is None else x * inv * gain


def embedding_rows(table: np.ndarray | PackedMatrix, token_ids: np.ndarray) -> np.ndarray:
    """The embedding rows of the tokens, [T, D] float32 (a copy: the table is read-only)."""
    if isinstance(table, PackedMatrix):
        return dequantize_rows(table, token_ids)
    return table[token_ids]


# Threads of the compiled prefill attention: 1 (the calling thread) next to OpenBLAS's own pool in fp32 engines,
# whose spinning workers would fight a second pool; 0 (the kernels' pool) once use_quant_threads() has run.
_ATTENTION_THREADS = [1]


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, qkv: np.ndarray, slot_mapping: np.ndarray, n_heads: int) -> None:
    """K and V of each new token into its slot of one layer's cache.

    k_cache, v_cache: [num_blocks, block_size, KV, hd]; qkv: [T, H + 2 KV, hd]; slot_mapping: [T] int64."""
    T, _, hd = qkv.shape
    kv = k_cache.shape[2]
    if _C is not None:
        _C.write_kv(k_cache, v_cache, qkv, slot_mapping, T, n_heads, kv, hd, k_cache.shape[0] * k_cache.shape[1])
        return
    k_cache.reshape(-1, kv, hd)[slot_mapping] = qkv[:, n_heads : n_heads + kv]
    v_cache.reshape(-1, kv, hd)[slot_mapping] = qkv[:, n_heads + kv :]


def attention_threads() -> int:
    """Threads for the compiled attention kernels: 1 (the calling thread), or 0 (the kernels' pool)."""
    return _ATTENTION_THREADS[0]


def use_quant_threads() -> None:
    """Quantized engines run their matmuls and prefill attention on the kernels' own 2-thread pool; OpenBLAS
    then runs on one thread, since its spinning workers would fight that pool (docs/kernels.md)."""
    quant.openblas_threads(1)
    _ATTENTION_THREADS[0] = 0


def use_blas_threads() -> None:
    """fp32 engines: OpenBLAS on its default threads, the compiled attention on the calling thread."""
    quant.openblas_threads(quant.DEFAULT_BLAS_THREADS)
    _ATTENTION_THREADS[0] = 1


def rope_tables(max_positions: int, head_dim: int, theta: float, freq_factors: np.ndarray | None) -> np.ndarray:
    """cos and sin for every position: [2, max_positions, head_dim // 2] float32 (computed in float64)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [P, hd/2]
    return np.stack([np.cos(angles), np.sin(angles)]).astype(np.float32)


def apply_rope(x: np.ndarray, rope: np.ndarray, positions: np.ndarray, n_rot: int) -> None:
    """Rotate-half RoPE in place on the first n_rot heads of x: [T, heads, head_dim] (C-contiguous);
    rope: rope_tables() [2, P, head_dim // 2]; positions: [T] int64."""
    if _C is not None:
        T, heads, hd = x.shape
        _C.rope(x, rope, positions, T, heads, n_rot, hd, rope.shape[1])
        return
    cos = rope[0, positions][:, None, :]  # [T, 1, hd/2]
    sin = rope[1, positions][:, None, :]  # [T, 1, hd/2]
    _rope_numpy(x[:, :n_rot], cos, sin)


def _rope_numpy(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    half = x.shape[-1] // 2
    x1 = x[..., :half].copy()  # [T, heads, hd/2]
    x2 = x[..., half:]
    x[..., :half] = x1 * cos - x2 * sin
    x[..., half:] = x2 * cos + x1 * sin


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU activation: silu(gate) * up, with gate_up = [gate | up] along the last axis."""
    # gate_up: [T, 2F] -> [T, F]; sigmoid(g) = 0.5 * (1 + tanh(g / 2)) cannot overflow, unlike 1 / (1 + exp(-g))
    f = gate_up.shape[1] // 2
    if _C is not None:  # g / (1 + exp(-g)) with exp's argument clamped: no overflow either
        gate_up = np.ascontiguousarray(gate_up, dtype=np.float32)
        out = np.empty((gate_up.shape[0], f), dtype=np.float32)  # [T, F]
        _C.silu_mul(gate_up, out, gate_up.shape[0], f)
        return out
    gate, up = gate_up[:, :f], gate_up[:, f:]
    return gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Grouped-query attention of one sequence's new queries over its whole context.

    q: [n, H, hd] new queries (already scaled by 1/sqrt(hd)), the last n positions of the context
    k, v: [ctx, KV, hd] keys and values of positions 0 .. ctx - 1
    returns [n, H * hd]
    Compiled (service/engine/quant/_kernels.c: online softmax, no score matrix) where the extension is built.
    """
    compiled = quant.attention(q, k, v, _ATTENTION_THREADS[0])
    if compiled is not None:
        return compiled
    return causal_attention_numpy(q, k, v)


def paged_causal_attention(
    q: np.ndarray, k_layer: np.ndarray, v_layer: np.ndarray, table: np.ndarray, ctx: int
) -> np.ndarray:
    """causal_attention over a sequence's blocks of a layer's cache ([num_blocks, block_size, KV, hd]): read in
    place by the compiled kernel where it can, else gathered into a contiguous copy first."""
    compiled = quant.paged_attention(q, k_layer, v_layer, table, ctx, _ATTENTION_THREADS[0])
    if compiled is not None:
        return compiled
    kv, hd = k_layer.shape[2], k_layer.shape[3]
    k = np.take(k_layer, table, axis=0).reshape(-1, kv, hd)[:ctx]  # [ctx, KV, hd] gathered
    v = np.take(v_layer, table, axis=0).reshape(-1, kv, hd)[:ctx]
    return causal_attention(q, k, v)


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
