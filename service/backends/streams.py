"""The event-loop side of every backend: one output stream per request in flight, keyed by the backend's own
request id (never the client's), fed from the backend's thread without ever blocking it.

A backend's thread hands lists of RequestOutput to the event loop (`call_soon_threadsafe(streams.dispatch,
...)`); each request's collector merges deltas while its consumer lags, so a slow client costs memory for one
merged delta, never a blocked engine. `stream()` is the consumer: it yields deltas, raises EngineError for an
engine failure, and aborts the request in the backend when the consumer goes away (client gone, deadline).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

from service.errors import EngineError
from service.request import RequestOutput

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
    """Hand-off from the backend (via the event loop) to one consumer; put() never blocks.

    `on_done` runs once, when the request's work ends: its final output arrives (whether or not the consumer
    has taken it yet), or the stream closes early.
    """

    __slots__ = ("_on_done", "_output", "_waiter")

    def __init__(self, on_done: Callable[[], None] | None = None) -> None:
        self._output: RequestOutput | None = None
        self._waiter: asyncio.Future[None] | None = None  # the consumer waiting in get(), if it is
        self._on_done = on_done

    def put(self, out: RequestOutput) -> None:
        self._output = out if self._output is None else merge_outputs(self._output, out)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if out.finished:
            self.done()

    def done(self) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done()

    async def get(self) -> RequestOutput:
        while self._output is None:
            # NOTE: one future per wait, resolved by put() directly (an asyncio.Event would add a waiter deque
            # and a second future object per token)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self._output = self._output, None
        return out


class RequestStreams:
    """Collectors of the requests in flight, and which of them are still queued (the bounded queue).

    Runs in the event loop thread only.
    """

    def __init__(self) -> None:
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._queued: set[str] = set()  # accepted, not yet scheduled

    @property
    def num_in_flight(self) -> int:
        return len(self._collectors)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def ids(self) -> list[str]:
        return list(self._collectors)

    def open(self, req_id: str, on_done: Callable[[], None] | None = None) -> RequestOutputCollector:
        collector = RequestOutputCollector(on_done)
        self._collectors[req_id] = collector
        self._queued.add(req_id)
        return collector

    def close(self, req_id: str, collector: RequestOutputCollector | None = None) -> None:
        """Forget a stream; with `collector`, only if the id still belongs to it (an id may be reused later)."""
        if collector is not None and self._collectors.get(req_id) is not collector:
            collector.done()
            return
        closed = self._collectors.pop(req_id, None)
        if closed is not None:
            closed.done()
        self._queued.discard(req_id)

    def dispatch(self, outputs: Iterable[RequestOutput], newly_scheduled: Iterable[str] = ()) -> None:
        for req_id in newly_scheduled:
            self._queued.discard(req_id)
        for out in outputs:
            if out.finished or out.new_token_ids:
                self._queued.discard(out.request_id)
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)

    def fail_all(self, message: str) -> None:
        """End every stream at once with an engine error (the backend cannot end them itself)."""
        self.dispatch(RequestOutput(i, [], finished=True, finish_reason="error", error=message) for i in self.ids())

    async def stream(
        self, req_id: str, collector: RequestOutputCollector, abort: Callable[[str], None]
    ) -> AsyncIterator[RequestOutput]:
        """The consumer of one request: deltas until the final one; abort in the backend if closed early."""
        try:
            while True:
                out = await collector.get()
                if out.finish_reason == "error":
                    raise EngineError(out.error or "engine failure")
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            abort(req_id)
            raise
        finally:
            self.close(req_id, collector)
