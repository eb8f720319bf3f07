"""Requests, their sampling parameters, lifecycle and outputs (a leaf module: no numpy, no grpc)."""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from service.errors import InvalidRequest

# Caps on list-valued and count-valued fields, checked before any work (RELIABILITY: bound inputs first).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_CONSTRAINT_CHARS = 1 << 18  # a schema's or grammar's text (compiling it is bounded by this too)
MAX_CHOICES = 256
MAX_SPECULATIVE_TOKENS = 16  # drafts per verify step (SpecConfig.num_speculative_tokens caps it further)
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf", "choice", "structural_tag")
# a kind as llm.v1's Constraint message names its field (messages about a constraint name that field)
CONSTRAINT_FIELDS = {k: {"lark": "lark_grammar", "gbnf": "gbnf_grammar"}.get(k, k) for k in CONSTRAINT_KINDS}


class RequestStatus(enum.IntEnum):
    """Ordered by terminality: anything after PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # an EOS / stop token id / stop string
    FINISHED_LENGTH = 4  # max_tokens (or max_seq_len) reached
    FINISHED_ABORTED = 5  # cancelled by the client, a deadline, or shutdown
    FINISHED_ERROR = 6  # the engine failed while the request was in flight

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


@dataclass(frozen=True, slots=True)
class Constraint:
    """Structured output: what the generated text must match (vLLM's guided decoding / structured outputs,
    OpenAI's response_format, TensorRT-LLM's GuidedDecodingParams). Only the shape is checked here; whether the
    text compiles is the grammar engine's check, when a backend admits the request."""

    kind: str  # one of CONSTRAINT_KINDS
    # json_schema: the schema as JSON text; regex: the pattern; lark / gbnf: the grammar; structural_tag: its JSON;
    # json_object and choice: ""
    spec: str = ""
    choices: tuple[str, ...] = ()  # kind "choice": the output is exactly one of these strings
    any_whitespace: bool = True  # False: JSON with no free whitespace (vLLM's disable-any-whitespace)

    def __post_init__(self) -> None:
        _check(
            self.kind in CONSTRAINT_KINDS,
            f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}",
        )
        _check(
            len(self.spec) <= MAX_CONSTRAINT_CHARS,
            f"the constraint's text has {len(self.spec)} characters, more than {MAX_CONSTRAINT_CHARS}",
        )
        needs_spec = self.kind not in ("json_object", "choice")
        _check(bool(self.spec) == needs_spec, f"a {self.kind} constraint {'needs' if needs_spec else 'takes no'} text")
        _check(
            (self.kind == "choice") == bool(self.choices),
            "choices go with a choice constraint, which needs at least one",
        )
        _check(
            len(self.choices) <= MAX_CHOICES, f"choice allows at most {MAX_CHOICES} strings, got {len(self.choices)}"
        )
        _check(
            sum(map(len, self.choices)) <= MAX_CONSTRAINT_CHARS and all(self.choices),
            f"choices must be non-empty strings, {MAX_CONSTRAINT_CHARS} characters in all at most",
        )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM's names and defaults)."""

    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (HF / CTRL style)
    presence_penalty: float = 0.0  # subtracted once from tokens already generated (OpenAI style)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output (OpenAI style)
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings, matched across token boundaries, not included in the text
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the request (kept in token_ids)
    ignore_eos: bool = False  # keep generating past the model's EOS tokens
    min_tokens: int = 0  # EOS and stop token ids are suppressed until this many tokens exist
    logprobs: int | None = None  # None: none; 0: the chosen token's; N <= 20: plus the top N
    skip_special_tokens: bool = True  # leave special tokens out of the text
    constraint: Constraint | None = None  # structured output; None: free text
    # speculative drafts per step at most (docs/speculative.md): None: the server's setting; 0: none for this
    # request; k: at most k (and at most the server's num_speculative_tokens) where the server speculates
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature}",
        )
        _check(math.isfinite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(math.isfinite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(math.isfinite(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value}")
        _check(self.seed is None or 0 <= self.seed <= MAX_SEED, f"seed must be in [0, 2^63 - 1], got {self.seed}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS, f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
        )
        for s in self.stop:
            _check(
                0 < len(s) <= MAX_STOP_STRING_CHARS,
                f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters",
            )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
        )
        _check(
            self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}",
        )
        _check(
            not (self.ignore_eos and self.constraint is not None),
            "ignore_eos cannot be combined with a constraint: the grammar decides where the output ends",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float  # log-probability of the chosen token under the model's distribution
    top: tuple[tuple[int, float], ...] = ()  # the top-N (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Milliseconds on the engine's monotonic clock (definitions in docs/timing.md)."""

    queue_ms: float  # arrival -> first scheduled
    prefill_ms: float  # first scheduled -> first token
    ttft_ms: float  # arrival -> first token
    decode_ms: float  # first token -> last token
    tpot_ms: float  # decode_ms / (output tokens - 1); 0 with one token
    e2e_ms: float  # arrival -> finish
    itl_ms: tuple[float, ...] = ()  # gaps between consecutive tokens
    source: str = "engine"  # engine: the engine's own timestamps; edge: measured by the backend around it
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified for this request
    spec_accepted_tokens: int = 0  # of which accepted (docs/timing.md: several tokens per step)

    @classmethod
    def from_times(
        cls,
        arrival: float,
        scheduled: float | None,
        token_times: Sequence[float],
        finish: float,
        source: str = "engine",
        first_token: float | None = None,
        last_token: float | None = None,
    ) -> RequestTiming:
        """From seconds on one monotonic clock. first_token/last_token override token_times' ends (an engine's
        own stamps), token_times still give the inter-token gaps."""
        first = first_token if first_token is not None else (token_times[0] if token_times else None)
        last = last_token if last_token is not None else (token_times[-1] if token_times else None)
        if first is None or last is None:  # finished before any token (aborted while queued or prefilling)
            queue = (scheduled if scheduled is not None else finish) - arrival
            return cls(queue * 1e3, 0.0, 0.0, 0.0, 0.0, (finish - arrival) * 1e3, source=source)
        sched = first if scheduled is None else scheduled
        n, decode = len(token_times), last - first
        return cls(
            queue_ms=(sched - arrival) * 1e3,
            prefill_ms=(first - sched) * 1e3,
            ttft_ms=(first - arrival) * 1e3,
            decode_ms=decode * 1e3,
            tpot_ms=decode * 1e3 / (n - 1) if n > 1 else 0.0,
            e2e_ms=(finish - arrival) * 1e3,
            itl_ms=tuple((b - a) * 1e3 for a, b in itertools.pairwise(token_times)),
            source=source,
        )


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: a delta, and on the last one the totals and timing."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    timing: RequestTiming | None = None  # on the final output
    error: str | None = None  # with finish_reason "error"


class TextStream(Protocol):
    """A request's streaming text (service/textstream.py's RequestText): the scheduler pushes each new token."""

    def push(self, token: int) -> str | None:
        """Add a token's text; return the stop string it completed, if any."""


class Request:
    """Mutable state of one request inside the engine (owned by the scheduler)."""

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "cache_salt",
        "detokenizer",
        "eos_token_ids",
        "finish_reason",
        "finish_time",
        "first_scheduled_time",
        "grammar",
        "num_bypassed",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_token_ids",
        "priority",
        "prompt_token_ids",
        "request_id",
        "sampling",
        "spec",
        "status",
        "stop_reason",
        "text",
        "token_times",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_salt: str = "",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, grown as tokens are sampled
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.priority = priority  # lower value = served first (vLLM convention)
        self.arrival_time = arrival_time
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt  # prefix KV blocks are shared only among requests with the same salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first scheduling
        self.num_preemptions = 0
        self.num_bypassed = 0  # times a later request was admitted ahead of this one
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []  # when each output token was sampled
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text: TextStream | None = None  # the request's text and stop strings (set by the output processor)
        self.grammar: object | None = None  # the constrained request's matcher (service/engine/grammar.py)
        self.spec: object | None = None  # a speculating request's drafter and counters (spec_decode.SpecState)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)

    def timing(self) -> RequestTiming:
        times = self.token_times
        end = self.finish_time if self.finish_time is not None else (times[-1] if times else 0.0)
        timing = RequestTiming.from_times(self.arrival_time, self.first_scheduled_time, times, end)
        if self.spec:  # a SpecState (spec_decode.py): its counters
            timing = replace(
                timing, spec_draft_tokens=self.spec.draft_tokens, spec_accepted_tokens=self.spec.accepted_tokens
            )
        return timing


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A request as submitted to the engine (the servicer builds it from the protobuf message)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    # prefix KV blocks are shared only among requests with the same salt ("": no salt, shared by all unsalted
    # requests); the client's cache_salt, joined with its tenant's under --cache-salt-per-token
    cache_salt: str = ""
