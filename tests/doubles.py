"""Test doubles, named as such: they stand in only for what a test must control (faults, stalls)."""

from __future__ import annotations

import threading
import time

import numpy as np

from service.engine.runners.base import ForwardBatch


class FaultyRunner:
    """Test double of the native model runner: runs the real runner, but raises at one chosen step or stalls
    at one chosen step (steps counted from construction, 1-based), as a device fault or a hung kernel would."""

    def __init__(
        self, real, fail_at_step: int | None = None, stall_at_step: int | None = None, stall_s: float = 0.0
    ) -> None:
        self.real = real
        self.fail_at_step = fail_at_step
        self.stall_at_step = stall_at_step
        self.stall_s = stall_s
        self.steps = 0
        self.failed = threading.Event()
        self.stalled = threading.Event()

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        self.steps += 1
        if self.steps == self.fail_at_step:
            self.failed.set()
            raise RuntimeError(f"injected fault at step {self.steps}")
        if self.steps == self.stall_at_step:
            self.stalled.set()
            time.sleep(self.stall_s)
        return self.real.execute(batch)

    def __getattr__(self, name: str):
        return getattr(self.real, name)
