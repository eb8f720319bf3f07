"""The engine failure policy, with faults injected through the FaultyRunner test double.

recover: every request in flight fails (INTERNAL after output, UNAVAILABLE before), the engine rebuilds its KV
pool, scheduler and gauges, and serves again. exit (the default): the same failures, then the process exits
with a non-zero code so a supervisor restarts it; a stalled step is fatal too. No zombie either way.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from service.__main__ import EXIT_ENGINE_FAILED
from tests.doubles import FaultyRunner
from tests.engines import build_tiny
from tests.servers import free_port, running_server, wait_serving

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FAIL_WITHIN_S = 6.0
WARMUP_STEPS = 2  # the warm-up generation's prefill and decode steps come before any client's


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-faults", max_batch_size=8, max_num_tokens=64, max_seq_len=1024)


def _req(i: int, max_tokens: int = 400) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        request_id=f"victim-{i}",
        prompt=f"request number {i}",
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _stream(stub, req) -> tuple[grpc.StatusCode, str, int, float]:
    """(code, details, tokens received, seconds) of one Generate that is expected to fail."""
    tokens, start = 0, time.monotonic()
    try:
        for resp in stub.Generate(req, timeout=30):
            tokens += len(resp.chunk.token_ids)
    except grpc.RpcError as err:
        return err.code(), err.details(), tokens, time.monotonic() - start
    return grpc.StatusCode.OK, "", tokens, time.monotonic() - start


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def _assert_failed_cleanly(results) -> None:
    for i, (code, details, tokens, _) in enumerate(results):
        assert code == (grpc.StatusCode.INTERNAL if tokens else grpc.StatusCode.UNAVAILABLE), (code, tokens)
        assert f"victim-{i}" in details and "injected" not in details  # its id, never the exception text
    # the fault comes within a second of the start (tiny-model steps take milliseconds): nothing may hang
    assert max(r[3] for r in results) < FAIL_WITHIN_S, "a request hung after the fault"


def _started_streams(stub, n: int, pool: ThreadPoolExecutor):
    futures = [pool.submit(_stream, stub, _req(i)) for i in range(n)]
    time.sleep(0.3)  # all admitted and decoding
    return futures


def test_recover_policy_fails_in_flight_requests_then_serves_again(engine_dir: Path) -> None:
    with running_server(engine_dir, on_engine_error="recover") as srv:
        core = srv.server.backend.core
        faulty = FaultyRunner(core.runner, fail_at_step=40)
        core.runner = faulty
        stub = srv.stub()
        with ThreadPoolExecutor(4) as pool:
            futures = _started_streams(stub, 4, pool)
            assert faulty.failed.wait(10)
            results = [f.result(timeout=10) for f in futures]
        _assert_failed_cleanly(results)
        assert any(r[2] for r in results), "no request had streamed output before the fault"
        deadline = time.monotonic() + 2
        while srv.metric("llm_kv_cache_blocks_used") or srv.metric("llm_num_requests_running"):
            assert time.monotonic() < deadline, "gauges stuck after the failure"
            time.sleep(0.02)
        assert srv.metric("llm_num_requests_waiting") == 0
        assert srv.server.backend.core is core and core.kv.pool.num_used_blocks == 0
        core.scheduler.check_invariants()
        assert _health(srv.channel()) == SERVING and srv.server.fatal is None
        code, _, tokens, _ = _stream(stub, _req(9, max_tokens=20))  # serving again, with the same runner
        assert code == grpc.StatusCode.OK and tokens == 20


def test_exit_policy_marks_the_server_fatal(engine_dir: Path) -> None:
    with running_server(engine_dir) as srv:  # exit is the default
        core = srv.server.backend.core
        core.runner = FaultyRunner(core.runner, fail_at_step=30)
        with ThreadPoolExecutor(2) as pool:
            futures = _started_streams(srv.stub(), 2, pool)
            results = [f.result(timeout=10) for f in futures]
        _assert_failed_cleanly(results)
        assert srv.server.fatal == "RuntimeError in engine step"
        assert _health(srv.channel()) == NOT_SERVING
        assert _stream(srv.stub(), _req(5))[0] == grpc.StatusCode.UNAVAILABLE


def test_stall_turns_health_not_serving_and_back_with_recover(engine_dir: Path) -> None:
    with running_server(engine_dir, on_engine_error="recover", stall_timeout_s=1.0) as srv:
        core = srv.server.backend.core
        faulty = FaultyRunner(core.runner, stall_at_step=5, stall_s=3.0)
        core.runner = faulty
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(_stream, srv.stub(), _req(0, max_tokens=20))
            assert faulty.stalled.wait(10)
            stalled_at = time.monotonic()
            while _health(srv.channel()) != NOT_SERVING:
                assert time.monotonic() - stalled_at < 1.0 + 1.5, "health stayed SERVING during a stall"
                time.sleep(0.05)
            code, _, tokens, _ = future.result(timeout=20)
        assert code == grpc.StatusCode.OK and tokens == 20  # the step came back: the request finished
        deadline = time.monotonic() + 1.5  # the watchdog looks every stall_timeout / 4
        while _health(srv.channel()) != SERVING:
            assert time.monotonic() < deadline, "health did not come back after the stall"
            time.sleep(0.05)


def _fault_server(engine_dir: Path, port: int, *fault: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.fault_server", *fault, "--", "--engine", str(engine_dir), "--port",
           str(port), "--metrics-port", "-1", "--kv-cache-memory", "64MiB", "--no-measure-ceilings", *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    ("fault", "extra"),
    [
        (("--fail-at-step", str(WARMUP_STEPS + 30)), ()),
        (("--stall-at-step", str(WARMUP_STEPS + 30), "--stall-seconds", "60"), ("--stall-timeout", "1")),
    ],
    ids=["fault", "stall"],
)
def test_exit_policy_exits_non_zero_with_no_zombie(engine_dir: Path, fault, extra) -> None:
    port = free_port()
    proc = _fault_server(engine_dir, port, *fault, extra=extra)
    try:
        target = f"127.0.0.1:{port}"
        wait_serving(target, proc)
        stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target))
        with ThreadPoolExecutor(3) as pool:
            futures = _started_streams(stub, 3, pool)
            results = [f.result(timeout=20) for f in futures]
        _assert_failed_cleanly(results)
        assert proc.wait(timeout=10) == EXIT_ENGINE_FAILED
        assert "will exit" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
