"""Every layer of an all-decode step in one compiled call (csrc/decode_step.c).

The runner's Python loop calls about 12 kernels a layer; in a one-token step their interpreter and argument
costs are about a tenth of the step (docs/benchmarks.md). DecodeLayers runs the same kernels in the same order on
the same buffers from C, so it gives the same bits (tests/test_decode_step.py). It applies where every layer
matrix is packed and the extension does the matmuls and decode attention; elsewhere (fp32 engines, no
extension, numba) and for steps with a longer prefill chunk, the runner's Python loop runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from build_engine.packing import PackedMatrix
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KVCache
from service.engine.kernels.matmul import KIND_ID


class DecodeLayers:
    """The layers' weights held once by the extension (a capsule), and the call that runs them all."""

    def __init__(self, layers: Sequence, heads: tuple[int, int, int], eps: float) -> None:
        """layers: the runner's LayerWeights (numpy_runner.py), every matrix packed; heads: H, KV, hd."""
        H, KV, hd = heads
        first = layers[0]
        D, F = first.qkv.cols, first.gate_up.rows // 2
        specs = [
            (
                *(a for m in (w.qkv, w.o, w.gate_up, w.down) for a in (m.data, KIND_ID[m.kind])),
                w.attn_norm,
                w.ffn_norm,
                float(w.q_scale) if w.q_scale is not None else 0.0,
            )
            for w in layers
        ]
        self.model = BACKEND.ext.decode_model(specs, D, H, KV, hd, F, float(eps))

    @staticmethod
    def applies(layers: Sequence, decode_attention: str | None) -> bool:
        """Whether the compiled path can run these layers: the extension does the matmuls and decode attention,
        and every layer matrix is packed."""
        if BACKEND.ext is None or BACKEND.matmul != "c" or decode_attention != "c" or not layers:
            return False
        return all(isinstance(m, PackedMatrix) for w in layers for m in (w.qkv, w.o, w.gate_up, w.down))

    def __call__(
        self,
        x: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        prepared: tuple,
        kv: KVCache,
        rope: np.ndarray,
        threads: int,
    ) -> None:
        """x [T, D] (float32, C-contiguous) in place through every layer; positions, slot_mapping [T] int64;
        prepared: DecodeAttention.prepare() of every row in order (a decode query each); rope: rope_tables()
        [2, P, hd/2]; threads: the decode attention's (ThreadPolicy.attention_threads)."""
        tables, starts, lens = prepared
        _, num_blocks, block_size = kv.k.shape[:3]
        BACKEND.ext.decode_layers(
            self.model,
            x,
            rope,
            positions,
            slot_mapping,
            kv.k,
            kv.v,
            kv.k_scale,
            kv.v_scale,
            tables,
            starts,
            lens,
            x.shape[0],
            rope.shape[1],
            num_blocks,
            block_size,
            kv.fmt.code,
            threads,
        )
