"""Tokenization and chat rendering for every front door, in one place.

- Off the event loop, in a small pool, through Tokenizer.encode, which releases the GIL: a maximal prompt
  (seconds of tokenizing) no longer stops the event loop, health checks or the engine thread.
- Bounded: the text being tokenized (queued or running) is at most `server_texts` x max_text_bytes in the
  server and `connection_texts` x max_text_bytes per client connection; beyond, RESOURCE_EXHAUSTED at once
  instead of a queue of seconds of work.
- A prompt that cannot fit the context is refused after tokenizing little more than it may hold
  (Tokenizer.encode(max_tokens=...)), not after tokenizing all of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from service.errors import Overloaded

T = TypeVar("T")


class TokenizationGate:
    def __init__(self, threads: int, server_texts: float, connection_texts: float) -> None:
        self.server_texts = server_texts  # budget in maximal texts (max_text_bytes each), server-wide
        self.connection_texts = connection_texts  # the same, per client connection
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self.bytes_in_flight = 0
        self._per_peer: dict[str, int] = {}

    async def run(self, peer: str, num_bytes: int, max_text_bytes: int, fn: Callable[..., T], *args: object) -> T:
        """Run tokenization-sized work on `num_bytes` of text from `peer` in the pool, or raise Overloaded."""
        server_budget = int(self.server_texts * max_text_bytes)
        peer_budget = int(self.connection_texts * max_text_bytes)
        held = self._per_peer.get(peer, 0)
        if self.bytes_in_flight and self.bytes_in_flight + num_bytes > server_budget:
            raise Overloaded(
                f"tokenization backlog is full ({self.bytes_in_flight} bytes of text in flight, limit "
                f"{server_budget}); retry later"
            )
        if held and held + num_bytes > peer_budget:
            raise Overloaded(
                f"tokenization backlog of this connection is full ({held} bytes of text in flight, limit "
                f"{peer_budget} per connection); retry later"
            )
        self.bytes_in_flight += num_bytes
        self._per_peer[peer] = held + num_bytes
        loop = asyncio.get_running_loop()
        work = self._pool.submit(fn, *args)
        # NOTE: the reservation ends with the work, not with the caller: a client that cancels keeps its
        # bytes counted while a thread still tokenizes them (queued work is cancelled with the caller)
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, peer, num_bytes))
        return await asyncio.wrap_future(work)

    def _release(self, peer: str, num_bytes: int) -> None:
        # NOTE: entries of 0 bytes (an empty text) share the peer's key too: the first release of two may
        # already have dropped it
        self.bytes_in_flight -= num_bytes
        left = self._per_peer.get(peer, 0) - num_bytes
        if left > 0:
            self._per_peer[peer] = left
        else:
            self._per_peer.pop(peer, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
