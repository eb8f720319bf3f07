"""In-flight batching at the engine level: throughput, TTFT and TPOT against concurrency, in one run.

    python -m benchmarks.batch_bench --engine engines/smollm2-135m [--concurrency 1,4,16,32,64] [--write]

Closed loop per concurrency level C: C requests in flight (input --input-len random tokens, exactly
--output-len output tokens, ignore_eos), a new one submitted as soon as one finishes, --rounds x C requests in
all. Output throughput = output tokens / wall time of the level (ramp-up and ramp-down included).
Also measured: steady decode throughput (median over steps without prefill tokens), the share of step time
spent in attention, and the GEMM-bound limit (measured fp32 GEMM rate / (2 x parameters) tokens per second).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from benchmarks.common import add_sweep_args, bench_parser, gemm_gflops, joined, machine_line, publish
from service.engine.core import EngineCore
from service.request import GenerateRequest, SamplingParams


def run_level(engine: EngineCore, concurrency: int, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    vocab = engine.config.arch.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    total = args.rounds * concurrency
    submitted = finished = generated = 0
    timings, decode_rates = [], []
    attention_s = [0.0]
    runner = engine.runner
    real_attention = runner._attention

    def timed_attention(*a):
        start = time.perf_counter()
        out = real_attention(*a)
        attention_s[0] += time.perf_counter() - start
        return out

    runner._attention = timed_attention
    step_s = 0.0
    start = time.perf_counter()
    try:
        while finished < total:
            while submitted < total and submitted - finished < concurrency:
                prompt = rng.integers(100, vocab, size=args.input_len).tolist()
                engine.add_request(GenerateRequest(f"c{concurrency}-{submitted}", prompt, params))
                submitted += 1
            for out in engine.step():
                generated += len(out.new_token_ids)
                if out.finished:
                    finished += 1
                    timings.append(out.timing)
            s = engine.last_step
            step_s += s.step_ms / 1e3
            if s.num_prefill_tokens == 0 and s.num_decode_tokens == concurrency:
                decode_rates.append(s.num_decode_tokens / (s.step_ms / 1e3))
    finally:
        del runner._attention
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": total,
        "wall_s": wall,
        "output_tok_s": generated / wall,
        "decode_tok_s": statistics.median(decode_rates) if decode_rates else float("nan"),
        "ttft_ms": statistics.mean(t.ttft_ms for t in timings),
        "tpot_ms": statistics.mean(t.tpot_ms for t in timings),
        "attention_share": attention_s[0] / step_s,
    }


def main() -> None:
    p = bench_parser(__doc__, "batch")
    add_sweep_args(p, rounds=2, rounds_help="requests per level = rounds x concurrency")
    args = p.parse_args()
    levels = args.concurrency
    tokens = max(levels) * (args.input_len + args.output_len)
    engine = EngineCore(args.engine, num_kv_blocks=tokens // 16 + 64, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    print("measuring the GEMM rate ...", file=sys.stderr)
    gemm = gemm_gflops()
    limit = gemm * 1e9 / (2 * engine.config.arch.num_parameters())
    warm = GenerateRequest("warmup", rng.integers(100, 1000, size=16).tolist(), SamplingParams(max_tokens=4))
    engine.generate([warm])
    results = []
    for c in levels:
        print(f"concurrency {c} ...", file=sys.stderr)
        results.append(run_level(engine, c, args, rng))
    single = 1e3 / results[0]["tpot_ms"] if levels[0] == 1 else float("nan")
    lines = [
        "## In-flight batching, engine level (`python -m benchmarks.batch_bench`)",
        "",
        f"Command: `python -m benchmarks.batch_bench --engine {args.engine} --concurrency {joined(levels)} "
        f"--rounds {args.rounds} --write`  ",
        f"Machine: {machine_line()}. {args.input_len} input / {args.output_len} output tokens per request "
        f"(ignore_eos), closed loop, {args.rounds} x C requests per level, chunked prefill "
        f"({engine.sched_cfg.max_num_batched_tokens} tokens per step). Measured in the same run: fp32 GEMM "
        f"{gemm:.0f} GFLOP/s -> GEMM-bound limit {limit:.0f} tok/s "
        f"(2 x {engine.config.arch.num_parameters() / 1e6:.1f}M FLOPs per token).",
        "",
        "| Concurrency | Output tok/s | x single-request decode | x GEMM-bound limit | Steady decode tok/s | "
        "Mean TTFT ms | Mean TPOT ms | Attention share of step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['concurrency']} | {r['output_tok_s']:.0f} | {r['output_tok_s'] / single:.1f}x | "
            f"{r['output_tok_s'] / limit:.2f}x | {r['decode_tok_s']:.0f} | {r['ttft_ms']:.0f} | {r['tpot_ms']:.1f} | "
            f"{r['attention_share'] * 100:.0f}% |"
        )
    lines += [
        "",
        f"Single-request decode throughput (1000 / TPOT at concurrency 1): {single:.1f} tok/s.",
    ]
    publish("batch_bench", lines, args.write)


if __name__ == "__main__":
    main()
