"""The Triton front door against llm.v1: the same load-test sweep over both protocols of one service.

    python -m benchmarks.triton_bench --engine engines/smollm2-135m [--concurrency 1,8] [--rounds 3] [--write]

Starts `python -m service --engine ... --triton-port P`, then runs `python -m clients.loadtest` (its own process,
as a user would) over llm.v1 and over Triton's protocol (`--protocol triton --model ensemble`, text prompts from
the engine's tokenizer, `end_id=-1` for ignore-EOS), interleaved, --rounds times, and compares the median output
token throughput per concurrency level. The work is the same: the same synthetic prompts (seeded), exactly
--output-len tokens each, every run (round and protocol) with prompts of its own, so the service's prefix cache
serves neither protocol the other's prompts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (
    Rounds,
    add_sweep_args,
    bench_parser,
    free_port,
    joined,
    machine_line,
    publish,
    running_service,
)


def sweep(target: str, engine: str, protocol: str, args: argparse.Namespace, out: Path, seed: int) -> list[dict]:
    cmd = [
        sys.executable, "-m", "clients.loadtest", "--target", target, "--tokenizer", engine,
        "--concurrency", joined(args.concurrency), "--num-requests", str(args.num_requests),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos", "--warmup", "2",
        "--seed", str(seed), "--output", str(out),
    ]  # fmt: skip
    if protocol == "triton":
        cmd += ["--protocol", "triton", "--model", "ensemble"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    return json.loads(out.read_text())["runs"]


def compare(engine: str, args: argparse.Namespace) -> dict:
    triton_port = free_port()
    results: dict[str, list[list[dict]]] = {"llm": [], "triton": []}
    with running_service(engine, args.kv_cache_memory, "--triton-port", str(triton_port)) as (_, port):
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                for j, (protocol, target) in enumerate((("llm", f"127.0.0.1:{port}"),
                                                        ("triton", f"127.0.0.1:{triton_port}"))):  # fmt: skip
                    out = Path(tmp) / f"{protocol}{i}.json"
                    results[protocol].append(sweep(target, engine, protocol, args, out, seed=2 * i + j))
    table = []
    for j, level in enumerate(args.concurrency):
        row = {"concurrency": level}
        for protocol, rounds in results.items():
            runs = [r[j] for r in rounds]
            tok = Rounds.of(runs, "output_throughput_tok_s")
            row[protocol] = tok.median
            row[f"{protocol}_all"] = [round(v, 1) for v in tok.values]
            row[f"{protocol}_failed"] = sum(r["failed"] for r in runs)
            row[f"{protocol}_tokens"] = {r["output_tokens"] for r in runs}
        row["ratio"] = row["triton"] / row["llm"]
        table.append(row)
    return {"levels": table}


def main() -> None:
    p = bench_parser(__doc__, "triton")
    add_sweep_args(p, concurrency="1,8", output_len=64, rounds=3)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="1GiB")
    args = p.parse_args()
    result = compare(args.engine, args)
    lines = [
        "## Triton front door against llm.v1 (`python -m benchmarks.triton_bench`)",
        "",
        f"Command: `python -m benchmarks.triton_bench --engine {args.engine} --concurrency {joined(args.concurrency)} "
        f"--rounds {args.rounds} --write`  ",
        f"Machine: {machine_line()}. One `python -m service --triton-port P` (native engine); the load tester runs "
        f"in its own process, {args.num_requests} requests per level of {args.input_len}-token synthetic prompts and "
        f"exactly {args.output_len} output tokens, over llm.v1 and over Triton's protocol (`--protocol triton "
        f"--model ensemble`: tritonclient's sync streaming client, one stream per request), interleaved, "
        f"{args.rounds} rounds, every run with prompts of its own (no prefix-cache hits across runs); the table gives "
        "the median output tokens/s (every round in brackets). Rounds "
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
