"""The compiled causal attention (service/engine/kernels/csrc/attention.c) against the numpy one it replaces.

Shapes cover the AVX-512 path (head_dim a multiple of 16; 64 and 128 compiled apart), the AVX2 one (a multiple of
8) and the portable one (other head sizes), each run on every kernel ISA the CPU has (the kernel_isa fixture),
GQA groups of 1 to 6 query heads per KV head, a first prefill chunk (n == ctx) and later ones (n < ctx), one
thread and the pool. The paged-runner tests (test_paged_runner, test_quantized) run it inside whole models.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.kernels.attention import causal_attention, causal_attention_numpy, paged_causal_attention
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KV_FORMATS, KVLayer
from service.engine.kernels.paged_attention import DecodeAttention

pytestmark = pytest.mark.skipif(
    BACKEND.ext is None, reason="the C extension is not built (pip install -e . with a C compiler)"
)
SHAPES = [  # n, ctx, heads, kv_heads, head_dim
    (512, 512, 9, 3, 64),
    (37, 300, 9, 3, 64),
    (1, 17, 4, 2, 16),
    (70, 90, 12, 2, 128),
    (33, 33, 10, 2, 32),
    (100, 100, 4, 4, 8),
    (64, 200, 8, 1, 20),
    (5, 5, 2, 2, 12),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-ctx{}-h{}-kv{}-hd{}".format(*s))
@pytest.mark.parametrize("threads", [1, 0], ids=["1-thread", "pool"])
def test_compiled_attention_equals_numpy(shape: tuple, threads: int, kernel_isa) -> None:
    n, ctx, heads, kv_heads, hd = shape
    rng = np.random.default_rng(n * 1000 + ctx)
    q = rng.standard_normal((n, heads, hd), dtype=np.float32) / np.float32(np.sqrt(hd))
    k = rng.standard_normal((ctx, kv_heads, hd), dtype=np.float32) * 2
    v = rng.standard_normal((ctx, kv_heads, hd), dtype=np.float32)
    ref = causal_attention_numpy(q, k, v)  # [n, H * hd]
    out = causal_attention(q, k, v, threads)
    assert out.shape == ref.shape
    assert float(np.abs(out - ref).max() / np.abs(ref).max()) < 1e-5


def float32_layer(k: np.ndarray, v: np.ndarray) -> KVLayer:
    """A float32 paged cache layer over k, v [num_blocks, bs, KV, hd]."""
    none = np.zeros(0, np.float32)
    return KVLayer(k, v, none, none, KV_FORMATS["float32"])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-ctx{}-h{}-kv{}-hd{}".format(*s))
@pytest.mark.parametrize("threads", [1, 0], ids=["1-thread", "pool"])
def test_paged_attention_reads_the_blocks_in_place(shape: tuple, threads: int, kernel_isa) -> None:
    """The same attention read through a block table from a paged cache (scattered blocks, a partial last one):
    bitwise the contiguous kernel's result."""
    n, ctx, heads, kv_heads, hd = shape
    rng = np.random.default_rng(n * 7 + ctx)
    bs = 16
    nblk = -(-ctx // bs)
    q = rng.standard_normal((n, heads, hd), dtype=np.float32) / np.float32(np.sqrt(hd))
    k_layer = rng.standard_normal((3 * nblk + 5, bs, kv_heads, hd), dtype=np.float32)
    v_layer = rng.standard_normal((3 * nblk + 5, bs, kv_heads, hd), dtype=np.float32)
    table = rng.permutation(len(k_layer))[:nblk].astype(np.int64)
    k = k_layer[table].reshape(-1, kv_heads, hd)[:ctx]
    v = v_layer[table].reshape(-1, kv_heads, hd)[:ctx]
    contiguous = causal_attention(q, k, v, threads)
    paged = paged_causal_attention(q, float32_layer(k_layer, v_layer), table, ctx, threads)
    np.testing.assert_array_equal(paged, contiguous)


def test_paged_attention_refuses_block_ids_outside_the_cache() -> None:
    q = np.zeros((2, 2, 16), np.float32)
    cache, none = np.zeros((4, 16, 1, 16), np.float32), np.zeros(0, np.float32)
    with pytest.raises(ValueError, match="block id 4 out of range"):
        BACKEND.ext.paged_attention(q, cache, cache, none, none, np.array([0, 4], np.int64),
                                    np.empty((2, 32), np.float32), 2, 20, 2, 1, 16, 16, 4, 1, 0)  # fmt: skip


def test_large_scores_do_not_overflow() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((20, 2, 64), dtype=np.float32) * 30  # scores in the thousands
    k = rng.standard_normal((40, 1, 64), dtype=np.float32)
    v = rng.standard_normal((40, 1, 64), dtype=np.float32)
    out = causal_attention(q, k, v, 0)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, causal_attention_numpy(q, k, v), rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_refused() -> None:
    q = np.zeros((4, 3, 16), np.float32)
    kv = np.zeros((2, 1, 16), np.float32)  # ctx 2 < n 4
    with pytest.raises(ValueError, match="n <= ctx"):
        BACKEND.ext.attention(q, kv, kv, np.empty((4, 48), np.float32), 4, 2, 3, 1, 16, 1)
    with pytest.raises(ValueError, match="too small"):
        BACKEND.ext.attention(q, kv, kv, np.empty((4, 48), np.float32), 4, 8, 3, 1, 16, 1)


@pytest.mark.parametrize("lens", [(1500,), (2000, 300), (700, 513, 64)], ids=str)
def test_split_key_decode_attention_equals_float64(lens: tuple[int, ...]) -> None:
    """Few sequences with long contexts take the split-K path on the pool (partials combined); short ones and
    1-thread calls do not: all must equal a float64 softmax over the same paged keys."""
    rng = np.random.default_rng(len(lens))
    H, KV, hd, bs = 9, 3, 64, 16  # SmolLM2's heads
    tables = [rng.permutation(200)[: -(-n // bs)] + 0 for n in lens]
    k = rng.standard_normal((200, bs, KV, hd), dtype=np.float32)
    v = rng.standard_normal((200, bs, KV, hd), dtype=np.float32)
    q = rng.standard_normal((len(lens), H, hd), dtype=np.float32) * 0.3
    prepared = DecodeAttention.prepare([t.astype(np.int64) for t in tables], np.array(lens))
    # the pool (split-K), then the calling thread
    results = [DecodeAttention("c")(q, float32_layer(k, v), prepared, threads) for threads in (0, 1)]
    for b, n in enumerate(lens):
        slots = np.concatenate([np.arange(bs) + blk * bs for blk in tables[b]])[:n]
        kb = k.reshape(-1, KV, hd)[slots].astype(np.float64)  # [n, KV, hd]
        vb = v.reshape(-1, KV, hd)[slots].astype(np.float64)
        for h in range(H):
            s = kb[:, h // (H // KV)] @ q[b, h].astype(np.float64)
            p = np.exp(s - s.max())
            ref = (p / p.sum()) @ vb[:, h // (H // KV)]
            for out in results:
                assert np.abs(out[b, h] - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), (b, h)
