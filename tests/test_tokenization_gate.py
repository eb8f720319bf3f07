"""The tokenization gate's per-connection accounting (service/api/tokenization.py): every reservation comes back,
empty texts included (two 0-byte texts of one connection once made the second release fail with a KeyError)."""

from __future__ import annotations

import asyncio
import threading

from service.api.tokenization import TokenizationGate


def test_reservations_of_one_connection_all_come_back_empty_texts_included() -> None:
    gate = TokenizationGate(threads=2, server_texts=4, connection_texts=2)
    both_running = threading.Barrier(2, timeout=30)  # neither text's work ends before the other's has started

    def work(n: int) -> int:
        both_running.wait()
        return n

    errors: list[dict] = []

    async def main() -> list[int]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        # both reserved (in run(), before their work is submitted) before either is released
        return await asyncio.gather(*(gate.run("peer-a", 0, 100, work, i) for i in range(2)))

    try:
        assert asyncio.run(main()) == [0, 1]
        assert not errors, errors  # a release callback that raised (logged by asyncio, not raised here)
        assert gate.bytes_in_flight == 0 and gate._per_peer == {}
    finally:
        gate.close()
