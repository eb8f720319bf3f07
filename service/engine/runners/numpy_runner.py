"""The native model runner: a Llama forward pass in numpy over a paged KV cache.

One execute() runs a flattened batch that may mix prefill chunks and decode tokens of many sequences
(no padding), writes each new token's K/V through the slot mapping and reads each sequence's context
through its block table. Only each sequence's last position goes through the LM head.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from build_engine import spec
from build_engine.packing import PackedMatrix, aligned_empty, from_stored
from build_engine.spec import EngineConfig, load_engine_config
from build_engine.tensor_io import SafetensorsFile
from service.engine.kernels.attention import paged_causal_attention
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.decode_step import DecodeLayers
from service.engine.kernels.kv_cache import DEFAULT_KV_CACHE_DTYPE, KVCache, kv_format
from service.engine.kernels.ops import (
    apply_rope,
    embedding_rows,
    linear,
    rms_normalize,
    rope_tables,
    silu_mul,
    write_kv,
)
from service.engine.kernels.paged_attention import DecodeAttention
from service.engine.kernels.threads import ThreadPolicy
from service.engine.runners.base import ForwardBatch

logger = logging.getLogger(__name__)


# A sequence with at most this many new tokens in a step (a decode, a speculative verify step of up to 16 drafts, a
# short prefill chunk) has each row's attention computed by the paged decode kernel as a query of its own: the same
# per-query routine as the prefill kernel (bitwise the same result, csrc/decode_attention.c), which at long
# contexts reads the keys faster than the prefill kernel does for a few rows.
SMALL_CHUNK_ROWS = 17


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one step's attention is split, worked out once per step and reused by every layer."""

    decode_seqs: list[int]  # sequences of at most SMALL_CHUNK_ROWS new tokens: the paged decode kernel (C, else
    # numba), one query per token row (a decode, a verify step's rows, a short chunk)
    decode_tokens: np.ndarray  # [Bd] their token rows in the flat batch (every row of those sequences, in order)
    decode_inputs: tuple | None  # DecodeAttention.prepare() of a block table and visible keys per row
    other_seqs: list[int]  # longer prefill chunks: causal attention over the blocks (C, else numpy)


Matrix = np.ndarray | PackedMatrix  # fp32 [out, in], or quantized blocks (build_engine/packing.py)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    qkv: Matrix  # [q_size + 2 * kv_size, D]
    o: Matrix  # [D, q_size]
    gate_up: Matrix  # [2F, D]
    down: Matrix  # [D, F]
    attn_norm: np.ndarray | None  # [D] gain on the activations; None: folded into qkv (fp32 engines)
    ffn_norm: np.ndarray | None  # [D] gain on the activations; None: folded into gate_up
    q_scale: np.float32 | None  # 1/sqrt(hd) applied to q after the matmul; None: folded into qkv's Q rows


class NumpyRunner:
    """Owns the weights (memory-mapped), the KV cache arrays and its thread policy.

    decode_attention: "c", "numba" (DecodeAttention) or "numpy" (gathered blocks, attention.py); the
    process's choice (kernels/backend.py) unless a test asks for another. The numba kernel reads float32 only:
    with another kv_cache_dtype and no extension, decode attention gathers (numpy).
    kv_cache_dtype: the KV cache's stored type (kernels/kv_cache.py).
    fuse_decode: run a step whose rows are all decode queries through every layer in one compiled call
    (kernels/decode_step.py: the same kernels in the same order) where it applies; False: always the Python
    loop (tests compare the two, the benchmarks' per-kernel breakdown times it)."""

    def __init__(
        self,
        engine_dir: str | Path,
        num_kv_blocks: int,
        config: EngineConfig | None = None,
        decode_attention: str = BACKEND.decode_attention,
        kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE,
        fuse_decode: bool = True,
    ) -> None:
        self.config = config or load_engine_config(engine_dir)
        arch = self.config.arch
        self.block_size = self.config.limits.kv_block_size
        self.num_kv_blocks = num_kv_blocks
        self.n_heads, self.n_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        w = SafetensorsFile(Path(engine_dir) / spec.WEIGHTS_FILE)
        packed = json.loads(w.metadata.get("packed", "{}"))
        folded = packed.pop("q_scale_folded", {})

        def matrix(name: str) -> Matrix:  # a memory map either way: loading converts nothing
            return from_stored(w.raw(name)[0], packed[name]) if name in packed else w.get(name)

        self.embed = matrix("embed")  # [V, D]
        self.lm_head = self.embed if arch.tie_word_embeddings else matrix("lm_head")  # [V, D]
        self.final_norm = w.get("final_norm")  # [D]
        self.weight_format = self.config.weight_format
        scale = np.float32(1.0 / np.sqrt(arch.head_dim))
        self.layers = []
        for i in range(arch.num_hidden_layers):
            p = f"layers.{i}."
            norms = [w.get(p + n) if p + n in w else None for n in ("attn_norm", "ffn_norm")]
            q_scale = None if norms[0] is None or folded.get(p + "qkv", False) else scale
            mats = (matrix(p + n) for n in ("qkv", "o", "gate_up", "down"))
            self.layers.append(LayerWeights(*mats, *norms, q_scale))
        self.packed = bool(packed)
        self.threads = ThreadPolicy.for_weights(self.packed)
        self.bind_threads()
        factors = w.get("rope_freq_factors") if arch.rope_freq_factors else None
        self.rope = rope_tables(self.config.limits.max_seq_len, arch.head_dim, arch.rope_theta, factors)  # [2, P, hd/2]
        # Every page is written now: the pool is memory the server has committed to, so it is resident from the
        # start (a container's memory limit fails at startup, not under load) and RSS stays flat while blocks
        # are used for the first time (zeros alone would map pages lazily: +KV budget over a soak's first hour).
        self.kv_cache = KVCache(
            arch.num_hidden_layers,
            num_kv_blocks,
            self.block_size,
            arch.num_key_value_heads,
            arch.head_dim,
            kv_cache_dtype,
        )  # k, v: [L, num_blocks, block_size, KV, hd] of the stored type
        if decode_attention == "numba" and self.kv_cache.fmt.name != "float32":
            decode_attention = "numpy"  # numba_kernels.decode_attention reads float32 only
        self.decode_attention = DecodeAttention(decode_attention) if decode_attention != "numpy" else None
        fused = fuse_decode and DecodeLayers.applies(self.layers, decode_attention)
        self.decode_layers = (
            DecodeLayers(self.layers, (self.n_heads, self.n_kv_heads, self.head_dim), self.eps) if fused else None
        )
        logger.info(
            "KV cache: %d blocks x %d tokens, %s, %.1f MiB (resident)",
            num_kv_blocks,
            self.block_size,
            self.kv_cache.fmt.name,
            self.kv_cache.nbytes / 2**20,
        )

    def bind_threads(self) -> None:
        """Set OpenBLAS's threads (process-wide) for this engine's policy (the constructor does; a process that
        runs several engines in turn, like the benchmarks, calls it before each)."""
        self.threads.bind()

    @property
    def weight_bytes(self) -> int:
        """Bytes every decode step streams, as stored (packed 4-bit blocks count as 4-bit): all layer matrices,
        the LM head and the final norm (one embedding row besides)."""
        layers = sum(m.nbytes for w in self.layers for m in (w.qkv, w.o, w.gate_up, w.down))
        return layers + self.lm_head.nbytes + self.final_norm.nbytes

    @staticmethod
    def kv_bytes_per_block(config: EngineConfig, kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> int:
        """K and V of one block over every layer, in the stored type (int8's scales included)."""
        arch = config.arch
        per_slot = kv_format(kv_cache_dtype).bytes_per_slot(arch.num_key_value_heads, arch.head_dim)
        return 2 * arch.num_hidden_layers * config.limits.kv_block_size * per_slot

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        """Forward pass over the batch; logits of batch.logits_rows, [R, V]."""
        # token_ids, positions, slot_mapping: [T]
        plan = self._plan(batch)
        x = embedding_rows(self.embed, batch.token_ids)  # [T, D] residual stream (a copy)
        if self.decode_layers is not None and not plan.other_seqs:  # every row a decode query: one C call
            x = np.ascontiguousarray(x, dtype=np.float32)
            threads = self.threads.attention_threads
            self.decode_layers(
                x, batch.positions, batch.slot_mapping, plan.decode_inputs, self.kv_cache, self.rope, threads
            )
        else:
            self._layers(x, batch, plan)
        last = x[batch.logits_rows]  # [R, D] the last new token of each sampled seq (every token of a verify step)
        h = rms_normalize(last, self.eps, self.final_norm)  # [R, D]
        return linear(h, self.lm_head)  # [R, V]

    def _layers(self, x: np.ndarray, batch: ForwardBatch, plan: AttentionPlan) -> None:
        """x [T, D] in place through every layer, kernel by kernel (what DecodeLayers does in one call)."""
        T = batch.num_tokens
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        for layer, w in enumerate(self.layers):
            # attention block
            h = rms_normalize(x, self.eps, w.attn_norm)  # [T, D]
            qkv = linear(h, w.qkv).reshape(T, H + 2 * KV, hd)  # [T, H + 2KV, hd]
            if w.q_scale is not None:
                qkv[:, :H] *= w.q_scale
            apply_rope(qkv, self.rope, batch.positions, H + KV)  # rotate Q and K heads together, in place
            self._write_kv(layer, qkv, batch.slot_mapping)
            attn = self._attention(layer, qkv[:, :H], batch, plan)  # [T, H * hd]
            x += linear(attn, w.o)  # [T, D]
            # feed-forward block
            h = rms_normalize(x, self.eps, w.ffn_norm)  # [T, D]
            x += linear(silu_mul(linear(h, w.gate_up)), w.down)  # [T, 2F] -> [T, F] -> [T, D]

    def _write_kv(self, layer: int, qkv: np.ndarray, slot_mapping: np.ndarray) -> None:
        # qkv: [T, H + 2KV, hd]; slot = block_id * block_size + offset in the layer's cache
        write_kv(self.kv_cache.layer(layer), qkv, slot_mapping, self.n_heads)

    def _plan(self, batch: ForwardBatch) -> AttentionPlan:
        lens = np.diff(batch.query_start_loc)  # [B] new tokens per sequence
        small = [b for b in range(batch.num_seqs) if lens[b] <= SMALL_CHUNK_ROWS] if self.decode_attention else []
        rows, tables, visible = [], [], []  # one decode query per token row: row i of n sees L - n + 1 + i keys
        for b in small:
            n, first, end = int(lens[b]), int(batch.query_start_loc[b]), int(batch.seq_lens[b])
            rows += range(first, first + n)
            tables += [batch.block_tables[b]] * n
            visible += range(end - n + 1, end + 1)
        inputs = self.decode_attention.prepare(tables, np.asarray(visible, dtype=np.int64)) if small else None
        chosen = set(small)
        others = [b for b in range(batch.num_seqs) if b not in chosen]
        return AttentionPlan(small, np.asarray(rows, dtype=np.int64), inputs, others)

    def _attention(self, layer: int, q: np.ndarray, batch: ForwardBatch, plan: AttentionPlan) -> np.ndarray:
        # q: [T, H, hd] -> [T, H * hd]
        kv = self.kv_cache.layer(layer)  # k, v: [num_blocks, block_size, KV, hd]
        threads = self.threads.attention_threads
        if not plan.other_seqs:  # every row is a decode query, in order (decodes, verify steps, short chunks)
            out = self.decode_attention(q, kv, plan.decode_inputs, threads)
            return out.reshape(batch.num_tokens, -1)
        out = aligned_empty((batch.num_tokens, self.n_heads * self.head_dim), np.float32)  # [T, H * hd]
        if plan.decode_seqs:
            rows = plan.decode_tokens
            decoded = self.decode_attention(q[rows], kv, plan.decode_inputs, threads)
            out[rows] = decoded.reshape(len(rows), -1)
        qsl = batch.query_start_loc
        for b in plan.other_seqs:  # one causal attention per sequence over the blocks of its table
            ctx, table, rows = int(batch.seq_lens[b]), batch.block_tables[b], slice(qsl[b], qsl[b + 1])
            out[rows] = paged_causal_attention(q[rows], kv, table, ctx, threads)
        return out
