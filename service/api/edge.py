"""What every front door shares at the edge: RPC slots, drain state, the watch on streams nobody reads,
request parsing and tokenization (service/api/tokenization.py).

- Slots: one per LLM RPC (one per inference request on the Triton port), at most `max_rpcs` in the server and
  `max_rpcs_per_connection` on one client connection (a connection is what gRPC's peer string names). A
  slot is released when the request's work ends (the backend's final output, an error, a cancel), not when the
  client has read it: a client that stops reading keeps none of the shared slots it used.
- Stalled writers: a stream whose next response has waited on the client for `stall_timeout_s` (HTTP/2 flow
  control: the client stopped reading, its window and gRPC's buffers are full) is ended with ABORTED, which
  aborts its requests in the backend; so unread responses hold memory for a bounded time, never forever.
- Drain: `draining` (readiness says no, subscriptions end) and `cut` (the drain timeout passed: streams still
  running end with ServerShutdown, new ones get UNAVAILABLE), set by the server's drain. The transport refuses new
  streams (the gRPC server's stop: listener closed, GOAWAY); an RPC it accepted before that reached its peer is
  served, as HTTP/2 promises for streams below a GOAWAY's last stream id. `admit()` is the backend for a request,
  `ready()` the same while not draining (what readiness reports).

Runs in the event loop only (no locks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from service.api.status import DEADLINE_SLACK_S, status_for
from service.api.tokenization import TokenizationGate
from service.api.validation import TextLimits, parse
from service.backends.base import Backend
from service.config import ServerConfig
from service.errors import EngineUnavailable, MessageTooLarge, Overloaded, StreamStalled

logger = logging.getLogger(__name__)
T = TypeVar("T")

TOKENIZER_THREADS = 2  # tokenization runs here, never on the event loop (it releases the GIL: see Tokenizer)


class Slot:
    """One RPC's claim on the server's and its connection's capacity; release() is idempotent."""

    __slots__ = ("_edge", "peer")

    def __init__(self, edge: Edge, peer: str) -> None:
        self._edge: Edge | None = edge
        self.peer = peer  # the client connection, as gRPC names it

    def release(self) -> None:
        edge, self._edge = self._edge, None
        if edge is not None:
            edge._release(self.peer)


class WriteWatch:
    """The writer side of one stream: `pending()` before handing a response to gRPC, `sent()` once it took it;
    `on_stall` (set by the handler) aborts the stream's requests in the backend when the edge ends it."""

    __slots__ = ("context", "message", "on_stall", "peer", "since", "stalled")

    def __init__(self, peer: str, context: grpc.aio.ServicerContext) -> None:
        self.peer = peer
        self.context = context
        self.message = ""
        self.on_stall: Callable[[], None] | None = None
        self.since: float | None = None  # when the response now being written was handed over
        self.stalled = False  # the edge ended the stream for it

    def pending(self) -> None:
        self.since = time.monotonic()

    def sent(self) -> None:
        """gRPC took the response; StreamStalled if the edge has ended the stream meanwhile (the client read
        again): the handler ends with ABORTED, the status going out after what was buffered."""
        self.since = None
        if self.stalled:
            raise StreamStalled(self.message)


class Outcome:
    """One RPC's final status, decided the same way at every front door (Edge.outcome)."""

    __slots__ = ("code", "deadline", "label", "request_id", "tokens", "writes")

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        remaining = context.time_remaining()
        self.deadline = None if remaining is None else time.monotonic() + remaining
        self.code = grpc.StatusCode.OK
        self.request_id: str | None = None  # for the error message, once known
        self.tokens = 0  # streamed so far: an error after output is INTERNAL / ABORTED, before it UNAVAILABLE
        self.label = ""  # what the RPC was about, for its metrics (a Triton model)
        self.writes: WriteWatch | None = None  # the stream's writer, when it has one

    def past_deadline(self, slack: float = 0.0) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline - slack


class Edge:
    def __init__(
        self,
        cfg: ServerConfig,
        backend: Callable[[], Backend | None],
        on_stall: Callable[[], None] | None = None,
    ) -> None:
        self._backend = backend  # None until the backend has loaded and warmed up
        self.max_rpcs = cfg.max_concurrent_rpcs
        self.max_rpcs_per_connection = cfg.max_rpcs_per_connection or max(1, cfg.max_concurrent_rpcs // 2)
        self.stall_timeout_s = cfg.stream_stall_timeout_s
        self.max_message_bytes = cfg.max_message_bytes  # request and reply messages larger are RESOURCE_EXHAUSTED
        self._on_stall = on_stall  # counts streams ended for a stalled writer (a metric)
        self.tokenization = TokenizationGate(
            TOKENIZER_THREADS, cfg.tokenize_backlog, cfg.tokenize_backlog_per_connection
        )
        self.num_active = 0  # slots held (the drain waits for them)
        self._per_peer: dict[str, int] = {}
        self._writers: set[WriteWatch] = set()
        self.draining = False  # set on shutdown: readiness says no; requests the transport accepted are served
        self.cut = False  # set at the drain timeout: streams still running end with ServerShutdown
        self._sweeper: asyncio.Task | None = None

    # ---- requests ------------------------------------------------------------------------------------
    def admit(self) -> Backend:
        """The backend for a request, or EngineUnavailable while loading or once the drain has cut its streams.

        A request that arrives while draining is served: the transport stopped taking streams at the drain's start
        (GOAWAY), so one that still reaches a handler was sent before the peer saw that, and a proxy treats it as
        accepted. Refusing it would hand the proxy an UNAVAILABLE it relays instead of retrying elsewhere."""
        if self.cut:
            raise EngineUnavailable("the server is shutting down")
        backend = self._backend()
        if backend is None:
            raise EngineUnavailable("the engine is still loading")
        return backend

    def ready(self) -> Backend:
        """admit(), and not draining: what readiness probes report."""
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        return self.admit()

    def parse(self, message_type: type[Message], raw: bytes) -> Message:
        """A request message of this server (size-checked, then parsed: service/api/validation.py)."""
        return parse(message_type, raw, self.max_message_bytes)

    async def tokenize(self, peer: str, num_bytes: int, limits: TextLimits, fn: Callable[..., T], *args: object) -> T:
        """Tokenization-sized work on `num_bytes` of text from `peer`, off the event loop and bounded."""
        return await self.tokenization.run(peer, num_bytes, limits.max_text_bytes, fn, *args)

    @contextlib.asynccontextmanager
    async def outcome(
        self, context: grpc.aio.ServicerContext, done: Callable[[Outcome], None]
    ) -> AsyncIterator[Outcome]:
        """The block is one RPC; its exceptions become its status, and `done(outcome)` runs once with the final
        code: a cancel at the client's deadline is DEADLINE_EXCEEDED, another CANCELLED (re-raised: swallowing it
        leaks, grpc#43360), a stream the edge ended for a stalled reader ABORTED, an exception its code from
        status_for (the request id and the tokens sent decide the message and UNAVAILABLE vs INTERNAL)."""
        call = Outcome(context)
        try:
            yield call
        except (asyncio.CancelledError, GeneratorExit):  # client gone or deadline: gRPC ends the handler
            expired = call.past_deadline(DEADLINE_SLACK_S)
            call.code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            call.code, message = status_for(exc, call.request_id, call.tokens)
            await context.abort(call.code, message)
        finally:
            if call.writes is not None and call.writes.stalled:
                call.code = grpc.StatusCode.ABORTED  # the edge ended it: its client took no response for too long
            done(call)

    def check_reply(self, reply: Message, what: str, advice: str) -> None:
        """A reply larger than the send limit is refused by its size, naming the limit (not a transport error)."""
        size = reply.ByteSize()
        if size > self.max_message_bytes:
            raise MessageTooLarge(
                f"{what} would be {size} bytes, over the server's limit of {self.max_message_bytes} "
                f"(--max-message-bytes); {advice}"
            )

    # ---- slots ---------------------------------------------------------------------------------------
    def acquire(self, peer: str) -> Slot:
        """A slot for an RPC from `peer`, or Overloaded (RESOURCE_EXHAUSTED) naming the limit it hit."""
        # NOTE: gRPC core's maximum_concurrent_rpcs would also refuse health checks, so the limit lives here.
        if self.num_active >= self.max_rpcs:
            raise Overloaded(f"too many RPCs in flight (limit {self.max_rpcs}); retry later")
        held = self._per_peer.get(peer, 0)
        if held >= self.max_rpcs_per_connection:
            raise Overloaded(
                f"too many RPCs in flight on this connection (limit {self.max_rpcs_per_connection} per "
                "connection); retry later"
            )
        self.num_active += 1
        self._per_peer[peer] = held + 1
        return Slot(self, peer)

    @contextlib.contextmanager
    def slot(self, peer: str) -> Iterator[Slot]:
        """A slot for the block; released at its end at the latest (earlier with Slot.release())."""
        slot = self.acquire(peer)
        try:
            yield slot
        finally:
            slot.release()

    def _release(self, peer: str) -> None:
        self.num_active -= 1
        left = self._per_peer[peer] - 1
        if left:
            self._per_peer[peer] = left
        else:
            del self._per_peer[peer]

    def held_by(self, peer: str) -> int:
        return self._per_peer.get(peer, 0)

    # ---- stalled writers -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch_writes(self, context: grpc.aio.ServicerContext) -> Iterator[WriteWatch]:
        """Register a stream's writer for the stall watch for the block."""
        watch = WriteWatch(context.peer(), context)
        self._writers.add(watch)
        self._start_sweeper()
        try:
            yield watch
        finally:
            self._writers.discard(watch)

    @property
    def num_blocked_writers(self) -> int:
        """Streams whose current response is still waiting for the client to take it."""
        return sum(1 for w in self._writers if w.since is not None)

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        period = min(1.0, self.stall_timeout_s / 4)
        while self._writers:
            await asyncio.sleep(period)
            self.end_stalled()

    def end_stalled(self) -> int:
        """End every stream whose pending response has waited longer than the stall timeout; how many."""
        now = time.monotonic()
        stalled = [w for w in self._writers if w.since is not None and now - w.since > self.stall_timeout_s]
        for watch in stalled:
            logger.warning(
                "ending a stream from %s: its client took no response for %.0f s", watch.peer, now - watch.since
            )
            self._writers.discard(watch)
            watch.stalled = True
            # NOTE: the handler waits in gRPC's write of a response its client does not take: nothing can end
            # that write from outside and still give the client a status (a cancel leaves it waiting for one;
            # an abort from another task sometimes never sends it). So its requests are aborted in the backend
            # now (on_stall), and the handler itself ends with ABORTED when the write returns (WriteWatch.sent).
            watch.message = (
                f"stream ended: its client took no response for {self.stall_timeout_s:.0f} s (--stream-stall-timeout)"
            )
            if watch.on_stall is not None:
                watch.on_stall()
            if self._on_stall is not None:
                self._on_stall()
        return len(stalled)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.tokenization.close()
