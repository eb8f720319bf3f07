"""What the scheduler decided for one step (a leaf module shared by the scheduler, engine and runner)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's share of a step."""

    req_id: str
    token_ids: list[int]  # the tokens to compute now: a prefill chunk, or one decode token (+ its drafts)
    num_computed: int  # tokens of the request already in the KV cache
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this chunk reaches the request's last token: a new token comes out
    is_decode: bool  # one token of a request that is already generating (else prefill / recompute)
    num_drafts: int = 0  # speculative draft tokens at the end of token_ids (a verify step; decodes only)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens this step
    total_num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0  # prompt (or recompute) tokens this step
    num_decode_tokens: int = 0  # generated-token steps this step
    num_draft_tokens: int = 0  # speculative draft tokens verified this step (besides the decode tokens)
    newly_scheduled_req_ids: list[str] = field(default_factory=list)  # first time ever scheduled
    preempted_req_ids: list[str] = field(default_factory=list)  # preempted (by recompute) this step

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
