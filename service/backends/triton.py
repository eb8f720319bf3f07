"""The triton backend: our llm.v1 service in front of a Triton Inference Server running TensorRT-LLM's models
(or our own front door, `--triton-port`), through tritonclient's gRPC streaming client.

- One client stream per request in flight: tritonclient's sync client (its aio client cannot ask for empty final
  responses), its callback thread handing outputs to the event loop through BackendRuntime; closing a stream
  with `stop_stream(cancel_requests=True)` cancels the request on the server (Triton checks for cancelled
  requests and the TensorRT-LLM backend cancels them in the executor). Clients are pooled; each holds a channel.
- `--triton-model tensorrt_llm` (default): token ids in, `output_ids` out, so our tokenizer, chat template and
  detokenizer (service/textstream.py) make the text, stop strings and stop token ids are ours, usage is exact:
  the same tokens give the same chunks as the native backend.
- `--triton-model ensemble`: the prompt's ids are decoded to `text_input` (refused unless they survive
  re-encoding, as the ensemble's preprocessing tokenizes the text again), chunks carry text and the token counts
  (`num_output_tokens`), stop strings are matched here on that text; token ids, logprobs, cached tokens and stop
  token ids cannot be reported (ModelInfo.not_reported).
- Sampling as TensorRT-LLM needs it: it decodes greedily unless top_k > 1 or top_p > 0, so temperature 0 sends
  top_k = 1 and sampling without top_k sends top_p; ignore_eos sends end_id = -1; without a seed each request
  draws one (TensorRT-LLM's runtime default is 0 for every request).
- A constraint (structured output) goes as the models' guided_decoding_guide_type / guided_decoding_guide inputs
  (xgrammar on the server; triton_io.guided_inputs): lark, any_whitespace=false and structural_tag refused.
- Timing from the `*_time_ns` outputs (return_perf_metrics) when the server returns them, on its steady clock
  (differences only); else measured here (Timing.source = edge).
- Health: ServerReady and ModelReady, polled; a server that does not answer turns the service NOT_SERVING and
  new requests UNAVAILABLE (naming the URL), and SERVING again when it answers. A Triton outage is not a failure
  of this process: no exit code 3, whatever --on-engine-error says.
tritonclient is imported only in this module (and the front door), lazily from load_backend.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonclient.grpc import InferenceServerClient, InferInput
from tritonclient.utils import InferenceServerException

from build_engine.spec import load_engine_config
from service.backends.base import BackendInfo
from service.backends.remote import EndIds, RemoteRequest
from service.backends.runtime import BackendRuntime
from service.backends.triton_io import (
    CONSTRAINT_KINDS,
    channel_args,
    end_requests,
    ensemble_inputs,
    guided_inputs,
    is_final,
    stamps,
    streamed_text,
    streamed_tokens,
    token_inputs,
)
from service.config import BackendConfig
from service.errors import BackendLoadError, EngineUnavailable, InvalidRequest
from service.limits import check_request
from service.request import GenerateRequest, RequestOutput
from service.stops import Stop
from service.telemetry import BackendStats, Observer
from service.textstream import RequestText
from service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_IDLE_CLIENTS = 64  # pooled clients kept between requests (each holds a channel)
NEEDS = {  # inputs the remote model must have for us to drive it
    "tensorrt_llm": ("input_ids", "input_lengths", "request_output_len", "streaming", "end_id"),
    "ensemble": ("text_input", "max_tokens", "stream"),
}
NOT_REPORTED = {
    "tensorrt_llm": ("logprobs", "cached_prompt_tokens"),
    "ensemble": ("chunk.token_ids", "logprobs", "cached_prompt_tokens", "stop_token_id"),
}


@dataclass
class _Live(RemoteRequest):
    """One request on its own Triton stream (touched by its stream's callback thread, and once by abort)."""

    req_id: str = ""
    client: InferenceServerClient | None = None
    num_tokens: int = 0  # ensemble: counted from num_output_tokens
    done: bool = False  # the final output went out (or the request was aborted): ignore anything later


class TritonBackend(BackendRuntime):
    def __init__(self, cfg: BackendConfig) -> None:
        super().__init__(cfg.admission)
        t = self.triton = cfg.triton
        if not t.url:
            raise BackendLoadError("the triton backend needs --triton-url HOST:PORT (a Triton server's gRPC endpoint)")
        self.url, self.model = t.url, t.model
        engine_dir = Path(cfg.engine_dir)
        self.config = load_engine_config(engine_dir)  # a native or TensorRT-LLM engine directory
        self.tokenizer = Tokenizer.from_engine_dir(engine_dir)
        self.end_ids = EndIds.of(self.config)
        self._health_client = InferenceServerClient(self.url, channel_args=channel_args(t))
        remote = self._wait_ready(t.ready_timeout_s)
        self.info = self._info(remote)
        self._remote_ready, self._remote_problem = True, ""
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._idle: list[InferenceServerClient] = []
        self._ids = itertools.count()
        self._closer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="triton-close")
        self._observer: Observer | None = None
        self._health_thread: threading.Thread | None = None
        self._prompt_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="triton-prompt")

    # ---- loading -----------------------------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> Any:
        """Wait for the server and the model, then check the model is one we can drive; its ModelConfig."""
        deadline, problem, logged = time.monotonic() + timeout, "", 0.0
        while True:
            ready, problem = self._probe()
            if ready:
                break
            if time.monotonic() >= deadline:
                raise BackendLoadError(
                    f"the Triton server at {self.url} is not ready with model '{self.model}' after "
                    f"{timeout:g} s (--triton-ready-timeout): {problem}"
                )
            if time.monotonic() - logged > 10:
                logger.info("waiting for the Triton server at %s (%s)", self.url, problem)
                logged = time.monotonic()
            time.sleep(min(self.triton.health_period_s, 1.0))
        c = self._health_client
        rpc = self.triton.rpc_timeout_s
        config = c.get_model_config(self.model, client_timeout=rpc).config
        names = {i.name for i in config.input}
        missing = [n for n in NEEDS[self.model] if n not in names]
        if missing:
            raise BackendLoadError(
                f"model '{self.model}' on {self.url} has no input {', '.join(missing)}: is it TensorRT-LLM's "
                f"{self.model} model?"
            )
        decoupled = config.model_transaction_policy.decoupled or any(
            c.get_model_config(s.model_name, client_timeout=rpc).config.model_transaction_policy.decoupled
            for s in config.ensemble_scheduling.step
        )
        if not decoupled:
            raise BackendLoadError(
                f"model '{self.model}' on {self.url} is not decoupled: streaming needs decoupled_mode:true "
                f"(python -m build_engine.triton_repo writes it)"
            )
        meta = c.get_server_metadata(client_timeout=rpc)
        logger.info("Triton server at %s: %s %s, model %s", self.url, meta.name, meta.version, self.model)
        return config

    def _probe(self) -> tuple[bool, str]:
        rpc = self.triton.rpc_timeout_s
        try:
            if not self._health_client.is_server_ready(client_timeout=rpc):
                return False, "server not ready"
            if not self._health_client.is_model_ready(self.model, client_timeout=rpc):
                return False, f"model '{self.model}' not ready"
            return True, ""
        except InferenceServerException as exc:
            return False, str(exc.message() or exc)

    def _info(self, remote: Any) -> BackendInfo:
        c = self.config
        return BackendInfo.of_engine(
            c,
            "triton",
            max_seq_len=c.limits.max_seq_len,
            max_batch_size=remote.max_batch_size or c.limits.max_batch_size,
            max_num_tokens=c.limits.max_num_tokens,
            kv_block_size=c.limits.kv_block_size,
            num_kv_blocks=0,  # the Triton server's own: not visible over KServe v2
            constraint_kinds=CONSTRAINT_KINDS,
            dtype=c.limits.dtype,
            weight_format=c.limits.dtype,
            prefix_caching=remote.parameters["enable_kv_cache_reuse"].string_value.lower() == "true"
            if "enable_kv_cache_reuse" in remote.parameters
            else False,
            max_queue=self.admission.max_queue,
            not_reported=NOT_REPORTED[self.model],
        )

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, on_health_change: Callable[[bool], None], on_fatal: Callable[[str], None]) -> None:
        self.bind(on_health_change, on_fatal)
        self._health_thread = threading.Thread(target=self._watch_remote, name="triton-health", daemon=True)
        self._health_thread.start()
        self.start_runtime()

    def worker_alive(self) -> bool:
        return self._health_thread is not None and self._health_thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        return super().is_healthy and self._remote_ready

    def check_alive(self) -> None:
        super().check_alive()
        if not self._remote_ready:
            raise EngineUnavailable(f"the Triton server at {self.url} is not ready: {self._remote_problem}")

    def observe(self, observer: Observer | None) -> None:
        self._observer = observer

    def stats(self) -> BackendStats:
        queued = self.num_queued
        return BackendStats(self.num_in_flight - queued, queued, 0, 0)

    async def shutdown(self, timeout: float) -> None:
        self.begin_shutdown()
        if self._health_thread is not None:
            await self.join([self._health_thread], timeout)
        self._closer.shutdown(wait=True)
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            idle, self._idle = self._idle, []
        for client in [*idle, self._health_client]:
            client.close()

    def _watch_remote(self) -> None:
        while not self.stopping:
            ready, problem = self._probe()
            if ready != self._remote_ready:
                self._remote_ready, self._remote_problem = ready, problem
                if ready:
                    logger.warning("the Triton server at %s is ready again", self.url)
                else:
                    logger.error("the Triton server at %s is not ready: %s", self.url, problem)
                self.notify_health()
            time.sleep(self.triton.health_period_s)

    # ---- requests ------------------------------------------------------------------------------------------------
    def generate(self, gen: GenerateRequest, on_done: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        # NOTE: no await between these checks and the reservation (atomic admission, as the native backend).
        self.check_alive()
        check_request(gen.prompt_token_ids, gen.sampling, self.info.limits)
        self._check_supported(gen)
        self.check_queue()
        req_id = f"t{next(self._ids)}"
        text = RequestText(self.tokenizer, gen.prompt_token_ids, gen.sampling)
        live = _Live(gen, text, time.monotonic(), req_id=req_id)
        with self._lock:
            self._live[req_id] = live
        collector = self.streams.open(req_id, on_done)
        return self._stream(live, collector)

    def _check_supported(self, gen: GenerateRequest) -> None:
        p = gen.sampling
        if p.logprobs is not None:
            raise InvalidRequest("output.logprobs: the triton backend does not return log-probabilities")
        if p.min_p:
            raise InvalidRequest("sampling.min_p: TensorRT-LLM's Triton models have no min_p input")
        if gen.priority:
            raise InvalidRequest("priority: the triton backend sends every request at priority 0")
        guided_inputs(p.constraint)  # refuses, by name, a constraint the server cannot take
        if gen.cache_salt:
            raise InvalidRequest(
                "cache_salt: TensorRT-LLM's Triton models have no cache salt input, so the triton backend cannot "
                "keep this request's prefix blocks apart (serve the Triton model without KV block reuse instead)"
            )
        if self.model == "ensemble":
            if p.stop_token_ids:
                raise InvalidRequest(
                    "stopping.stop_token_ids: the ensemble model returns text only; use --triton-model tensorrt_llm"
                )
            if not p.skip_special_tokens:
                raise InvalidRequest(
                    "output.include_special_tokens: the ensemble's postprocessing decides; use --triton-model "
                    "tensorrt_llm"
                )

    async def _stream(self, live: _Live, collector) -> AsyncIterator[RequestOutput]:
        try:
            if self.model == "ensemble":
                text = await asyncio.get_running_loop().run_in_executor(self._prompt_pool, self._prompt_text, live.gen)
                inputs = ensemble_inputs(live.gen, text)
            else:
                inputs = token_inputs(live.gen, self.end_ids)
            self._send(live, inputs)
        except BaseException:
            self._forget(live)
            self.streams.close(live.req_id)
            raise
        async for out in self.streams.stream(live.req_id, collector, self.abort):
            yield out

    def _prompt_text(self, gen: GenerateRequest) -> str:
        """The ensemble takes text, tokenized again by its preprocessing: only ids that survive the round trip."""
        text = self.tokenizer.decode(gen.prompt_token_ids, skip_special_tokens=False)
        if self.tokenizer.encode(text) != list(gen.prompt_token_ids):
            raise InvalidRequest(
                "prompt_token_ids: these ids do not survive decoding and re-encoding, and the ensemble model takes "
                "text; use --triton-model tensorrt_llm for token-level prompts"
            )
        return text

    def _client(self) -> InferenceServerClient:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return InferenceServerClient(self.url, channel_args=channel_args(self.triton))

    def _send(self, live: _Live, inputs: list[InferInput]) -> None:
        client = live.client = self._client()
        try:
            client.start_stream(callback=functools.partial(self._on_response, live))
            client.async_stream_infer(self.model, inputs, request_id=live.req_id, enable_empty_final_response=True)
        except InferenceServerException as exc:
            self._release(live, cancel=True)
            raise EngineUnavailable(f"the Triton server at {self.url} did not take the request: {exc}") from None

    def abort(self, req_id: str) -> None:
        """Cancel by our id (the consumer went away, a deadline, the drain); idempotent."""
        with self._lock:
            live = self._live.get(req_id)
        if live is not None and not live.done:
            live.done = True
            self._forget(live)
            self._release(live, cancel=True)

    def abort_all(self) -> None:
        with self._lock:
            ids = list(self._live)
        for req_id in ids:
            self.abort(req_id)
        if ids:  # the streams are cut: end their consumers too
            self.deliver([RequestOutput(i, [], finished=True, finish_reason="abort") for i in ids])

    def _forget(self, live: _Live) -> None:
        with self._lock:
            self._live.pop(live.req_id, None)

    def _release(self, live: _Live, cancel: bool) -> None:
        """Close the request's stream (cancelling it on the server) off this thread, then pool the client."""
        client, live.client = live.client, None
        if client is None:
            return

        def close() -> None:
            try:
                end_requests(client)
                client.stop_stream(cancel_requests=cancel)
            except Exception:  # a broken stream: the client cannot be reused
                logger.debug("stop_stream failed", exc_info=True)
                client.close()
                return
            with self._lock:
                if len(self._idle) < MAX_IDLE_CLIENTS and not self.stopping:
                    self._idle.append(client)
                    return
            client.close()

        try:
            self._closer.submit(close)
        except RuntimeError:  # shutting down: close here
            close()

    # ---- the stream's callback thread -------------------------------------------------------------------------------
    def _on_response(self, live: _Live, result: Any, error: InferenceServerException | None) -> None:
        if live.done:
            return  # after our own final or cancel (e.g. the CANCELLED that closing the stream reports)
        now = time.monotonic()
        if error is not None:
            live.done = True
            self._forget(live)
            logger.warning("request %s failed on the Triton server at %s: %s", live.req_id, self.url, error)
            self._release(live, cancel=True)
            self.deliver([RequestOutput(live.req_id, [], finished=True, finish_reason="error", error=str(error))])
            return
        try:
            out = self._output(live, result, now)
        except Exception:  # a response we cannot read: this request fails, loudly
            logger.exception("unreadable response from the Triton server for request %s", live.req_id)
            out = RequestOutput(live.req_id, [], finished=True, finish_reason="error", error="unreadable response")
        if out is None:
            return
        if out.finished:
            live.done = True
            self._forget(live)
            self._release(live, cancel=True)  # the server has finished (or we stopped early): close the stream
        self.deliver([out])
        if self._observer is not None:
            self._observer.on_outputs([out])
            if out.finished:
                self._observer.on_gauges(self.stats())

    def _output(self, live: _Live, result: Any, now: float) -> RequestOutput | None:
        final = is_final(result)
        stop: Stop | None = None  # ours: the stop rules of every backend (service/stops.py)
        accepted: list[int] = []
        if self.model == "tensorrt_llm":
            accepted, stop = live.push(streamed_tokens(result), now, self.end_ids.eos)
            live.num_tokens = len(live.token_ids)
        else:
            piece, n = streamed_text(result)
            live.num_tokens += n
            live.token_times.extend([now] * n)  # one stamp per token, as TPOT counts tokens
            found = live.text.push_text(piece)
            stop = Stop("stop", found) if found is not None else None
        ended = stop is not None
        finished = final or ended
        if finished:
            live.text.finish()  # release what was held back (as the native engine, a stop in the tail is not one)
        text = live.text.take(finished)
        if not finished and not accepted and not text:
            return None  # nothing to send yet (an empty response, or text held back for a stop string)
        out = RequestOutput(
            request_id=live.req_id,
            new_token_ids=accepted,
            new_text=text,
            num_prompt_tokens=len(live.gen.prompt_token_ids),
            num_output_tokens=live.num_tokens,
        )
        if finished:
            out.finished = True
            stop = stop or self._finish_reason(live)
            out.finish_reason, out.stop_reason = stop.finish_reason, stop.stop_reason
            out.timing = live.timing(stamps(result), now, same_clock=False)
        return out

    def _finish_reason(self, live: _Live) -> Stop:
        """Why the server ended a request our stop rules did not end (it does not return its end token)."""
        if live.num_tokens >= live.gen.sampling.max_tokens:
            return Stop("length")
        return Stop("stop")  # the server ended before max_tokens: at its end token
