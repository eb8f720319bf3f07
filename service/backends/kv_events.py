"""KvEventLog: a backend's KV-cache events (service/kv_events.py) as numbered batches, with a bounded history
for a subscriber's replay and the live block set for a state snapshot. Thread-safe: the engine's thread (or the
TensorRT-LLM event poller) publishes, subscribers on the event loop read (service/api/worker/kv_stream.py).

Sequence numbers count up by one per batch from a start taken from the clock in microseconds at construction,
so a restarted server's numbers begin above every number its previous incarnation could have reached (one batch
per engine step is far below one per microsecond): a subscriber's cursor from before a restart is below this
history and gets OUT_OF_RANGE, never another incarnation's batches under the numbers it expects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from service.errors import DataLoss, OutOfRange
from service.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    timestamp: float  # seconds since the epoch, when published
    events: tuple[KvEvent, ...]
    first_event_id: int  # events are numbered too, from 1, across batches


@dataclass(frozen=True, slots=True)
class LiveBlock:
    """One block the cache holds, as its store event described it."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]  # [block_size]
    cache_salt: str


class KvEventLog:
    def __init__(self, history: int, block_size: int, clock: Callable[[], float] = time.time) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.history = history
        self.block_size = block_size
        self._clock = clock
        self._lock = threading.Lock()
        self._batches: deque[EventBatch] = deque(maxlen=history)
        self.first_ever = time.time_ns() // 1000 + 1  # the first batch's number
        self._last = self.first_ever - 1
        self._live: dict[int, LiveBlock] = {}  # insertion order: stores in order
        self._events = 0  # events published
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # ---- publishing (any thread) ---------------------------------------------------------------------
    def publish(self, events: Iterable[KvEvent]) -> int | None:
        """Number the events as one batch (none: nothing happens); returns its sequence number."""
        events = tuple(events)
        if not events:
            return None
        with self._lock:
            self._last += 1
            self._batches.append(EventBatch(self._last, self._clock(), events, self._events + 1))
            self._events += len(events)
            for event in events:
                self._apply(event)
            waiters, self._waiters = self._waiters, []
            seq = self._last
        for loop, ready in waiters:
            with contextlib.suppress(RuntimeError):  # that subscriber's loop has closed
                loop.call_soon_threadsafe(ready.set)
        return seq

    def _apply(self, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            for block_hash, parent, tokens in event.blocks():
                self._live.pop(block_hash, None)  # a store again moves it last (after its parent)
                self._live[block_hash] = LiveBlock(block_hash, parent, tokens, event.cache_salt)
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._live.pop(block_hash, None)
        elif isinstance(event, AllBlocksCleared):
            self._live.clear()

    # ---- reading (the event loop) ------------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        """The last batch's number (first_ever - 1 before the first)."""
        return self._last

    def batches_from(self, seq: int) -> list[EventBatch]:
        """The batches numbered `seq` and later; OutOfRange when `seq` is beyond the next batch or the history
        no longer holds it."""
        with self._lock:
            first = self._batches[0].seq if self._batches else self._last + 1
            if seq > self._last + 1:
                raise OutOfRange(
                    f"start_sequence_number {seq} is beyond the last sequence {self._last}: the publisher restarted; "
                    "resubscribe from zero"
                )
            if seq < first:
                raise OutOfRange(
                    f"start_sequence_number {seq} is before the history, which keeps sequences from {first}; "
                    "resubscribe from zero for a state snapshot"
                )
            return list(itertools.islice(self._batches, seq - first, None))

    def next_batches(self, after: int) -> list[EventBatch]:
        """A subscriber's next batches after the last it sent; DataLoss when the history has moved past it."""
        try:
            return self.batches_from(after + 1)
        except OutOfRange:
            raise DataLoss(
                f"the subscriber fell behind: its next batch {after + 1} has left the history of {self.history} "
                "batches (--kv-event-history); resubscribe from zero"
            ) from None

    def live_block_hashes(self) -> set[int]:
        """Every block the events say the cache holds now."""
        with self._lock:
            return set(self._live)

    def complete(self) -> bool:
        """Whether the history still holds every batch ever published (a subscriber from zero replays it)."""
        with self._lock:
            return not self._batches or self._batches[0].seq == self.first_ever

    def snapshot(self) -> tuple[int, list[LiveBlock]]:
        """(the sequence the state was taken at, every live block reachable from a root, parents first)."""
        with self._lock:
            live, seq = dict(self._live), self._last
        ordered: list[LiveBlock] = []
        placed: set[int] = set()
        orphaned: set[int] = set()  # an ancestor is gone: a router could not place them (nor can we use them)
        for start in live.values():
            chain: list[LiveBlock] = []  # start, its parent, ... up to a placed block or a root
            on_chain: set[int] = set()
            block: LiveBlock | None = start
            while True:
                if block is None or block.block_hash in orphaned or block.block_hash in on_chain:
                    orphaned.update(on_chain)
                    chain = []
                    break
                if block.block_hash in placed:
                    break
                chain.append(block)
                on_chain.add(block.block_hash)
                if block.parent_hash is None:
                    break
                block = live.get(block.parent_hash)
            for b in reversed(chain):
                placed.add(b.block_hash)
                ordered.append(b)
        return seq, ordered

    async def wait(self, after: int, timeout: float) -> None:
        """Return once a batch after `after` exists, or after `timeout` seconds."""
        ready = asyncio.Event()
        entry = (asyncio.get_running_loop(), ready)
        with self._lock:
            if self._last > after:
                return
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(ready.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove(entry)
