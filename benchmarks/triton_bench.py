"""The Triton front door against llm.v1: the same load-test sweep over both protocols of one service.

    python -m benchmarks.triton_bench --engine engines/smollm2-135m [--concurrency 1,8] [--rounds 3] [--write]

Starts `python -m service --engine ... --triton-port P`, then runs `python -m clients.loadtest` (its own process,
as a user would) over llm.v1 and over Triton's protocol (`--protocol triton --model ensemble`, text prompts from
the engine's tokenizer, `end_id=-1` for ignore-EOS), interleaved, --rounds times, and compares the median output
token throughput per concurrency level. The work is the same: the same synthetic prompts (seeded), exactly
--output-len tokens each.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import free_port, machine_line, publish, start_service


def sweep(target: str, engine: str, protocol: str, args: argparse.Namespace, out: Path) -> list[dict]:
    cmd = [
        sys.executable, "-m", "clients.loadtest", "--target", target, "--tokenizer", engine,
        "--concurrency", args.concurrency, "--num-requests", str(args.num_requests),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos", "--warmup", "2",
        "--output", str(out),
    ]  # fmt: skip
    if protocol == "triton":
        cmd += ["--protocol", "triton", "--model", "ensemble"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    return json.loads(out.read_text())["runs"]


def compare(engine: str, args: argparse.Namespace) -> dict:
    port, triton_port = free_port(), free_port()
    proc = start_service(engine, port, args.kv_cache_memory, "--triton-port", str(triton_port))
    results: dict[str, list[list[dict]]] = {"llm": [], "triton": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                for protocol, target in (("llm", f"127.0.0.1:{port}"), ("triton", f"127.0.0.1:{triton_port}")):
                    results[protocol].append(sweep(target, engine, protocol, args, Path(tmp) / f"{protocol}{i}.json"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    levels = [int(c) for c in args.concurrency.split(",")]
    table = []
    for j, level in enumerate(levels):
        row = {"concurrency": level}
        for protocol, rounds in results.items():
            runs = [r[j] for r in rounds]
            row[protocol] = statistics.median(r["output_throughput_tok_s"] for r in runs)
            row[f"{protocol}_all"] = [round(r["output_throughput_tok_s"], 1) for r in runs]
            row[f"{protocol}_failed"] = sum(r["failed"] for r in runs)
            row[f"{protocol}_tokens"] = {r["output_tokens"] for r in runs}
        row["ratio"] = row["triton"] / row["llm"]
        table.append(row)
    return {"levels": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--write", action="store_true", help="regenerate the triton section of docs/benchmarks.md")
    args = p.parse_args()
    result = compare(args.engine, args)
    lines = [
        "## Triton front door against llm.v1 (`python -m benchmarks.triton_bench`)",
        "",
        f"Command: `python -m benchmarks.triton_bench --engine {args.engine} --concurrency {args.concurrency} "
        f"--rounds {args.rounds} --write`  ",
        f"Machine: {machine_line()}. One `python -m service --triton-port P` (native engine); the load tester runs "
        f"in its own process, {args.num_requests} requests per level of {args.input_len}-token synthetic prompts and "
        f"exactly {args.output_len} output tokens, over llm.v1 and over Triton's protocol (`--protocol triton "
        f"--model ensemble`: tritonclient's sync streaming client, one stream per request), interleaved, "
        f"{args.rounds} rounds; the table gives the median output tokens/s (every round in brackets). Rounds "
        "are interleaved so that a busy period of a shared machine hits both protocols alike; single rounds vary "
        "widely there, the medians are the comparison.",
        "",
        "| Concurrency | llm.v1 tok/s | Triton tok/s | Triton / llm.v1 | failed (llm.v1 / Triton) |",
        "|---|---|---|---|---|",
    ]
    for r in result["levels"]:
        lines.append(
            f"| {r['concurrency']} | {r['llm']:.1f} {r['llm_all']} | {r['triton']:.1f} {r['triton_all']} | "
            f"{r['ratio']:.2f} | {r['llm_failed']} / {r['triton_failed']} |"
        )
    publish("triton_bench", lines, args.write)


if __name__ == "__main__":
    main()
