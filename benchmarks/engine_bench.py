"""Single-request speed of the native engine against this machine's ceilings, measured in one run.

    python -m benchmarks.engine_bench --engine engines/smollm2-135m [--runs 5] [--write]

Prefill: one prompt of --prompt-len tokens in one step (logits for the last token only).
Decode: --decode-tokens steps of one token each after a --decode-context-token prompt.
Ceilings (service/engine/roofline.py, measured in the same run): fp32 GEMM rate (2048^3) and read bandwidth (an
fp32 GEMV over a matrix of >= 4x the last-level cache), each the best of --runs.
Ratios: decode roofline = bytes a step must read (weights + KV) / bandwidth; prefill = achieved GFLOP/s / GEMM.
The report names our kernel path (BACKEND.name) and, with --llama-python, llama.cpp's system_info.
Where the time goes: one extra run with every named kernel of the runner wrapped in a timer (the Python loop: the
compiled all-decode call, kernels/decode_step.py, has no kernel to wrap, so its decode shares are the loop's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from benchmarks.common import (
    bench_parser,
    ceilings_line,
    gemm_gflops,
    kernel_path,
    machine_line,
    publish,
    read_bandwidth_gbs,
)
from build_engine.spec import load_engine_config
from service.engine.runners import numpy_runner
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner

LENGTHS = {"prompt_len": 512, "decode_tokens": 128, "decode_context": 16}  # the defaults (the report names others)
CATEGORIES = ("matmuls", "attention", "norms/RoPE/SiLU", "LM head", "other (embedding, Python)")


def weight_bytes_per_step(runner: NumpyRunner) -> int:
    """Bytes every decode step streams (NumpyRunner.weight_bytes: the step statistics count the same)."""
    return runner.weight_bytes


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
        # the kernel-by-kernel loop: the compiled all-decode call (kernels/decode_step.py) has no kernel to wrap
        self._fused, self.runner.decode_layers = self.runner.decode_layers, None
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
        self.runner.decode_layers = self._fused
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
    runner.bind_threads()
    with KernelTimer(runner) as timer:
        start = time.perf_counter()
        fn()
        total = time.perf_counter() - start
    shares = {c: timer.totals.get(c, 0.0) for c in CATEGORIES}
    shares["other (embedding, Python)"] = total - sum(shares.values())
    return {c: v / total for c, v in shares.items()}


@dataclass
class EngineRun:
    """One engine's measurements, gathered over interleaved rounds."""

    path: str
    runner: NumpyRunner
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.runner.weight_format


def _measure_round(run: EngineRun, prompt: list[int], short: list[int], steps: int) -> None:
    run.runner.bind_threads()  # this engine's thread setup (packed: own pool + 1-thread BLAS; fp32: BLAS threads)
    start = time.perf_counter()
    prefill_once(run.runner, prompt)
    run.prefill_s.append(time.perf_counter() - start)
    run.decode_s.append(statistics.median(decode_run(run.runner, short, steps)))


def _peer_round(peer: dict | None, llama_python: str | None, gguf: str, args: argparse.Namespace) -> dict | None:
    if llama_python is None:
        return None
    from benchmarks.llamacpp_peer import single_stream

    r = single_stream(llama_python, gguf, threads=2, prompt_len=args.prompt_len, decode_tokens=args.decode_tokens,
                      runs=1)  # fmt: skip
    peer = peer or {"decode_tok_s": [], "prefill_tok_s": [], "system_info": r["system_info"]}
    peer["decode_tok_s"].append(r["decode_tok_s"])
    peer["prefill_tok_s"].append(r["prefill_tok_s"])
    return peer


def main() -> None:
    p = bench_parser(__doc__, "engine", engines=True,
                     engine_help="engine directories (e.g. the default, packed, engine and a --weight-only none one)")  # fmt: skip
    p.add_argument("--runs", type=int, default=5, help="interleaved rounds (every engine and the peer each round)")
    p.add_argument("--prompt-len", type=int, default=LENGTHS["prompt_len"])
    p.add_argument("--decode-tokens", type=int, default=LENGTHS["decode_tokens"])
    p.add_argument("--decode-context", type=int, default=LENGTHS["decode_context"],
                   help="prompt tokens before the decode steps")  # fmt: skip
    p.add_argument("--llama-python", help="a Python with llama-cpp-python: llama.cpp measured in the same run")
    args = p.parse_args()

    tokens = max(args.prompt_len, args.decode_context + args.decode_tokens)
    runs = []
    for path in args.engine:
        config = load_engine_config(path)
        blocks = -(-tokens // config.limits.kv_block_size)
        runs.append(EngineRun(path, NumpyRunner(path, num_kv_blocks=blocks, config=config)))
    rng = np.random.default_rng(0)
    vocab = runs[0].runner.config.arch.vocab_size
    prompt = rng.integers(100, vocab, size=args.prompt_len).tolist()
    short = prompt[: args.decode_context]
    gguf = _gguf_of(runs[0].runner)

    print("measuring ceilings ...", file=sys.stderr)
    gemm = gemm_gflops(args.runs)
    bandwidth = read_bandwidth_gbs(args.runs)
    for run in runs:  # warm-up: page in, compile
        _measure_round(run, prompt[:64], short, 4)
        run.prefill_s.clear()
        run.decode_s.clear()
    peer = None
    for r in range(args.runs):
        print(f"round {r + 1}/{args.runs} ...", file=sys.stderr)
        for run in runs:
            _measure_round(run, prompt, short, args.decode_tokens)
        peer = _peer_round(peer, args.llama_python, gguf, args)
    lines = _report(args, runs, peer, gemm, bandwidth, prompt, short)
    publish("engine_bench", lines, args.write)


def _gguf_of(runner: NumpyRunner) -> str:
    from build_engine.gguf_source import smollm2_gguf_path

    return str(smollm2_gguf_path()) if runner.config.source.get("kind") == "gguf" else ""


def _lengths(args: argparse.Namespace) -> dict[str, int]:
    return {k: getattr(args, k) for k in LENGTHS}


def _report(args, runs, peer, gemm, bandwidth, prompt, short) -> list[str]:
    mean_ctx = args.decode_context + args.decode_tokens / 2
    lines = [
        "## Native engine, single request (`python -m benchmarks.engine_bench`)",
        "",
        f"Command: `python -m benchmarks.engine_bench --engine {' '.join(args.engine)} --runs {args.runs}"
        + "".join(f" --{k.replace('_', '-')} {v}" for k, v in _lengths(args).items() if v != LENGTHS[k])
        + (" --llama-python PY" if args.llama_python else "")
        + " --write`  ",
        f"Machine: {machine_line()}. Medians of {args.runs} interleaved rounds (every engine"
        + (", then llama.cpp," if peer else "")
        + " in each); ceilings measured in the same run.",
        "",
        f"{ceilings_line(gemm, bandwidth, args.runs)} The rooflines divide by that bandwidth. Our kernel path: "
        f"{kernel_path()}.",
        "",
        "| Weights | Bytes read per decode step | Decode ms/token (tok/s) | x roofline of those bytes | Matmul G weights/s "
        f"| Prefill {args.prompt_len} tok/s (GFLOP/s) | x GEMM rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        r = run.runner
        step_bytes = weight_bytes_per_step(r) + kv_bytes(r, int(mean_ctx))
        roofline = step_bytes / (bandwidth * 1e9)
        decode = statistics.median(run.decode_s)
        prefill = statistics.median(run.prefill_s)
        share = breakdown(r, lambda r=r: decode_run(r, short, args.decode_tokens))
        matmul_s = decode * (share["matmuls"] + share["LM head"])
        weights = sum(w.size for layer in r.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        weights += r.lm_head.size
        gflops = prefill_flops(r, args.prompt_len) / prefill / 1e9
        lines.append(
            f"| {run.label} | {step_bytes / 1e6:.0f} MB | {decode * 1e3:.1f} ({1 / decode:.1f}) | "
            f"**{roofline / decode:.2f}x** | {weights / matmul_s / 1e9:.1f} | {args.prompt_len / prefill:.0f} "
            f"({gflops:.0f}) | **{gflops / gemm:.2f}x** |"
        )
    if peer:
        d, pf = statistics.median(peer["decode_tok_s"]), statistics.median(peer["prefill_tok_s"])
        lines += [
            "",
            f"llama.cpp (llama-cpp-python, same GGUF, 2 threads, same run): decode {d:.1f} tok/s, prefill "
            f"{args.prompt_len} tokens {pf:.0f} tok/s. Its system_info: `{peer['system_info']}`.",
            "",
            "| Weights | decode vs llama.cpp | prefill vs llama.cpp |",
            "|---|---|---|",
            *(f"| {run.label} | **{(1 / statistics.median(run.decode_s)) / d:.2f}x** | "
              f"**{(args.prompt_len / statistics.median(run.prefill_s)) / pf:.2f}x** |" for run in runs),
        ]  # fmt: skip
    else:
        lines += ["", "llama.cpp: not measured in this run (llama-cpp-python is not installed here; --llama-python)."]
    lines += ["", "Where the time goes (share of the step, one instrumented run each, kernel by kernel: the Python loop, not the"
              " compiled all-decode call):", "",
              "| Part | " + " | ".join(f"{r.label} prefill | {r.label} decode" for r in runs) + " |",
              "|---|" + "---|---|" * len(runs)]  # fmt: skip
    shares = [(breakdown(r.runner, lambda r=r: prefill_once(r.runner, prompt)),
               breakdown(r.runner, lambda r=r: decode_run(r.runner, short, args.decode_tokens))) for r in runs]  # fmt: skip
    for c in CATEGORIES:
        lines.append(f"| {c} | " + " | ".join(f"{pf[c] * 100:.0f}% | {dc[c] * 100:.0f}%" for pf, dc in shares) + " |")
    for run in runs:
        lines.append("")
        lines.append(f"{run.label}: decode rounds {', '.join(f'{t * 1e3:.1f}' for t in run.decode_s)} ms/token; "
                     f"prefill rounds {', '.join(f'{t * 1e3:.0f}' for t in run.prefill_s)} ms.")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
