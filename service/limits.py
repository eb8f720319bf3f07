"""What every request is checked against, once, when a backend admits it (a leaf module: no numpy, no grpc).

Field-level ranges (temperature, top_p, ...) are checked when SamplingParams is built; this module checks what
depends on the model: token ids against the vocabulary, and whether the request can ever fit the context and
the KV cache. Messages name fields the way the llm.v1 API spells them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.errors import InvalidRequest
from service.request import CONSTRAINT_FIELDS, SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_seq_len: int  # prompt + max_tokens of one request
    kv_block_size: int | None = None  # with num_kv_blocks: the whole KV cache, when the backend knows it
    num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= 0 or self.max_seq_len <= 0:
            raise ValueError("vocab_size and max_seq_len must be positive")


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{field} contains token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_request(prompt_token_ids: Sequence[int], sampling: SamplingParams, limits: RequestLimits) -> None:
    """Raise InvalidRequest if the request is malformed for this model or could never run."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequest("the prompt is empty")
    check_token_ids(prompt_token_ids, limits.vocab_size, "prompt_token_ids.ids")
    check_token_ids(sampling.stop_token_ids, limits.vocab_size, "stopping.stop_token_ids")
    total = num_prompt + sampling.max_tokens
    if total > limits.max_seq_len:
        raise InvalidRequest(
            f"prompt ({num_prompt} tokens) + max_tokens ({sampling.max_tokens}) = {total} exceeds "
            f"max_seq_len {limits.max_seq_len}"
        )
    if limits.num_kv_blocks is not None and limits.kv_block_size:
        blocks = -(-total // limits.kv_block_size)
        if blocks > limits.num_kv_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens needs {blocks} KV blocks, more than the whole KV cache "
                f"({limits.num_kv_blocks} blocks)"
            )


def check_constraint(sampling: SamplingParams, kinds: Sequence[str], backend: str) -> None:
    """Raise InvalidRequest if the request's constraint is of a kind the backend cannot apply (`kinds`: its
    BackendInfo.constraint_kinds): a constraint is never silently dropped."""
    c = sampling.constraint
    if c is not None and c.kind not in kinds:
        supported = ", ".join(CONSTRAINT_FIELDS[k] for k in kinds) or "none"
        raise InvalidRequest(
            f"constraint: the {backend} backend does not support {CONSTRAINT_FIELDS[c.kind]} constraints "
            f"(supported: {supported})"
        )
