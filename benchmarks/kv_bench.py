"""KV cache stored types and batch-invariant attention: speed against the read roofline, quality, and the
attention kernels' cost against a baseline build.

    python -m benchmarks.kv_bench decode    [--engine engines/smollm2-135m] [--context 4096] [--batches 1,16]
    python -m benchmarks.kv_bench quality   [--engine engines/smollm2-135m] [--max-tokens N]
    python -m benchmarks.kv_bench attention --baseline PATH/_kernels.cpython-*.so

decode: one decode step of `batch` sequences at `context` keys each, per --kv-cache-dtype, interleaved (every
round times each type once, in a rotated order); the bytes a step reads (the weights as stored plus the K and V
rows of every sequence's keys, int8 scales included) over the step's time, as a fraction of the machine's read
bandwidth (service/engine/roofline.py); the best round too (on a shared machine the others' load varies from round
to round). The KV arrays hold random values, not a prefill's (a step's time does not depend on them). --dtypes
float16 runs one type alone (less memory: batch 16 at 4096 keys holds 3 GB of float32 KV).
quality: perplexity of the bundled text and agreement with transformers' greedy tokens on the golden prompts
(benchmarks/quality.py, tests/golden), per KV type, against float32.
attention: the compiled prefill and decode attention of this checkout against another build of the extension
(e.g. main's: `git worktree add /tmp/base main && cd /tmp/base && python setup.py build_ext --inplace`), float32,
calls alternated A/B in one process: what batch invariance costs; and a whole 512-token prefill step of the engine
with either build's prefill attention (the rest of the step the same).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from benchmarks.common import machine_line
from benchmarks.quality import agreement, perplexity
from build_engine.spec import load_engine_config
from service.config import KV_CACHE_DTYPES
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.kv_cache import KV_FORMATS, KVFormat
from service.engine.roofline import read_bandwidth_gbs
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner
from service.tokenizer import Tokenizer

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "smollm2_golden.json"


def bandwidth_gbs() -> float:
    """The machine's read bandwidth, GB/s: roofline.py's one measurement (a GEMV over >= 4x the LLC), best of 3."""
    return read_bandwidth_gbs(3)


def fill_random(runner: NumpyRunner, rng: np.random.Generator) -> None:
    """Random K, V in the cache's stored type (layer 0's values copied to every layer: generating them is slow)."""
    cache, fmt = runner.kv_cache, runner.kv_cache.fmt
    x = rng.standard_normal(cache.k.shape[1:], dtype=np.float32)  # [num_blocks, block_size, KV, hd]
    if fmt.name == "bfloat16":
        stored = (x.view(np.uint32) >> 16).astype(np.uint16)
    elif fmt.name == "int8":
        stored = rng.integers(-127, 128, size=x.shape, dtype=np.int8)
    else:
        stored = x.astype(fmt.storage)
    for arrays in (cache.k, cache.v):
        arrays[...] = stored
    for scales in (cache.k_scale, cache.v_scale):
        scales.fill(0.02)


def step_bytes(runner: NumpyRunner, fmt: KVFormat, batch: int, context: int) -> int:
    """Bytes one decode step reads: the weights as stored, and K and V of every key of every sequence."""
    arch = runner.config.arch
    kv = 2 * arch.num_hidden_layers * fmt.bytes_per_slot(arch.num_key_value_heads, arch.head_dim)
    return runner.weight_bytes + batch * context * kv


def decode_steps(engine: str, batch: int, context: int, rounds: int, steps: int, dtypes: list[str]) -> dict:
    cfg = load_engine_config(engine)
    bs = cfg.limits.kv_block_size
    per_seq = -(-(context + steps) // bs)
    rng = np.random.default_rng(1)
    runners = {}
    for name in dtypes:
        runners[name] = NumpyRunner(engine, num_kv_blocks=batch * per_seq, config=cfg, kv_cache_dtype=name)
        fill_random(runners[name], rng)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    times: dict[str, list[float]] = {name: [] for name in dtypes}
    for r in range(rounds):
        for name in dtypes[r % len(dtypes) :] + dtypes[: r % len(dtypes)]:
            runner = runners[name]
            runner.bind_threads()
            per_step = []
            for s in range(steps + 1):  # the first one warms up
                chunks = [SeqChunk([int(rng.integers(100, 1000))], context + s, t) for t in tables]
                start = time.perf_counter()
                runner.execute(ForwardBatch.from_chunks(chunks, bs))
                per_step.append(time.perf_counter() - start)
            times[name].append(statistics.median(per_step[1:]))
    return {
        name: {"step_s": statistics.median(t), "rounds_ms": [round(v * 1e3, 2) for v in t],
               "bytes": step_bytes(runners[name], KV_FORMATS[name], batch, context)}
        for name, t in times.items()
    }  # fmt: skip


def cmd_decode(args: argparse.Namespace) -> None:
    bw = bandwidth_gbs()
    print(f"{machine_line()}; kernels {BACKEND.name}; read bandwidth {bw:.1f} GB/s (roofline.py)")
    print(
        "| batch | KV type | step ms (median) | rounds ms | bytes read MB | GB/s | x roofline | best round x roofline |"
    )
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for batch in args.batches:
        res = decode_steps(args.engine, batch, args.context, args.rounds, args.steps, args.dtypes)
        results[batch] = res
        for name, r in res.items():
            rate, best = r["bytes"] / r["step_s"] / 1e9, r["bytes"] / min(r["rounds_ms"]) / 1e6
            print(f"| {batch} | {name} | {r['step_s'] * 1e3:.1f} | {', '.join(map(str, r['rounds_ms']))} | "
                  f"{r['bytes'] / 1e6:.1f} | {rate:.2f} | {rate / bw:.2f} | {best / bw:.2f} |", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_gbs": bw, "context": args.context, "results": results}))


def cmd_quality(args: argparse.Namespace) -> None:
    cases = json.loads(GOLDEN.read_text())["cases"]
    tokenizer = Tokenizer.from_engine_dir(args.engine)
    print(f"{machine_line()}; kernels {BACKEND.name}; engine {args.engine}")
    print("| KV type | perplexity | x float32 | greedy identical | mean first divergence | teacher-forced top-1 |")
    print("|---|---|---|---|---|---|")
    base = None
    for name in args.dtypes:
        runner = NumpyRunner(args.engine, num_kv_blocks=args.kv_blocks, kv_cache_dtype=name)
        ppl, n = perplexity(runner, tokenizer, args.max_tokens)
        agree = agreement(runner, cases)
        base = ppl if base is None else base
        first = sum(agree.first_divergence) / agree.prompts
        print(f"| {name} | {ppl:.4f} ({n} tokens) | {ppl / base:.4f} | {agree.identical} / {agree.prompts} | "
              f"{first:.1f} of 32 | {agree.teacher_forced_top1:.1%} |", flush=True)  # fmt: skip


def load_extension(path: str) -> ModuleType:
    """Another build of service.engine.kernels._kernels, loaded beside this one under its own name."""
    loader = importlib.machinery.ExtensionFileLoader("_kernels", path)
    spec = importlib.util.spec_from_file_location("_kernels", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Attention:
    """The float32 prefill and decode attention entry points of one build (before KV types: no scales, no
    dtype argument)."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext
        self.typed = "k_scale" in (ext.decode_attention.__doc__ or "")

    def decode(self, q, k, v, tables, starts, lens, out, *ints) -> None:
        extra = ((self.none, self.none), (0,)) if self.typed else ((), ())
        self.ext.decode_attention(q, k, v, *extra[0], tables, starts, lens, out, *ints, *extra[1])

    def prefill(self, q, k, v, table, out, *ints) -> None:
        extra = ((self.none, self.none), (0,)) if self.typed else ((), ())
        self.ext.paged_attention(q, k, v, *extra[0], table, out, *ints, *extra[1])

    none = np.zeros(0, np.float32)


def attention_cases(rng: np.random.Generator) -> dict:
    """Label -> (kind, arguments) over one SmolLM2-shaped layer cache (9 heads, 3 KV heads, hd 64, blocks of 16)."""
    H, KV, hd, bs = 9, 3, 64, 16
    nb = 16 * 257 + 8
    k = rng.standard_normal((nb, bs, KV, hd), dtype=np.float32)
    v = rng.standard_normal((nb, bs, KV, hd), dtype=np.float32)
    cases = {}
    for batch, ctx in ((1, 4096), (16, 4096), (16, 512), (64, 256)):
        per = -(-ctx // bs)
        tables = np.arange(batch * per, dtype=np.int64) % nb
        starts = np.arange(batch + 1, dtype=np.int64) * per
        lens = np.full(batch, ctx, np.int64)
        q = rng.standard_normal((batch, H, hd), dtype=np.float32) / 8
        out = np.empty_like(q)
        cases[f"decode B={batch} ctx={ctx}"] = ("decode", (q, k, v, tables, starts, lens, out, batch, H, KV, hd, bs,
                                                           nb, 0))  # fmt: skip
    for n, ctx in ((512, 512), (64, 4096), (256, 2048), (16, 1024)):
        table = np.arange(-(-ctx // bs), dtype=np.int64)
        q = rng.standard_normal((n, H, hd), dtype=np.float32) / 8
        out = np.empty((n, H * hd), np.float32)
        cases[f"prefill n={n} ctx={ctx}"] = ("prefill", (q, k, v, table, out, n, ctx, H, KV, hd, bs, nb, 0))
    return cases


class Baseline:
    """The baseline build behind this checkout's paged_attention call: the engine's prefill attention run by the
    other build, for the end-to-end A/B (a build from before KV types takes float32 caches only, no scales and
    no dtype argument)."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext
        self.typed = Attention(ext).typed

    def paged_attention(self, q, k, v, k_scale, v_scale, table, out, *ints) -> None:
        if self.typed:
            self.ext.paged_attention(q, k, v, k_scale, v_scale, table, out, *ints)
        else:
            self.ext.paged_attention(q, k, v, table, out, *ints[:-1])

    def attention(self, *a) -> None:
        self.ext.attention(*a)


def prefill_steps(engine: str, baseline: ModuleType, rounds: int, n: int = 512) -> tuple[list[float], list[float]]:
    """An n-token first prefill chunk of the engine with this build's prefill attention and the baseline's
    (service.engine.kernels.attention's extension swapped per call), alternated: seconds per step each."""
    from service.engine.kernels import attention

    runner = NumpyRunner(engine, num_kv_blocks=-(-n // 16) + 1)
    prompt = np.random.default_rng(2).integers(100, 1000, n).tolist()
    batch = ForwardBatch.from_chunks([SeqChunk(prompt, 0, list(range(runner.num_kv_blocks)))], runner.block_size)
    ours, theirs = attention._C, Baseline(baseline)
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for r in range(rounds):
            for which in (0, 1) if r % 2 == 0 else (1, 0):
                attention._C = theirs if which == 0 else ours
                runner.execute(batch)
                start = time.perf_counter()
                runner.execute(batch)
                times[which].append(time.perf_counter() - start)
    finally:
        attention._C = ours
    return times


def cmd_attention(args: argparse.Namespace) -> None:
    builds = {"baseline": Attention(load_extension(args.baseline)), "this": Attention(BACKEND.ext)}
    for b in builds.values():
        b.ext.set_num_threads(BACKEND.ext.get_num_threads())
    print(f"{machine_line()}; baseline {args.baseline}; {BACKEND.ext.get_num_threads()} kernel threads")
    print("| case | baseline ms | this ms | this / baseline | rounds (baseline / this ms) |")
    print("|---|---|---|---|---|")
    for label, (kind, call_args) in attention_cases(np.random.default_rng(0)).items():
        times = {name: [] for name in builds}
        for r in range(args.rounds):
            for name in list(builds) if r % 2 == 0 else list(builds)[::-1]:
                fn = getattr(builds[name], kind)
                fn(*call_args)  # warm up (and let the other build's idle workers go to sleep)
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn(*call_args)
                times[name].append((time.perf_counter() - start) / args.calls)
        base, this = (statistics.median(times[n]) for n in builds)
        spread = "; ".join(
            f"{a * 1e3:.2f} / {b * 1e3:.2f}" for a, b in zip(times["baseline"], times["this"], strict=True)
        )
        print(f"| {label} | {base * 1e3:.2f} | {this * 1e3:.2f} | {this / base:.2f} | {spread} |", flush=True)
    if args.engine:
        base, this = prefill_steps(args.engine, builds["baseline"].ext, args.rounds)
        spread = "; ".join(f"{a * 1e3:.0f} / {b * 1e3:.0f}" for a, b in zip(base, this, strict=True))
        b, t = statistics.median(base), statistics.median(this)
        print(
            f"| engine step: 512-token first prefill chunk | {b * 1e3:.1f} | {t * 1e3:.1f} | {t / b:.2f} | {spread} |"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    dec = sub.add_parser("decode", help="decode step per KV type against the read roofline")
    qual = sub.add_parser("quality", help="perplexity and greedy agreement per KV type")
    for s in (dec, qual):
        s.add_argument("--engine", default="engines/smollm2-135m")
        s.add_argument("--dtypes", type=lambda t: t.split(","), default=list(KV_CACHE_DTYPES))
    dec.add_argument("--context", type=int, default=4096)
    dec.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16])
    dec.add_argument("--rounds", type=int, default=5)
    dec.add_argument("--steps", type=int, default=3, help="timed steps per round (median), after one warm-up")
    dec.add_argument("--json", help="also write the results here")
    qual.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    qual.add_argument("--kv-blocks", type=int, default=400)
    att = sub.add_parser("attention", help="attention kernels A/B against another build of the extension")
    att.add_argument("--baseline", required=True, help="path of the other build's _kernels*.so")
    att.add_argument("--rounds", type=int, default=7)
    att.add_argument("--calls", type=int, default=5, help="calls timed together per round")
    att.add_argument("--engine", default="engines/smollm2-135m", help="also a whole prefill step A/B ('' to skip)")
    args = p.parse_args(argv)
    for name in getattr(args, "dtypes", []):
        if name not in KV_CACHE_DTYPES:
            sys.exit(f"kv_bench: --dtypes: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    {"decode": cmd_decode, "quality": cmd_quality, "attention": cmd_attention}[args.cmd](args)


if __name__ == "__main__":
    main()
