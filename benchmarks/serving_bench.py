"""Serving benchmark: start the service, sweep concurrency with the load tester, write docs/benchmarks.md.

    python -m benchmarks.serving_bench --engine engines/smollm2-135m [--concurrency 1,4,16,32,64] [--write]

Each level runs max(16, 3 x C) requests of --input-len synthetic tokens and exactly --output-len output tokens
(ignore_eos), closed loop, through real gRPC on 127.0.0.1. Plots go to docs/img/serving/.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from rich.console import Console

from benchmarks.common import DOC, free_port, machine_line, publish, start_service
from clients.loadtest import report
from clients.loadtest.__main__ import parse_args, run_sweep

IMG = DOC.parent / "img" / "serving"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--concurrency", default="1,4,16,32,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--write", action="store_true", help="regenerate the serving section of docs/benchmarks.md")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    port = free_port()
    proc = start_service(args.engine, port, args.kv_cache_memory)
    runs = []
    console = Console(stderr=True)
    try:
        for c in levels:
            lt_args = parse_args([
                "--target", f"127.0.0.1:{port}", "--concurrency", str(c), "--num-requests", str(max(16, 3 * c)),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
                "--warmup", "2", "--slo", "ttft_ms=2000", "tpot_ms=100",
            ])  # fmt: skip
            runs += asyncio.run(run_sweep(lt_args, console))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report.print_table(runs)
    by_c = {r["concurrency"]: r for r in runs}
    lines = [
        "## Serving: concurrency sweep through gRPC (`python -m benchmarks.serving_bench`)",
        "",
        f"Command: `python -m benchmarks.serving_bench --engine {args.engine} --concurrency {args.concurrency} --write`  ",
        f"Machine: {machine_line()}. The service runs as `python -m service` (native engine, defaults: 512-token steps, "
        f"prefix caching on); the load tester (`python -m clients.loadtest`, same machine, sharing its 2 cores) sends "
        f"{args.input_len}-token synthetic prompts and asks for exactly {args.output_len} tokens (ignore_eos), closed "
        "loop, max(16, 3 x C) requests per level after 2 warm-up requests. Latencies are client-side; the server's "
        "TTFT comes from each final message. Goodput SLO: TTFT <= 2000 ms and TPOT <= 100 ms.",
        "",
        "| Concurrency | Requests ok / failed | Output tok/s | x concurrency 1 | Req/s | Goodput req/s | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | ITL p50 ms | E2E p50 ms | Server TTFT p50 ms | TTFT gap p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = by_c[levels[0]]["output_throughput_tok_s"]
    for r in runs:
        lines.append(
            f"| {r['concurrency']} | {r['completed']} / {r['failed']} | {r['output_throughput_tok_s']:.1f} | "
            f"{r['output_throughput_tok_s'] / base:.2f}x | {r['request_throughput_rps']:.2f} | {r['goodput_rps']:.2f} | "
            f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} | "
            f"{r['itl_ms']['p50']:.1f} | {r['e2e_ms']['p50']:.0f} | {r['server_ttft_ms']['p50']:.0f} | "
            f"{r['ttft_gap_ms']['p50']:.2f} |"
        )
    if 16 in by_c and 1 in by_c:
        ratio = by_c[16]["output_throughput_tok_s"] / by_c[1]["output_throughput_tok_s"]
        lines += ["", f"Concurrency 16 against 1: **{ratio:.2f}x** output tokens/s (target >= 3.5x), "
                      f"{by_c[16]['failed']} failed requests."]  # fmt: skip
    plots = report.write_plots(IMG, runs)
    lines += ["", *(f"![{p.stem}](img/serving/{p.name})" for p in plots)]
    publish("serving_bench", lines, args.write)


if __name__ == "__main__":
    main()
