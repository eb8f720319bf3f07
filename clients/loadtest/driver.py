"""Load generation: a closed loop at a fixed concurrency, or an open loop of Poisson / gamma arrivals.

Every run is bounded: it ends when its requests are done or its time limit passes, whichever comes first;
requests still in flight at the limit are cancelled and counted as failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import numpy as np

from clients.loadtest.backends import Backend, Sampling
from clients.loadtest.metrics import RequestRecord
from clients.loadtest.workload import WorkItem

OnDone = Callable[[RequestRecord], None]


async def closed_loop(
    backend: Backend,
    items: list[WorkItem],
    concurrency: int,
    sampling: Sampling,
    time_limit_s: float,
    send_for_s: float | None = None,
    on_done: OnDone | None = None,
) -> tuple[list[RequestRecord], float]:
    """`concurrency` users, each sending its next request as soon as the previous one finishes.

    Stops sending after the items run out or `send_for_s` seconds (items are reused in a cycle when a
    duration is given). Returns the records and the run's duration (first send to last completion).
    """
    records: list[RequestRecord] = []
    start = time.perf_counter()
    source: Iterator[WorkItem] = _cycle(items) if send_for_s is not None else iter(items)

    async def user() -> None:
        for item in source:
            if send_for_s is not None and time.perf_counter() - start > send_for_s:
                return
            rec = RequestRecord(input_tokens=item.input_tokens)
            records.append(rec)
            await backend.send(item, sampling, rec)
            if on_done is not None:
                on_done(rec)

    users = [asyncio.create_task(user()) for _ in range(concurrency)]
    await _bounded(users, start + time_limit_s)
    return records, time.perf_counter() - start


async def open_loop(
    backend: Backend,
    items: list[WorkItem],
    request_rate: float,
    sampling: Sampling,
    time_limit_s: float,
    burstiness: float = 1.0,
    rng: np.random.Generator | None = None,
    send_for_s: float | None = None,
    on_done: OnDone | None = None,
) -> tuple[list[RequestRecord], float]:
    """Requests arrive at `request_rate` per second, independent of completions: gaps are gamma distributed
    with shape `burstiness` and mean 1 / rate (burstiness 1 = Poisson; < 1 burstier; > 1 more regular)."""
    rng = rng or np.random.default_rng()
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()

    async def one(item: WorkItem) -> None:
        rec = RequestRecord(input_tokens=item.input_tokens)
        records.append(rec)
        await backend.send(item, sampling, rec)
        if on_done is not None:
            on_done(rec)

    source = _cycle(items) if send_for_s is not None else iter(items)
    next_at = start
    for item in source:
        next_at += float(rng.gamma(burstiness, 1.0 / (request_rate * burstiness)))
        now = time.perf_counter()
        if send_for_s is not None and next_at - start > send_for_s:
            break
        if next_at - start > time_limit_s:
            break
        if next_at > now:
            await asyncio.sleep(next_at - now)
        tasks.append(asyncio.create_task(one(item)))
    await _bounded(tasks, start + time_limit_s)
    return records, time.perf_counter() - start


def _cycle(items: list[WorkItem]) -> Iterator[WorkItem]:
    while True:
        yield from items


async def _bounded(tasks: list[asyncio.Task], deadline: float) -> None:
    """Wait for the tasks until the deadline, then cancel the rest (their requests count as failed)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
