"""The engine failure policy, with faults injected through the FaultyRunner test double.

recover: every request in flight fails (INTERNAL after output, UNAVAILABLE before), the engine rebuilds its KV
pool, scheduler and gauges, and serves again. exit (the default): the same failures, then the process exits
with a non-zero code so a supervisor restarts it; a stalled step is fatal too. No zombie either way.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from service.__main__ import EXIT_ENGINE_FAILED
from tests.doubles import FaultyRunner, PacedRunner
from tests.engines import build_tiny
from tests.servers import free_port, running_server, wait_serving
from tests.waiting import wait_until

pytestmark = pytest.mark.server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FAIL_WITHIN_S = 6.0


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


def _stream(stub, req, first: threading.Event) -> tuple[grpc.StatusCode, str, int, float]:
    """(code, details, tokens received, when it ended) of one Generate that is expected to fail; `first` is set
    once it has received a token."""
    tokens = 0
    try:
        for resp in stub.Generate(req, timeout=60):
            tokens += len(resp.chunk.token_ids)
            first.set()
    except grpc.RpcError as err:
        return err.code(), err.details(), tokens, time.monotonic()
    return grpc.StatusCode.OK, "", tokens, time.monotonic()


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def _assert_failed_cleanly(results, fault_at: float, all_streamed: bool = True) -> None:
    for i, (code, details, tokens, _) in enumerate(results):
        assert tokens > 0 or not all_streamed, f"stream {i} had no output before the fault"
        assert code == (grpc.StatusCode.INTERNAL if tokens else grpc.StatusCode.UNAVAILABLE), (code, tokens)
        assert f"victim-{i}" in details and "injected" not in details  # its id, never the exception text
    assert max(r[3] for r in results) - fault_at < FAIL_WITHIN_S, "a request hung after the fault"


def _faulty(srv) -> tuple[PacedRunner, FaultyRunner]:
    """The runner as PacedRunner(FaultyRunner(real)): a fault armed while the engine waits at the gate hits the
    next step."""
    core = srv.server.backend.core
    faulty = FaultyRunner(core.runner)
    core.runner = paced = PacedRunner(faulty)
    return paced, faulty


def _decoding_streams(srv, n: int, pool: ThreadPoolExecutor, paced: PacedRunner, max_tokens: int = 400):
    """n streams, returned with the engine held at the gate once every one has received a token at the client
    (all admitted, decoding, and far from done)."""
    core = srv.server.backend.core
    firsts = [threading.Event() for _ in range(n)]
    paced.hold()
    futures = [pool.submit(_stream, srv.stub(), _req(i, max_tokens), first) for i, first in enumerate(firsts)]
    wait_until(lambda: srv.server.backend.num_in_flight == n, "every stream admitted")
    reqs = core.scheduler.requests
    paced.step_until(lambda: len(reqs) == n and all(r.output_token_ids for r in reqs.values()))
    wait_until(lambda: all(f.is_set() for f in firsts), "every client's first token")
    return futures


def test_recover_policy_fails_in_flight_requests_then_serves_again(engine_dir: Path) -> None:
    with running_server(engine_dir, on_engine_error="recover") as srv:
        core = srv.server.backend.core
        paced, faulty = _faulty(srv)
        with ThreadPoolExecutor(4) as pool:
            futures = _decoding_streams(srv, 4, pool, paced)
            faulty.fail_next()
            fault_at = time.monotonic()
            paced.release()
            results = [f.result(timeout=60) for f in futures]
        assert faulty.failed.is_set()
        _assert_failed_cleanly(results, fault_at)
        wait_until(
            lambda: not srv.metric("llm_kv_cache_blocks_used") and not srv.metric("llm_num_requests_running"),
            "gauges back to zero after the failure",
        )
        assert srv.metric("llm_num_requests_waiting") == 0
        assert srv.server.backend.core is core and core.kv.pool.num_used_blocks == 0
        core.scheduler.check_invariants()
        assert _health(srv.channel()) == SERVING and srv.server.fatal is None
        code, _, tokens, _ = _stream(srv.stub(), _req(9, 20), threading.Event())  # serving again, same runner
        assert code == grpc.StatusCode.OK and tokens == 20


def test_exit_policy_marks_the_server_fatal(engine_dir: Path) -> None:
    with running_server(engine_dir) as srv:  # exit is the default
        paced, faulty = _faulty(srv)
        with ThreadPoolExecutor(2) as pool:
            futures = _decoding_streams(srv, 2, pool, paced)
            faulty.fail_next()
            fault_at = time.monotonic()
            paced.release()
            results = [f.result(timeout=60) for f in futures]
        _assert_failed_cleanly(results, fault_at)
        wait_until(lambda: srv.server.fatal, "the server marked fatal")
        assert srv.server.fatal == "RuntimeError in engine step"
        wait_until(lambda: _health(srv.channel()) == NOT_SERVING, "health NOT_SERVING")
        assert _stream(srv.stub(), _req(5), threading.Event())[0] == grpc.StatusCode.UNAVAILABLE


def test_stall_turns_health_not_serving_and_back_with_recover(engine_dir: Path) -> None:
    with running_server(engine_dir, on_engine_error="recover", stall_timeout_s=1.0) as srv:
        _, faulty = _faulty(srv)
        faulty.stall_next()  # the request's first step hangs until unstall()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(_stream, srv.stub(), _req(0, 20), threading.Event())
            assert faulty.stalled.wait(30)
            wait_until(lambda: _health(srv.channel()) == NOT_SERVING, "health NOT_SERVING during the stall")
            assert not future.done()
            faulty.unstall()
            code, _, tokens, _ = future.result(timeout=60)
        assert code == grpc.StatusCode.OK and tokens == 20  # the step came back: the request finished
        wait_until(lambda: _health(srv.channel()) == SERVING, "health SERVING after the stall")


def _fault_server(engine_dir: Path, port: int, *fault: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.fault_server", *fault, "--", "--engine", str(engine_dir), "--port",
           str(port), "--metrics-port", "-1", "--kv-cache-memory", "64MiB", "--no-measure-ceilings", *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    ("fault", "extra"),
    [(("--fail-when-decoding", "3"), ()), (("--stall-when-decoding", "3"), ("--stall-timeout", "1"))],
    ids=["fault", "stall"],
)
def test_exit_policy_exits_non_zero_with_no_zombie(engine_dir: Path, fault, extra) -> None:
    port = free_port()
    proc = _fault_server(engine_dir, port, *fault, extra=extra)
    try:
        target = f"127.0.0.1:{port}"
        wait_serving(target, proc)
        stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target))
        firsts = [threading.Event() for _ in range(3)]
        with ThreadPoolExecutor(3) as pool:  # the fault hits the first step in which all 3 decode
            futures = [pool.submit(_stream, stub, _req(i, 1000), first) for i, first in enumerate(firsts)]
            results = [f.result(timeout=60) for f in futures]
        # a stream whose first token and failure reached the server's edge together shows no output: UNAVAILABLE
        _assert_failed_cleanly(results, min(r[3] for r in results), all_streamed=False)
        assert proc.wait(timeout=30) == EXIT_ENGINE_FAILED
        assert "will exit" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
