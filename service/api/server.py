"""The gRPC server: LLMService and TensorRT-LLM's worker protocol trtllm.TrtllmService (service/api/worker/, for
gateways such as smg) on one port, grpc.health.v1, reflection, Prometheus, auth, TLS, graceful drain; with
`--triton-port`, a second grpc.aio server on that port for the Triton (KServe v2) front door, over the same
backend, with the same interceptors, credentials, RPC limit and drain (service/api/triton/); with
`--triton-http-port`, the same door's HTTP/REST protocol on that port (aiohttp: service/api/triton/http.py), over
the same servicer, tokens, certificate and drain.

Lifecycle: bind and serve health (NOT_SERVING) at once; load the backend in a worker thread; run one warm-up
generation; then SERVING. On drain: NOT_SERVING, stop accepting, let streams in flight finish within the drain
timeout, stop the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from protos.llm.v1 import llm_pb2
from service.api.edge import Edge
from service.api.health import DrainingHealthServicer
from service.api.interceptors import AuthInterceptor, read_tokens
from service.api.llm.servicer import LLMServicer
from service.api.metrics import ServiceMetrics
from service.api.validation import transport_limit
from service.api.worker.servicer import SERVICE_NAME as WORKER_SERVICE_NAME
from service.api.worker.servicer import TrtllmServicer
from service.backends import load_backend
from service.backends.base import Backend
from service.config import ServerConfig
from service.request import GenerateRequest, SamplingParams
from service.telemetry import Ceilings

logger = logging.getLogger(__name__)
CEILINGS_TIMEOUT_S = 300.0  # the startup ceilings' child process, at most
CEILINGS_COMMAND = (sys.executable, "-m", "service.engine.roofline")  # prints the ceilings as JSON

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
CUT_GRACE_S = 2.0  # after the drain timeout, how long aborted streams get to send their final status
STREAMS_FOR_HEALTH = 16  # streams a connection may open beyond its RPC slots (health, reflection)


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


def _ssl_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    """The HTTP port's TLS: the gRPC ports' certificate and client CA (checked by _credentials first)."""
    if not cfg.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    if cfg.tls_client_ca:
        ctx.load_verify_locations(cfg.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _interceptors(cfg: ServerConfig) -> list[grpc.aio.ServerInterceptor]:
    if cfg.cache_salt_per_token and not cfg.auth_token_file:
        raise ValueError("--cache-salt-per-token needs --auth-token-file: the salt comes from each client's token")
    if cfg.cache_salt_per_token and cfg.backend.backend == "triton":
        raise ValueError("--cache-salt-per-token: the triton backend cannot pass a cache salt to the Triton server")
    if not cfg.auth_token_file:
        return []
    return [AuthInterceptor(read_tokens(cfg.auth_token_file), salt_per_token=cfg.cache_salt_per_token)]


class LLMServer:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.metrics = ServiceMetrics()
        self.backend: Backend | None = None  # set once loaded and warmed up
        self.health = DrainingHealthServicer()
        self.edge = Edge(cfg, lambda: self.backend, self.metrics.stream_stalled)
        self.servicer = LLMServicer(self.edge, self.metrics, cfg.log_prompts)
        # TensorRT-LLM's worker protocol, for gateways (smg): on the same server, port, edge and health service
        self.worker_servicer = TrtllmServicer(self.edge, self.metrics, cfg.backend.engine_dir)
        self.metrics.watch_slots(lambda: self.edge.num_active)
        self._server: grpc.aio.Server | None = None
        self._triton_server: grpc.aio.Server | None = None
        self.triton_servicer = None  # the Triton front door's servicer, with --triton-port or --triton-http-port
        self._triton_http = None  # its HTTP/REST routes, with --triton-http-port
        self._metrics_http = None
        self.port = 0
        self.triton_port: int | None = None
        self.triton_http_port: int | None = None
        self.metrics_port: int | None = None
        self._force = False  # a second signal: stop waiting for streams
        self._stopped = False  # drain_and_stop ran (it runs once): health stays NOT_SERVING
        self._tasks: set[asyncio.Future] = set()
        self.fatal: str | None = None  # why the engine can no longer serve (the process should exit non-zero)
        self.fatal_event = asyncio.Event()

    # ---- startup ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind and start serving (health NOT_SERVING), then load and warm up the engine; returns when ready."""
        cfg = self.cfg
        credentials = _credentials(cfg)
        server = self._new_server()
        self._add_services(server)
        triton = None
        if cfg.triton_port is not None:  # the Triton front door: its own server, the same backend and edge
            triton = self._new_server()
            triton.add_generic_rpc_handlers((self._triton_servicer().generic_handler(),))
        if cfg.triton_http_port is not None:
            self._triton_http = self._triton_http_door()
        # NOTE: the aio HealthServicer answers SERVING by default; say NOT_SERVING before anyone can ask.
        for name in ("", SERVICE_NAME, WORKER_SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.metrics.watch_event_loop(asyncio.get_running_loop())
        self._check_ports_free()  # one line naming every busy port and its flag, before gRPC core's own log
        self._start_metrics()  # every port is bound before anything says "listening"
        self.port = self._bind(server, credentials, cfg.port, "gRPC")
        if triton is not None:
            self.triton_port = self._bind(triton, credentials, cfg.triton_port, "Triton gRPC")
            await triton.start()
            self._triton_server = triton
        if self._triton_http is not None:
            self.triton_http_port = await self._bind_http(cfg.triton_http_port)
        await server.start()
        self._server = server
        logger.info(
            "listening on %s:%d (%s); loading the engine", cfg.host, self.port, "TLS" if credentials else "plaintext"
        )
        if self.triton_port is not None:
            logger.info("Triton (KServe v2) front door on %s:%d", cfg.host, self.triton_port)
        if self.triton_http_port is not None:
            logger.info("Triton (KServe v2) HTTP/REST front door on %s:%d", cfg.host, self.triton_http_port)
        if self.metrics_port is not None:
            logger.info("Prometheus metrics on http://%s:%d/metrics", cfg.host, self.metrics_port)
        backend = await asyncio.get_running_loop().run_in_executor(None, self._load_backend)
        backend.start(self._on_health_change, self._on_fatal)
        await self._warm_up(backend)
        backend.observe(self.metrics)  # from here on: the warm-up is not counted
        self.backend = backend
        await self._set_serving(backend.is_healthy)
        logger.info("ready: %s (%s backend, model %s)", SERVICE_NAME, backend.info.backend, backend.info.model_name)
        if self.cfg.measure_ceilings and backend.measures_ceilings:
            task = asyncio.ensure_future(self._measure_ceilings())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _new_server(self) -> grpc.aio.Server:
        cfg = self.cfg
        return grpc.aio.server(
            interceptors=_interceptors(cfg),
            options=[
                ("grpc.so_reuseport", 0),  # gRPC's default would let a second server share the port
                ("grpc.max_receive_message_length", transport_limit(cfg.max_message_bytes)),  # parse() checks
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 2),
                # streams per client connection: its share of the RPC slots, plus room for health checks
                ("grpc.max_concurrent_streams", self.edge.max_rpcs_per_connection + STREAMS_FOR_HEALTH),
            ],
        )

    def _triton_servicer(self):
        from service.api.triton.servicer import TritonServicer  # tritonclient: only with a Triton port

        if self.triton_servicer is None:  # one for both protocols: the same statistics and drain
            cfg = self.cfg
            self.triton_servicer = TritonServicer(
                self.edge, self.metrics, cfg.max_requests_per_stream, cfg.backend.engine_dir, cfg.triton_decoupled
            )
        return self.triton_servicer

    def _triton_http_door(self):
        from service.api.triton.http import TritonHttp  # aiohttp and tritonclient: only with --triton-http-port

        interceptors = _interceptors(self.cfg)
        auth = interceptors[0] if interceptors else None
        # a request still running at the drain's cut gets CUT_GRACE_S to end, as on the gRPC ports
        shutdown_s = self.cfg.drain_timeout_s + CUT_GRACE_S + 1
        return TritonHttp(self._triton_servicer(), self.edge, auth, shutdown_s)

    async def _bind_http(self, port: int) -> int:
        try:
            return await self._triton_http.start(self.cfg.host, port, _ssl_context(self.cfg))
        except OSError as exc:
            raise OSError(
                f"Triton HTTP port {port} on {self.cfg.host} cannot be bound: {exc.strerror} (set it with "
                "--triton-http-port / LLM_TRITON_HTTP_PORT)"
            ) from None

    def _ports(self) -> list[tuple[str, int, str]]:
        """(what, port, the flag and variable that set it) of every port this server binds."""
        cfg = self.cfg
        ports = [("gRPC", cfg.port, "--port / LLM_PORT")]
        if cfg.metrics_port is not None:
            ports.append(("metrics", cfg.metrics_port, "--metrics-port / LLM_METRICS_PORT (-1: off)"))
        if cfg.triton_port is not None:
            ports.append(("Triton gRPC", cfg.triton_port, "--triton-port / LLM_TRITON_PORT"))
        if cfg.triton_http_port is not None:
            ports.append(("Triton HTTP", cfg.triton_http_port, "--triton-http-port / LLM_TRITON_HTTP_PORT"))
        return ports

    def _check_ports_free(self) -> None:
        busy = []
        for what, port, flag in self._ports():
            if port == 0:
                continue
            with socket.socket(socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds its ports
                try:
                    probe.bind((self.cfg.host, port))
                except OSError as exc:
                    busy.append(f"{what} port {port} ({exc.strerror}; set it with {flag})")
        if busy:
            raise OSError(f"cannot bind on {self.cfg.host}: " + ", ".join(busy))

    def _start_metrics(self) -> None:
        cfg = self.cfg
        if cfg.metrics_port is None:
            return
        try:
            self._metrics_http, _ = start_http_server(cfg.metrics_port, addr=cfg.host, registry=self.metrics.registry)
        except OSError as exc:
            raise OSError(
                f"metrics port {cfg.metrics_port} on {cfg.host} cannot be bound: {exc.strerror} (set it with "
                "--metrics-port / LLM_METRICS_PORT, -1: off)"
            ) from None
        self.metrics_port = self._metrics_http.server_port

    def _bind(self, server: grpc.aio.Server, credentials: grpc.ServerCredentials | None, port: int, what: str) -> int:
        address = f"{self.cfg.host}:{port}"
        try:
            return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:  # grpc says only "Failed to bind"; with SO_REUSEPORT off, a busy port is the usual cause
            flag = next(f for w, _, f in self._ports() if w == what)
            raise OSError(
                f"{what} port {port} on {self.cfg.host} cannot be bound (in use?); set it with {flag}"
            ) from None

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
        server.add_generic_rpc_handlers((self.worker_servicer.generic_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if self.cfg.reflection:
            health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
            names = (SERVICE_NAME, WORKER_SERVICE_NAME, health, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, server)

    def _load_backend(self) -> Backend:
        """In a worker thread: load the model (slow)."""
        backend = load_backend(self.cfg.backend)
        self.metrics.set_static(backend.info.num_kv_blocks, None)
        return backend

    async def _measure_ceilings(self) -> None:
        """The machine's GEMM rate and read bandwidth for the step metrics, measured once after SERVING in a child
        process at low priority (`python -m service.engine.roofline`: its buffer of 4x the last-level cache and its
        BLAS threads stay out of this process; seconds to tens of seconds on a small VM); the gauges are unset
        until it reports, and a failure is logged, never fatal."""
        proc = await asyncio.create_subprocess_exec(
            *CEILINGS_COMMAND, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            preexec_fn=lambda: os.nice(10),
        )  # fmt: skip
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), CEILINGS_TIMEOUT_S)
            doc = json.loads(out)
            ceilings = Ceilings(float(doc["gemm_gflops"]), float(doc["read_gbytes_per_s"]))
        except (asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
            logger.warning("could not measure the machine's ceilings (%s): the ceiling gauges stay unset", exc)
            return
        finally:
            if proc.returncode is None:  # timed out, or the server is stopping (the task was cancelled)
                proc.kill()
                await proc.wait()
        self.metrics.set_static(self.backend.info.num_kv_blocks if self.backend else 0, ceilings)
        logger.info("machine: %.0f GFLOP/s fp32 GEMM, %.1f GB/s read", ceilings.gemm_gflops, ceilings.read_gbytes_per_s)

    async def _warm_up(self, backend: Backend) -> None:
        """One real generation: pages the weights in, compiles kernels, proves the backend produces tokens."""
        prompt = backend.tokenizer.encode("Hello") or [0]
        gen = GenerateRequest("warmup", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        async for _ in backend.generate(gen):
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
        if self._stopped:
            return
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME, WORKER_SERVICE_NAME):
            await self.health.set(name, status)

    # ---- shutdown --------------------------------------------------------------------------------
    async def drain_and_stop(self, timeout: float | None = None) -> None:
        """NOT_SERVING at once, close the listener, let streams in flight finish within the timeout, then stop.

        The transport stops first: the listener closes and existing connections get GOAWAY, so a load balancer's
        next connection attempt is refused and it retries another replica (nginx `grpc_next_upstream error`). An
        RPC the transport accepted before its GOAWAY reached the peer is served, not refused (edge.admit): the
        peer counts it as accepted, so an UNAVAILABLE would be relayed to the client, not retried.
        """
        if self._stopped:
            return
        self._stopped = True
        timeout = self.cfg.drain_timeout_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        stopping = []
        # NOTE: the transport first, before anything here awaits. Behind nginx (least_conn, kept-alive upstream
        # connections) a drained replica draws new requests until its GOAWAY lands: when the handlers refused
        # those, 14 of 20 requests failed in one compose e2e run; with the stop first but handlers still refusing
        # the ones already on the wire, 2 of 20.
        for server in (self._server, self._triton_server):
            if server is not None:
                # one stop() call per server for the whole drain (concurrent calls on one server crash grpc);
                # it returns once every RPC is done
                stopping.append(asyncio.ensure_future(server.stop(timeout + CUT_GRACE_S + 1)))
        await asyncio.sleep(0)  # the stops' first steps (listener closed, GOAWAY sent) run now
        self.edge.draining = True  # readiness says no; subscriptions end
        await self.health.enter_graceful_shutdown()
        if self.triton_servicer is not None:
            self.triton_servicer.begin_drain()  # idle Triton streams end; those with requests end after them
        if self._server is not None:
            await self.health.end_watches()  # else the stop's grace would wait for them: they never end
        if self._triton_http is not None:  # the listener and idle connections close now, busy ones after
            stopping.append(asyncio.ensure_future(self._triton_http.stop()))
        deadline = loop.time() + timeout
        while self.edge.num_active and loop.time() < deadline and not self._force:
            await asyncio.sleep(0.02)
        if self.edge.num_active:  # the drain timeout: end what still runs, with a status that says so
            logger.warning("drain timeout: ending %d RPCs still in flight", self.edge.num_active)
            self.edge.cut = True  # and an RPC that still arrives gets UNAVAILABLE
            if self.backend is not None:
                self.backend.abort_all()
            cut_deadline = loop.time() + CUT_GRACE_S
            while self.edge.num_active and loop.time() < cut_deadline:
                await asyncio.sleep(0.01)
        for stop in stopping:  # an RPC accepted after the loop above saw none left runs within the stop's grace
            await stop
        if self.backend is not None:  # a dead engine's thread may be stuck in a stalled step: do not wait long
            await self.backend.shutdown(timeout=0.5 if self.fatal else 5.0)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        self.edge.close()
        logger.info("stopped")

    def force_stop(self) -> None:
        """A second SIGINT/SIGTERM: end the drain now (streams still running are cut)."""
        self._force = True

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
