"""The native backend (the engine's runtime): streaming, cancellation storm, bounded queue, slow consumers, engine
failure, watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path

import pytest

from service.backends.native import NativeBackend
from service.config import AdmissionConfig
from service.engine.core import EngineCore
from service.errors import EngineError, EngineUnavailable, InvalidRequest, QueueFull
from service.request import GenerateRequest, SamplingParams
from tests.doubles import FaultyRunner, PacedRunner
from tests.engines import build_tiny
from tests.waiting import wait_until_async


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-async", max_batch_size=16, max_num_tokens=64, max_seq_len=512)


def _gen(rid: str, max_tokens: int = 16, prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(
        rid, prompt or [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )


async def _started(engine_dir: Path, blocks: int = 256, **cfg) -> NativeBackend:
    engine = NativeBackend(EngineCore(engine_dir, num_kv_blocks=blocks), AdmissionConfig(**cfg))
    engine.start()
    return engine


async def _collect(engine: NativeBackend, gen: GenerateRequest) -> list:
    return await _drain(engine.generate(gen))


async def _drain(stream) -> list:
    return [out async for out in stream]


async def aenumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1


def test_streams_complete_and_everything_is_released(engine_dir: Path) -> None:
    async def main() -> None:
        engine = await _started(engine_dir)
        results = await asyncio.gather(*(_collect(engine, _gen(f"r{i}", 10 + i)) for i in range(8)))
        for i, outs in enumerate(results):
            assert sum(len(o.new_token_ids) for o in outs) == 10 + i and outs[-1].finish_reason == "length"
        core = engine.core
        assert not core.scheduler.requests and core.kv.pool.num_free_blocks == 256 and engine.num_in_flight == 0
        await engine.shutdown()

    asyncio.run(main())


def test_cancellation_storm_frees_everything(engine_dir: Path) -> None:
    async def main() -> None:
        engine = await _started(engine_dir, blocks=512, max_queue=256)
        core = engine.core
        paced = core.runner = PacedRunner(core.runner)
        rng = random.Random(0)

        async def consume(i: int, stop_after: int) -> None:
            prompt = [rng.randrange(3, 260) for _ in range(rng.randint(1, 90))]
            async with contextlib.aclosing(engine.generate(_gen(f"c{i}", 300, prompt))) as outputs:
                async for n, _ in aenumerate(outputs):
                    if n + 1 == stop_after:
                        break  # aborted mid-prefill (outputs are only sampled tokens) or mid-decode

        paced.hold()  # every request admitted before any step runs: some are cancelled while still queued
        tasks = [asyncio.create_task(consume(i, rng.randint(1, 8))) for i in range(200)]
        await wait_until_async(lambda: engine.num_in_flight == 200, "all 200 admitted")
        for t in rng.sample(tasks, 60):
            t.cancel()
        paced.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_until_async(
            lambda: not core.scheduler.requests and not core.kv.pool.num_used_blocks, "every request and block freed"
        )
        assert engine.num_in_flight == 0 and engine.num_queued == 0 and not core.outputs.texts
        core.scheduler.check_invariants()
        await engine.shutdown()

    asyncio.run(main())


def test_queue_bound_rejects_the_overflow(engine_dir: Path) -> None:
    async def main() -> None:
        core = EngineCore(engine_dir, num_kv_blocks=256, max_num_seqs=1)
        engine = NativeBackend(core, AdmissionConfig(max_queue=8))
        engine.start()
        running = engine.generate(_gen("running", 200))
        await running.__anext__()  # it is running (it produced a token): it is not queued
        admitted, rejected = [], 0
        for i in range(12):  # admission is synchronous: nothing leaves the queue between these calls
            try:
                admitted.append(engine.generate(_gen(f"q{i}", 4)))
            except QueueFull:
                rejected += 1
        assert rejected == 4 and len(admitted) == 8
        results = await asyncio.gather(*(_drain(s) for s in admitted))
        assert all(sum(len(o.new_token_ids) for o in r) == 4 for r in results)
        assert [o async for o in running][-1].finished
        await engine.shutdown()

    asyncio.run(main())


def test_validation_and_client_ids_are_not_engine_ids(engine_dir: Path) -> None:
    async def main() -> None:
        engine = await _started(engine_dir)
        with pytest.raises(InvalidRequest, match="max_seq_len"):
            await _collect(engine, _gen("big", 600))
        with pytest.raises(InvalidRequest, match=r"stopping\.stop_token_ids contains token id 999"):
            bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(999,))
            await _collect(engine, GenerateRequest("oov", [5, 6], bad))
        first = engine.generate(_gen("dup", 50))
        head = await first.__anext__()
        second = await _collect(engine, _gen("dup", 5, prompt=[9, 8, 7]))  # same client id, its own request
        assert sum(len(o.new_token_ids) for o in second) == 5 and second[-1].request_id != head.request_id
        engine.abort("dup")  # client ids mean nothing to the engine: no-op
        engine.abort("never-existed")  # idempotent, unknown ids ignored
        rest = [o async for o in first]
        assert sum(len(o.new_token_ids) for o in [head, *rest]) == 50
        await engine.shutdown()


def test_slow_consumer_does_not_slow_the_others(engine_dir: Path) -> None:
    async def main() -> None:
        engine = await _started(engine_dir)
        slow = engine.generate(_gen("slow", 60))
        first = await slow.__anext__()  # then never read again while the others run
        start = time.monotonic()
        fast = await asyncio.gather(*(_collect(engine, _gen(f"f{i}", 30)) for i in range(4)))
        assert time.monotonic() - start < 5 and all(o[-1].finished for o in fast)
        rest = [o async for o in slow]  # the lagging stream was merged, nothing lost
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 60
        assert len(rest) < 59
        await engine.shutdown()

    asyncio.run(main())


def test_step_failure_fails_requests_and_marks_engine_dead(engine_dir: Path) -> None:
    async def main() -> None:
        health: list[bool] = []
        core = EngineCore(engine_dir, num_kv_blocks=64)
        engine = NativeBackend(core, AdmissionConfig())
        engine.bind(on_health_change=health.append)
        engine.start()
        await _collect(engine, _gen("ok", 3))

        def broken(batch):
            raise RuntimeError("simulated kernel failure")

        core.runner.execute = broken
        with pytest.raises(EngineError):
            await _collect(engine, _gen("doomed", 5))
        await wait_until_async(lambda: health, "the health callback")
        assert not engine.is_healthy and health == [False]
        with pytest.raises(EngineUnavailable):
            await _collect(engine, _gen("after", 5))
        assert core.kv.pool.num_used_blocks == 0 and not core.scheduler.requests
        await engine.shutdown()

    asyncio.run(main())


def test_watchdog_reports_a_stalled_step(engine_dir: Path) -> None:
    async def main(on_failure: str) -> None:
        health: list[bool] = []
        fatal: list[str] = []
        core = EngineCore(engine_dir, num_kv_blocks=64)
        engine = NativeBackend(core, AdmissionConfig(stall_timeout_s=0.2, on_failure=on_failure))
        engine.bind(health.append, fatal.append)
        engine.start()
        stalling = core.runner = FaultyRunner(core.runner)
        stalling.stall_next()  # the next step hangs until unstall()
        request = asyncio.create_task(_collect(engine, _gen("slow", 1)))
        if on_failure == "recover":  # unhealthy while the step hangs, healthy again once it returns
            await wait_until_async(lambda: health, "the watchdog noticing the stall")
            assert health == [False] and not engine.is_healthy and not request.done()
            stalling.unstall()
            assert (await request)[-1].finished
            await wait_until_async(lambda: len(health) > 1, "health back after the stall")
            assert health == [False, True] and engine.is_healthy and not fatal
        else:  # a stalled step is fatal: the stream fails at the stall limit, while the step still hangs
            with pytest.raises(EngineError, match="stalled"):
                await request
            assert stalling.stalled.is_set() and fatal == ["engine step stalled"] and not engine.is_healthy
            with pytest.raises(EngineUnavailable):
                await _collect(engine, _gen("after", 1))
            stalling.unstall()
        await engine.shutdown()

    asyncio.run(main("recover"))
    asyncio.run(main("exit"))


def test_draining_engine_rejects_new_requests(engine_dir: Path) -> None:
    async def main() -> None:
        engine = await _started(engine_dir)
        in_flight = engine.generate(_gen("inflight", 30))  # admitted (admission is synchronous)
        engine.stop_accepting()
        with pytest.raises(EngineUnavailable):
            await _collect(engine, _gen("late", 3))
        assert sum(len(o.new_token_ids) for o in await _drain(in_flight)) == 30
        await engine.shutdown()

    asyncio.run(main())
