"""Waiting for an observed condition: the only place the suite's own code sleeps (tests/test_suite_rules.py).

A test never sleeps hoping the engine has got somewhere: it waits until it sees the state it needs (a token,
a metric, a counter), with a generous bound that only a hang reaches. A slower box makes a test slower, never
red.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.01
WITHIN_S = 30.0  # far above what any condition takes on a busy 2-core box: reaching it means a hang


def wait_until(predicate: Callable[[], T], what: str, within: float = WITHIN_S) -> T:
    """Poll `predicate` until it returns a truthy value (returned); AssertionError naming `what` after `within`."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"never happened within {within:.0f} s: {what}"
        time.sleep(POLL_S)


async def wait_until_async(predicate: Callable[[], T], what: str, within: float = WITHIN_S) -> T:
    """wait_until for coroutines: polls without blocking the event loop."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"never happened within {within:.0f} s: {what}"
        await asyncio.sleep(POLL_S)
