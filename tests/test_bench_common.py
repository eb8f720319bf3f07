"""The benchmarks' shared helpers (benchmarks/common.py) and the llama-server comparison's table, without a server."""

from __future__ import annotations

import argparse
import os

import pytest

from benchmarks.common import (
    CpuMeter,
    CpuUse,
    Rounds,
    add_sweep_args,
    bench_parser,
    int_list,
    joined,
    process_cpu_s,
    wait_for_quiet,
)


def test_sweep_arguments_parse_levels() -> None:
    p = bench_parser("doc", "serving")
    add_sweep_args(p, concurrency="1,8", output_len=64, rounds=3)
    args = p.parse_args([])
    assert (args.engine, args.concurrency, args.input_len, args.output_len, args.rounds, args.write) == (
        "engines/smollm2-135m", [1, 8], 128, 64, 3, False)  # fmt: skip
    assert p.parse_args(["--concurrency", "4,16,32"]).concurrency == [4, 16, 32]
    assert joined([4, 16, 32]) == "4,16,32"
    for bad in ("", "4,x", "0,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_list(bad)
    several = bench_parser("doc", "engine", engines=True).parse_args(["--engine", "a", "b"])
    assert several.engine == ["a", "b"]


def test_rounds_take_medians_of_summaries() -> None:
    runs = [{"output_throughput_tok_s": v, "ttft_ms": {"p50": t}} for v, t in ((80.9, 10), (100.3, 30), (85.8, 20))]
    tok, ttft = Rounds.of(runs, "output_throughput_tok_s"), Rounds.of(runs, "ttft_ms.p50")
    assert (tok.median, ttft.median) == (85.8, 20.0)
    assert tok.spread() == "80.9, 100.3, 85.8"  # in round order


def test_cpu_meter_counts_this_process() -> None:
    meter = CpuMeter([os.getpid(), None]).start()  # a pid of None (a server not started) is skipped
    spent = process_cpu_s()
    while process_cpu_s() - spent < 0.05:  # burn 50 ms of CPU: bounded by CPU time, not by a clock
        pass
    use = meter.stop()
    assert use.own > 0 and use.watched == pytest.approx(use.own, abs=0.2)  # watching itself: the same process
    assert CpuUse(box=1.5, own=0.5, watched=0.75).others == 0.25
    assert CpuUse(box=0.5, own=0.5, watched=0.5).others == 0.0


def test_wait_for_quiet_without_time_returns_at_once() -> None:
    assert wait_for_quiet(0) < 0.5


def _summary(tok: float, ttft: float, tpot: float) -> dict:
    return {"output_throughput_tok_s": tok, "ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot}, "others_cores": 0.1,
            "completed": 32, "failed": 0, "input_tokens": 32 * 128, "output_tokens": 32 * 128, "errors": []}  # fmt: skip


def test_llama_server_comparison_table() -> None:
    from benchmarks.serving_bench import _compare_lines, _exact

    args = argparse.Namespace(compare_concurrency=16, input_len=128, output_len=128)
    rounds = [(_summary(200, 600, 80), _summary(100, 6000, 120)), (_summary(180, 700, 70), _summary(90, 7000, 140))]
    lines = _compare_lines(rounds, args)
    assert "| ours (gRPC) | 190.0 [200.0, 180.0] | 650 | 75.0 | 0.10 |" in lines
    assert "| llama-server (HTTP) | 95.0 [100.0, 90.0] | 6500 | 130.0 | 0.10 |" in lines
    assert lines[-1].startswith("| ratio | **2.00x** (floor 2x, stretch 3x) | **0.10x**")
    assert _exact(rounds[0][1], 32, args, "llama-server") is rounds[0][1]
    short = {**_summary(1, 1, 1), "output_tokens": 32 * 128 - 5}  # a request that stopped early: not the same work
    with pytest.raises(RuntimeError, match="llama-server"):
        _exact(short, 32, args, "llama-server")
