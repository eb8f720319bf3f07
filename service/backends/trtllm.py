"""The TensorRT-LLM backend: a compiled engine served by tensorrt_llm.bindings.executor.Executor (1.2.1).

The Executor schedules, batches in flight and pages the KV cache itself; this backend maps our requests onto
it and its responses back, the way Triton's own Python model drives it:
- one response thread loops await_responses(timeout) and hands outputs to the event loop (never blocking it);
- requests are enqueued streaming, with end/pad ids from the tokenizer, the model's extra EOS ids and our stop
  token ids as single-token stop words, and the full SamplingConfig mapping (sampling_config() below);
- stop strings and text come from our own detokenizer (service/textstream.py), exactly as in the native
  backend; a stop string cancels the request in the executor;
- cancel_request on client cancel, deadline and drain; aborts and routing use the executor's request ids;
- perf metrics (arrival, first scheduled, first token, last token) become the same Timing as the native
  engine's (docs/timing.md); iteration stats feed the KV and batch gauges;
- a request's cache salt becomes the executor's cache_salt_id, so KV blocks are reused only under one salt;
- structured output on xgrammar (trtllm_guided.py): the executor is built with a GuidedDecodingConfig from the
  engine's tokenizer, a constrained request carries GuidedDecodingParams (lark and any_whitespace=false refused);
- admission refuses what the executor would only fail (trtllm_rules.py: prompts over max_input_len, or over
  max_num_tokens without chunked context; min_p, logprobs > 0, priority); finish reasons come from a map of
  every real FinishReason member (an unknown one fails the request, it is never reported as "length");
- the failure policy of the seam: a dead executor fails every stream, then exit (default) or recover: every
  reference to the old Executor is dropped and its shutdown() has returned before the next one is built, so its
  KV pool is released first.
tensorrt_llm is imported lazily, inside this module only.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import logging
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from build_engine import spec
from build_engine.spec import EngineFormatError, load_engine_config, load_trtllm_build_config
from build_engine.xgrammar_info import tokenizer_info
from service.backends import trtllm_guided as guided
from service.backends import trtllm_kv_events as kv_events
from service.backends.base import BackendInfo
from service.backends.kv_events import KvEventLog
from service.backends.remote import EndIds, RemoteRequest, sampling_values
from service.backends.runtime import BackendRuntime
from service.backends.trtllm_rules import (
    PromptLimits,
    UnknownFinishReason,
    check_prompt,
    check_supported,
    finish_reasons,
    finish_stop,
)
from service.config import BackendConfig
from service.errors import BackendLoadError, EngineUnavailable
from service.limits import check_request
from service.request import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob
from service.telemetry import BackendStats, Observer
from service.textstream import RequestText
from service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RESPONSE_WAIT = datetime.timedelta(milliseconds=50)  # await_responses returns at once when responses are ready
STATS_PERIOD_S = 0.1  # iteration stats -> gauges (Triton's stats_check_period_ms is 100)
KV_EVENT_PERIOD_S = 0.05  # the KV event manager is polled this often (without waiting: the executor lock is held)
KV_EVENT_BUFFER_MIN = 4096  # KvCacheConfig.event_buffer_max_size at least (events per poll period, with room)
POLICIES = {"guaranteed_no_evict": "GUARANTEED_NO_EVICT", "max_utilization": "MAX_UTILIZATION"}
WORKER_ENV = "TRTLLM_EXECUTOR_WORKER"  # orchestrator mode: path of TensorRT-LLM's executorWorker binary


def import_executor() -> ModuleType:
    """tensorrt_llm.bindings.executor, or BackendLoadError with one line saying what is missing."""
    from build_engine.trtllm_builder import INSTALL_HINT, TRTLLM_VERSION

    try:
        trt = importlib.import_module("tensorrt_llm")
        executor = importlib.import_module("tensorrt_llm.bindings.executor")
    except ImportError as exc:
        raise BackendLoadError(f"tensorrt_llm cannot be imported ({exc}); {INSTALL_HINT}") from None
    version = str(getattr(trt, "__version__", "unknown"))
    if not version.startswith("1.2"):
        raise BackendLoadError(
            f"tensorrt_llm {version} is installed; the trtllm backend is written for {TRTLLM_VERSION}"
        )
    return executor


def sampling_config(trt: ModuleType, p: SamplingParams) -> Any:
    """Our sampling parameters as TensorRT-LLM's SamplingConfig (remote.sampling_values: its greedy and seed
    traps handled)."""
    return trt.SamplingConfig(beam_width=1, **sampling_values(p))


def cache_salt_id(cache_salt: str) -> int | None:
    """TensorRT-LLM's cache_salt_id (a uint64: blocks are reused only under the same id) of our salt: the first
    8 bytes of its SHA-256, unsigned; None without a salt (blocks shared by every unsalted request)."""
    if not cache_salt:
        return None
    return int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little")


def _weight_format(dtype: str, weight_only: str) -> str:
    return dtype if weight_only == "none" else f"{weight_only} weight-only ({dtype} activations)"


def _seconds(value: Any) -> float | None:
    """A TimingMetrics stamp (timedelta on the steady clock; zero when not reached) in seconds."""
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else None
    return seconds if seconds else None


class TrtllmBackend(BackendRuntime):
    def __init__(self, cfg: BackendConfig) -> None:
        super().__init__(cfg.admission)
        self.cfg = cfg
        self.trt = import_executor()
        self.engine_dir = Path(cfg.engine_dir)
        self.config = load_engine_config(self.engine_dir)  # the manifest's copy of our engine config
        if self.config.backend != "trtllm":
            raise BackendLoadError(f"{self.engine_dir} is not a TensorRT-LLM engine built by python -m build_engine")
        self.settings = spec.read_manifest(self.engine_dir).get("settings", {})
        try:
            build = load_trtllm_build_config(self.engine_dir)  # TensorRT-LLM's own config.json
        except EngineFormatError as exc:
            raise BackendLoadError(str(exc)) from None
        self.prompt_limits = PromptLimits.of(build, cfg.trtllm.enable_chunked_context, cfg.max_num_tokens)
        self.finish = finish_reasons(self.trt.FinishReason)  # BackendLoadError unless every member is mapped
        self.tokenizer = Tokenizer.from_engine_dir(self.engine_dir)
        self.end_ids = EndIds.of(self.config)
        self.xgrammar = tokenizer_info(self.engine_dir, self.config.tokenizer.eos_token_ids)
        self._base_info = self._info()
        self._stats = BackendStats(0, 0, 0, 0)
        self._observer: Observer | None = None
        self._lock = threading.Lock()  # the executor id -> Live map, shared with the response thread
        self._live: dict[int, RemoteRequest] = {}
        self._threads: list[threading.Thread] = []
        self._generation = 0  # executors created so far: stream ids are "<generation>:<executor id>"
        self.executor = self._new_executor()
        if self._kv_event_buffer():
            self.kv_events = KvEventLog(cfg.kv_event_history, self.config.limits.kv_block_size)

    # ---- loading ---------------------------------------------------------------------------------------------
    def _new_executor(self) -> Any:
        trt, cfg = self.trt, self.cfg
        kv = trt.KvCacheConfig(
            enable_block_reuse=cfg.prefix_caching,
            free_gpu_memory_fraction=cfg.trtllm.kv_cache_free_gpu_memory_fraction,
            event_buffer_max_size=self._kv_event_buffer(),
        )
        policy = getattr(trt.CapacitySchedulerPolicy, POLICIES[cfg.trtllm.scheduler_policy])
        kw: dict[str, Any] = {
            "max_beam_width": 1,
            "scheduler_config": trt.SchedulerConfig(capacity_scheduler_policy=policy),
            "kv_cache_config": kv,
            "enable_chunked_context": cfg.trtllm.enable_chunked_context,
            "iter_stats_max_iterations": 1000,
            "guided_decoding_config": guided.guided_decoding_config(trt, self.xgrammar),
        }
        if cfg.max_num_seqs:
            kw["max_batch_size"] = cfg.max_num_seqs
        if cfg.max_num_tokens:
            kw["max_num_tokens"] = cfg.max_num_tokens
        world = int(self.settings.get("tp_size", 1)) * int(self.settings.get("pp_size", 1))
        if world > 1:
            kw["parallel_config"] = self._orchestrator(world)
        self._generation += 1  # a new executor numbers its requests from 1 again
        try:
            return trt.Executor(str(self.engine_dir), trt.ModelType.DECODER_ONLY, trt.ExecutorConfig(**kw))
        except RuntimeError as exc:  # TensorRT-LLM reports engine/GPU mismatches this way
            raise BackendLoadError(f"TensorRT-LLM could not load {self.engine_dir}: {exc}") from None

    def _kv_event_buffer(self) -> int:
        """KV events TensorRT-LLM keeps between our polls (0: it records none); when more come within one poll
        period it drops the oldest, so the buffer is never small even with a short history."""
        if not (self.cfg.kv_event_history and self.cfg.prefix_caching):
            return 0
        return max(self.cfg.kv_event_history, KV_EVENT_BUFFER_MIN)

    def _orchestrator(self, world: int) -> Any:
        """Multi-GPU engines: one orchestrator process spawning TensorRT-LLM's worker per rank (MPI)."""
        import os

        worker = os.environ.get(WORKER_ENV) or str(
            Path(importlib.import_module("tensorrt_llm").__file__).parent / "bin" / "executorWorker"
        )
        if not Path(worker).is_file():
            raise BackendLoadError(
                f"the engine needs {world} GPUs (orchestrator mode) but TensorRT-LLM's executorWorker is not at "
                f"{worker}; set {WORKER_ENV} to its path"
            )
        trt = self.trt
        return trt.ParallelConfig(
            communication_type=trt.CommunicationType.MPI,
            communication_mode=trt.CommunicationMode.ORCHESTRATOR,
            orchestrator_config=trt.OrchestratorConfig(is_orchestrator=True, worker_executable_path=worker),
        )

    def _info(self) -> BackendInfo:
        c, s = self.config, self.settings
        return BackendInfo.of_engine(
            c,
            "trtllm",
            max_seq_len=c.limits.max_seq_len,
            max_batch_size=self.cfg.max_num_seqs or c.limits.max_batch_size,
            max_num_tokens=self.cfg.max_num_tokens or c.limits.max_num_tokens,
            kv_block_size=c.limits.kv_block_size,
            num_kv_blocks=0,  # known once the executor reports its iteration stats
            constraint_kinds=guided.SUPPORTED_KINDS,
            dtype=s.get("dtype", c.limits.dtype),
            weight_format=_weight_format(s.get("dtype", c.limits.dtype), s.get("weight_only", "none")),
            prefix_caching=self.cfg.prefix_caching,
            max_queue=self.admission.max_queue,
        )

    @property
    def info(self) -> BackendInfo:
        from dataclasses import replace

        return replace(self._base_info, num_kv_blocks=self._stats.kv_blocks_total)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self, on_health_change: Callable[[bool], None], on_fatal: Callable[[str], None]) -> None:
        self.bind(on_health_change, on_fatal)
        self._threads = [
            threading.Thread(target=self._respond, name="trtllm-responses", daemon=True),
            threading.Thread(target=self._poll_stats, name="trtllm-stats", daemon=True),
        ]
        if self.kv_events is not None:
            self._threads.append(threading.Thread(target=self._poll_kv_events, name="trtllm-kv-events", daemon=True))
        for t in self._threads:
            t.start()
        self.start_runtime()

    def worker_alive(self) -> bool:
        return bool(self._threads) and self._threads[0].is_alive()

    def observe(self, observer: Observer | None) -> None:
        self._observer = observer

    def stats(self) -> BackendStats:
        return self._stats

    async def shutdown(self, timeout: float) -> None:
        self.begin_shutdown()
        await self.join(self._threads, timeout)
        if self.executor is None:  # a recovery failed to build the next one
            return
        try:
            self.executor.shutdown()
        except Exception:  # already dead: nothing left to release
            logger.exception("executor shutdown failed")

    # ---- requests ----------------------------------------------------------------------------------------------
    def generate(self, gen: GenerateRequest, on_done: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        # NOTE: no await between these checks and the reservation (atomic admission, as the native backend).
        self.check_alive()
        check_request(gen.prompt_token_ids, gen.sampling, self._base_info.limits)
        check_prompt(len(gen.prompt_token_ids), self.prompt_limits)
        check_supported(gen)
        guided.check_constraint(gen.sampling.constraint)
        self.check_queue()
        request = self._request(gen)
        with self._lock:
            self.check_alive()  # again, under the lock: a failure may have begun since (recovery swaps executors)
            try:
                rid = self.executor.enqueue_request(request)
            except Exception as exc:
                logger.exception("enqueue_request failed")
                raise EngineUnavailable(f"the executor did not accept the request ({type(exc).__name__})") from None
            text = RequestText(self.tokenizer, gen.prompt_token_ids, gen.sampling)
            self._live[rid] = RemoteRequest(gen, text, time.monotonic())
        req_id = f"{self._generation}:{rid}"
        collector = self.streams.open(req_id, on_done)
        self.busy(True)  # progress is expected from here: the watchdog times the gap between responses
        return self.streams.stream(req_id, collector, self.abort)

    def _request(self, gen: GenerateRequest) -> Any:
        trt, p = self.trt, gen.sampling
        stop_words = [[t] for t in self.end_ids.stop_words(p)]
        extra = {}  # only what a request uses: an unconstrained request is what it was before guided decoding
        if p.constraint is not None:
            extra["guided_decoding_params"] = guided.guided_decoding_params(trt, p.constraint)
        return trt.Request(
            input_token_ids=list(gen.prompt_token_ids),
            max_tokens=p.max_tokens,
            streaming=True,
            sampling_config=sampling_config(trt, p),
            output_config=trt.OutputConfig(
                return_log_probs=p.logprobs is not None, exclude_input_from_output=True, return_perf_metrics=True
            ),
            end_id=self.end_ids.end_id_for(p),
            pad_id=self.end_ids.pad_id,
            stop_words=stop_words or None,
            cache_salt_id=cache_salt_id(gen.cache_salt),
            **extra,
        )

    def abort(self, req_id: str) -> None:
        """Cancel by the stream id ("<generation>:<executor id>"); idempotent, unknown or stale ids ignored."""
        generation, _, rid_text = req_id.partition(":")
        rid = int(rid_text)
        with self._lock:  # NOTE: under the lock, so a recovery never swaps the executor in the middle of a call
            if rid not in self._live or int(generation) != self._generation:
                return
            try:
                self.executor.cancel_request(rid)
            except Exception:  # the executor is gone: the failure path ends the stream
                logger.exception("cancel_request(%d) failed", rid)

    def abort_all(self) -> None:
        with self._lock:
            ids = [f"{self._generation}:{rid}" for rid in self._live]
        for req_id in ids:
            self.abort(req_id)

    # ---- response thread ---------------------------------------------------------------------------------------
    def _respond(self) -> None:
        while not self.stopping:
            failure = None
            try:
                responses = self.executor.await_responses(timeout=RESPONSE_WAIT)
            except Exception as exc:  # the executor died: every stream fails, then the failure policy
                # NOTE: logged as text: a kept traceback (exc_info in a log record) would keep the dead
                # executor's frames, and so the executor, alive through the recovery
                logger.error("the executor failed; failing every request in flight\n%s",
                             "".join(traceback.format_exception(exc)))  # fmt: skip
                failure = f"{type(exc).__name__} in the executor"
            if failure is not None:  # outside the except block: the exception and its frames are gone
                if not self._after_failure(failure):
                    return
                continue
            if not responses:
                continue
            if not self._stats.kv_blocks_total:  # the pool's size is known once the executor has iterated
                self._poll_once()
            with self._lock:
                outputs = [o for o in (self._output(r) for r in responses) if o is not None]
                waiting = bool(self._live)
            self.busy(waiting)  # a response came: restart (or stop) the watchdog's clock
            self.deliver(outputs)
            if self._observer is not None and outputs:
                self._observer.on_outputs(outputs)

    def _after_failure(self, reason: str) -> bool:
        """Fail every stream; recover with a new executor (True: keep running) or mark dead (False)."""
        with self._lock:
            self.stop_accepting("recovering from an engine failure")  # nothing may reach the dead executor
            self._live.clear()
        self.call_in_loop(self.streams.fail_all, "internal engine error")
        self.busy(False)
        if self.admission.on_failure == "recover":
            self._drop_executor()  # its GPU memory (weights, KV pool) is free before the next one allocates
            try:
                executor = self._new_executor()
            except BackendLoadError:
                logger.exception("the executor cannot be recreated")
            else:
                with self._lock:
                    self.executor = executor
                self.resume_accepting()
                logger.warning("a new executor serves after %s", reason)
                return True
        self.mark_dead(reason)
        return False

    def _drop_executor(self) -> None:
        """Take the executor out of every hand (the lock: no abort or stats poll is inside a call to it) and wait
        for its shutdown; this was its last reference. NOTE: shutdown() returns when the executor has stopped."""
        with self._lock:
            old, self.executor = self.executor, None
        try:
            old.shutdown()
        except Exception:  # dead already
            logger.warning("the failed executor did not shut down cleanly")
        del old

    def _output(self, response: Any) -> RequestOutput | None:
        rid = response.request_id
        live = self._live.get(rid)
        if live is None:
            return None  # finished here already (a stop string cancelled it): later responses are ignored
        if response.has_error():  # never the client's fault (we checked): logged, reported with the request id
            logger.error("request %d failed in the executor: %s", rid, response.error_msg)
            del self._live[rid]
            return RequestOutput(self._stream_id(rid), [], finished=True, finish_reason="error", error="executor error")
        result = response.result
        now = time.monotonic()
        new = list(result.output_token_ids[0]) if result.output_token_ids else []
        accepted, stop = live.push(new, now, self.end_ids.eos)
        finished = bool(result.is_final) or stop is not None
        if stop is None and finished:  # the executor ended it where our rules say nothing (EOS, cancelled)
            try:
                stop = finish_stop(self.finish, result)
            except UnknownFinishReason as exc:  # never guessed: the request fails, the executor's word logged
                logger.error("request %d: %s", rid, exc)
                del self._live[rid]
                return RequestOutput(self._stream_id(rid), [], finished=True, finish_reason="error",
                                     error="executor error")  # fmt: skip
        if finished:
            live.text.finish()  # what was held back for a possible stop string goes out
            if not result.is_final:  # we ended it first (a stop string): the executor stops too
                self.executor.cancel_request(rid)
        out = RequestOutput(
            request_id=self._stream_id(rid),
            new_token_ids=accepted,
            new_text=live.text.take(finished),
            logprobs=self._logprobs(result, accepted),
            num_prompt_tokens=len(live.gen.prompt_token_ids),
            num_output_tokens=len(live.token_ids),
        )
        if finished:
            out.finished, out.finish_reason, out.stop_reason = True, stop.finish_reason, stop.stop_reason
            out.timing = live.timing(self._stamps(result), now, same_clock=True)
            self._live.pop(rid, None)
        return out

    def _stream_id(self, rid: int) -> str:
        return f"{self._generation}:{rid}"

    @staticmethod
    def _stamps(result: Any) -> tuple[float | None, ...] | None:
        """The executor's (arrival, first scheduled, first token, last token) stamps, in seconds of the steady
        clock, or None when it reports none."""
        t = getattr(getattr(result, "request_perf_metrics", None), "timing_metrics", None)
        if t is None:
            return None
        return tuple(
            _seconds(x) for x in (t.arrival_time, t.first_scheduled_time, t.first_token_time, t.last_token_time)
        )

    @staticmethod
    def _logprobs(result: Any, tokens: list[int]) -> list[TokenLogprob] | None:
        values = result.log_probs[0] if getattr(result, "log_probs", None) else None
        if values is None:
            return None
        return [
            TokenLogprob(t, float(v)) for t, v in zip(tokens, values[-len(tokens) :] if tokens else [], strict=False)
        ]

    # ---- stats thread --------------------------------------------------------------------------------------------
    def _poll_stats(self) -> None:
        while not self.stopping and self.is_alive:
            time.sleep(STATS_PERIOD_S)
            self._poll_once()

    def _poll_kv_events(self) -> None:
        """The executor's KV events -> the log (service/backends/trtllm_kv_events.py). A new executor (after a
        recovery) starts with a Created event: the log then says the cache was cleared."""
        assert self.kv_events is not None
        while not self.stopping and self.is_alive:
            time.sleep(KV_EVENT_PERIOD_S)
            with self._lock:  # NOTE: see _drop_executor
                try:
                    manager = self.executor.get_kv_cache_event_manager()
                    events = manager.get_latest_events(0) if manager is not None else []
                except Exception:  # the response thread handles a dead executor (None: being replaced)
                    continue
            try:
                self.kv_events.publish(kv_events.convert(events, self.config.limits.kv_block_size))
            except ValueError:  # an event kind 1.2 does not have: the router's index may now be stale
                logger.exception("unreadable KV cache events from the executor")

    def _poll_once(self) -> None:
        with self._lock:  # NOTE: see _drop_executor
            try:
                stats = self.executor.get_latest_iteration_stats()
            except Exception:  # the response thread handles a dead executor (None: being replaced)
                return
        if not stats:
            return
        s = stats[-1]
        kv, ifb = s.kv_cache_stats, s.inflight_batching_stats
        running = ifb.num_scheduled_requests if ifb is not None else s.num_active_requests - s.num_queued_requests
        self._stats = BackendStats(running, s.num_queued_requests, kv.used_num_blocks, kv.max_num_blocks)
        if self._observer is not None:
            self._observer.on_gauges(self._stats)
