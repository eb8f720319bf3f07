"""AsyncEngine: streaming, cancellation storm, bounded queue, slow consumers, engine failure, watchdog."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from service.config import AdmissionConfig
from service.engine.async_engine import AsyncEngine
from service.engine.core import EngineCore
from service.errors import EngineError, EngineUnavailable, InvalidRequest, QueueFull
from service.request import GenerateRequest, SamplingParams
from tests.engines import build_tiny


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-async", max_batch_size=16, max_num_tokens=64, max_seq_len=512)


def _gen(rid: str, max_tokens: int = 16, prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(
        rid, prompt or [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )


async def _started(engine_dir: Path, blocks: int = 256, **cfg) -> AsyncEngine:
    engine = AsyncEngine(EngineCore(engine_dir, num_kv_blocks=blocks), AdmissionConfig(**cfg))
    engine.start()
    return engine


async def _collect(engine: AsyncEngine, gen: GenerateRequest) -> list:
    return [out async for out in engine.generate(gen)]


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


def test_cancellation_storm_frees_everything_within_a_second(engine_dir: Path) -> None:
    async def main() -> None:
        engine = await _started(engine_dir, blocks=512, max_queue=256)
        rng = random.Random(0)

        async def consume(i: int) -> None:
            async for _ in engine.generate(
                _gen(f"c{i}", 300, [rng.randrange(3, 260) for _ in range(rng.randint(1, 90))])
            ):
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(consume(i)) for i in range(200)]
        for t in tasks:  # abort at random points: queued, prefilling, decoding
            await asyncio.sleep(rng.random() * 0.01)
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 1.0
        core = engine.core
        while time.monotonic() < deadline and (core.scheduler.requests or core.kv.pool.num_used_blocks):
            await asyncio.sleep(0.01)
        assert not core.scheduler.requests and core.kv.pool.num_used_blocks == 0
        assert engine.num_in_flight == 0 and engine.num_queued == 0 and not core.outputs.texts
        core.scheduler.check_invariants()
        await engine.shutdown()

    asyncio.run(main())


def test_queue_bound_rejects_the_overflow(engine_dir: Path) -> None:
    async def main() -> None:
        core = EngineCore(engine_dir, num_kv_blocks=256, max_num_seqs=1)
        engine = AsyncEngine(core, AdmissionConfig(max_queue=8))
        engine.start()
        running = engine.generate(_gen("running", 200))
        await running.__anext__()  # it is running (it produced a token)
        tasks = [asyncio.create_task(_collect(engine, _gen(f"q{i}", 4))) for i in range(12)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        rejected = [r for r in results if isinstance(r, QueueFull)]
        assert len(rejected) == 4 and all(isinstance(r, list) for r in results if r not in rejected)
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
        engine = AsyncEngine(core, AdmissionConfig())
        engine.bind(on_health_change=health.append)
        engine.start()
        await _collect(engine, _gen("ok", 3))

        def broken(batch):
            raise RuntimeError("simulated kernel failure")

        core.runner.execute = broken
        with pytest.raises(EngineError):
            await _collect(engine, _gen("doomed", 5))
        await asyncio.sleep(0.05)
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
        config = AdmissionConfig(stall_timeout_s=0.2, on_failure=on_failure)
        engine = AsyncEngine(core, config)
        engine.bind(health.append, fatal.append)
        engine.start()
        real = core.runner.execute

        def slow(batch):
            time.sleep(0.8)
            return real(batch)

        core.runner.execute = slow
        if on_failure == "recover":  # unhealthy while the step runs, healthy again once it returns
            outs = await _collect(engine, _gen("slow", 1))
            assert outs[-1].finished
            await asyncio.sleep(0.3)
            assert health[:2] == [False, True] and engine.is_healthy and not fatal
        else:  # a stalled step is fatal: the stream fails at the stall limit, not when the step returns
            start = time.monotonic()
            with pytest.raises(EngineError, match="stalled"):
                await _collect(engine, _gen("slow", 1))
            assert time.monotonic() - start < 0.7
            assert fatal == ["engine step stalled"] and not engine.is_healthy
            with pytest.raises(EngineUnavailable):
                await _collect(engine, _gen("after", 1))
        await engine.shutdown()

    asyncio.run(main("recover"))
    asyncio.run(main("exit"))


def test_draining_engine_rejects_new_requests(engine_dir: Path) -> None:
    async def main() -> None:
        engine = await _started(engine_dir)
        in_flight = asyncio.create_task(_collect(engine, _gen("inflight", 30)))
        await asyncio.sleep(0.01)
        engine.stop_accepting()
        with pytest.raises(EngineUnavailable):
            await _collect(engine, _gen("late", 3))
        assert len(await in_flight) > 0
        await engine.shutdown()

    asyncio.run(main())
