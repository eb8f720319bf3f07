"""The stress tool against real servers, scaled down for CI (the full-size runs are in benchmarks.reliability_bench):
the abuse matrix, a seeded field-level fuzz, and a soak with random cancellations and auth on."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from clients.stress import run
from clients.stress.cases import abuse_cases
from clients.stress.fuzz import Fuzzer
from tests.engines import build_tiny
from tests.servers import free_port, running_server, wait_serving

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-stress", max_batch_size=16, max_num_tokens=64, max_seq_len=512)


def test_abuse_matrix(engine_dir: Path) -> None:
    async def main(target: str) -> list[run.CaseResult]:
        async with grpc.aio.insecure_channel(target) as channel:
            from clients.stress.__main__ import model_info

            info = await model_info(channel, ())
            assert info.max_text_bytes == 512 * 13 and info.max_concurrent_rpcs == 1024
            cases = abuse_cases(info.vocab_size, info.max_seq_len, info.max_text_bytes, 4 * 1024 * 1024)
            return await run.abuse(channel, cases)

    with running_server(engine_dir) as srv:
        results = asyncio.run(main(srv.target))
        failed = [(r.case.name, r.outcome.code.name, r.outcome.details[:100], r.outcome.problem)
                  for r in results if not (r.passed or (r.case.expected != grpc.StatusCode.OK
                  and r.outcome.code == r.case.expected and r.case.field in r.outcome.details))]  # fmt: skip
        assert not failed
        refusals = [r.outcome.first_ms for r in results if r.case.expected != grpc.StatusCode.OK]
        assert len(results) > 70 and statistics.median(refusals) < 100  # the bench reports each; CI boxes are noisy
        core = srv.server.backend.core
        assert srv.server.backend.num_in_flight == 0 and not core.scheduler.requests


def test_seeded_field_level_fuzz(engine_dir: Path) -> None:
    async def main(target: str, metrics: str) -> tuple[run.FuzzReport, dict]:
        async with grpc.aio.insecure_channel(target) as channel:
            report = await run.fuzz(channel, Fuzzer(seed=1, vocab=267, max_seq_len=512), 300, 8, timeout=3.0)
            return report, await run.wait_idle(metrics)

    with running_server(engine_dir) as srv:
        report, state = asyncio.run(main(srv.target, f"http://127.0.0.1:{srv.server.metrics_port}/metrics"))
        assert report.requests == 300 and not report.findings, report.findings[:5]
        assert report.codes["OK"] and report.codes["INVALID_ARGUMENT"]  # both sides of the edges were reached
        assert state["llm_kv_cache_blocks_used"] == 0 and srv.server.backend.is_healthy
        a, b = iter(Fuzzer(seed=1, vocab=267, max_seq_len=512)), iter(Fuzzer(seed=1, vocab=267, max_seq_len=512))
        assert [next(a) for _ in range(50)] == [next(b) for _ in range(50)]  # same seed, same requests


def test_soak_with_cancellations_and_auth(engine_dir: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("soak-secret\n")
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "clients.stress", "--target", f"127.0.0.1:{port}", "--auth-token-file", str(token),
           "--metrics-url", f"http://127.0.0.1:{metrics_port}/metrics", "soak", "--streams", "400",
           "--concurrency", "16", "--max-tokens", "12", "--warmup", "150"]  # fmt: skip
    log = open(tmp_path / "server.log", "w")  # a pipe nobody reads would fill up and block the server's logging
    server = subprocess.Popen(
        [sys.executable, "-m", "service", "--engine", str(engine_dir), "--port", str(port), "--metrics-port",
         str(metrics_port), "--auth-token-file", str(token), "--kv-cache-memory", "64MiB", "--no-measure-ceilings"],
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{port}", server)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        result = json.loads(out.stdout)
        assert out.returncode == 0, result
        assert result["streams"] == 400 and 40 <= result["cancelled"] <= 130
        assert result["kv_blocks_used_after"] == 0 and not result["problems"]
        assert result["growth"]["process_resident_memory_bytes"] < 20 * 2**20
        assert result["growth"]["llm_event_loop_tasks"] <= 0 and result["growth"]["process_open_fds"] <= 0
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
