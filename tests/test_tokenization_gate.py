"""The tokenization gate's per-connection accounting (service/api/tokenization.py): every reservation comes back,
empty texts included (two 0-byte texts of one connection once made the second release fail with a KeyError)."""

from __future__ import annotations

import asyncio
import threading

from service.api.tokenization import TokenizationGate


def test_reservations_of_one_connection_all_come_back_empty_texts_included() -> None:
    gate = TokenizationGate(threads=2, server_texts=4, connection_texts=2)
    release = threading.Event()

    def work(n: int) -> int:
        release.wait(10)
        return n

    errors: list[dict] = []

    async def main() -> list[int]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        tasks = [asyncio.ensure_future(gate.run("peer-a", nbytes, 100, work, i)) for i, nbytes in enumerate((0, 0, 5))]
        await asyncio.sleep(0)  # all three reserved before any finishes
        assert gate.bytes_in_flight == 5
        release.set()
        out = await asyncio.gather(*tasks)
        for _ in range(10):  # the releases are scheduled on the loop after each work item ends
            await asyncio.sleep(0)
        return out

    try:
        assert asyncio.run(main()) == [0, 1, 2]
        assert not errors, errors  # a release callback that raised (logged by asyncio, not raised here)
        assert gate.bytes_in_flight == 0 and gate._per_peer == {}
    finally:
        gate.close()
