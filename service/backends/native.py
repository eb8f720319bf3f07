"""The native backend: our own engine on any CPU. It *is* the engine's runtime: EngineCore's step loop runs in a
thread this backend owns, with asyncio streams per request (service/engine/ stays synchronous, so an engine
core in another process could replace the thread behind the same Backend).

- generate() is an async iterator of RequestOutput deltas; closing it early (client gone, deadline) aborts the
  request in whatever state it is: queued, prefilling, decoding or finishing. abort() is idempotent.
- Admission is synchronous (no await between the check and the reservation): invalid requests raise
  InvalidRequest, a full waiting queue raises QueueFull, a draining or dead engine raises EngineUnavailable.
- The engine thread never blocks on a consumer: outputs go to a per-request collector (streams.py).
- An exception in a step fails every in-flight request cleanly, then the failure policy applies; a watchdog
  marks the engine unhealthy while a single step runs longer than `stall_timeout_s` (runtime.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable

from service.backends.base import BackendInfo
from service.backends.kv_events import KvEventLog
from service.backends.runtime import ENGINE_THREAD_NAME, BackendRuntime, name_os_thread
from service.backends.streams import RequestOutputCollector
from service.config import AdmissionConfig, BackendConfig
from service.engine.core import EngineCore
from service.engine.grammar import SUPPORTED_KINDS
from service.request import GenerateRequest, RequestOutput
from service.telemetry import BackendStats, Observer

logger = logging.getLogger(__name__)


class NativeBackend(BackendRuntime):
    measures_ceilings = True  # its steps run on this machine: the step metrics divide by its ceilings

    def __init__(self, core: EngineCore, admission: AdmissionConfig | None = None, kv_event_history: int = 0) -> None:
        super().__init__(admission)
        self.core = core
        if core.kv_events and kv_event_history:
            self.kv_events = KvEventLog(kv_event_history, core.sched_cfg.block_size)
        self.tokenizer = core.tokenizer
        self.info = _info(core, self.admission.max_queue)
        self._observer: Observer | None = None
        self._new_observer: tuple[Observer | None] | None = None  # applied by the engine thread
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[tuple[str, GenerateRequest, float]] = []
        self._ids = itertools.count()  # engine-side request ids: unique, never taken from the client
        self._aborts: set[str] = set()
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, cfg: BackendConfig) -> NativeBackend:
        core = EngineCore(
            cfg.engine_dir,
            kv_cache_memory=cfg.native.kv_cache_memory,
            kv_cache_dtype=cfg.native.kv_cache_dtype,
            enable_prefix_caching=cfg.prefix_caching,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_tokens,
            long_prefill_token_threshold=cfg.native.long_prefill_token_threshold,
            kv_events=cfg.kv_event_history > 0,
            speculative=cfg.native.speculative,
        )
        return cls(core, cfg.admission, cfg.kv_event_history)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(
        self, on_health_change: Callable[[bool], None] | None = None, on_fatal: Callable[[str], None] | None = None
    ) -> None:
        self.bind(on_health_change, on_fatal)
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()
        self.start_runtime()

    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> BackendStats:
        return self.core.stats()

    def observe(self, observer: Observer | None) -> None:
        """Attach the observer of steps, outputs and gauges (the service's metrics).

        Applied by the engine thread before its next step, so a step that ran before this call (the warm-up's
        last one, whose outputs may already have been delivered) is never reported to the new observer.
        """
        with self._lock:
            self._new_observer = (observer,)
        self._wake.set()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, abort whatever is still in flight, stop the engine thread."""
        self.begin_shutdown()
        self._wake.set()
        if self._thread is not None:
            await self.join([self._thread], timeout)

    # ---- requests --------------------------------------------------------------------------------------------
    def generate(self, gen: GenerateRequest, on_done: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request. Raises InvalidRequest, QueueFull or EngineUnavailable at once.

        The engine keys the request on an id of its own (RequestOutput.request_id); gen.request_id is the
        client's, never used to route outputs or aborts, so two clients may send the same one.
        """
        # NOTE: no await between these checks and the reservation below (RELIABILITY: atomic admission).
        self.check_alive()
        self.core.check(gen)
        self.check_queue()
        req_id = str(next(self._ids))
        collector = self.streams.open(req_id, on_done)
        arrival = self.core.clock()
        constraint = gen.sampling.constraint
        if constraint is not None and self.core.grammars.cached(constraint) is None:
            return self._compile_then_stream(gen, req_id, collector, arrival)
        self._submit(gen, req_id, arrival)
        return self.streams.stream(req_id, collector, self.abort)

    def _submit(self, gen: GenerateRequest, req_id: str, arrival: float) -> None:
        with self._lock:
            self._adds.append((req_id, gen, arrival))
        self._wake.set()

    async def _compile_then_stream(
        self, gen: GenerateRequest, req_id: str, collector: RequestOutputCollector, arrival: float
    ) -> AsyncIterator[RequestOutput]:
        """A constraint not compiled yet: compile it in a thread (milliseconds to a second: never on the event
        loop), then queue the request; a grammar that does not compile is InvalidRequest on the first read."""
        try:
            await asyncio.to_thread(self.core.compile, gen)
        except BaseException:
            self.streams.close(req_id, collector)
            raise
        self._submit(gen, req_id, arrival)
        async for out in self.streams.stream(req_id, collector, self.abort):
            yield out

    def abort(self, req_id: str) -> None:
        """Abort a request (by its engine id) in any state; safe to call repeatedly or for unknown ids."""
        with self._lock:
            self._aborts.add(req_id)
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown, the drain timeout)."""
        with self._lock:
            self._aborts.update(self.streams.ids())
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread(ENGINE_THREAD_NAME)
        core = self.core
        while True:
            outputs = self._apply_commands()
            if not core.has_unfinished_requests():
                self.deliver(outputs)
                self._publish_kv_events()
                if outputs:
                    self._report_gauges()
                if self.stopping:
                    break
                self._wake.wait(self.admission.idle_wait_s)
                self._wake.clear()
                continue
            self.busy(True)
            try:
                outputs += core.step()
                failed = False
            except Exception as exc:  # every request in flight fails cleanly; then the failure policy applies
                logger.exception("engine step failed; failing all in-flight requests")
                outputs += core.fail_all("internal engine error")
                failed = True
                self._after_failure(f"{type(exc).__name__} in engine step")
            finally:
                self.busy(False)
            self._report(outputs, failed)  # first: a client that has its response finds the metrics counting it
            self.deliver(outputs, core.last_newly_scheduled)
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """The prefix cache's changes since the last call, as one batch (after the step that made them)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.core.take_kv_events())

    def _report(self, outputs: list[RequestOutput], failed: bool) -> None:
        if self._observer is None:
            return
        if not failed and self.core.last_step is not None:
            self._observer.on_step(self.core.last_step)
        self._observer.on_outputs(outputs)
        if failed:
            self._report_gauges()

    def _report_gauges(self) -> None:
        if self._observer is not None:
            self._observer.on_gauges(self.core.stats())

    def _after_failure(self, reason: str) -> None:
        """The failure policy (AdmissionConfig.on_failure), in the engine thread, after fail_all."""
        if self.admission.on_failure == "recover":
            self.core.reset()
            logger.warning("engine state rebuilt after %s; serving again", reason)
            return
        self.mark_dead(reason)

    def _apply_commands(self) -> list[RequestOutput]:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, set()
            if self._new_observer is not None:
                (self._observer,), self._new_observer = self._new_observer, None
        outputs: list[RequestOutput] = []
        for req_id, gen, arrival in adds:
            if req_id in aborts:  # cancelled before the engine saw it
                aborts.discard(req_id)
                outputs.append(RequestOutput(req_id, [], finished=True, finish_reason="abort"))
                continue
            try:
                self.core.enqueue(gen, req_id, arrival_time=arrival)
            except Exception:  # checked on admission, so a bug: fail this request alone, loudly
                logger.exception("cannot queue request %s", req_id)
                outputs.append(RequestOutput(req_id, [], finished=True, finish_reason="error", error="enqueue failed"))
        if aborts:
            outputs += self.core.abort(list(aborts))
        return outputs


def _info(core: EngineCore, max_queue: int) -> BackendInfo:
    cfg, sched = core.config, core.sched_cfg
    return BackendInfo.of_engine(
        cfg,
        "native",
        max_seq_len=sched.max_seq_len,
        max_batch_size=sched.max_num_seqs,
        max_num_tokens=sched.max_num_batched_tokens,
        kv_block_size=sched.block_size,
        num_kv_blocks=sched.num_kv_blocks,
        dtype=cfg.limits.dtype,
        weight_format=cfg.weight_format,
        prefix_caching=sched.enable_prefix_caching,
        max_queue=max_queue,
        constraint_kinds=SUPPORTED_KINDS,
        kv_cache_dtype=core.runner.kv_cache.fmt.name,
        speculative_method=core.speculator.cfg.method if core.speculator else "off",
        num_speculative_tokens=core.speculator.cfg.num_speculative_tokens if core.speculator else 0,
    )
