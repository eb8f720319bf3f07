"""python -m service --engine engines/smollm2-135m --host 127.0.0.1 --port 50051 --metrics-port 9400

Every flag can also be set by an environment variable (LLM_ + the flag in capitals, e.g. LLM_PORT=50051);
a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from service.api.server import LLMServer, ServerConfig
from service.engine.core import DEFAULT_KV_CACHE_MEMORY

logger = logging.getLogger("service")

_BOOL_TRUE = {"1", "true", "yes", "on"}


def _env(flag: str) -> str:
    return "LLM_" + flag.lstrip("-").replace("-", "_").upper()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        prog="python -m service",
        description="Serve an engine over gRPC (llm.v1.LLMService, grpc.health.v1, reflection) with Prometheus "
        "metrics. Every flag can also be set by the environment variable shown in brackets.",
    )

    def add(flag: str, help: str, **kw) -> None:
        env = _env(flag)
        if kw.get("action") == "store_true":
            kw["default"] = os.environ.get(env, "").lower() in _BOOL_TRUE
        elif env in os.environ:
            kw["default"] = kw.get("type", str)(os.environ[env])
            kw.pop("required", None)
        p.add_argument(flag, help=f"{help} [{env}]", **kw)

    add("--engine", "engine directory written by python -m build_engine", required=True)
    add("--backend", "engine backend", choices=["native"], default="native")
    add("--host", "address to bind (0.0.0.0 in containers)", default="127.0.0.1")
    add("--port", "gRPC port (0 picks a free one)", type=int, default=50051)
    add("--metrics-port", "Prometheus port (-1 disables the endpoint)", type=int, default=9400)
    add(
        "--kv-cache-memory",
        "KV cache budget: bytes (512MiB, 2GB) or a fraction of available memory",
        default=DEFAULT_KV_CACHE_MEMORY,
    )
    add(
        "--max-queue",
        "requests accepted but not yet scheduled, at most (beyond: RESOURCE_EXHAUSTED)",
        type=int,
        default=256,
    )
    add("--max-num-seqs", "sequences per step (default: the engine's max_batch_size)", type=int, default=None)
    add("--max-num-tokens", "tokens per step (default: the engine's max_num_tokens)", type=int, default=None)
    add("--no-prefix-caching", "do not share KV blocks of common prompt prefixes", action="store_true")
    add("--drain-timeout", "seconds streams in flight may take to finish after SIGTERM", type=float, default=30.0)
    add("--stall-timeout", "a step running longer than this marks the service unhealthy", type=float, default=60.0)
    add(
        "--on-engine-error",
        "after an engine failure (in-flight requests fail either way): exit non-zero so a supervisor restarts "
        "the process, or recover: rebuild the engine's state and serve again; a stalled step is fatal with exit",
        choices=["exit", "recover"],
        default="exit",
    )
    add("--tls-cert", "server certificate (PEM); enables TLS", default=None)
    add("--tls-key", "server private key (PEM)", default=None)
    add("--tls-client-ca", "CA (PEM) that client certificates must chain to; enables mutual TLS", default=None)
    add("--auth-token-file", "file holding a bearer token every RPC but health must send", default=None)
    add("--max-message-bytes", "largest request or response message", type=int, default=4 * 1024 * 1024)
    add("--max-concurrent-rpcs", "RPCs in flight at most (beyond: RESOURCE_EXHAUSTED)", type=int, default=1024)
    add("--keepalive-time", "seconds between server keepalive pings on idle connections", type=float, default=30.0)
    add(
        "--keepalive-timeout",
        "seconds to wait for a keepalive ack before dropping the connection",
        type=float,
        default=10.0,
    )
    add("--log-prompts", "log prompt token ids (off by default: prompts are not logged)", action="store_true")
    add("--no-reflection", "disable gRPC server reflection", action="store_true")
    add("--no-measure-ceilings", "skip measuring the machine's GEMM rate and bandwidth at startup", action="store_true")
    add("--log-level", "logging level", default="INFO")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        engine_dir=args.engine,
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        backend=args.backend,
        kv_cache_memory=args.kv_cache_memory,
        max_queue=args.max_queue,
        max_num_seqs=args.max_num_seqs,
        max_num_tokens=args.max_num_tokens,
        prefix_caching=not args.no_prefix_caching,
        drain_timeout_s=args.drain_timeout,
        stall_timeout_s=args.stall_timeout,
        on_engine_error=args.on_engine_error,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        auth_token_file=args.auth_token_file,
        max_message_bytes=args.max_message_bytes,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        keepalive_time_s=args.keepalive_time,
        keepalive_timeout_s=args.keepalive_timeout,
        log_prompts=args.log_prompts,
        reflection=not args.no_reflection,
        measure_ceilings=not args.no_measure_ceilings,
    )


FATAL_DRAIN_S = 2.0  # after an engine failure, how long the failed streams get to send their statuses
EXIT_ENGINE_FAILED = 3  # the engine died (on_engine_error=exit): a supervisor should restart the process


async def serve(cfg: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT (drain, exit 0) or an engine failure (exit EXIT_ENGINE_FAILED)."""
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        return asyncio.run(serve(cfg))
    except (OSError, ValueError) as exc:
        logger.error("cannot start: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
