"""Small named kernels of the Llama forward pass (llama2.c style: one job each, shapes in comments).

Each runs compiled (csrc/elementwise.c) where the extension is built (backend.py) and in numpy otherwise; one C
call replaces 3-6 numpy passes, which is most of a decode step's non-matmul time. Attention is attention.py
(prefill chunks) and paged_attention.py (decode), the quantized matmuls matmul.py.
"""

from __future__ import annotations

import numpy as np

from build_engine.packing import PackedMatrix, aligned_empty, dequantize_rows
from service.engine.kernels import matmul as quant
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KVLayer, encode

_C = BACKEND.ext

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
        out = aligned_empty((x.shape[0], w.shape[0]), np.float32)  # [T, out]
        for i in range(x.shape[0]):
            np.matmul(x[i], w.T, out=out[i])
        return out
    return x @ w.T


def rms_normalize(x: np.ndarray, eps: float, gain: np.ndarray | None = None) -> np.ndarray:
    """x / rms(x) per row, times the gain [D] when given (fp32 engines fold it into the next matmul instead)."""
    # x: [T, D]
    if _C is not None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = aligned_empty(x.shape, np.float32)  # [T, D]
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


def write_kv(kv: KVLayer, qkv: np.ndarray, slot_mapping: np.ndarray, n_heads: int) -> None:
    """K and V of each new token into its slot of one layer's cache, converted to the stored type.

    kv: k, v [num_blocks, block_size, KV, hd]; qkv: [T, H + 2 KV, hd]; slot_mapping: [T] int64."""
    T, _, hd = qkv.shape
    num_blocks, block_size, n_kv, _ = kv.k.shape
    if _C is not None:
        args = (T, n_heads, n_kv, hd, num_blocks * block_size, kv.fmt.code)
        _C.write_kv(kv.k, kv.v, kv.k_scale, kv.v_scale, qkv, slot_mapping, *args)
        return
    for cache, scales, heads in (
        (kv.k, kv.k_scale, qkv[:, n_heads : n_heads + n_kv]),
        (kv.v, kv.v_scale, qkv[:, n_heads + n_kv :]),
    ):
        stored, scale = encode(heads, kv.fmt)  # [T, KV, hd], [T, KV] (int8)
        cache.reshape(-1, n_kv, hd)[slot_mapping] = stored
        if scale is not None:
            scales.reshape(-1, n_kv)[slot_mapping] = scale


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
        out = aligned_empty((gate_up.shape[0], f), np.float32)  # [T, F]
        _C.silu_mul(gate_up, out, gate_up.shape[0], f)
        return out
    gate, up = gate_up[:, :f], gate_up[:, f:]
    return gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up
