"""Test doubles, named as such: they stand in only for what a test must control (faults, stalls, pacing)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from service.engine.runners.base import ForwardBatch


class FaultyRunner:
    """Test double of the native model runner: runs the real runner, but raises or stalls in one step, as a
    device fault or a hung kernel would.

    The faulty step is chosen by number (steps counted from construction, 1-based: `fail_at_step`,
    `stall_at_step`), as the first step in which at least N sequences decode (`fail_when_decoding`,
    `stall_when_decoding`: every one of N requests has its first token and is still running, however fast the
    engine is), or armed by the test once it has seen the state it wants (`fail_next()`, `stall_next()`: the
    next step to start). A stall lasts until `unstall()`, or `stall_s` seconds at most.
    """

    def __init__(
        self,
        real,
        fail_at_step: int | None = None,
        stall_at_step: int | None = None,
        stall_s: float = 600.0,
        fail_when_decoding: int | None = None,
        stall_when_decoding: int | None = None,
    ) -> None:
        self.real = real
        self.fail_at_step, self.stall_at_step, self.stall_s = fail_at_step, stall_at_step, stall_s
        self.fail_when_decoding, self.stall_when_decoding = fail_when_decoding, stall_when_decoding
        self.steps = 0
        self.failed = threading.Event()
        self.stalled = threading.Event()
        self._unstall = threading.Event()
        self._armed: str | None = None  # "fail" | "stall": the next step's fault

    def fail_next(self) -> None:
        self._armed = "fail"

    def stall_next(self) -> None:
        self._armed = "stall"

    def unstall(self) -> None:
        self._unstall.set()

    def _fault(self, batch: ForwardBatch) -> str | None:
        armed, self._armed = self._armed, None
        decoding = int(np.count_nonzero(np.diff(batch.query_start_loc) == 1))
        if armed == "fail" or self.steps == self.fail_at_step or decoding >= (self.fail_when_decoding or 1 << 30):
            self.fail_when_decoding = None  # once
            return "fail"
        if armed == "stall" or self.steps == self.stall_at_step or decoding >= (self.stall_when_decoding or 1 << 30):
            self.stall_when_decoding = None
            return "stall"
        return None

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        self.steps += 1
        fault = self._fault(batch)
        if fault == "fail":
            self.failed.set()
            raise RuntimeError(f"injected fault at step {self.steps}")
        if fault == "stall":
            self.stalled.set()
            self._unstall.wait(self.stall_s)
        return self.real.execute(batch)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


class PacedRunner:
    """Test double of the native model runner: runs the real runner's steps only as fast as the test allows.

    Free at first (every step runs). `hold()`: the step in progress finishes, the next one waits at the gate
    (after scheduling, before the forward pass) until `allow(n)` lets n more through or `release()` frees it
    again. `wait_held()` returns once the engine thread waits at the gate, i.e. no step is running and a
    batch has been scheduled. This is how a test keeps a request running, queued or unfinished for as long as
    it needs, on any machine, instead of hoping that a sleep is shorter than the request.

    `min_step_s` is a floor under every step's duration, as a slow device would have: a request of N tokens
    then takes at least N x min_step_s on any machine (a deadline shorter than that always expires first).
    """

    def __init__(self, real, min_step_s: float = 0.0) -> None:
        self.real = real
        self.min_step_s = min_step_s
        self.steps = 0  # forward passes run
        self._cond = threading.Condition()
        self._allowance: int | None = None  # steps that may still start; None: any number
        self._at_gate = False

    def hold(self) -> None:
        with self._cond:
            self._allowance = 0

    def allow(self, n: int = 1) -> None:
        with self._cond:
            self._allowance = (self._allowance or 0) + n
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._allowance = None
            self._cond.notify_all()

    def wait_held(self, within: float = 30.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._at_gate, within), "the engine never reached the gate"

    def step_until(self, done: Callable[[], bool], within: float = 30.0) -> None:
        """Held: run one step at a time until `done()` (checked while the engine waits at the gate, so it reads
        a state no step is changing); the engine stays held at the gate afterwards."""
        self.wait_held(within)
        while not done():
            with self._cond:
                target = self.steps + 1
                self._allowance = 1
                self._cond.notify_all()
                ok = self._cond.wait_for(lambda t=target: self.steps >= t and self._at_gate, within)
                assert ok, "the engine did not come back to the gate (no more work?)"

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        with self._cond:
            self._at_gate = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._allowance != 0)
            self._at_gate = False
            if self._allowance is not None:
                self._allowance -= 1
            self.steps += 1
        start = time.monotonic()
        logits = self.real.execute(batch)
        rest = self.min_step_s - (time.monotonic() - start)
        if rest > 0:
            time.sleep(rest)
        return logits

    def __getattr__(self, name: str):
        return getattr(self.real, name)
