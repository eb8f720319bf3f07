"""The service as users run it: `python -m service` in a subprocess (SIGTERM drain), and the real SmolLM2."""

from __future__ import annotations

import json
import os
import signal
import socket
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
from tests.engines import build_tiny
from tests.servers import free_port, running_server, wait_serving
from tests.waiting import wait_until

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-proc", max_batch_size=8, max_num_tokens=64, max_seq_len=1024)


def test_sigterm_drains_streams_in_flight(engine_dir: Path) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = {**os.environ, "LLM_ENGINE": str(engine_dir), "LLM_PORT": str(port)}  # flags from the environment
    cmd = [sys.executable, "-m", "service", "--metrics-port", "-1", "--kv-cache-memory", "128MiB",
           "--drain-timeout", "20", "--no-measure-ceilings"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(target, proc)
        channel = grpc.insecure_channel(target)
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        statuses: list[int] = []
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())

        def watcher() -> None:
            try:
                for resp in watch:
                    statuses.append(resp.status)
            except grpc.RpcError:
                pass

        threading.Thread(target=watcher, daemon=True).start()
        started = threading.Barrier(5)

        def stream(i: int) -> tuple[int, llm_pb2.Complete]:
            req = llm_pb2.GenerateRequest(
                prompt=f"stream {i}", stopping=llm_pb2.StoppingParams(max_tokens=600, ignore_eos=True)
            )
            tokens, complete = 0, None
            for resp in stub.Generate(req):
                if resp.HasField("chunk"):
                    if tokens == 0:
                        started.wait()
                    tokens += len(resp.chunk.token_ids)
                else:
                    complete = resp.complete
            return tokens, complete

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, i) for i in range(4)]
            started.wait()
            proc.send_signal(signal.SIGTERM)
            sigterm = time.monotonic()

            def refused() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                except ConnectionRefusedError:
                    return True
                return False

            # the listener is closed at the start of the drain (a balancer retries elsewhere), streams go on
            wait_until(refused, "the listener closed")
            with pytest.raises(grpc.RpcError) as err:
                list(llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target)).Generate(
                    llm_pb2.GenerateRequest(prompt="late"), timeout=5
                ))  # fmt: skip
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            results = [f.result(timeout=30) for f in futures]
        for tokens, complete in results:
            assert complete is not None and tokens == complete.usage.completion_tokens == 600
        assert proc.wait(timeout=25) == 0
        assert time.monotonic() - sigterm < 5  # streams done: no need to wait out the 20 s drain timeout
        assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_sigterm_with_zero_drain_exits_fast(engine_dir: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "service", "--engine", str(engine_dir), "--port", str(port), "--metrics-port", "-1",
           "--kv-cache-memory", "128MiB", "--drain-timeout", "0", "--no-measure-ceilings"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stream = stub.Generate(
            llm_pb2.GenerateRequest(prompt="x", stopping=llm_pb2.StoppingParams(max_tokens=1000, ignore_eos=True))
        )
        next(stream)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0 and time.monotonic() - start < 4
        with pytest.raises(grpc.RpcError):
            list(stream)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_bad_engine_dir_exits_2(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "service",
        "--engine",
        str(tmp_path / "missing"),
        "--port",
        "0",
        "--metrics-port",
        "-1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "does not exist" in out.stderr


@pytest.mark.slow
def test_smollm2_stream_equals_offline_cli(smollm2_engine_dir: Path) -> None:
    prompt = "The three primary colors are"
    offline = subprocess.run(
        [sys.executable, "-m", "service.offline", "--engine", str(smollm2_engine_dir), "--prompt", prompt,
         "--max-tokens", "32", "--json", "--kv-cache-memory", "256MiB"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    expected = json.loads(offline.stdout)
    with running_server(smollm2_engine_dir) as srv:
        req = llm_pb2.GenerateRequest(
            prompt=prompt,
            sampling=llm_pb2.SamplingParams(temperature=0),
            stopping=llm_pb2.StoppingParams(max_tokens=32),
        )
        text, ids, complete = "", [], None
        for resp in srv.stub().Generate(req):
            if resp.HasField("chunk"):
                text += resp.chunk.text
                ids += list(resp.chunk.token_ids)
            else:
                complete = resp.complete
    assert ids == expected["token_ids"] and text == expected["text"]
    assert complete.usage.prompt_tokens == len(expected["prompt_token_ids"])
