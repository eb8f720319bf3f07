"""The compiled causal attention (service/engine/quant/_kernels.c) against the numpy one it replaces.

Shapes cover the AVX2 path (head_dim a multiple of 16) and the portable one (other head sizes, or forced),
GQA groups of 1 to 6 query heads per KV head, a first prefill chunk (n == ctx) and later ones (n < ctx), one
thread and the pool. The paged-runner tests (test_paged_runner, test_quantized) run it inside whole models.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.quant import kernels as quant
from service.engine.runners.kernels import causal_attention_numpy

pytestmark = pytest.mark.skipif(
    quant.attention(np.zeros((1, 1, 16), np.float32), *[np.zeros((1, 1, 16), np.float32)] * 2) is None,
    reason="the C extension is not built (pip install -e . with a C compiler)",
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


@pytest.fixture(params=[False, True], ids=["native-isa", "portable"])
def isa(request: pytest.FixtureRequest):
    from service.engine.quant import _kernels

    _kernels.force_generic(request.param)
    yield
    _kernels.force_generic(False)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-ctx{}-h{}-kv{}-hd{}".format(*s))
@pytest.mark.parametrize("threads", [1, 0], ids=["1-thread", "pool"])
def test_compiled_attention_equals_numpy(shape: tuple, threads: int, isa) -> None:
    n, ctx, heads, kv_heads, hd = shape
    rng = np.random.default_rng(n * 1000 + ctx)
    q = rng.standard_normal((n, heads, hd), dtype=np.float32) / np.float32(np.sqrt(hd))
    k = rng.standard_normal((ctx, kv_heads, hd), dtype=np.float32) * 2
    v = rng.standard_normal((ctx, kv_heads, hd), dtype=np.float32)
    ref = causal_attention_numpy(q, k, v)  # [n, H * hd]
    out = quant.attention(q, k, v, threads)
    assert out.shape == ref.shape
    assert float(np.abs(out - ref).max() / np.abs(ref).max()) < 1e-5


def test_large_scores_do_not_overflow() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((20, 2, 64), dtype=np.float32) * 30  # scores in the thousands
    k = rng.standard_normal((40, 1, 64), dtype=np.float32)
    v = rng.standard_normal((40, 1, 64), dtype=np.float32)
    out = quant.attention(q, k, v)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, causal_attention_numpy(q, k, v), rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_refused() -> None:
    from service.engine.quant import _kernels

    q = np.zeros((4, 3, 16), np.float32)
    kv = np.zeros((2, 1, 16), np.float32)  # ctx 2 < n 4
    with pytest.raises(ValueError, match="n <= ctx"):
        _kernels.attention(q, kv, kv, np.empty((4, 48), np.float32), 4, 2, 3, 1, 16, 1)
    with pytest.raises(ValueError, match="too small"):
        _kernels.attention(q, kv, kv, np.empty((4, 48), np.float32), 4, 8, 3, 1, 16, 1)
