"""grpc.health.v1 with a drain: Watch streams end when the server drains (after telling NOT_SERVING).

gRPC's aio HealthServicer keeps every Watch stream open until the client leaves, so a server.stop(grace)
would wait out the whole grace for them; ending them lets the stop return as soon as the real work is done.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health

WATCH_FLUSH_S = 0.05  # time for Watch streams to send NOT_SERVING before they are ended


class DrainingHealthServicer(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._ended = asyncio.Event()

    async def end_watches(self) -> None:
        """Call after enter_graceful_shutdown(): every Watch stream sends NOT_SERVING, then ends with OK."""
        await asyncio.sleep(WATCH_FLUSH_S)
        self._ended.set()

    async def Watch(self, request, context) -> None:
        watch = asyncio.ensure_future(super().Watch(request, context))
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({watch, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # ended, or the client left (CancelledError): either way the inner watch stops here
            watch.cancel()
            ended.cancel()
