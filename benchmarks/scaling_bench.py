"""Scaling curves of the native engine, per weight format, beside the ceilings measured in the same run.

    python -m benchmarks.scaling_bench --engine engines/smollm2-135m engines/smollm2-fp32 [--write]

- prefill tok/s against prompt length (128 .. 4096): EngineCore with its real chunked prefill (max_num_tokens
  per step), time to the first token of one request;
- TPOT against context length (128 .. 4096) at batch 1 and 16: the model runner's decode step over B sequences
  whose KV already holds `context` tokens each (random values: the time does not depend on them; median of 8
  steps after 2 untimed ones);
against the fp32 GEMM rate (prefill) and the bandwidth roofline of the bytes a step reads (decode), both ceilings
measured in the same run (service/engine/roofline.py: best of 3; the read is a GEMV over >= 4x the last-level cache).
Plots: docs/img/scaling/. Engines need max_seq_len >= the longest length (build with --max-seq-len 8192).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    DOC,
    bench_parser,
    ceilings_line,
    gemm_gflops,
    kernel_path,
    machine_line,
    publish,
    read_bandwidth_gbs,
)
from benchmarks.engine_bench import kv_bytes, prefill_flops, weight_bytes_per_step
from build_engine.spec import load_engine_config
from service.engine.core import EngineCore
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner
from service.request import GenerateRequest, SamplingParams

IMG = DOC.parent / "img" / "scaling"
LENGTHS = (128, 256, 512, 1024, 2048, 4096)
BATCHES = (1, 16)
WARMUP_STEPS = 2  # decode steps run before the timed ones at each context


def prefill_curve(engine: str, lengths: tuple[int, ...], runs: int) -> dict[int, float]:
    """Prompt length -> prefill seconds (first token of one request, chunked as the engine does)."""
    blocks = -(-max(lengths) // load_engine_config(engine).limits.kv_block_size) + 2
    core = EngineCore(engine, num_kv_blocks=blocks, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    vocab = core.config.arch.vocab_size
    out = {}
    for n in lengths:
        times = []
        for _ in range(runs):
            gen = GenerateRequest("p", rng.integers(100, vocab, size=n).tolist(), SamplingParams(max_tokens=1))
            start = time.perf_counter()
            core.generate([gen])
            times.append(time.perf_counter() - start)
        out[n] = statistics.median(times)
    return out


def decode_curve(engine: str, contexts: tuple[int, ...], batch: int, steps: int = 8) -> dict[int, float]:
    """Context length -> seconds per decode step of `batch` sequences with that much KV each."""
    cfg = load_engine_config(engine)
    bs = cfg.limits.kv_block_size
    per_seq = -(-(max(contexts) + WARMUP_STEPS + steps) // bs)
    runner = NumpyRunner(engine, num_kv_blocks=batch * per_seq, config=cfg)
    rng = np.random.default_rng(1)
    # The KV arrays hold random values, not a prefill's: a step's time does not depend on them, and prefilling
    # 16 x 4096 tokens per context would take most of the benchmark's time.
    for cache in (runner.kv_cache.k, runner.kv_cache.v):  # [L, num_blocks, block_size, KV, hd] float32
        for layer in cache:
            layer[...] = rng.standard_normal(layer.shape, dtype=np.float32)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    out = {}
    for ctx in contexts:
        times = []
        for s in range(WARMUP_STEPS + steps):  # the first steps at a context, untimed: caches, pages, the pool
            chunks = [SeqChunk([int(rng.integers(100, 1000))], ctx + s, t) for t in tables]
            start = time.perf_counter()
            runner.execute(ForwardBatch.from_chunks(chunks, bs))
            times.append(time.perf_counter() - start)
        out[ctx] = statistics.median(times[WARMUP_STEPS:])
    return out


def _plot(curves: dict[str, dict], ylabel: str, title: str, path: Path, ceiling: dict[str, dict] | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, values in curves.items():
        xs = sorted(values)
        ax.plot(xs, [values[x] for x in xs], marker="o", label=label)
    for label, values in (ceiling or {}).items():
        xs = sorted(values)
        ax.plot(xs, [values[x] for x in xs], linestyle="--", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = bench_parser(__doc__, "scaling", engines=True)
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    print("measuring ceilings ...", file=sys.stderr)
    gemm = gemm_gflops(3)
    bandwidth = read_bandwidth_gbs(3)
    prefill, decode, rooflines, labels = {}, {b: {} for b in BATCHES}, {b: {} for b in BATCHES}, {}
    for engine in args.engine:
        label = load_engine_config(engine).weight_format
        labels[engine] = label
        print(f"{label}: prefill ...", file=sys.stderr)
        prefill[label] = prefill_curve(engine, lengths, args.runs)
        probe = NumpyRunner(engine, num_kv_blocks=1)
        weights = weight_bytes_per_step(probe)
        flops = {n: prefill_flops(probe, n) for n in lengths}
        for b in BATCHES:
            print(f"{label}: decode at batch {b} ...", file=sys.stderr)
            decode[b][label] = decode_curve(engine, lengths, b)
            rooflines[b][f"{label} roofline"] = {
                c: (weights + b * kv_bytes(probe, c)) / (bandwidth * 1e9) * 1e3 for c in lengths
            }
        prefill[label] = {n: (t, flops[n] / t / 1e9) for n, t in prefill[label].items()}
    _plot({k: {n: n / v[0] for n, v in c.items()} for k, c in prefill.items()}, "prefill tok/s",
          f"prefill (GEMM ceiling {gemm:.0f} GFLOP/s)", IMG / "prefill.png")  # fmt: skip
    for b in BATCHES:
        _plot({k: {c: t * 1e3 for c, t in v.items()} for k, v in decode[b].items()}, "ms per decode step",
              f"decode step, batch {b}", IMG / f"decode_batch{b}.png", rooflines[b])  # fmt: skip
    lines = [
        "## Scaling curves (`python -m benchmarks.scaling_bench`)",
        "",
        f"Command: `python -m benchmarks.scaling_bench --engine {' '.join(args.engine)}"
        + (f" --lengths {args.lengths}" if lengths != LENGTHS else "")
        + (f" --runs {args.runs}" if args.runs != 3 else "")
        + " --write`  ",
        f"Machine: {machine_line()}. Kernel path: {kernel_path()}. {ceilings_line(gemm, bandwidth, 3)}",
        "",
        "Prefill of one request (EngineCore, chunked at max_num_tokens), tok/s and x the GEMM rate:",
        "",
        "| Prompt tokens | " + " | ".join(prefill) + " |",
        "|---|" + "---|" * len(prefill),
    ]
    for n in lengths:
        lines.append(
            f"| {n} | " + " | ".join(f"{n / v[n][0]:.0f} ({v[n][1] / gemm:.2f}x)" for v in prefill.values()) + " |"
        )
    for b in BATCHES:
        lines += ["", f"Decode step at batch {b} (the model runner; KV holding random values), ms (x the roofline "
                  f"of the bytes read: weights + {b} x KV):", "",
                  "| Context | " + " | ".join(decode[b]) + " |", "|---|" + "---|" * len(decode[b])]  # fmt: skip
        for c in lengths:
            cells = []
            for label, v in decode[b].items():
                roof = rooflines[b][f"{label} roofline"][c]
                cells.append(f"{v[c] * 1e3:.1f} ({roof / (v[c] * 1e3):.2f}x)")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "![prefill](img/scaling/prefill.png) ![decode batch 1](img/scaling/decode_batch1.png) "
              "![decode batch 16](img/scaling/decode_batch16.png)"]  # fmt: skip
    publish("scaling_bench", lines, args.write)


if __name__ == "__main__":
    main()
