"""Serving metrics from per-request records, defined as vLLM's `vllm bench serve` and GenAI-Perf define them.

Per request (client clock, time.perf_counter, t0 = just before the request is sent):
  TTFT  = arrival of the first chunk carrying tokens - t0
  E2E   = arrival of the last chunk carrying tokens - t0
  TPOT  = (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token
  ITL   = the gaps between consecutive token-carrying chunks (every request's gaps pooled)
Per run (duration = first send to last completion):
  request throughput = completed / duration; output throughput = sum(output tokens) / duration;
  total throughput = sum(input + output tokens) / duration;
  goodput = completed requests meeting every given SLO (TTFT, TPOT, E2E, each value <= its limit; TPOT counts
  as 0 for a request with one token) / duration.
Statistics: mean, min, max and the 50/90/95/99th percentiles with numpy's linear interpolation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

STAT_KEYS = ("mean", "min", "max", "p50", "p90", "p95", "p99")


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as the load generator saw it (plus the server's own timers when reported)."""

    input_tokens: int
    send_time: float = 0.0  # perf_counter just before sending
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    ok: bool = False
    error: str | None = None  # gRPC status name and message, when the request failed
    server_ttft_ms: float | None = None
    server_tpot_ms: float | None = None
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens the server verified for it (llm.v1 Timing)
    spec_accepted_tokens: int = 0

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_ms(self) -> float | None:
        return (self.chunk_times[0] - self.send_time) * 1e3 if self.chunk_times else None

    @property
    def e2e_ms(self) -> float | None:
        return (self.chunk_times[-1] - self.send_time) * 1e3 if self.chunk_times else None

    @property
    def tpot_ms(self) -> float | None:
        n = self.output_tokens
        if n <= 1 or not self.chunk_times:
            return None
        return (self.e2e_ms - self.ttft_ms) / (n - 1)

    @property
    def itl_ms(self) -> list[float]:
        t = self.chunk_times
        return [(b - a) * 1e3 for a, b in itertools.pairwise(t)]


def stats(values: list[float]) -> dict[str, float | None]:
    """mean, min, max, p50, p90, p95, p99 (numpy linear interpolation); None for an empty list."""
    if not values:
        return dict.fromkeys(STAT_KEYS)
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p95, p99 = np.percentile(a, [50, 90, 95, 99])
    return {
        "mean": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
        "p50": float(p50),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
    }


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> SLO:
        """From ['ttft_ms=500', 'tpot_ms=50'] (command-line --slo)."""
        values: dict[str, float] = {}
        for item in items or []:
            key, _, value = item.partition("=")
            if key not in ("ttft_ms", "tpot_ms", "e2e_ms") or not value:
                raise ValueError(f"--slo takes ttft_ms=, tpot_ms= or e2e_ms=, got {item!r}")
            values[key] = float(value)
        return cls(**values)

    def met_by(self, r: RequestRecord) -> bool:
        checks = ((self.ttft_ms, r.ttft_ms), (self.tpot_ms, r.tpot_ms or 0.0), (self.e2e_ms, r.e2e_ms))
        return all(limit is None or (value is not None and value <= limit) for limit, value in checks)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict:
    """One sweep point of the results contract (docs/loadtest.md)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_tokens for r in done)
    ttft = [r.ttft_ms for r in done if r.ttft_ms is not None]
    server_ttft = [r.server_ttft_ms for r in done if r.server_ttft_ms is not None]
    gaps = [r.ttft_ms - r.server_ttft_ms for r in done if r.ttft_ms is not None and r.server_ttft_ms is not None]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput_rps": len(done) * per_s,
        "output_throughput_tok_s": out_tokens * per_s,
        "total_throughput_tok_s": (in_tokens + out_tokens) * per_s,
        "goodput_rps": sum(1 for r in done if slo.met_by(r)) * per_s,
        "ttft_ms": stats(ttft),
        "tpot_ms": stats([r.tpot_ms for r in done if r.tpot_ms is not None]),
        "itl_ms": stats([g for r in done for g in r.itl_ms]),
        "e2e_ms": stats([r.e2e_ms for r in done if r.e2e_ms is not None]),
        "server_ttft_ms": stats(server_ttft),
        "server_tpot_ms": stats([r.server_tpot_ms for r in done if r.server_tpot_ms is not None]),
        "ttft_gap_ms": stats(gaps),  # client TTFT - server TTFT: transport, serialization, client scheduling
        # speculative decoding (llm.v1 only; 0 where the server does not speculate): accepted / draft tokens
        "spec_draft_tokens": sum(r.spec_draft_tokens for r in done),
        "spec_acceptance": (
            sum(r.spec_accepted_tokens for r in done) / drafted
            if (drafted := sum(r.spec_draft_tokens for r in done))
            else None
        ),
        "errors": sorted({r.error for r in failed if r.error})[:10],
    }
