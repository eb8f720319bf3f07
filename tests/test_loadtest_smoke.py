"""A bounded end-to-end sweep of the load tester against an in-process server (real gRPC on 127.0.0.1)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import pytest

from clients.loadtest.__main__ import main
from tests.engines import build_tiny
from tests.servers import running_server

pytestmark = pytest.mark.server

STATS = {"mean", "min", "max", "p50", "p90", "p95", "p99"}
RUN_KEYS = {
    "completed", "failed", "duration_s", "request_throughput_rps", "output_throughput_tok_s", "total_throughput_tok_s",
    "goodput_rps", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "server_ttft_ms", "server_tpot_ms",
}  # fmt: skip


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-loadtest", max_batch_size=16, max_num_tokens=128, max_seq_len=512)


def test_short_sweep_writes_the_results_contract(engine_dir: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    with running_server(engine_dir) as srv:
        code = main([
            "--target", srv.target, "--concurrency", "1,4", "--num-requests", "8", "--input-len", "32",
            "--output-len", "16", "--ignore-eos", "--warmup", "1", "--time-limit", "20", "--slo", "ttft_ms=5000",
            "tpot_ms=1000", "--output", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"),
            "--plot", str(tmp_path / "plots"),
        ])  # fmt: skip
        rate = main([
            "--target", srv.target, "--request-rate", "20", "--burstiness", "0.5", "--num-requests", "10",
            "--input-len-range", "8:64", "--output-len", "8", "--ignore-eos", "--output", str(tmp_path / "rate.json"),
        ])  # fmt: skip
    assert time.monotonic() - start < 30
    assert code == 0 and rate == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["meta"]["model"] == {"model_name": "tiny-random", "backend": "native", "dtype": "float32",
                                       "weight_format": "float32", "kv_cache_dtype": "float32"}  # fmt: skip
    runs = result["runs"]
    assert [r["concurrency"] for r in runs] == [1, 4]
    for r in runs:
        assert RUN_KEYS <= set(r)
        assert all(
            set(r[k]) == STATS for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "server_ttft_ms", "server_tpot_ms")
        )
        assert r["completed"] == 8 and r["failed"] == 0 and r["output_tokens"] == 8 * 16 and r["input_tokens"] == 8 * 32
        assert 0 < r["server_ttft_ms"]["p50"] <= r["ttft_ms"]["p50"]
        assert r["goodput_rps"] == pytest.approx(r["request_throughput_rps"])
    rate_runs = json.loads((tmp_path / "rate.json").read_text())["runs"]
    assert rate_runs[0]["request_rate"] == 20 and rate_runs[0]["completed"] == 10
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [row["concurrency"] for row in rows] == ["1", "4"] and "ttft_ms_p99" in rows[0]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "latency_vs_throughput.png", "tpot_distribution.png", "ttft_distribution.png",
    ]  # fmt: skip


def test_unreachable_server_fails_cleanly(tmp_path: Path) -> None:
    code = main(["--target", "127.0.0.1:1", "--concurrency", "1", "--num-requests", "2", "--time-limit", "5"])
    assert code == 1


def test_triton_protocol_sweep_against_the_front_door(engine_dir: Path, tmp_path: Path) -> None:
    """`--protocol triton --model ensemble` against the service's own Triton port: no failures, and the same
    work as the llm.v1 sweep (the same prompts, exactly the same tokens in and out)."""
    common = [
        "--tokenizer", str(engine_dir), "--concurrency", "1,4", "--num-requests", "8", "--input-len", "32",
        "--output-len", "16", "--ignore-eos", "--warmup", "1", "--time-limit", "30",
    ]  # fmt: skip
    with running_server(engine_dir, triton_port=0) as srv:
        triton = f"127.0.0.1:{srv.server.triton_port}"
        code = main(["--target", triton, "--protocol", "triton", "--model", "ensemble", *common,
                     "--output", str(tmp_path / "triton.json")])  # fmt: skip
        llm = main(["--target", srv.target, *common, "--output", str(tmp_path / "llm.json")])
    assert code == 0 and llm == 0
    triton_runs = json.loads((tmp_path / "triton.json").read_text())["runs"]
    llm_runs = json.loads((tmp_path / "llm.json").read_text())["runs"]
    for t, r in zip(triton_runs, llm_runs, strict=True):
        assert t["completed"] == 8 and t["failed"] == 0
        assert t["output_tokens"] == r["output_tokens"] == 8 * 16  # counted per response, end_id=-1 honoured
        assert t["input_tokens"] == r["input_tokens"]
        assert 0 < t["server_ttft_ms"]["p50"] <= t["ttft_ms"]["p50"]  # from the *_time_ns outputs


def test_llama_server_comparison_path_against_a_fake_binary(engine_dir: Path, tmp_path: Path) -> None:
    """serving_bench --llama-server end to end but for llama.cpp: LlamaServer starts tests/fake_llama_server.py as
    its binary, and the same load tester drives both servers in interleaved rounds (the fake answers at once)."""
    from rich.console import Console

    from benchmarks.serving_bench import _compare, _compare_lines

    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).parent / "fake_llama_server.py"} "$@"\n')
    binary.chmod(0o755)
    args = argparse.Namespace(llama_server=str(binary), gguf="/models/tiny.gguf", engine=str(engine_dir),
                              compare_concurrency=2, rounds=2, input_len=16, output_len=4)  # fmt: skip
    with running_server(engine_dir) as srv:
        rounds, system_info = _compare(srv.target, os.getpid(), args, Console(stderr=True))
    assert len(rounds) == 2 and system_info == "n_threads = 2 | CPU : FAKE = 1 |"  # read from its log
    for ours, peer in rounds:  # _compare checked the counts; these are the same work on both
        assert ours["output_tokens"] == peer["output_tokens"] == 4 * 4
        assert ours["input_tokens"] == peer["input_tokens"] == 4 * 16
        assert peer["server_ttft_ms"]["p50"] == 12.5  # the fake's timings reached the summary
    lines = _compare_lines(rounds, args, system_info)
    assert any(line.startswith("| llama-server (HTTP) |") for line in lines) and lines[-1].startswith("| ratio |")
    assert any("`n_threads = 2 | CPU : FAKE = 1 |`" in line and "kernel path" in line for line in lines)


@pytest.mark.slow
def test_triton_and_llm_v1_serve_the_same_load(smollm2_engine_dir: Path) -> None:
    """The real model, the service as a process, the load tester in its own, both protocols in interleaved runs:
    every request served, the same tokens. (How their throughputs compare is measured, not asserted:
    benchmarks/triton_bench.py writes it to docs/benchmarks.md; a busy box moves it far from 1.)"""
    import argparse

    from benchmarks.triton_bench import compare

    args = argparse.Namespace(
        concurrency=[4], num_requests=8, input_len=64, output_len=32, rounds=3, kv_cache_memory="512MiB"
    )
    (level,) = compare(str(smollm2_engine_dir), args)["levels"]
    assert level["llm_failed"] == level["triton_failed"] == 0
    assert level["llm_tokens"] == level["triton_tokens"] == {8 * 32}
    assert level["ratio"] > 0  # both measured
