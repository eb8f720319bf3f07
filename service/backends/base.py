"""The backend seam: what the gRPC edge needs from whatever runs the model.

TensorRT-LLM's Executor and a Triton server schedule, batch and page the KV cache themselves, so the seam is
at the request level, not at the model runner: a backend takes a checked GenerateRequest and returns an async
stream of RequestOutput deltas (token ids, text, and on the last one the finish reason, usage and Timing),
keyed by ids of its own. Everything below this line is backend-specific; everything above (validation,
status codes, metrics, auth, drain) is shared. Admission, health and the failure policy are implemented
once, in service/backends/runtime.py, which the backends build on (and what the two remote backends share in
service/backends/remote.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from build_engine import spec
from service.backends.kv_events import KvEventLog
from service.limits import RequestLimits
from service.request import GenerateRequest, RequestOutput
from service.telemetry import BackendStats, Observer
from service.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """The model and the limits requests must respect (GetModelInfo, the Triton front door's configs)."""

    backend: str  # native | trtllm | triton
    model_name: str
    architecture: str  # as Hugging Face names it
    vocab_size: int
    max_seq_len: int  # prompt + generated tokens of one request
    max_batch_size: int  # sequences per step
    max_num_tokens: int  # tokens per step
    kv_block_size: int  # tokens per KV block
    num_kv_blocks: int  # blocks in the pool (0: not known to us)
    dtype: str  # activation dtype
    weight_format: str  # how the weights are stored (float32, q4_1, int8 weight-only, ...)
    prefix_caching: bool
    eos_token_ids: tuple[int, ...]
    max_queue: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    engine_format_version: int
    not_reported: tuple[str, ...] = ()  # what this backend cannot report (GetModelInfo says so)
    constraint_kinds: tuple[str, ...] = ()  # the Constraint kinds it compiles (service/request.py's names)
    kv_cache_dtype: str = ""  # the KV cache's stored type (native: --kv-cache-dtype); "": not known to us
    speculative_method: str = ""  # "ngram" or "off" (native); "": does not speculate
    num_speculative_tokens: int = 0  # drafts per step at most, where it speculates

    @classmethod
    def of_engine(cls, config: spec.EngineConfig, backend: str, **limits: object) -> BackendInfo:
        """The fields every backend reads from the engine directory's config (model, architecture, EOS ids,
        format version); `limits` are the backend's own (max_seq_len, batch and KV limits, dtype, ...)."""
        a = config.arch
        return cls(
            backend=backend,
            model_name=config.model_name,
            architecture=a.architecture,
            vocab_size=a.vocab_size,
            eos_token_ids=tuple(config.tokenizer.eos_token_ids),
            num_layers=a.num_hidden_layers,
            hidden_size=a.hidden_size,
            num_attention_heads=a.num_attention_heads,
            num_key_value_heads=a.num_key_value_heads,
            engine_format_version=spec.FORMAT_VERSION,
            **limits,
        )

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.max_seq_len, self.kv_block_size or None, self.num_kv_blocks or None)


class Backend(Protocol):
    """One model behind the service (native engine, TensorRT-LLM Executor, Triton server)."""

    info: BackendInfo
    tokenizer: Tokenizer  # the engine's tokenizer: prompts are tokenized, and outputs detokenized, by us
    kv_events: KvEventLog | None  # the prefix cache's KV events (SubscribeKvEvents); None: not published
    measures_ceilings: bool  # its steps run on this machine: the server measures its ceilings for the step metrics

    def start(self, on_health_change: Callable[[bool], None], on_fatal: Callable[[str], None]) -> None:
        """Start serving (called in the event loop, after the slow load happened in a worker thread)."""

    def generate(self, gen: GenerateRequest, on_done: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Admit a request (raising InvalidRequest, QueueFull or EngineUnavailable at once) and stream its
        outputs; closing the stream early aborts the request. Outputs carry the backend's own request id.
        `on_done` runs once the request's work has ended (its final output is in, whether or not the stream's
        consumer has taken it; or the stream was closed): the edge frees the RPC's slot there."""

    def abort(self, req_id: str) -> None:
        """Abort one request by the backend's id, in any state; idempotent."""

    def abort_all(self) -> None:
        """Abort every request in flight (the drain timeout)."""

    def check_capacity(self) -> None:
        """Raise EngineUnavailable or QueueFull if a new request would be refused now (cheap)."""

    @property
    def is_healthy(self) -> bool:
        """Serving and making progress."""

    @property
    def num_in_flight(self) -> int:
        """Requests whose streams are open."""

    def stats(self) -> BackendStats:
        """Gauges: running and waiting requests, KV blocks used and total."""

    def observe(self, observer: Observer | None) -> None:
        """Attach the telemetry observer (the service's metrics)."""

    def stop_accepting(self) -> None:
        """New requests get EngineUnavailable; requests in flight continue (graceful drain)."""

    async def shutdown(self, timeout: float) -> None:
        """Abort what is still in flight and release the model (threads, executor, connections)."""
