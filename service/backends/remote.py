"""What the two remote backends share (TensorRT-LLM's Executor, a Triton server): the model runs elsewhere and
streams token ids (or text) back; these pieces turn our requests into what TensorRT-LLM reads and its streams
into our RequestOutputs the same way for both.

- sampling_values(): our SamplingParams as TensorRT-LLM's sampling fields, its greedy and seed traps handled;
- EndIds: the end, pad and extra end-of-sequence ids of the engine's tokenizer, as a request sends them;
- RemoteRequest: one request in flight: its text (our detokenizer and stop strings), tokens and their times,
  the stop rules (service/stops.py) applied to each streamed token, and its Timing from the server's stamps.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from build_engine.spec import EngineConfig
from service.request import GenerateRequest, RequestTiming, SamplingParams
from service.stops import Stop, stop_for
from service.textstream import RequestText


def sampling_values(p: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters under TensorRT-LLM's names (SamplingConfig's keywords; Triton's inputs rename a few).

    TensorRT-LLM samples greedily whenever top_k is unset/0/1 and top_p is unset/0, whatever the temperature
    (regularizeTopKTopP), so temperature 0 sends top_k=1 and temperature > 0 without top-k/top-p sends
    top_p=1.0; with no seed its runtime seed is 0 for every request, so each request without one draws its own.
    Unset fields are left out (TensorRT-LLM's defaults are ours). min_p is never sent: both remote backends
    refuse it (whether a TensorRT engine's decoder applies SamplingConfig.min_p is unverified, docs/gpu.md).
    """
    kw: dict[str, Any] = {"seed": p.seed if p.seed is not None else secrets.randbits(63)}
    if p.greedy:
        kw["top_k"] = 1
    else:
        kw["temperature"] = p.temperature
        if p.top_k:
            kw["top_k"] = p.top_k
        if p.top_p < 1.0 or not p.top_k:
            kw["top_p"] = p.top_p
    if p.min_tokens:
        kw["min_tokens"] = p.min_tokens
    if p.repetition_penalty != 1.0:
        kw["repetition_penalty"] = p.repetition_penalty
    if p.presence_penalty:
        kw["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        kw["frequency_penalty"] = p.frequency_penalty
    return kw


@dataclass(frozen=True, slots=True)
class EndIds:
    """The tokenizer's end-of-sequence ids as TensorRT-LLM takes them: one end id, a pad id, the others as
    single-token stop words."""

    end_id: int
    pad_id: int
    extra_eos: tuple[int, ...]
    eos: frozenset[int]  # every end-of-sequence id (the stop rules' EOS)

    @classmethod
    def of(cls, config: EngineConfig) -> EndIds:
        ids = config.tokenizer
        end = ids.eos_token_ids[0]
        pad = ids.pad_token_id if ids.pad_token_id is not None else end
        return cls(end, pad, tuple(ids.eos_token_ids[1:]), frozenset(ids.eos_token_ids))

    def end_id_for(self, p: SamplingParams) -> int:
        return -1 if p.ignore_eos else self.end_id  # -1: TensorRT-LLM never stops on an end id

    def stop_words(self, p: SamplingParams) -> list[int]:
        """Our stop token ids and the extra end-of-sequence ids (unless ignore_eos), one-token stop words each."""
        return [*p.stop_token_ids, *(() if p.ignore_eos else self.extra_eos)]


@dataclass
class RemoteRequest:
    """One request on a remote server, as the backend's callback thread sees it."""

    gen: GenerateRequest
    text: RequestText
    arrival: float  # time.monotonic() when sent (the clock TensorRT-LLM stamps with)
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    def push(self, tokens: Sequence[int], now: float, eos: frozenset[int]) -> tuple[list[int], Stop | None]:
        """Take streamed tokens up to the first that ends the request by our stop rules: (taken, its Stop)."""
        taken: list[int] = []
        for token in tokens:
            self.token_ids.append(token)
            self.token_times.append(now)
            taken.append(token)
            stop = stop_for(token, self.gen.sampling, eos, len(self.token_ids), stop_string=self.text.push(token))
            if stop is not None:
                return taken, stop
        return taken, None

    def timing(self, stamps: Sequence[float | None] | None, now: float, same_clock: bool) -> RequestTiming:
        """From the server's (arrival, first scheduled, first token, last token) stamps; without them (or without an
        arrival), measured here (Timing.source = edge). same_clock: the stamps are on our monotonic clock (an
        in-process executor), so `now` may end a request the server did not stamp the end of; else only the
        stamps' differences mean anything."""
        if stamps is not None and stamps[0]:
            arrival, scheduled, first, last = stamps
            finish = last or (now if same_clock else arrival)
            return RequestTiming.from_times(
                arrival, scheduled or None, self.token_times, finish, first_token=first or None,
                last_token=last or None,
            )  # fmt: skip
        return RequestTiming.from_times(self.arrival, None, self.token_times, now, source="edge")
