"""benchmarks/overhead_bench.py's split of a service's CPU: the engine's threads against everything else."""

from __future__ import annotations

import os
import threading

import pytest

from benchmarks.overhead_bench import ENGINE_THREAD, cpu_split, thread_cpu


def _threads(engine_name: str) -> tuple[dict, dict]:
    before = {1: ("python", 1.0), 2: (engine_name, 5.0), 3: (engine_name, 4.0), 4: ("grpc", 0.5)}
    after = {1: ("python", 1.4), 2: (engine_name, 15.0), 3: (engine_name, 12.0), 4: ("grpc", 0.6), 5: ("x", 0.1)}
    return before, after


@pytest.mark.parametrize("engine_name", [ENGINE_THREAD, "python"])  # named, and an older tree told by use
def test_engine_threads_against_the_loop_and_the_rest(engine_name: str) -> None:
    split = cpu_split(1, *_threads(engine_name))  # pid 1: the main thread, the event loop
    assert split.engine == pytest.approx(18.0)
    assert split.loop == pytest.approx(0.4)
    assert split.other == pytest.approx(0.2)  # a thread that started meanwhile counts from zero
    assert split.outside == pytest.approx(0.6)


def test_thread_cpu_reads_every_thread_of_a_process() -> None:
    ready, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (ready.set(), done.wait()))
    worker.start()
    ready.wait()
    try:
        threads = thread_cpu(os.getpid())
        assert {threading.get_native_id(), worker.native_id} <= set(threads)
        assert all(cpu >= 0 for _, cpu in threads.values())
    finally:
        done.set()
        worker.join()
