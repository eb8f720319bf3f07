"""AsyncEngine: EngineCore's step loop in a background thread, with asyncio streams per request.

- generate() is an async iterator of RequestOutput deltas; closing it early (client gone, deadline) aborts the
  request in whatever state it is: queued, prefilling, decoding or finishing. abort() is idempotent.
- Admission is synchronous (no await between the check and the reservation): invalid requests raise
  InvalidRequest, a full waiting queue raises QueueFull, a draining or dead engine raises EngineUnavailable.
- The engine thread never blocks on a consumer: outputs go to a per-request collector that merges deltas
  when its consumer lags.
- An exception in a step fails every in-flight request cleanly and marks the engine dead; a watchdog marks it
  unhealthy while a single step runs longer than `stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from service.engine.core import EngineCore
from service.engine.stats import StepStats
from service.errors import EngineError, EngineUnavailable, QueueFull
from service.request import GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)


# fields of a RequestOutput that hold totals or state, not deltas: the newest value wins when merging
_LATEST_FIELDS = (
    "finished",
    "finish_reason",
    "stop_reason",
    "num_output_tokens",
    "num_cached_tokens",
    "timing",
    "error",
)


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """b arrived before a's consumer took a: fold them into one delta."""
    a.new_token_ids = a.new_token_ids + b.new_token_ids
    a.new_text += b.new_text
    if b.logprobs is not None:
        a.logprobs = (a.logprobs or []) + b.logprobs
    for name in _LATEST_FIELDS:
        setattr(a, name, getattr(b, name))
    return a


class RequestOutputCollector:
    """Hand-off from the engine (via the event loop) to one consumer; put() never blocks."""

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self._output = out if self._output is None else merge_outputs(self._output, out)
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._output is None:
            await self._ready.wait()
        out, self._output = self._output, None
        self._ready.clear()
        return out


@dataclass(frozen=True, slots=True)
class AsyncEngineConfig:
    max_queue: int = 256  # requests accepted but not yet scheduled
    stall_timeout_s: float = 60.0  # a step running longer than this marks the engine unhealthy
    # after a failed step (every request in flight has failed): "exit" marks the engine dead and calls on_fatal
    # (the server exits non-zero so a supervisor restarts it; a stalled step is fatal too); "recover" rebuilds
    # the KV pool, scheduler and output state and serves again
    on_failure: str = "exit"
    idle_wait_s: float = 0.05  # how long the idle loop sleeps between checks


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        config: AsyncEngineConfig | None = None,
        on_step: Callable[[StepStats, list[RequestOutput]], None] | None = None,
        on_health_change: Callable[[bool], None] | None = None,
        on_idle: Callable[[int, int, int], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.core = core
        self.config = config or AsyncEngineConfig()
        self._on_step = on_step
        self._on_health_change = on_health_change
        self._on_fatal = on_fatal  # called in the event loop once the engine cannot serve any more
        self._on_idle = on_idle  # (KV blocks used, waiting, running) after aborts when no step follows
        self._observers: tuple | None = None  # new (on_step, on_idle), applied by the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._queued: set[str] = set()  # accepted, not yet scheduled (the bounded queue)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[tuple[str, GenerateRequest, float]] = []
        self._ids = itertools.count()  # engine-side request ids: unique, never taken from the client
        self._aborts: set[str] = set()
        self._accepting = False
        self._stop = False
        self._dead: str | None = None
        self._step_started: float | None = None
        self._stalled = False
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self._accepting = True
        self._thread.start()
        self._watchdog.start()

    def observe(
        self,
        on_step: Callable[[StepStats, list[RequestOutput]], None] | None = None,
        on_idle: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """Attach observers (metrics) of steps and of idle-time state changes.

        Applied by the engine thread before its next step, so a step that ran before this call (the warm-up's
        last one, whose outputs may already have been delivered) is never reported to the new observers.
        """
        with self._lock:
            self._observers = (on_step, on_idle)
        self._wake.set()

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None and not self._stalled

    @property
    def num_in_flight(self) -> int:
        return len(self._collectors)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def stop_accepting(self) -> None:
        """New requests get EngineUnavailable; requests in flight continue (graceful drain)."""
        self._accepting = False

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, abort whatever is still in flight, stop the engine thread."""
        self._accepting = False
        self.abort_all()
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # ---- requests --------------------------------------------------------------------------------
    async def generate(self, gen: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request. Raises InvalidRequest, QueueFull or EngineUnavailable at once.

        The engine keys the request on an id of its own (RequestOutput.request_id); gen.request_id is the
        client's, never used to route outputs or aborts, so two clients may send the same one.
        """
        req_id, collector = self._admit(gen)
        try:
            while True:
                out = await collector.get()
                if out.finish_reason == "error":
                    raise EngineError(out.error or "engine failure")
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.abort(req_id)
            raise
        finally:
            self._collectors.pop(req_id, None)
            self._queued.discard(req_id)

    def check_capacity(self) -> None:
        """Raise EngineUnavailable or QueueFull if a request would be refused now (cheap; admission re-checks)."""
        self._check_alive()
        self._check_queue()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineUnavailable(f"engine is not healthy: {self._dead}")
        if not self._accepting:
            raise EngineUnavailable("engine is not accepting requests (starting or draining)")

    def _check_queue(self) -> None:
        if len(self._queued) >= self.config.max_queue:
            raise QueueFull(f"waiting queue is full ({self.config.max_queue} requests); retry later")

    def _admit(self, gen: GenerateRequest) -> tuple[str, RequestOutputCollector]:
        # NOTE: no await between these checks and the reservation below (RELIABILITY: atomic admission).
        self._check_alive()
        self.core.check(gen)
        self._check_queue()
        req_id = str(next(self._ids))
        collector = RequestOutputCollector()
        self._collectors[req_id] = collector
        self._queued.add(req_id)
        with self._lock:
            self._adds.append((req_id, gen, self.core.clock()))
        self._wake.set()
        return req_id, collector

    def abort(self, req_id: str) -> None:
        """Abort a request (by its engine id) in any state; safe to call repeatedly or for unknown ids."""
        with self._lock:
            self._aborts.add(req_id)
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request in flight (the drain timeout)."""
        with self._lock:
            self._aborts.update(self._collectors)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while True:
            outputs = self._apply_commands()
            if self._stop and not core.has_unfinished_requests():
                self._deliver(outputs, [])
                break
            if not core.has_unfinished_requests():
                self._deliver(outputs, [])
                if outputs:
                    self._report_idle()
                self._wake.wait(self.config.idle_wait_s)
                self._wake.clear()
                continue
            self._step_started = time.monotonic()
            failed = False
            try:
                outputs += core.step()
            except Exception as exc:  # every request in flight fails cleanly; then the failure policy applies
                logger.exception("engine step failed; failing all in-flight requests")
                outputs += core.fail_all("internal engine error")
                failed = True
                self._after_failure(f"{type(exc).__name__} in engine step")
            finally:
                self._step_started = None
            self._deliver(outputs, core.last_newly_scheduled)
            if failed:
                self._report_idle()
            elif self._on_step is not None and core.last_step is not None:
                self._on_step(core.last_step, outputs)

    def _after_failure(self, reason: str) -> None:
        """The failure policy (AsyncEngineConfig.on_failure), in the engine thread, after fail_all."""
        if self.config.on_failure == "recover":
            self.core.reset()
            logger.warning("engine state rebuilt after %s; serving again", reason)
            return
        self._dead = reason
        self._accepting = False
        self._notify_health()
        self._notify_fatal(reason)

    def _report_idle(self) -> None:
        if self._on_idle is not None:
            sched = self.core.scheduler
            self._on_idle(self.core.kv.pool.num_used_blocks, sched.num_waiting, sched.num_running)

    def _apply_commands(self) -> list[RequestOutput]:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, set()
            if self._observers is not None:
                (self._on_step, self._on_idle), self._observers = self._observers, None
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

    def _deliver(self, outputs: list[RequestOutput], newly_scheduled: list[str]) -> None:
        if (outputs or newly_scheduled) and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._dispatch, outputs, newly_scheduled)
            except RuntimeError:  # the loop closed while we were stepping
                pass

    def _dispatch(self, outputs: list[RequestOutput], newly_scheduled: list[str]) -> None:
        """Runs in the event loop thread."""
        for req_id in newly_scheduled:
            self._queued.discard(req_id)
        for out in outputs:
            if out.finished:
                self._queued.discard(out.request_id)
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)

    def _watch(self) -> None:
        while not self._stop or (self._thread is not None and self._thread.is_alive()):
            started = self._step_started
            stalled = started is not None and time.monotonic() - started > self.config.stall_timeout_s
            if stalled != self._stalled:
                self._stalled = stalled
                if stalled:
                    logger.error("engine step has been running for over %.0f s", self.config.stall_timeout_s)
                self._notify_health()
                if stalled and self.config.on_failure == "exit":
                    self._dead = "engine step stalled"
                    self._accepting = False
                    self._call_in_loop(self._fail_collectors, "engine step stalled")
                    self._notify_fatal("engine step stalled")
            time.sleep(min(1.0, self.config.stall_timeout_s / 4))
            if self._thread is not None and not self._thread.is_alive():
                break

    def _notify_health(self) -> None:
        if self._on_health_change is not None:
            self._call_in_loop(self._on_health_change, self.is_healthy)

    def _notify_fatal(self, reason: str) -> None:
        if self._on_fatal is not None:
            self._call_in_loop(self._on_fatal, reason)

    def _call_in_loop(self, fn: Callable[..., None], *args: object) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _fail_collectors(self, message: str) -> None:
        """Runs in the event loop: end every stream at once (the engine thread is stuck and cannot)."""
        for req_id, collector in self._collectors.items():
            collector.put(RequestOutput(req_id, [], finished=True, finish_reason="error", error=message))
