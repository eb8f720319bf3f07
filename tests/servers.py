"""Run an LLMServer on 127.0.0.1 with ephemeral ports, in its own event loop thread, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from service.api.server import LLMServer
from service.config import BackendConfig, NativeConfig, ServerConfig, replace_path
from tests.doubles import PacedRunner
from tests.waiting import WITHIN_S, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING


class ServerThread:
    def __init__(self, cfg: ServerConfig) -> None:
        self.server = LLMServer(cfg)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self, wait_ready: bool = True) -> ServerThread:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop)
        self.startup = future
        if wait_ready:
            future.result(timeout=120)
        return self

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if not self._thread.is_alive():  # stopped already (or never started): nothing would run the drain
            return
        with contextlib.suppress(Exception):
            self.run(self.server.drain_and_stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def core(self):
        """The native EngineCore that generates: the native backend's, or the one inside the TensorRT-LLM double."""
        backend = self.server.backend
        return backend.core if hasattr(backend, "core") else backend.executor.core

    def _is_idle(self) -> bool:
        backend = self.server.backend
        core = getattr(backend, "core", None) or getattr(getattr(backend, "executor", None), "core", None)
        return backend.num_in_flight == 0 and (
            core is None or (not core.scheduler.requests and core.kv.pool.num_used_blocks == 0)
        )

    def idle(self, within: float = WITHIN_S) -> bool:
        """True once, within `within` s, no request is in flight and a native engine (the backend's, or the one
        inside the TensorRT-LLM double) has no request and no KV block left; a Triton backend has none here."""
        try:
            return wait_until(self._is_idle, "the server idle", within)
        except AssertionError:
            return False

    @contextlib.contextmanager
    def paced(self, min_step_s: float = 0.0) -> Iterator[PacedRunner]:
        """The PacedRunner test double around the generating engine's runner (free until held), for the block;
        afterwards it is released and the real runner is back."""
        core = self.core
        real = core.runner
        core.runner = runner = PacedRunner(real, min_step_s)
        try:
            yield runner
        finally:
            runner.release()
            core.runner = real

    def break_engine(self) -> None:
        """Make the engine fail the way each backend fails: a step raising, or the executor dying."""
        backend = self.server.backend
        if hasattr(backend, "core"):

            def broken(batch):
                raise RuntimeError("simulated device fault")

            backend.core.runner.execute = broken
        else:
            backend.executor.crash()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def stub(self) -> llm_pb2_grpc.LLMServiceStub:
        return llm_pb2_grpc.LLMServiceStub(self.channel())

    def finished(self, code: str) -> float:
        """llm_requests_total{code}: the requests that ended with this status code (0 before the first)."""
        try:
            return self.metric("llm_requests_total", f'code="{code}"')
        except KeyError:
            return 0.0

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of the Prometheus exposition, scraped over HTTP."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.server.metrics_port}/metrics", timeout=5).read().decode()
        pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
        m = re.search("^" + pattern + "$", text, re.M)
        if m is None:
            raise KeyError(f"{name}{{{labels}}} not in the exposition")
        return float(m.group(1))


def generate(stub: llm_pb2_grpc.LLMServiceStub, req: llm_pb2.GenerateRequest, **kw):
    """One Generate stream: (chunks, the final Complete or None); a chunk after the final message, or two final
    messages, fail the test."""
    chunks, complete = [], None
    for resp in stub.Generate(req, **kw):
        assert complete is None, "a message after the final one"
        if resp.HasField("chunk"):
            chunks.append(resp.chunk)
        else:
            complete = resp.complete
    return chunks, complete


def ids_and_text(chunks) -> tuple[list[int], str]:
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


# flat test-friendly names -> where they live in ServerConfig
_PATHS = {
    "kv_cache_memory": "backend.native.kv_cache_memory",
    "max_queue": "backend.admission.max_queue",
    "stall_timeout_s": "backend.admission.stall_timeout_s",
    "on_engine_error": "backend.admission.on_failure",
    "max_num_seqs": "backend.max_num_seqs",
    "max_num_tokens": "backend.max_num_tokens",
    "prefix_caching": "backend.prefix_caching",
    "backend_name": "backend.backend",
}


def make_config(engine_dir, **overrides) -> ServerConfig:
    cfg: object = ServerConfig(
        backend=BackendConfig(engine_dir=str(engine_dir), native=NativeConfig(kv_cache_memory="256MiB")),
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        measure_ceilings=False,
        drain_timeout_s=5,
    )
    for name, value in overrides.items():
        cfg = replace_path(cfg, _PATHS.get(name, name), value)
    return cfg  # type: ignore[return-value]


@contextlib.contextmanager
def running_server(engine_dir, **overrides) -> Iterator[ServerThread]:
    server = ServerThread(make_config(engine_dir, **overrides)).start()
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))

    def serving() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else f"exited with {proc.returncode}"
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == SERVING
        except grpc.RpcError:
            return False

    wait_until(serving, "the service SERVING", timeout)
