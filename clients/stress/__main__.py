"""Stress tool: try a server as an attacker would. python -m clients.stress {abuse,fuzz,soak} --target HOST:PORT

abuse  the abuse matrix (every field at its bounds and beyond, malformed protobuf, invalid UTF-8, oversized
       messages), each case alone, with normal traffic running alongside; every case must get its documented
       code, naming the field, within 100 ms
fuzz   seeded field-level fuzzing: every answer must be a documented code with a well-formed stream
soak   many streams, a share cancelled at random points; the server's RSS, fds, threads and event-loop
       tasks (from its Prometheus endpoint) must come back, and every KV block must be free
Prints a JSON report; exits 1 when a check fails. Loopback or your own servers only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

from clients.common import add_connection_args, call_metadata, open_aio_channel
from clients.stress import run
from clients.stress.cases import abuse_cases
from clients.stress.fuzz import Fuzzer
from protos.llm.v1 import llm_pb2, llm_pb2_grpc

SOAK_LIMITS = {  # growth allowed from the warmed-up baseline to the end of the soak
    "process_resident_memory_bytes": 20 * 2**20,
    "process_open_fds": 0,
    "llm_process_threads": 0,
    "llm_event_loop_tasks": 0,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m clients.stress",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
    )
    add_connection_args(p)
    p.add_argument("--metrics-url", help="the server's Prometheus endpoint, e.g. http://127.0.0.1:9400/metrics")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("abuse", help="the abuse matrix")
    a.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024, help="the server's message limit")
    a.add_argument("--baseline-s", type=float, default=3.0, help="seconds of normal traffic alone, first")
    f = sub.add_parser("fuzz", help="seeded field-level fuzzing")
    f.add_argument("--requests", type=int, default=10_000)
    f.add_argument("--concurrency", type=int, default=16)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--timeout", type=float, default=3.0, help="deadline of each request, seconds")
    s = sub.add_parser("soak", help="streams with random cancellations; leak checks")
    s.add_argument("--streams", type=int, default=10_000)
    s.add_argument("--concurrency", type=int, default=32)
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--cancel-share", type=float, default=0.2)
    s.add_argument("--warmup", type=int, default=500, help="streams before the baseline is taken")
    s.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def model_info(channel, metadata) -> llm_pb2.ModelInfo:
    return await llm_pb2_grpc.LLMServiceStub(channel).GetModelInfo(llm_pb2.GetModelInfoRequest(), metadata=metadata)


async def run_abuse(args: argparse.Namespace, channel, metadata) -> dict:
    info = await model_info(channel, metadata)
    cases = abuse_cases(info.vocab_size, info.max_seq_len, info.max_text_bytes, args.max_message_bytes)
    stop = asyncio.Event()
    baseline_task = asyncio.create_task(run.normal_traffic(channel, stop, metadata))
    await asyncio.sleep(args.baseline_s)
    stop.set()
    baseline = await baseline_task
    stop = asyncio.Event()
    alongside_task = asyncio.create_task(run.normal_traffic(channel, stop, metadata))
    results = await run.abuse(channel, cases, metadata)
    stop.set()
    alongside = await alongside_task
    failed = [r for r in results if not r.passed]
    return {
        "cases": len(results),
        "failed": [
            {
                "case": r.case.name,
                "expected": r.case.expected.name,
                "got": r.outcome.code.name,
                "details": r.outcome.details[:200],
                "ms": round(r.outcome.first_ms, 1),
                "problem": r.outcome.problem,
            }
            for r in failed
        ],
        "max_ms": round(max(r.outcome.first_ms for r in results), 1),
        "median_ms": round(statistics.median(r.outcome.first_ms for r in results), 2),
        "normal_p99_ms_alone": round(run.p99(baseline), 1),
        "normal_p99_ms_alongside": round(run.p99(alongside), 1),
        "normal_requests": [len(baseline), len(alongside)],
        "ok": not failed,
    }


async def run_fuzz(args: argparse.Namespace, channel, metadata) -> dict:
    info = await model_info(channel, metadata)
    fuzzer = Fuzzer(args.seed, info.vocab_size, info.max_seq_len)
    report = await run.fuzz(channel, fuzzer, args.requests, args.concurrency, args.timeout, metadata)
    state = await run.wait_idle(args.metrics_url) if args.metrics_url else {}
    health = await _health(channel)
    ok = not report.findings and health == "SERVING" and not state.get("llm_kv_cache_blocks_used", 0)
    return {
        "requests": report.requests,
        "codes": dict(report.codes),
        "findings": report.findings[:20],
        "num_findings": len(report.findings),
        "seconds": round(report.seconds, 1),
        "health": health,
        "kv_blocks_used_after": state.get("llm_kv_cache_blocks_used"),
        "ok": ok,
    }


async def run_soak(args: argparse.Namespace, channel, metadata) -> dict:
    if not args.metrics_url:
        raise SystemExit("stress: error: soak needs --metrics-url to read the server's state")
    report = await run.soak(channel, args.metrics_url, args.streams, args.concurrency, args.max_tokens,
                            args.cancel_share, args.warmup, args.seed, metadata)  # fmt: skip
    growth = {name: report.growth(name) for name in SOAK_LIMITS}
    over = {name: g for name, g in growth.items() if g > SOAK_LIMITS[name]}
    blocks = report.after.get("llm_kv_cache_blocks_used")
    return {
        "streams": report.streams,
        "cancelled": report.cancelled,
        "codes": dict(report.codes),
        "problems": report.problems[:20],
        "seconds": round(report.seconds, 1),
        "baseline": {k: report.baseline.get(k) for k in SOAK_LIMITS},
        "growth": growth,
        "over_limit": over,
        "kv_blocks_used_after": blocks,
        "ok": not report.problems and not over and blocks == 0,
    }


async def _health(channel) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


async def main_async(args: argparse.Namespace) -> dict:
    metadata = tuple(call_metadata(args))
    async with open_aio_channel(args) as channel:
        command = {"abuse": run_abuse, "fuzz": run_fuzz, "soak": run_soak}[args.command]
        return await command(args, channel, metadata)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(main_async(args))
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
