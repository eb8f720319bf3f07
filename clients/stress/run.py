"""Drivers of the stress tool: the abuse matrix, the fuzz run and the soak, each bounded in requests and time.

Every call goes over a real gRPC channel with raw request bytes (so malformed messages reach the server as
sent). Server-side state (KV blocks, RSS, fds, threads, event-loop tasks) is read from its Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from clients.stress.cases import GENERATE, Case
from protos.llm.v1 import llm_pb2

# What the API documents a Generate can end with (docs/api.md); anything else is a finding.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
REFUSAL_MS = 100  # a bad request is refused within this
LEAKY_WORDS = ("Traceback", "Error:", "Exception", "/usr/", ".py")  # internals an error message must not show


@dataclass(slots=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    first_ms: float  # time to the status or the first streamed message
    tokens: int = 0
    problem: str = ""  # a stream-shape or message-hygiene violation


def _unary_stream(channel: grpc.aio.Channel, method: str):
    return channel.unary_stream(
        method, request_serializer=None, response_deserializer=llm_pb2.GenerateResponse.FromString
    )


async def call(
    channel: grpc.aio.Channel,
    method: str,
    payload: bytes,
    timeout: float,
    metadata: tuple = (),
    cancel_after: int | None = None,
) -> Outcome:
    """One RPC with raw bytes. Generate streams are read to the end (or cancelled after `cancel_after` chunks)
    and their shape checked: chunks, then exactly one Complete whose usage matches the chunks."""
    start = time.perf_counter()
    if method != GENERATE:
        try:
            await channel.unary_unary(method, request_serializer=None)(payload, timeout=timeout, metadata=metadata)
            return Outcome(grpc.StatusCode.OK, "", (time.perf_counter() - start) * 1e3)
        except grpc.aio.AioRpcError as err:
            return _failed(err, start)
    stream = _unary_stream(channel, method)(payload, timeout=timeout, metadata=metadata)
    first, tokens, complete, problem, chunks = None, 0, None, "", 0
    try:
        async for resp in stream:
            first = first or time.perf_counter()
            if complete is not None:
                problem = "a message after Complete"
            if resp.HasField("chunk"):
                tokens += len(resp.chunk.token_ids)
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    stream.cancel()
                    return Outcome(grpc.StatusCode.CANCELLED, "", (first - start) * 1e3, tokens)
            else:
                complete = resp.complete
    except grpc.aio.AioRpcError as err:
        out = _failed(err, start)
        out.tokens = tokens
        return out
    except asyncio.CancelledError:
        stream.cancel()
        raise
    if complete is None:
        problem = "stream ended without Complete"
    elif complete.usage.completion_tokens != tokens:
        problem = f"usage says {complete.usage.completion_tokens} tokens, chunks carried {tokens}"
    return Outcome(grpc.StatusCode.OK, "", ((first or time.perf_counter()) - start) * 1e3, tokens, problem)


def _failed(err: grpc.aio.AioRpcError, start: float) -> Outcome:
    details = err.details() or ""
    out = Outcome(err.code(), details, (time.perf_counter() - start) * 1e3)
    if not details:
        out.problem = "an error without a message"
    elif err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED and any(w in details for w in LEAKY_WORDS):
        out.problem = f"error message shows internals: {details[:120]}"
    return out


# ---- server state ---------------------------------------------------------------------------------------------
def scrape(metrics_url: str) -> dict[str, float]:
    """Unlabelled samples of the server's Prometheus exposition."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            samples[name] = float(value)
    return samples


SETTLE_S = 30.0  # how long a soak waits for the server to come back to its baseline before it compares


async def wait_idle(
    metrics_url: str, within_s: float = 5.0, settled: dict[str, float] | None = None
) -> dict[str, float]:
    """Poll until no request runs or waits and no KV block is used, and every gauge named in `settled` is back at
    or under its value there (handlers of cancelled streams finish their bookkeeping after the client has moved
    on, later on a busy box); return the last scrape (at `within_s`, whatever it shows)."""
    deadline = time.monotonic() + within_s
    while True:
        s = await asyncio.to_thread(scrape, metrics_url)
        idle = not s["llm_kv_cache_blocks_used"] and not s["llm_num_requests_running"]
        back = all(s.get(name, 0.0) <= value for name, value in (settled or {}).items())
        if (idle and not s["llm_num_requests_waiting"] and back) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.05)


# ---- abuse matrix ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class CaseResult:
    case: Case
    outcome: Outcome

    @property
    def passed(self) -> bool:
        """Refused with the documented code, naming the field, within 100 ms; or accepted (its first chunk came:
        the tool then cancels it) when the case is a valid edge."""
        o, c = self.outcome, self.case
        if c.expected == grpc.StatusCode.OK:
            return o.code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED) and not o.problem
        return o.code == c.expected and not o.problem and c.field in o.details and o.first_ms < REFUSAL_MS


async def abuse(channel: grpc.aio.Channel, cases: Iterable[Case], metadata: tuple = ()) -> list[CaseResult]:
    """Each case alone, in turn; accepted Generate streams are cancelled after their first chunk."""
    results = []
    for case in cases:
        outcome = await call(channel, case.method, case.payload, timeout=30, metadata=metadata, cancel_after=1)
        results.append(CaseResult(case, outcome))
    return results


async def normal_traffic(channel: grpc.aio.Channel, stop: asyncio.Event, metadata: tuple = ()) -> list[float]:
    """Short greedy requests back to back until `stop`: their end-to-end latencies in ms."""
    req = llm_pb2.GenerateRequest(
        prompt="The capital of France is",
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=8, ignore_eos=True),
    ).SerializeToString()
    latencies = []
    while not stop.is_set():
        start = time.perf_counter()
        out = await call(channel, GENERATE, req, timeout=30, metadata=metadata)
        if out.code == grpc.StatusCode.OK:
            latencies.append((time.perf_counter() - start) * 1e3)
    return latencies


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else (values[0] if values else 0.0)


# ---- fuzz -----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class FuzzReport:
    requests: int = 0
    codes: Counter = field(default_factory=Counter)
    findings: list[tuple[str, str]] = field(default_factory=list)  # (mutation label, what went wrong)
    seconds: float = 0.0


async def fuzz(
    channel: grpc.aio.Channel, requests: Iterable[tuple[str, bytes]], n: int, concurrency: int,
    timeout: float = 3.0, metadata: tuple = (),
) -> FuzzReport:  # fmt: skip
    report = FuzzReport()
    source = iter(requests)
    start = time.perf_counter()

    async def worker() -> None:
        while report.requests < n:
            report.requests += 1
            label, payload = next(source)
            out = await call(channel, GENERATE, payload, timeout=timeout, metadata=metadata)
            report.codes[out.code.name] += 1
            if out.code not in DOCUMENTED:
                report.findings.append((label, f"{out.code.name}: {out.details[:160]}"))
            elif out.problem:
                report.findings.append((label, out.problem))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.seconds = time.perf_counter() - start
    return report


# ---- soak -----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class SoakReport:
    streams: int = 0
    cancelled: int = 0
    codes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    baseline: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def growth(self, name: str) -> float:
        return self.after.get(name, 0.0) - self.baseline.get(name, 0.0)


async def streams(
    channel: grpc.aio.Channel, n: int, concurrency: int, max_tokens: int, cancel_share: float, seed: int,
    metadata: tuple = (), report: SoakReport | None = None,
) -> SoakReport:  # fmt: skip
    """n streams, `cancel_share` of them cancelled after a random number of chunks (0: before any output)."""
    report = report or SoakReport()
    rng = random.Random(seed)
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < n:
            i = sent
            sent += 1
            req = llm_pb2.GenerateRequest(
                prompt=f"soak {i} " * rng.randint(1, 8),
                sampling=llm_pb2.SamplingParams(temperature=rng.choice((0.0, 0.8)), seed=i),
                stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
            ).SerializeToString()
            cancel = rng.randint(0, max_tokens - 1) if rng.random() < cancel_share else None
            if cancel == 0:  # gone before the first token: cancel while queued or prefilling
                task = asyncio.ensure_future(call(channel, GENERATE, req, timeout=60, metadata=metadata))
                await asyncio.sleep(rng.random() * 0.02)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                report.cancelled += 1
                continue
            out = await call(channel, GENERATE, req, timeout=60, metadata=metadata, cancel_after=cancel)
            report.codes[out.code.name] += 1
            report.cancelled += out.code == grpc.StatusCode.CANCELLED
            if out.problem or out.code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                report.problems.append(out.problem or f"{out.code.name}: {out.details}")
            elif out.code == grpc.StatusCode.OK and out.tokens != max_tokens:
                report.problems.append(f"{out.tokens} tokens, expected {max_tokens}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.streams += n
    report.seconds += time.perf_counter() - start
    return report


async def soak(
    channel: grpc.aio.Channel, metrics_url: str, n: int, concurrency: int, max_tokens: int = 16,
    cancel_share: float = 0.2, warmup: int = 200, seed: int = 0, metadata: tuple = (),
) -> SoakReport:  # fmt: skip
    """Warm up, take the baseline of the server's state, run n streams, wait for idle, compare."""
    await streams(channel, warmup, concurrency, max_tokens, cancel_share, seed + 1, metadata)
    report = SoakReport(baseline=await wait_idle(metrics_url))
    await streams(channel, n, concurrency, max_tokens, cancel_share, seed, metadata, report)
    # the server's own tasks may take a while to end after the last cancel: wait for them (bounded), not a guess
    tasks = {"llm_event_loop_tasks": report.baseline.get("llm_event_loop_tasks", 0.0)}
    report.after = await wait_idle(metrics_url, within_s=SETTLE_S, settled=tasks)
    return report
