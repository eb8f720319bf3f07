"""What a model runner takes and returns for one forward pass over a flattened, unpadded batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.engine.scheduler_output import SchedulerOutput


class ChunkLike(Protocol):
    token_ids: Sequence[int]
    num_computed: int
    block_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's part of a step: `token_ids` at positions num_computed .. num_computed + len - 1."""

    token_ids: Sequence[int]  # the new tokens (a prefill chunk, or one decode token)
    num_computed: int  # tokens of this sequence already in the KV cache
    block_ids: Sequence[int]  # the sequence's block table (must cover num_computed + len(token_ids) tokens)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Flattened inputs of one step, named as flash-attention / vLLM name them.

    T = total new tokens in the step, B = sequences in the step.
    """

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64, absolute position of each token in its sequence
    slot_mapping: np.ndarray  # [T] int64, block_id * block_size + offset: where each token's K/V is written
    query_start_loc: np.ndarray  # [B + 1] int64, token range of sequence b is [qsl[b], qsl[b + 1])
    seq_lens: np.ndarray  # [B] int64, tokens in the KV cache for sequence b once this step has written
    block_tables: list[np.ndarray]  # B arrays of [ceil(seq_lens[b] / block_size)] int64 block ids
    logits_rows: np.ndarray  # [R] int64, the token rows that go through the LM head, in order: the last new token
    # of each sampled sequence (every new token of a verify step's)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_chunks(
        cls,
        chunks: Sequence[ChunkLike],
        block_size: int,
        logits_seqs: Sequence[int] | None = None,
        all_rows: Sequence[int] = (),
    ) -> ForwardBatch:
        """logits_seqs: the sequences whose last new token goes through the LM head (None: all); all_rows: those
        of them whose every new token does (a verify step of speculative decoding)."""
        token_ids, positions, slots, starts, lens, tables = [], [], [], [0], [], []
        for c in chunks:
            n = len(c.token_ids)
            end = c.num_computed + n
            table = np.asarray(c.block_ids[: -(-end // block_size)], dtype=np.int64)  # blocks covering `end` tokens
            if len(table) * block_size < end:
                raise ValueError(f"block table of {len(c.block_ids)} blocks cannot hold {end} tokens")
            pos = np.arange(c.num_computed, end, dtype=np.int64)  # [n]
            token_ids.append(np.asarray(c.token_ids, dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            starts.append(starts[-1] + n)
            lens.append(end)
            tables.append(table)
        seqs = np.arange(len(chunks)) if logits_seqs is None else np.asarray(logits_seqs, dtype=np.int64)
        every = set(all_rows)
        rows = [r for b in seqs for r in (range(starts[b], starts[b + 1]) if b in every else (starts[b + 1] - 1,))]
        return cls(
            token_ids=np.concatenate(token_ids),
            positions=np.concatenate(positions),
            slot_mapping=np.concatenate(slots),
            query_start_loc=np.asarray(starts, dtype=np.int64),
            seq_lens=np.asarray(lens, dtype=np.int64),
            block_tables=tables,
            logits_rows=np.asarray(rows, dtype=np.int64),
        )

    @classmethod
    def from_scheduler_output(cls, sched: SchedulerOutput, block_size: int) -> ForwardBatch:
        """The step the scheduler decided; logits only for sequences that sample a token."""
        sampled = [i for i, s in enumerate(sched.scheduled) if s.sample]
        verified = [i for i in sampled if sched.scheduled[i].num_drafts]
        return cls.from_chunks(sched.scheduled, block_size, sampled, verified)


class ModelRunner(Protocol):
    """Owns the weights and the KV cache arrays; knows nothing about requests, queues or scheduling."""

    num_kv_blocks: int
    block_size: int

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        """Run one forward pass; return the logits of batch.logits_rows, [R, vocab] float32."""
        ...
