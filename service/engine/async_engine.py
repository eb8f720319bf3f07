"""AsyncEngine: EngineCore's step loop in a background thread, with asyncio streams per request.

- generate() is an async iterator of RequestOutput deltas; closing it early (client gone, deadline) aborts the
  request in whatever state it is: queued, prefilling, decoding or finishing. abort() is idempotent.
- Admission is synchronous (no await between the check and the reservation): invalid requests raise
  InvalidRequest, a full waiting queue raises QueueFull, a draining or dead engine raises EngineUnavailable.
- The engine thread never blocks on a consumer: outputs go to a per-request collector (service/streams.py).
- An exception in a step fails every in-flight request cleanly, then the failure policy applies; a watchdog
  marks the engine unhealthy while a single step runs longer than `stall_timeout_s` (service/runtime.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable

from service.config import AdmissionConfig
from service.engine.core import EngineCore
from service.request import GenerateRequest, RequestOutput
from service.runtime import BackendRuntime
from service.telemetry import Observer

logger = logging.getLogger(__name__)


class AsyncEngine(BackendRuntime):
    def __init__(self, core: EngineCore, config: AdmissionConfig | None = None) -> None:
        super().__init__(config)
        self.core = core
        self._observer: Observer | None = None
        self._new_observer: tuple[Observer | None] | None = None  # applied by the engine thread
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[tuple[str, GenerateRequest, float]] = []
        self._ids = itertools.count()  # engine-side request ids: unique, never taken from the client
        self._aborts: set[str] = set()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self.start_runtime()

    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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
        self._accepting = False
        self.abort_all()
        self._stop = self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await self._loop.run_in_executor(None, self._thread.join, timeout)

    # ---- requests --------------------------------------------------------------------------------
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
        with self._lock:
            self._adds.append((req_id, gen, self.core.clock()))
        self._wake.set()
        return self.streams.stream(req_id, collector, self.abort)

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

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while True:
            outputs = self._apply_commands()
            if not core.has_unfinished_requests():
                self.deliver(outputs)
                if outputs:
                    self._report_gauges()
                if self._stop:
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
            self.deliver(outputs, core.last_newly_scheduled)
            self._report(outputs, failed)

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
