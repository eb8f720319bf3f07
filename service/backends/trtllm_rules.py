"""What the TensorRT-LLM backend refuses at admission, and how it reads the executor's finish reasons.

Refused with InvalidRequest (INVALID_ARGUMENT) naming the field, before anything reaches the executor (which
would answer an error response, UNAVAILABLE to the client):
- a prompt longer than the engine's max_input_len, or, with chunked context off, than max_num_tokens (the
  executor then prefills a prompt in one step, which cannot exceed it); both read from TensorRT-LLM's own
  config.json (build_engine/spec.py load_trtllm_build_config);
- output.logprobs > 0, a non-zero priority, and min_p (check_supported).

FINISH_REASONS names every member of TensorRT-LLM's FinishReason (bindings.executor, 1.2); finish_reasons()
keys it by the installed enum and refuses to load when the two differ, and a final result whose reason it does
not know is an error, never a silent "length".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from build_engine.spec import TrtllmBuildConfig
from service.errors import BackendLoadError, InvalidRequest
from service.request import GenerateRequest
from service.stops import Stop

# TensorRT-LLM's FinishReason member -> how the request ended (None: not an end)
FINISH_REASONS: dict[str, Stop | None] = {
    "NOT_FINISHED": None,
    # the end id: TensorRT-LLM stops on it but does not return it (NVIDIA/TensorRT-LLM#2190), so our stop rules
    # never see the EOS token and this is the only sign of an EOS end
    "END_ID": Stop("stop"),
    # a stop word: when its token comes back our stop rules have ended the request first (with its id)
    "STOP_WORDS": Stop("stop"),
    "LENGTH": Stop("length"),
    "TIMED_OUT": Stop("abort"),
    "CANCELLED": Stop("abort"),
}


class UnknownFinishReason(RuntimeError):
    """A final result whose finish reason is not an end we know: the executor and this code disagree."""


def finish_reasons(enum: Any) -> dict[Any, Stop | None]:
    """FINISH_REASONS keyed by the installed FinishReason's members; BackendLoadError naming the names that are
    in one and not the other (a misspelt name here, or a member this code does not know)."""
    members = dict(enum.__members__)
    missing, extra = sorted(set(FINISH_REASONS) - set(members)), sorted(set(members) - set(FINISH_REASONS))
    if missing or extra:
        raise BackendLoadError(
            f"TensorRT-LLM's FinishReason has members {sorted(members)}; the trtllm backend maps "
            f"{sorted(FINISH_REASONS)} (not in FinishReason: {missing}; not mapped: {extra})"
        )
    return {members[name]: stop for name, stop in FINISH_REASONS.items()}


def finish_stop(by_member: dict[Any, Stop | None], result: Any) -> Stop:
    """How a final result ended, from its first beam's finish reason; UnknownFinishReason when it is no end."""
    reasons = list(getattr(result, "finish_reasons", None) or ())
    if not reasons:
        raise UnknownFinishReason("a final result without finish_reasons")
    try:
        stop = by_member[reasons[0]]
    except (KeyError, TypeError):
        stop = None
    if stop is None:
        raise UnknownFinishReason(f"a final result with finish reason {reasons[0]!r}")
    return stop


@dataclass(frozen=True, slots=True)
class PromptLimits:
    max_input_len: int  # the engine's longest prompt
    max_num_tokens: int | None  # chunked context off: a prompt's tokens in its one prefill step (None: chunked)

    @classmethod
    def of(cls, build: TrtllmBuildConfig, chunked_context: bool, max_num_tokens: int | None) -> PromptLimits:
        """max_num_tokens: the executor's runtime cap, if any (it can only lower the engine's)."""
        cap = min(build.max_num_tokens, max_num_tokens or build.max_num_tokens)
        return cls(build.max_input_len, None if chunked_context else cap)


def check_prompt(num_prompt: int, limits: PromptLimits) -> None:
    if num_prompt > limits.max_input_len:
        raise InvalidRequest(
            f"prompt ({num_prompt} tokens) exceeds the engine's max_input_len {limits.max_input_len} (the longest "
            "prompt the TensorRT-LLM engine was built for: python -m build_engine --max-input-len)"
        )
    if limits.max_num_tokens is not None and num_prompt > limits.max_num_tokens:
        raise InvalidRequest(
            f"prompt ({num_prompt} tokens) exceeds max_num_tokens {limits.max_num_tokens}: with chunked context off "
            "(--no-chunked-context) TensorRT-LLM prefills a prompt in one step of at most max_num_tokens tokens"
        )


def check_supported(gen: GenerateRequest) -> None:
    """Refuse, naming the field, what TensorRT-LLM cannot honour as we define it."""
    if gen.sampling.logprobs:
        raise InvalidRequest(
            "output.logprobs > 0: the trtllm backend returns the chosen token's log-probability only (logprobs=0)"
        )
    if gen.sampling.min_p:
        raise InvalidRequest(
            "sampling.min_p: the trtllm backend refuses min_p until a GPU run shows that a TensorRT-LLM engine's "
            "decoder applies it (min_p 0 only; docs/gpu.md)"
        )
    if gen.priority:
        raise InvalidRequest("priority: the trtllm backend schedules first come, first served (priority 0 only)")
