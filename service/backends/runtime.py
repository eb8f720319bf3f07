"""What every backend does the same way: admission, health, the failure policy and the stall watchdog.

A backend runs its work in a thread of its own (the native engine's step loop, TensorRT-LLM's response thread,
a Triton client's stream); BackendRuntime is its event-loop-facing half:

- admission: EngineUnavailable while starting, draining or dead, QueueFull beyond `max_queue` requests not
  yet scheduled; the backend's own request ids, never the client's;
- hand-off: outputs cross to the event loop with call_soon_threadsafe into RequestStreams, one wake-up for
  all the steps the loop has not taken yet (per step, never per request or token);
- failure policy (AdmissionConfig.on_failure): after a failure has ended every request in flight, "exit"
  marks the backend dead and calls on_fatal (the server exits non-zero for its supervisor), "recover" lets
  the backend rebuild its state;
- watchdog: a backend call (an engine step) running longer than `stall_timeout_s` turns health NOT_SERVING;
  under "exit" it is fatal, since a call that never returns cannot be recovered in-process.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable

from service.backends.kv_events import KvEventLog
from service.backends.streams import RequestStreams
from service.config import AdmissionConfig
from service.errors import EngineUnavailable, QueueFull
from service.request import RequestOutput

logger = logging.getLogger(__name__)

ENGINE_THREAD_NAME = "llm-engine"  # the native engine's step thread, as the OS (top -H, /proc/*/task/*/comm) names it
_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: 15 bytes; elsewhere nothing). Threads it starts later
    inherit the name, so the kernels' pool workers a step thread spawns carry it too (the overhead benchmark
    tells engine CPU from serving CPU by it)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class BackendRuntime:
    def __init__(self, admission: AdmissionConfig | None = None) -> None:
        self.admission = admission or AdmissionConfig()
        self.streams = RequestStreams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_health_change: Callable[[bool], None] | None = None
        self._on_fatal: Callable[[str], None] | None = None
        self._accepting = False
        self._why_not = "starting"  # why new requests are refused while _accepting is False
        self._stopping = False
        self._dead: str | None = None
        self._busy_since: float | None = None  # set while the backend thread is inside a call that may hang
        self._stalled = False
        self._watchdog: threading.Thread | None = None
        self.kv_events: KvEventLog | None = None  # the prefix cache's KV events, where the backend publishes them
        self._handoff: list[tuple[list[RequestOutput], list[str]]] = []  # steps delivered, not yet dispatched
        self._handoff_lock = threading.Lock()

    # ---- lifecycle ------------------------------------------------------------------------------------
    def bind(
        self,
        on_health_change: Callable[[bool], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """Callbacks (run in the event loop): health changes, and the backend can no longer serve."""
        self._on_health_change = on_health_change or self._on_health_change
        self._on_fatal = on_fatal or self._on_fatal

    def start_runtime(self) -> None:
        """Call from the event loop once the backend's thread is running."""
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._watchdog = threading.Thread(target=self._watch, name="backend-watchdog", daemon=True)
        self._watchdog.start()

    def worker_alive(self) -> bool:
        """Whether the backend's thread (or connection) is alive; backends override it."""
        return True

    @property
    def is_healthy(self) -> bool:
        return self._loop is not None and self.worker_alive() and self._dead is None and not self._stalled

    @property
    def num_in_flight(self) -> int:
        return self.streams.num_in_flight

    @property
    def num_queued(self) -> int:
        return self.streams.num_queued

    def stop_accepting(self, why: str = "draining") -> None:
        """New requests get EngineUnavailable; requests in flight continue (graceful drain)."""
        self._accepting = False
        self._why_not = why

    def resume_accepting(self) -> None:
        """Take new requests again (after a recovery)."""
        self._accepting = True

    @property
    def is_alive(self) -> bool:
        """Not marked dead by the failure policy."""
        return self._dead is None

    @property
    def stopping(self) -> bool:
        """Shutdown has begun: the backend's threads end."""
        return self._stopping

    def begin_shutdown(self) -> None:
        """Refuse new requests, abort every one in flight, and tell the backend's threads to end."""
        self.stop_accepting("shutting down")
        self.abort_all()
        self._stopping = True

    async def join(self, threads: Iterable[threading.Thread], timeout: float) -> None:
        """Wait (off the event loop) for the backend's threads to end, each up to `timeout` seconds."""
        loop = asyncio.get_running_loop()
        for thread in threads:
            await loop.run_in_executor(None, thread.join, timeout)

    def abort_all(self) -> None:
        """Abort every request in flight; backends override it."""

    # whether this machine's ceilings apply to the backend's steps (the native engine runs here; others elsewhere):
    # the server then measures them after SERVING, in a child process (service/engine/roofline.py)
    measures_ceilings: bool = False

    # ---- admission --------------------------------------------------------------------------------------
    def check_capacity(self) -> None:
        """Raise EngineUnavailable or QueueFull if a request would be refused now (cheap; admission re-checks)."""
        self.check_alive()
        self.check_queue()

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineUnavailable(f"engine is not healthy: {self._dead}")
        if not self._accepting:
            raise EngineUnavailable(f"engine is not accepting requests ({self._why_not}); retry")

    def check_queue(self) -> None:
        if self.streams.num_queued >= self.admission.max_queue:
            raise QueueFull(f"waiting queue is full ({self.admission.max_queue} requests); retry later")

    # ---- hand-off and failures (callable from the backend's thread) --------------------------------------
    def deliver(self, outputs: list[RequestOutput], newly_scheduled: Iterable[str] = ()) -> None:
        """Hand one step's outputs to the event loop. Steps the loop has not taken yet are coalesced: only the
        first wakes it (one call_soon_threadsafe, one self-pipe write), and its callback dispatches them all,
        in order."""
        newly = list(newly_scheduled)
        if not outputs and not newly:
            return
        with self._handoff_lock:
            wake = not self._handoff
            self._handoff.append((outputs, newly))
        if wake and not self.call_in_loop(self._dispatch_handoff):
            with self._handoff_lock:  # no loop to take them: nobody is waiting for them either
                self._handoff.clear()

    def _dispatch_handoff(self) -> None:
        with self._handoff_lock:
            batches, self._handoff = self._handoff, []
        for outputs, newly in batches:
            self.streams.dispatch(outputs, newly)

    def call_in_loop(self, fn: Callable[..., object], *args: object) -> bool:
        """Run fn(*args) in the event loop soon; False if there is no loop (any more) to run it."""
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
                return True
            except RuntimeError:  # the loop closed meanwhile
                pass
        return False

    def mark_dead(self, reason: str, fail_streams: bool = False) -> None:
        """The failure policy "exit": refuse new work at once, then (in the event loop, in this order) end the
        streams still open if asked, report unhealthy, and tell the server to exit."""
        self._dead = reason
        self._accepting = False
        self.call_in_loop(self._died, reason, fail_streams)

    def _died(self, reason: str, fail_streams: bool) -> None:
        if fail_streams:
            self.streams.fail_all(reason)
        if self._on_health_change is not None:
            self._on_health_change(False)
        if self._on_fatal is not None:
            self._on_fatal(reason)

    def notify_health(self) -> None:
        if self._on_health_change is not None:
            self.call_in_loop(self._on_health_change, self.is_healthy)

    def busy(self, on: bool) -> None:
        """Bracket a backend call the watchdog should time (an engine step)."""
        self._busy_since = time.monotonic() if on else None

    # ---- watchdog -------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        period = min(1.0, self.admission.stall_timeout_s / 4)
        while not self._stopping and self.worker_alive():
            since = self._busy_since
            stalled = since is not None and time.monotonic() - since > self.admission.stall_timeout_s
            if stalled != self._stalled:
                self._stalled = stalled
                if stalled:
                    logger.error("a backend call has been running for over %.1f s", self.admission.stall_timeout_s)
                self.notify_health()
                if stalled and self.admission.on_failure == "exit" and self._dead is None:
                    self.mark_dead("engine step stalled", fail_streams=True)
            time.sleep(period)
