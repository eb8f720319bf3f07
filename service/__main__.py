"""python -m service --engine engines/smollm2-135m --host 127.0.0.1 --port 50051 --metrics-port 9400

Every flag can also be set by an environment variable (LLM_ + the flag in capitals, e.g. LLM_PORT=50051);
a flag given on the command line wins. Defaults come from service/config.py, the one place they live.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TypeVar

from build_engine.trtllm_runtime import SCHEDULER_POLICIES
from service.api.server import LLMServer
from service.backends import preflight
from service.config import (
    BACKENDS,
    EVENT_LOOPS,
    FAILURE_POLICIES,
    KV_CACHE_DTYPES,
    TRITON_MODELS,
    BackendConfig,
    ServerConfig,
    get_path,
    replace_path,
)

logger = logging.getLogger("service")

_BOOL_TRUE = {"1", "true", "yes", "on"}
DEFAULTS = ServerConfig(backend=BackendConfig(engine_dir=""))
FATAL_DRAIN_S = 2.0  # after an engine failure, how long the failed streams get to send their statuses
T = TypeVar("T")
EXIT_ENGINE_FAILED = 3  # the engine died (on_engine_error=exit): a supervisor should restart the process


def _true_false(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() == "true"


@dataclass(frozen=True, slots=True)
class Flag:
    name: str  # --flag
    path: str  # where it goes in ServerConfig ("backend.native.kv_cache_memory")
    help: str
    type: type = str
    choices: tuple[str, ...] | None = None
    negate: bool = False  # a --no-X switch that sets a default-True field to False
    none_below_zero: bool = False  # -1 means None (off)


FLAGS = (
    Flag(
        "--engine",
        "backend.engine_dir",
        "engine directory written by python -m build_engine (triton backend: the one the Triton server serves, for "
        "its tokenizer and limits)",
    ),
    Flag(
        "--backend",
        "backend.backend",
        "auto: the backend the engine directory was built for",
        choices=("auto", *BACKENDS),
    ),
    Flag(
        "--skip-verify",
        "backend.verify_checksums",
        "do not check the engine's files against the sha256 checksums of its manifest.json at startup (for an "
        "engine edited on purpose; the shape, tokenizer and chat-template checks still run)",
        negate=True,
    ),
    Flag("--host", "host", "address to bind (0.0.0.0 in containers)"),
    Flag("--port", "port", "gRPC port (0 picks a free one)", int),
    Flag("--metrics-port", "metrics_port", "Prometheus port (-1 disables the endpoint)", int, none_below_zero=True),
    Flag(
        "--kv-cache-memory",
        "backend.native.kv_cache_memory",
        "native KV cache budget: auto (max_batch_size x max_seq_len tokens, capped at 10%% of available memory), "
        "bytes (512MiB, 2GB) or a fraction of available memory",
    ),
    Flag(
        "--kv-cache-dtype",
        "backend.native.kv_cache_dtype",
        "native KV cache's stored type: float32 (exact, the default), float16, bfloat16 (half the KV bytes) or "
        "int8 (a quarter, with a float32 scale per token and KV head)",
        choices=KV_CACHE_DTYPES,
    ),
    Flag(
        "--max-queue",
        "backend.admission.max_queue",
        "requests accepted but not yet scheduled, at most (beyond: RESOURCE_EXHAUSTED)",
        int,
    ),
    Flag(
        "--long-prefill-token-threshold",
        "backend.native.long_prefill_token_threshold",
        "native: while decodes run, one prefill chunk costs at most this many tokens' work, attention to earlier "
        "keys counted in (-1: a quarter of --max-num-tokens; 0: no cap), so every decode gets a token in a short "
        "step",
        int,
        none_below_zero=True,
    ),
    Flag(
        "--speculative-method",
        "backend.native.speculative.method",
        "native: speculative decoding; ngram: drafts looked up in the request's own tokens (prompt lookup), "
        "verified in one multi-token step: greedy output unchanged (docs/speculative.md)",
        choices=("off", "ngram"),
    ),
    Flag(
        "--num-speculative-tokens",
        "backend.native.speculative.num_speculative_tokens",
        "native: draft tokens per step at most (each request's recent acceptance and the measured verify cost "
        "choose fewer; a request may ask for fewer or 0)",
        int,
    ),
    Flag("--prompt-lookup-min", "backend.native.speculative.prompt_lookup_min", "native: shortest n-gram", int),
    Flag("--prompt-lookup-max", "backend.native.speculative.prompt_lookup_max", "native: longest n-gram", int),
    Flag(
        "--speculative-disable-by-batch-size",
        "backend.native.speculative.disable_by_batch_size",
        "native: no drafts in a step with more decoding requests than this (there, verify rows cost more than "
        "they return)",
        int,
    ),
    Flag("--max-num-seqs", "backend.max_num_seqs", "sequences per step (None: the engine's max_batch_size)", int),
    Flag("--max-num-tokens", "backend.max_num_tokens", "tokens per step (None: the engine's max_num_tokens)", int),
    Flag(
        "--no-prefix-caching",
        "backend.prefix_caching",
        "do not share KV blocks of common prompt prefixes (TensorRT-LLM: KV block reuse)",
        negate=True,
    ),
    Flag(
        "--kv-event-history",
        "backend.kv_event_history",
        "KV-cache event batches kept for replay to a gateway's SubscribeKvEvents (cache-aware routing); 0: no KV "
        "events (native and trtllm backends)",
        int,
    ),
    Flag("--drain-timeout", "drain_timeout_s", "seconds streams in flight may take to finish after SIGTERM", float),
    Flag(
        "--stall-timeout",
        "backend.admission.stall_timeout_s",
        "a step running longer than this marks the service unhealthy",
        float,
    ),
    Flag(
        "--on-engine-error",
        "backend.admission.on_failure",
        "after an engine failure (in-flight requests fail either way): exit non-zero so a supervisor restarts the "
        "process, or recover: rebuild the engine's state and serve again; a stalled step is fatal with exit",
        choices=FAILURE_POLICIES,
    ),
    Flag(
        "--kv-cache-free-gpu-memory-fraction",
        "backend.trtllm.kv_cache_free_gpu_memory_fraction",
        "trtllm: share of the GPU memory left after loading the engine that the KV cache takes",
        float,
    ),
    Flag(
        "--scheduler-policy",
        "backend.trtllm.scheduler_policy",
        "trtllm: guaranteed_no_evict reserves prompt + max_tokens before admitting; max_utilization packs more "
        "and may pause requests",
        choices=SCHEDULER_POLICIES,
    ),
    Flag(
        "--no-chunked-context",
        "backend.trtllm.enable_chunked_context",
        "trtllm: prefill long prompts in one piece instead of chunks",
        negate=True,
    ),
    Flag(
        "--triton-port",
        "triton_port",
        "also serve Triton's KServe v2 gRPC protocol (models ensemble, tensorrt_llm, ...) on this port, over the "
        "same backend, auth and TLS (-1: off; 0 picks a free port)",
        int,
        none_below_zero=True,
    ),
    Flag(
        "--triton-decoupled",
        "triton_decoupled",
        "true|false: the Triton front door serves ensemble and tensorrt_llm decoupled (streaming over "
        "ModelStreamInfer, as config.pbtxt's decoupled_mode true) or not (unary ModelInfer, as NVIDIA's "
        "non-streaming tools expect); ensemble_sync and tensorrt_llm_sync are never decoupled",
        _true_false,
    ),
    Flag(
        "--triton-http-port",
        "triton_http_port",
        "also serve Triton's KServe v2 HTTP/REST protocol (infer, generate, generate_stream, health, metadata) on this "
        "port, Triton's 8000 by convention; metrics stay on --metrics-port (-1: off; 0 picks a free port)",
        int,
        none_below_zero=True,
    ),
    Flag("--triton-url", "backend.triton.url", "triton backend: HOST:PORT of the Triton server's gRPC endpoint"),
    Flag(
        "--triton-model",
        "backend.triton.model",
        "triton backend: tensorrt_llm (token ids in and out: exact token parity) or ensemble (text in and out)",
        choices=TRITON_MODELS,
    ),
    Flag(
        "--triton-ready-timeout",
        "backend.triton.ready_timeout_s",
        "triton backend: seconds to wait at startup for the Triton server and model to be ready",
        float,
    ),
    Flag("--tls-cert", "tls_cert", "server certificate (PEM); enables TLS"),
    Flag("--tls-key", "tls_key", "server private key (PEM)"),
    Flag("--tls-client-ca", "tls_client_ca", "CA (PEM) that client certificates must chain to; enables mutual TLS"),
    Flag(
        "--auth-token-file",
        "auth_token_file",
        "file of the bearer tokens (one per line; blank lines and # comments ignored), one of which every RPC but "
        "health must send",
    ),
    Flag(
        "--cache-salt-per-token",
        "cache_salt_per_token",
        "salt each request's prefix cache by the bearer token it sent (a keyed hash of it, joined with any "
        "cache_salt): clients with different tokens never share prefix KV blocks",
        bool,
    ),
    Flag("--max-message-bytes", "max_message_bytes", "largest request or response message", int),
    Flag(
        "--max-concurrent-rpcs",
        "max_concurrent_rpcs",
        "LLM RPCs in flight at most (beyond: RESOURCE_EXHAUSTED; health and reflection never count)",
        int,
    ),
    Flag(
        "--max-rpcs-per-connection",
        "max_rpcs_per_connection",
        "of those, on one client connection (-1: half of --max-concurrent-rpcs); the connection's HTTP/2 streams "
        "are capped at this plus a few for health checks",
        int,
        none_below_zero=True,
    ),
    Flag(
        "--stream-stall-timeout",
        "stream_stall_timeout_s",
        "seconds a stream's next response may wait for its client to read before the stream is ended (its requests "
        "aborted)",
        float,
    ),
    Flag(
        "--max-requests-per-stream",
        "max_requests_per_stream",
        "requests in flight on one Triton ModelStreamInfer stream (beyond, the server stops reading it until some end)",
        int,
    ),
    Flag(
        "--tokenize-backlog",
        "tokenize_backlog",
        "text being tokenized at most, server-wide, in largest prompts (ModelInfo.max_text_bytes); beyond: "
        "RESOURCE_EXHAUSTED",
        float,
    ),
    Flag(
        "--tokenize-backlog-per-connection",
        "tokenize_backlog_per_connection",
        "the same, per client connection",
        float,
    ),
    Flag("--keepalive-time", "keepalive_time_s", "seconds between server keepalive pings on idle connections", float),
    Flag(
        "--keepalive-timeout",
        "keepalive_timeout_s",
        "seconds to wait for a keepalive ack before dropping the connection",
        float,
    ),
    Flag("--log-prompts", "log_prompts", "log prompt token ids (off by default: prompts are not logged)", bool),
    Flag("--no-reflection", "reflection", "disable gRPC server reflection", negate=True),
    Flag(
        "--no-measure-ceilings",
        "measure_ceilings",
        "skip measuring the machine's GEMM rate and bandwidth (native: once SERVING, in a child process, for the "
        "ceiling gauges)",
        negate=True,
    ),
    Flag(
        "--event-loop",
        "event_loop",
        "the event loop: auto is uvloop's when it is installed (~20%% less CPU per streamed token), else asyncio's",
        choices=EVENT_LOOPS,
    ),
)


def _env(flag: str) -> str:
    return "LLM_" + flag.lstrip("-").replace("-", "_").upper()


def _add(p: argparse.ArgumentParser, flag: Flag) -> None:
    env, dest = _env(flag.name), flag.name.lstrip("-").replace("-", "_")
    default = get_path(DEFAULTS, flag.path)
    if flag.negate or flag.type is bool:  # switches: the environment can turn them on too
        on = os.environ.get(env, "").lower() in _BOOL_TRUE
        p.add_argument(flag.name, dest=dest, action="store_true", default=on, help=f"{flag.help} [{env}]")
        return
    kw: dict = {"type": flag.type, "choices": flag.choices}
    if flag.path == "backend.engine_dir":
        kw["required"] = env not in os.environ
        default = None
    if env in os.environ:
        default = flag.type(os.environ[env])
    elif flag.none_below_zero and default is None:
        default = -1
    p.add_argument(flag.name, dest=dest, default=default, help=f"{flag.help} [{env}]", **kw)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        prog="python -m service",
        description="Serve an engine over gRPC (llm.v1.LLMService, TensorRT-LLM's worker protocol trtllm.TrtllmService "
        "for gateways such as smg, grpc.health.v1, reflection, all on --port; with --triton-port and "
        "--triton-http-port, Triton's KServe v2 protocol too, over gRPC and HTTP/REST) with Prometheus metrics. Every "
        "flag can also be set by the environment variable shown in brackets.",
    )
    for flag in FLAGS:
        _add(p, flag)
    p.add_argument("--log-level", default=os.environ.get("LLM_LOG_LEVEL", "INFO"), help="logging level [LLM_LOG_LEVEL]")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    cfg: object = DEFAULTS
    for flag in FLAGS:
        value = getattr(args, flag.name.lstrip("-").replace("-", "_"))
        if flag.negate:
            value = not value
        elif flag.none_below_zero and value is not None and value < 0:
            value = None
        cfg = replace_path(cfg, flag.path, value)
    return cfg  # type: ignore[return-value]


async def serve(cfg: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT (drain, exit 0) or an engine failure (exit EXIT_ENGINE_FAILED)."""
    preflight(cfg.backend)  # a missing dependency or a damaged engine is one line, before any port is bound
    server = LLMServer(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            logger.warning("second signal: stopping now")
            server.force_stop()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    startup = asyncio.create_task(server.start())
    waits = {startup, asyncio.create_task(stop.wait()), asyncio.create_task(server.fatal_event.wait())}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if startup.done() and startup.exception() is not None:
        await server.drain_and_stop(0)
        raise startup.exception()
    if not startup.done():
        startup.cancel()
    if not stop.is_set() and not server.fatal:  # started: now wait for a signal or an engine failure
        await asyncio.wait(
            {asyncio.create_task(stop.wait()), asyncio.create_task(server.fatal_event.wait())},
            return_when=asyncio.FIRST_COMPLETED,
        )
    if server.fatal:
        await server.drain_and_stop(FATAL_DRAIN_S)  # the failed requests' statuses go out, nothing else runs
        return EXIT_ENGINE_FAILED
    logger.info("signal received: draining for up to %.0f s", cfg.drain_timeout_s)
    await server.drain_and_stop()
    return 0


def run_loop(main: Callable[[], Coroutine[object, object, T]], event_loop: str) -> T:
    """asyncio.run(main()) on the event loop `event_loop` names (config.EVENT_LOOPS)."""
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.run(main())
    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        return run_loop(lambda: serve(cfg), cfg.event_loop)
    except (OSError, ValueError) as exc:  # EngineFormatError, BackendLoadError, a port in use, a bad flag value
        logger.error("cannot start: %s", " ".join(str(exc).split()))  # one line, whatever the message holds
        return 2


if __name__ == "__main__":
    sys.exit(main())
