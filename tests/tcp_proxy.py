"""A TCP forwarder on 127.0.0.1 whose open connections a test can cut (a network fault between two real
processes, e.g. a gateway and a worker); new connections keep being accepted."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from tests.servers import free_port


class TcpProxy:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.port = free_port()
        self.drops = 0
        self.refusing = False  # new connections are cut at once (a network partition)
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", self.port), self._loop
        )
        self._server = server.result(10)
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            self._writers.discard(writer)
            writer.close()

    def partition(self, on: bool) -> None:
        """While on, every connection is cut, open ones now and new ones at once."""
        self.refusing = on
        if on:
            self.drop()

    def drop(self) -> None:
        """Cut every open connection (both directions, at once)."""

        def cut() -> None:
            for writer in list(self._writers):
                writer.transport.abort()
            self.drops += 1

        done = threading.Event()
        self._loop.call_soon_threadsafe(lambda: (cut(), done.set()))
        done.wait(10)

    def stop(self) -> None:
        self.drop()
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def tcp_proxy(upstream: str) -> Iterator[TcpProxy]:
    proxy = TcpProxy(upstream).start()
    try:
        yield proxy
    finally:
        proxy.stop()
