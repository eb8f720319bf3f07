"""When a request ends: the stop rules, decided in one place for every backend (a leaf module: no numpy, no grpc).

The native engine's scheduler applies them to each new token in its update; the remote backends (TensorRT-LLM,
Triton) apply them to the tokens their server streams back, so the same tokens end a request at the same place
whatever runs the model. In order: a stop token id, an end-of-sequence token (unless ignore_eos), the length
(max_tokens, or the engine's max_seq_len), a stop string the token's text completed.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.request import SamplingParams


@dataclass(frozen=True, slots=True)
class Stop:
    """Why a request ended: finish reason "stop" (with the stop token id or string, None for an EOS) or
    "length"."""

    finish_reason: str
    stop_reason: str | int | None = None


def stop_for(
    token: int,
    sampling: SamplingParams,
    eos_token_ids: frozenset[int] | tuple[int, ...],
    num_output_tokens: int,
    num_tokens: int | None = None,
    max_seq_len: int | None = None,
    stop_string: str | None = None,
) -> Stop | None:
    """Whether `token` (the num_output_tokens-th of the request, num_tokens with the prompt) ends the request;
    `stop_string`: the stop string its text completed, if any."""
    if token in sampling.stop_token_ids:
        return Stop("stop", token)
    if not sampling.ignore_eos and token in eos_token_ids:
        return Stop("stop")
    if num_output_tokens >= sampling.max_tokens or (
        max_seq_len is not None and num_tokens is not None and num_tokens >= max_seq_len
    ):
        return Stop("length")
    if stop_string is not None:
        return Stop("stop", stop_string)
    return None
