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
    lines = _compare_lines(rounds, args, "CPU : AVX2 = 1 |")
    assert any("`CPU : AVX2 = 1 |`" in line for line in lines)
    assert "| ours (gRPC) | 190.0 [200.0, 180.0] | 650 | 75.0 | 0.10 |" in lines
    assert "| llama-server (HTTP) | 95.0 [100.0, 90.0] | 6500 | 130.0 | 0.10 |" in lines
    assert lines[-1].startswith("| ratio | **2.00x** (target >= 2x, stretch 2.5x) | **0.10x** (target <= 0.33x)")
    assert _exact(rounds[0][1], 32, args, "llama-server") is rounds[0][1]
    short = {**_summary(1, 1, 1), "output_tokens": 32 * 128 - 5}  # a request that stopped early: not the same work
    with pytest.raises(RuntimeError, match="llama-server"):
        _exact(short, 32, args, "llama-server")


def _cache(root, cpu: int, index: int, level: int, kind: str, size: str, shared: str) -> None:
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, text in (("level", str(level)), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(text + "\n")


def test_last_level_cache_sums_the_top_level_instances(tmp_path) -> None:
    from service.engine import roofline

    for cpu in range(4):  # two sockets of two cores: private L2s, one L3 per socket
        _cache(tmp_path, cpu, 0, 1, "Instruction", "64K", str(cpu))
        _cache(tmp_path, cpu, 1, 2, "Unified", "2048K", str(cpu))
        _cache(tmp_path, cpu, 2, 3, "Unified", "32M", "0-1" if cpu < 2 else "2-3")
    assert roofline.last_level_cache_bytes(str(tmp_path)) == 2 * 32 << 20
    assert roofline.last_level_cache_bytes(str(tmp_path / "none")) > 0  # sysconf's L3, else the fallback


def test_read_buffer_is_at_least_four_times_the_last_level_cache() -> None:
    from service.engine import roofline

    row = roofline.GEMV_COLS * 4
    for llc in (1 << 20, 32 << 20, 480 << 20, (480 << 20) + 12345):
        size = roofline.read_buffer_bytes(llc)
        assert size >= 4 * llc and size >= roofline.MIN_READ_BYTES and size % row == 0
        assert size < max(4 * llc, roofline.MIN_READ_BYTES) + row  # rounded up to whole rows, no more
    assert roofline.read_buffer_bytes() >= 4 * roofline.last_level_cache_bytes()  # this machine's
    assert "4x the" in roofline.read_method(3) and "best of 3" in roofline.read_method(3)


def test_read_bandwidth_uses_the_sized_buffer_and_returns_a_rate(monkeypatch) -> None:
    """The figure itself is not asserted (timings are noisy); only that it is a rate, over the buffer sized for it."""
    import math

    from service.engine import roofline

    calls = []

    def small_buffer() -> int:
        calls.append(1 << 20)
        return 1 << 20

    monkeypatch.setattr(roofline, "read_buffer_bytes", small_buffer)
    gbs = roofline.read_bandwidth_gbs(runs=2)
    assert calls == [1 << 20] and math.isfinite(gbs) and gbs > 0
    assert math.isfinite(roofline.gemm_gflops(runs=1, n=64)) and roofline.gemm_gflops(runs=1, n=64) > 0


def test_kernel_path_names_the_backend() -> None:
    from benchmarks.common import kernel_path
    from service.engine.kernels.backend import BACKEND

    assert kernel_path().startswith(BACKEND.name)


def test_system_info_is_read_from_a_llama_log() -> None:
    from benchmarks.llamacpp_peer import system_info_of

    log = "build: 1 (0c1e570)\nmain: system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 |\n"
    assert system_info_of(log) == "n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 |"
    assert system_info_of("no such line\n") == ""
