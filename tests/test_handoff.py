"""The hand-off from a backend's thread to the event loop (service/backends/runtime.py, streams.py): steps the
loop has not taken yet are coalesced into one wake-up and dispatched in order; a stream closed early loses its
outputs, and nobody else's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from service.backends.runtime import BackendRuntime
from service.request import RequestOutput
from tests.waiting import WITHIN_S


class CountingRuntime(BackendRuntime):
    """A runtime that counts its wake-ups of the event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def call_in_loop(self, fn: Callable[..., object], *args: object) -> bool:
        self.wakeups += 1
        return super().call_in_loop(fn, *args)


def _step(i: int, req_ids: list[str], last: int) -> list[RequestOutput]:
    """One step's outputs: token i for every request, the final one at i == last."""
    return [
        RequestOutput(r, [i], new_text=f"{i} ", finished=i == last, finish_reason="length" if i == last else None)
        for r in req_ids
    ]


def _deliver_from_thread(runtime: BackendRuntime, steps: list[list[RequestOutput]]) -> None:
    """Deliver the steps from another thread, blocking the caller (the event loop) until all are handed over."""
    thread = threading.Thread(target=lambda: [runtime.deliver(outs) for outs in steps])
    thread.start()
    thread.join()


async def _started() -> CountingRuntime:
    runtime = CountingRuntime()
    runtime.start_runtime()
    return runtime


def test_steps_the_loop_has_not_taken_are_one_wakeup_in_order() -> None:
    async def main() -> None:
        runtime = await _started()
        collectors = {r: runtime.streams.open(r) for r in ("a", "b")}
        _deliver_from_thread(runtime, [_step(i, ["a", "b"], 49) for i in range(50)])  # the loop is blocked meanwhile
        assert runtime.wakeups == 1
        for r, collector in collectors.items():
            out = await collector.get()  # the consumer lagged: every step merged into one delta
            assert out.new_token_ids == list(range(50)), r
            assert out.new_text == "".join(f"{i} " for i in range(50))
            assert out.finished and out.finish_reason == "length"
        _deliver_from_thread(runtime, [_step(0, ["c"], 1)])  # taken: the next step wakes the loop again
        assert runtime.wakeups == 2
        runtime.begin_shutdown()

    asyncio.run(main())


def test_a_stream_closed_early_loses_only_its_own_outputs() -> None:
    async def main() -> None:
        runtime = await _started()
        aborted: list[str] = []
        streams = {r: runtime.streams.stream(r, runtime.streams.open(r), aborted.append) for r in ("a", "b")}
        got: dict[str, list[int]] = {"a": [], "b": []}
        for i in range(3):
            _deliver_from_thread(runtime, [_step(i, ["a", "b"], 9)])
            for r, stream in streams.items():
                got[r] += (await anext(stream)).new_token_ids
        await streams["b"].aclose()  # the client went away
        assert aborted == ["b"] and runtime.streams.ids() == ["a"]
        _deliver_from_thread(runtime, [_step(i, ["a", "b"], 9) for i in range(3, 10)])
        async for out in streams["a"]:
            got["a"] += out.new_token_ids
        assert got == {"a": list(range(10)), "b": [0, 1, 2]}
        assert runtime.streams.num_in_flight == 0
        runtime.begin_shutdown()

    asyncio.run(main())


def test_outputs_with_no_loop_to_take_them_do_not_block_later_ones() -> None:
    async def main() -> None:
        runtime = CountingRuntime()
        runtime.deliver(_step(0, ["a"], 0))  # before start: no loop, nobody waits for it
        runtime.start_runtime()
        collector = runtime.streams.open("a")
        _deliver_from_thread(runtime, [_step(1, ["a"], 1)])
        out = await asyncio.wait_for(collector.get(), WITHIN_S)
        assert out.new_token_ids == [1] and out.finished
        runtime.begin_shutdown()

    asyncio.run(main())
