"""The gRPC server: LLMService, grpc.health.v1, reflection, Prometheus, auth, TLS, graceful drain.

Lifecycle: bind and serve health (NOT_SERVING) at once; load the engine in a worker thread; run one warm-up
generation; then SERVING. On drain: NOT_SERVING, stop accepting, let streams in flight finish within the drain
timeout, stop the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from protos.llm.v1 import llm_pb2
from service.api.metrics import ServiceMetrics
from service.api.servicer import LLMServicer
from service.engine.async_engine import AsyncEngine, AsyncEngineConfig
from service.engine.core import DEFAULT_KV_CACHE_MEMORY, EngineCore
from service.engine.roofline import measure_ceilings
from service.request import GenerateRequest, SamplingParams

logger = logging.getLogger(__name__)

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
HEALTH_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
CUT_GRACE_S = 2.0  # after the drain timeout, how long aborted streams get to send their final status


@dataclass(frozen=True, slots=True)
class ServerConfig:
    engine_dir: str
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    metrics_port: int | None = 9400  # None: no Prometheus endpoint; 0 picks a free port
    backend: str = "native"
    kv_cache_memory: str = DEFAULT_KV_CACHE_MEMORY
    max_queue: int = 256
    max_num_seqs: int | None = None  # default: the engine's max_batch_size
    max_num_tokens: int | None = None  # default: the engine's max_num_tokens
    prefix_caching: bool = True
    drain_timeout_s: float = 30.0
    stall_timeout_s: float = 60.0
    on_engine_error: str = "exit"  # exit: the process exits non-zero (a supervisor restarts it); recover
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require and verify client certificates (mutual TLS)
    auth_token_file: str | None = None
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_rpcs: int = 1024
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    log_prompts: bool = False
    reflection: bool = True
    measure_ceilings: bool = True


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token auth on every method but health; tokens compared in constant time."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    def allows(self, authorization: str) -> bool:
        scheme, _, token = authorization.strip().partition(" ")
        # NOTE: the auth scheme is case-insensitive (RFC 7235 section 2.1); the token is compared in constant time
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in HEALTH_METHODS:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.allows(str(metadata.get("authorization", ""))):
            return await continuation(handler_call_details)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        return grpc.unary_unary_rpc_method_handler(deny)


def _read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token


def _credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    if not cfg.tls_cert and not cfg.tls_key:
        if cfg.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cfg.tls_cert and cfg.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    pair = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
    ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class LLMServer:
    def __init__(self, cfg: ServerConfig) -> None:
        if cfg.backend != "native":
            raise ValueError(f"backend {cfg.backend!r} is not available in this build (choose: native)")
        self.cfg = cfg
        self.metrics = ServiceMetrics()
        self.engine: AsyncEngine | None = None  # set once loaded and warmed up
        self.health = health.aio.HealthServicer()
        self.servicer = LLMServicer(lambda: self.engine, self.metrics, cfg.max_concurrent_rpcs, cfg.log_prompts)
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self.port = 0
        self.metrics_port: int | None = None
        self._draining = False
        self._force = False  # a second signal: stop waiting for streams
        self._tasks: set[asyncio.Future] = set()
        self.fatal: str | None = None  # why the engine can no longer serve (the process should exit non-zero)
        self.fatal_event = asyncio.Event()

    # ---- startup ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind and start serving (health NOT_SERVING), then load and warm up the engine; returns when ready."""
        cfg = self.cfg
        credentials = _credentials(cfg)
        interceptors = [AuthInterceptor(_read_token(cfg.auth_token_file))] if cfg.auth_token_file else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 0),  # gRPC's default would let a second server share the port
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 2),
                ("grpc.max_concurrent_streams", 1000),
            ],
        )
        self._add_services(server)
        # NOTE: the aio HealthServicer answers SERVING by default; say NOT_SERVING before anyone can ask.
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.metrics.watch_event_loop(asyncio.get_running_loop())
        self._start_metrics()  # both ports are bound before anything says "listening"
        self.port = self._bind(server, credentials)
        await server.start()
        self._server = server
        logger.info(
            "listening on %s:%d (%s); loading the engine", cfg.host, self.port, "TLS" if credentials else "plaintext"
        )
        if self.metrics_port is not None:
            logger.info("Prometheus metrics on http://%s:%d/metrics", cfg.host, self.metrics_port)
        engine = await asyncio.get_running_loop().run_in_executor(None, self._load_engine)
        engine.start()
        await self._warm_up(engine)
        engine.observe(on_step=self.metrics.on_step, on_idle=self.metrics.on_idle)  # the warm-up is not counted
        self.engine = engine
        await self._set_serving(engine.is_healthy)
        logger.info("ready: %s", SERVICE_NAME)

    def _start_metrics(self) -> None:
        cfg = self.cfg
        if cfg.metrics_port is None:
            return
        try:
            self._metrics_http, _ = start_http_server(cfg.metrics_port, addr=cfg.host, registry=self.metrics.registry)
        except OSError as exc:
            raise OSError(f"metrics port {cfg.metrics_port} on {cfg.host} cannot be bound: {exc.strerror}") from None
        self.metrics_port = self._metrics_http.server_port

    def _bind(self, server: grpc.aio.Server, credentials: grpc.ServerCredentials | None) -> int:
        address = f"{self.cfg.host}:{self.cfg.port}"
        try:
            return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:  # grpc says only "Failed to bind"; with SO_REUSEPORT off, a busy port is the usual cause
            raise OSError(f"gRPC port {self.cfg.port} on {self.cfg.host} cannot be bound (in use?)") from None

    def _add_services(self, server: grpc.aio.Server) -> None:
        s = self.servicer
        handlers = {  # raw bytes in: the servicer parses, so bad input is INVALID_ARGUMENT
            "Generate": grpc.unary_stream_rpc_method_handler(
                s.Generate, response_serializer=llm_pb2.GenerateResponse.SerializeToString
            ),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                s.Tokenize, response_serializer=llm_pb2.TokenizeResponse.SerializeToString
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                s.GetModelInfo, response_serializer=llm_pb2.ModelInfo.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if self.cfg.reflection:
            names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, server)

    def _load_engine(self) -> AsyncEngine:
        cfg = self.cfg
        core = EngineCore(
            cfg.engine_dir,
            kv_cache_memory=cfg.kv_cache_memory,
            enable_prefix_caching=cfg.prefix_caching,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_tokens,
        )
        ceilings = measure_ceilings(quick=True) if cfg.measure_ceilings else None
        if ceilings is not None:
            logger.info(
                "machine: %.0f GFLOP/s fp32 GEMM, %.1f GB/s read", ceilings.gemm_gflops, ceilings.read_gbytes_per_s
            )
        self.metrics.set_static(core.sched_cfg.num_kv_blocks, ceilings)
        return AsyncEngine(
            core,
            AsyncEngineConfig(
                max_queue=cfg.max_queue, stall_timeout_s=cfg.stall_timeout_s, on_failure=cfg.on_engine_error
            ),
            on_health_change=self._on_health_change,
            on_fatal=self._on_fatal,
        )

    async def _warm_up(self, engine: AsyncEngine) -> None:
        """One real generation: pages the weights in, compiles kernels, proves the engine produces tokens."""
        prompt = engine.core.tokenizer.encode("Hello") or [0]
        gen = GenerateRequest("warmup", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        async for _ in engine.generate(gen):
            pass
        logger.info("warm-up generation done")

    def _on_fatal(self, reason: str) -> None:
        logger.error("engine failed (%s): the service cannot serve any more and will exit", reason)
        self.fatal = reason
        self.fatal_event.set()

    def _on_health_change(self, healthy: bool) -> None:
        task = asyncio.ensure_future(self._set_serving(healthy))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _set_serving(self, healthy: bool) -> None:
        if self._draining:
            return
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    # ---- shutdown --------------------------------------------------------------------------------
    async def drain_and_stop(self, timeout: float | None = None) -> None:
        """NOT_SERVING at once, refuse new RPCs, let streams in flight finish within the timeout, then stop."""
        timeout = self.cfg.drain_timeout_s if timeout is None else timeout
        self._draining = True
        await self.health.enter_graceful_shutdown()
        if self.engine is not None:
            self.engine.stop_accepting()
        self.servicer.draining = True  # every new LLMService RPC now gets UNAVAILABLE
        # NOTE: server.stop(grace) would also wait out health Watch streams, which never end; so wait for the
        # Generate streams in flight only, then stop with no grace (one stop() call: concurrent calls crash grpc).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.servicer.num_active and loop.time() < deadline and not self._force:
            await asyncio.sleep(0.02)
        if self.servicer.num_active:  # the drain timeout: end what still runs, with a status that says so
            logger.warning("drain timeout: ending %d RPCs still in flight", self.servicer.num_active)
            self.servicer.cut = True
            if self.engine is not None:
                self.engine.abort_all()
            cut_deadline = loop.time() + CUT_GRACE_S
            while self.servicer.num_active and loop.time() < cut_deadline:
                await asyncio.sleep(0.01)
        if self._server is not None:
            await self._server.stop(0)
        if self.engine is not None:  # a dead engine's thread may be stuck in a stalled step: do not wait long
            await self.engine.shutdown(timeout=0.5 if self.fatal else 5.0)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        self.servicer.close()
        logger.info("stopped")

    def force_stop(self) -> None:
        """A second SIGINT/SIGTERM: end the drain now (streams still running are cut)."""
        self._force = True

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
