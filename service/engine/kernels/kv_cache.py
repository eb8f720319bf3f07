"""The KV cache's stored types (--kv-cache-dtype) and the arrays of one engine's cache.

    float32    exact (the default)
    float16    IEEE half, rounded to nearest even on write
    bfloat16   the top 16 bits of a float32, rounded to nearest even (numpy has no bfloat16: kept as uint16 bits)
    int8       symmetric, one float32 scale per (slot, KV head) beside the cache: scale = max|x| / 127 over the
               head's hd values, q = rint(x / scale); x ~= q * scale (per-token-per-head: a token's scale is set
               when it is written and never changes, so a block needs no rescaling as it fills)

The compiled kernels (csrc/elementwise.c write_kv_rows, csrc/decode_attention.c attn_span) convert on write and
read the stored type directly; encode() / decode() are the same conversions in numpy, for the fallbacks without
the extension and as the tests' reference (bit-identical to the C conversions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.config import KV_CACHE_DTYPES, NativeConfig

DEFAULT_KV_CACHE_DTYPE = NativeConfig().kv_cache_dtype  # the one default, in service/config.py


@dataclass(frozen=True, slots=True)
class KVFormat:
    name: str  # the --kv-cache-dtype value
    code: int  # the kernels' dtype argument (csrc/kernels.h KV_F32, KV_F16, KV_BF16, KV_I8)
    storage: np.dtype  # the cache arrays' numpy dtype
    scaled: bool  # a float32 scale per (slot, KV head) beside the cache (int8)

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    def bytes_per_slot(self, kv_heads: int, head_dim: int) -> int:
        """Bytes of one token's K or V in one layer, scales included."""
        return kv_heads * (head_dim * self.itemsize + (4 if self.scaled else 0))


KV_FORMATS = {
    f.name: f
    for f in (
        KVFormat("float32", 0, np.dtype(np.float32), False),
        KVFormat("float16", 1, np.dtype(np.float16), False),
        KVFormat("bfloat16", 2, np.dtype(np.uint16), False),
        KVFormat("int8", 3, np.dtype(np.int8), True),
    )
}
assert tuple(KV_FORMATS) == KV_CACHE_DTYPES


def kv_format(name: str) -> KVFormat:
    """The format of a --kv-cache-dtype value; ValueError naming the choices otherwise."""
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return KV_FORMATS[name]


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer's cache as the attention kernels and KV writes take it."""

    k: np.ndarray  # [num_blocks, block_size, KV, hd] of fmt.storage
    v: np.ndarray  # [num_blocks, block_size, KV, hd]
    k_scale: np.ndarray  # [num_blocks, block_size, KV] float32 (int8), else an empty float32 array
    v_scale: np.ndarray  # [num_blocks, block_size, KV]
    fmt: KVFormat

    def dense(self, table: np.ndarray, ctx: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 copies of the first ctx keys and values of a sequence's blocks: [ctx, KV, hd] each."""
        kv, hd = self.k.shape[2], self.k.shape[3]

        def gather(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
            rows = np.take(x, table, axis=0).reshape(-1, kv, hd)[:ctx]  # [ctx, KV, hd] stored
            scales = np.take(scale, table, axis=0).reshape(-1, kv)[:ctx] if self.fmt.scaled else None  # [ctx, KV]
            return decode(rows, scales, self.fmt)

        return gather(self.k, self.k_scale), gather(self.v, self.v_scale)


class KVCache:
    """The cache arrays of every layer, every page written at allocation (resident from the start)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: str):
        self.fmt = kv_format(dtype)
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = np.empty(shape, dtype=self.fmt.storage)  # [L, num_blocks, block_size, KV, hd]
        self.v = np.empty(shape, dtype=self.fmt.storage)
        scale_shape = shape[:4] if self.fmt.scaled else (num_layers, 0)
        self.k_scale = np.empty(scale_shape, dtype=np.float32)  # [L, num_blocks, block_size, KV] (int8)
        self.v_scale = np.empty(scale_shape, dtype=np.float32)
        for a in (self.k, self.v, self.k_scale, self.v_scale):  # written now: resident from the start (numpy_runner.py)
            a.fill(0)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def layer(self, i: int) -> KVLayer:
        return KVLayer(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i], self.fmt)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; NaN stays NaN."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, ((b >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def encode(x: np.ndarray, fmt: KVFormat) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 rows [..., hd] -> (stored [..., hd], scales [...] for int8 else None): the kernels' conversion."""
    x = np.asarray(x, dtype=np.float32)
    if fmt.name == "float16":
        with np.errstate(over="ignore"):  # beyond 65504: inf, as the kernels' conversion
            return x.astype(np.float16), None
    if fmt.name == "bfloat16":
        return bf16_bits(x), None
    if fmt.name == "int8":
        amax = np.abs(x).max(axis=-1)  # [...]
        inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
        q = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
        return q, (amax / np.float32(127.0)).astype(np.float32)
    return x.copy(), None


def decode(stored: np.ndarray, scales: np.ndarray | None, fmt: KVFormat) -> np.ndarray:
    """Stored rows [..., hd] (and int8 scales [...]) -> float32, as the kernels widen them."""
    if fmt.name == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    if fmt.name == "int8":
        return stored.astype(np.float32) * scales[..., None]
    return stored.astype(np.float32)
