"""Single-request speed of the native engine against this machine's ceilings, measured in one run.

    python -m benchmarks.engine_bench --engine engines/smollm2-135m [--runs 5] [--write]

Prefill: one prompt of --prompt-len tokens in one step (logits for the last token only).
Decode: --decode-tokens steps of one token each after a --decode-context-token prompt.
Ceilings: fp32 GEMM rate (2048^3) and read bandwidth (the best of numpy sums and BLAS GEMVs over 576 MB).
Ratios: decode roofline = bytes a step must read (weights + KV) / bandwidth; prefill = achieved GFLOP/s / GEMM.
Where the time goes: one extra run with every named kernel of the runner wrapped in a timer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from benchmarks.common import gemm_gflops, machine_line, median_time, publish, read_bandwidth_gbs
from build_engine.spec import load_engine_config
from service.engine.runners import numpy_runner
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner

CATEGORIES = ("matmuls", "attention", "norms/RoPE/SiLU", "LM head", "other (embedding, Python)")


def weight_bytes_per_step(runner: NumpyRunner) -> int:
    """Bytes every decode step streams: all layer matrices, the LM head and the norms (one embedding row)."""
    total = sum(w.nbytes for layer in runner.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return total + runner.lm_head.nbytes + runner.final_norm.nbytes


def kv_bytes(runner: NumpyRunner, context: int) -> int:
    a = runner.config.arch
    return 2 * a.num_hidden_layers * context * a.kv_size * 4


def prefill_flops(runner: NumpyRunner, n: int) -> float:
    """Matmul FLOPs of the layers for n tokens, causal attention (QK^T and PV), and one LM-head row."""
    a = runner.config.arch
    layer_params = sum(w.size for w in (runner.layers[0].qkv, runner.layers[0].o, runner.layers[0].gate_up))
    layer_params += runner.layers[0].down.size
    attn = 4 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * n * (n + 1) / 2
    return 2 * a.num_hidden_layers * layer_params * n + attn + 2 * runner.lm_head.size


class KernelTimer:
    """Wraps the runner's named kernels with timers (only for the breakdown run)."""

    def __init__(self, runner: NumpyRunner) -> None:
        self.runner = runner
        self.totals: dict[str, float] = defaultdict(float)
        self._saved: dict[str, Callable] = {}

    def _wrap(self, fn: Callable, category: Callable[..., str]) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.totals[category(*args)] += time.perf_counter() - start
            return out

        return timed

    def __enter__(self) -> KernelTimer:
        lm_head = self.runner.lm_head
        kernels = {
            "linear": lambda x, w: "LM head" if w is lm_head else "matmuls",
            "rms_normalize": lambda *a: "norms/RoPE/SiLU",
            "apply_rope": lambda *a: "norms/RoPE/SiLU",
            "silu_mul": lambda *a: "norms/RoPE/SiLU",
        }
        for name, category in kernels.items():
            self._saved[name] = getattr(numpy_runner, name)
            setattr(numpy_runner, name, self._wrap(self._saved[name], category))
        for method in ("_attention", "_write_kv"):  # gathers, the attention kernel, and the KV writes
            setattr(self.runner, method, self._wrap(getattr(self.runner, method), lambda *a: "attention"))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(numpy_runner, name, fn)
        for method in ("_attention", "_write_kv"):
            delattr(self.runner, method)


def prefill_once(runner: NumpyRunner, prompt: list[int]) -> None:
    runner.execute(
        ForwardBatch.from_chunks([SeqChunk(prompt, 0, list(range(runner.num_kv_blocks)))], runner.block_size)
    )


def decode_run(runner: NumpyRunner, prompt: list[int], steps: int) -> list[float]:
    """Per-step seconds of `steps` single-token decode steps after prefilling `prompt`."""
    blocks = list(range(runner.num_kv_blocks))
    prefill_once(runner, prompt)
    token, times = prompt[-1], []
    for i in range(steps):
        start = time.perf_counter()
        logits = runner.execute(
            ForwardBatch.from_chunks([SeqChunk([token], len(prompt) + i, blocks)], runner.block_size)
        )
        times.append(time.perf_counter() - start)
        token = int(np.argmax(logits[0]))
    return times


def breakdown(runner: NumpyRunner, fn: Callable[[], object]) -> dict[str, float]:
    with KernelTimer(runner) as timer:
        start = time.perf_counter()
        fn()
        total = time.perf_counter() - start
    shares = {c: timer.totals.get(c, 0.0) for c in CATEGORIES}
    shares["other (embedding, Python)"] = total - sum(shares.values())
    return {c: v / total for c, v in shares.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-context", type=int, default=16, help="prompt tokens before the decode steps")
    p.add_argument("--write", action="store_true", help="write the results into docs/benchmarks.md")
    args = p.parse_args()

    config = load_engine_config(args.engine)
    tokens = max(args.prompt_len, args.decode_context + args.decode_tokens)
    runner = NumpyRunner(args.engine, num_kv_blocks=-(-tokens // config.limits.kv_block_size), config=config)
    rng = np.random.default_rng(0)
    vocab = runner.config.arch.vocab_size
    prompt = rng.integers(100, vocab, size=args.prompt_len).tolist()
    short = prompt[: args.decode_context]

    print("measuring ceilings ...", file=sys.stderr)
    gemm = gemm_gflops(args.runs)
    bw = read_bandwidth_gbs(args.runs)
    bandwidth = max(bw.values())

    print("measuring prefill ...", file=sys.stderr)
    prefill_s = median_time(lambda: prefill_once(runner, prompt), args.runs)
    print("measuring decode ...", file=sys.stderr)
    decode_runs = [statistics.median(decode_run(runner, short, args.decode_tokens)) for _ in range(args.runs)]
    decode_s = statistics.median(decode_runs)
    prefill_share = breakdown(runner, lambda: prefill_once(runner, prompt))
    decode_share = breakdown(runner, lambda: decode_run(runner, short, args.decode_tokens))

    flops = prefill_flops(runner, args.prompt_len)
    prefill_gflops = flops / prefill_s / 1e9
    mean_ctx = args.decode_context + args.decode_tokens / 2
    step_bytes = weight_bytes_per_step(runner) + kv_bytes(runner, int(mean_ctx))
    roofline_s = step_bytes / (bandwidth * 1e9)

    lines = [
        "## Native engine, single request (`python -m benchmarks.engine_bench`)",
        "",
        f"Command: `python -m benchmarks.engine_bench --engine {args.engine} --runs {args.runs} --write`  ",
        f"Machine: {machine_line()}. Medians of {args.runs} runs; ceilings measured in the same run.",
        "",
        "| Ceiling | Value |",
        "|---|---|",
        f"| fp32 GEMM 2048^3 | {gemm:.0f} GFLOP/s |",
        f"| read bandwidth: numpy sum 1 thread / 2 threads / GEMV [N,1024] / GEMV [N,576] | "
        f"{bw['sum_1_thread']:.1f} / {bw['sum_2_threads']:.1f} / {bw['gemv_1024']:.1f} / {bw['gemv_576']:.1f} GB/s "
        f"(ceiling used: the best, {bandwidth:.1f}) |",
        f"| bytes per decode step (weights + mean KV) | {step_bytes / 1e6:.0f} MB -> roofline "
        f"{roofline_s * 1e3:.1f} ms/token ({1 / roofline_s:.0f} tok/s) |",
        "",
        "| Phase | Measured | Ceiling | Ratio | Target |",
        "|---|---|---|---|---|",
        f"| prefill, {args.prompt_len}-token prompt | {prefill_s * 1e3:.0f} ms = "
        f"{args.prompt_len / prefill_s:.0f} tok/s, "
        f"{prefill_gflops:.0f} GFLOP/s | GEMM {gemm:.0f} GFLOP/s | **{prefill_gflops / gemm:.2f}x** | >= 0.5x |",
        f"| decode, {args.decode_tokens} tokens | {decode_s * 1e3:.1f} ms/token = {1 / decode_s:.1f} tok/s | "
        f"roofline {roofline_s * 1e3:.1f} ms | **{roofline_s / decode_s:.2f}x** | >= 0.4x |",
        "",
        "Where the time goes (share of the step, one instrumented run):",
        "",
        "| Part | Prefill | Decode |",
        "|---|---|---|",
    ]
    for c in CATEGORIES:
        lines.append(f"| {c} | {prefill_share[c] * 100:.0f}% | {decode_share[c] * 100:.0f}% |")
    lines += [
        "",
        f"Prefill FLOPs counted: 2 x layer parameters x tokens + causal attention + one LM-head row = "
        f"{flops / 1e9:.1f} GFLOP. Decode runs: {', '.join(f'{t * 1e3:.1f}' for t in decode_runs)} ms/token.",
    ]
    publish("engine_bench", lines, args.write)


if __name__ == "__main__":
    main()
