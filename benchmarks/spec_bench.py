"""Speculative decoding on the native engine: n-gram drafts vs plain decode, one stream and 16, same process.

    python -m benchmarks.spec_bench --engine engines/smollm2-135m [--rounds 3] [--output-len 256] [--write]

Workloads: benchmarks/data/spec_prompts.json (real instructions: rename a variable in a 40-line function, quote
three sentences from a ~1,000-token passage, reformat a 30-key JSON object, summarise with quotations; and plain
prose), greedy, exactly --output-len tokens (ignore_eos). Per workload, --rounds interleaved rounds (plain, spec,
plain, ...) on two engines loaded side by side: decode tok/s = 1000 / the engine's TPOT (first token -> last /
(tokens - 1)), medians; acceptance = accepted / draft tokens, mean k = draft tokens / verify steps; the outputs
are compared token for token. The plain-decode roofline of the same run: bytes a plain decode step reads (weights
as stored + the KV cache at the mean context) / the read bandwidth measured in this run. Verify cost: a forward
step with B sequences of 1 + k tokens each at --context keys, relative to the same step with 1 token each (k = 0),
B = 1 and 4, medians. 16 streams: 16 copy-heavy requests at once (the four kinds, four each), output tok/s of the
whole run, plain vs spec (which speculates only while the running decodes are --disable-by-batch-size or fewer).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import CpuMeter, bench_parser, machine_line, publish, read_bandwidth_gbs
from service.config import SpecConfig
from service.engine.core import EngineCore
from service.engine.kernels.backend import BACKEND
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.request import GenerateRequest, SamplingParams

DATA = Path(__file__).resolve().parent / "data" / "spec_prompts.json"


def run_one(core: EngineCore, ids: list[int], n: int, tag: str) -> dict:
    gen = GenerateRequest(tag, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    core.add_request(gen)
    tokens, timing, drafts, draft_tokens, accepted = [], None, 0, 0, 0
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
            timing = out.timing or timing
        st = core.last_step
        if st is not None:
            drafts += st.num_spec_drafts
            draft_tokens += st.num_spec_draft_tokens
            accepted += st.num_spec_accepted_tokens
    return {"tokens": tokens, "tok_s": 1e3 / timing.tpot_ms, "drafts": drafts, "draft_tokens": draft_tokens,
            "accepted": accepted}  # fmt: skip


def run_many(core: EngineCore, prompts: list[list[int]], n: int, tag: str) -> float:
    """Output tok/s of the whole run of all prompts at once."""
    for i, ids in enumerate(prompts):
        core.add_request(GenerateRequest(f"{tag}-{i}", ids, SamplingParams(max_tokens=n, temperature=0,
                                                                           ignore_eos=True)))  # fmt: skip
    start, total = time.perf_counter(), 0
    while core.has_unfinished_requests():
        total += sum(len(o.new_token_ids) for o in core.step())
    return total / (time.perf_counter() - start)


def verify_cost(core: EngineCore, batch: int, context: int, ks: list[int], reps: int) -> dict[int, float]:
    """Forward ms of a step of `batch` sequences with 1 + k tokens each at `context` keys, relative to k = 0."""
    runner, bs = core.runner, core.runner.block_size
    per = -(-(context + max(ks) + 1) // bs)
    rng = np.random.default_rng(0)
    tables = [list(range(b * per, (b + 1) * per)) for b in range(batch)]
    for t in tables:  # fill the context once
        runner.execute(ForwardBatch.from_chunks([SeqChunk(rng.integers(0, 49152, context).tolist(), 0, t)], bs))
    ms: dict[int, list[float]] = {k: [] for k in [0, *ks]}
    for _ in range(reps):
        for k in ms:
            chunks = [SeqChunk(rng.integers(0, 49152, 1 + k).tolist(), context, t) for t in tables]
            batch_in = ForwardBatch.from_chunks(chunks, bs, all_rows=range(batch) if k else ())
            start = time.perf_counter()
            runner.execute(batch_in)
            ms[k].append((time.perf_counter() - start) * 1e3)
    base = statistics.median(ms[0])
    return {k: statistics.median(v) / base for k, v in ms.items() if k}


def main() -> None:
    p = bench_parser(__doc__, "Speculative decoding")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="keys of the verify-cost steps")
    p.add_argument("--num-speculative-tokens", type=int, default=SpecConfig().num_speculative_tokens)
    p.add_argument("--disable-by-batch-size", type=int, default=SpecConfig().disable_by_batch_size)
    p.add_argument("--streams", type=int, default=16)
    args = p.parse_args()
    cfg = SpecConfig(method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                     disable_by_batch_size=args.disable_by_batch_size)  # fmt: skip
    blocks = 2 * args.streams * (1200 + args.output_len) // 16 + 64
    plain = EngineCore(args.engine, num_kv_blocks=blocks, enable_prefix_caching=False)
    spec = EngineCore(args.engine, num_kv_blocks=blocks, enable_prefix_caching=False, speculative=cfg)
    workloads = json.loads(DATA.read_text())["workloads"]
    prompts = {w["name"]: plain.tokenizer.encode_chat([{"role": "user", "content": w["content"]}]) for w in workloads}
    meter = CpuMeter().start()
    results: dict[str, dict[str, list]] = {}
    for r in range(args.rounds):
        for name, ids in prompts.items():
            res = results.setdefault(name, {"plain": [], "spec": []})
            res["plain"].append(run_one(plain, ids, args.output_len, f"p{r}{name}"))
            res["spec"].append(run_one(spec, ids, args.output_len, f"s{r}{name}"))
            print(f"round {r} {name}: plain {res['plain'][-1]['tok_s']:.0f} spec {res['spec'][-1]['tok_s']:.0f} tok/s",
                  flush=True)  # fmt: skip
    bw = max(read_bandwidth_gbs(3).values())
    arch = plain.config.arch
    kv_per_token = 2 * arch.num_hidden_layers * arch.kv_size * 4
    mean_ctx = statistics.mean(len(ids) for ids in prompts.values()) + args.output_len / 2
    roofline = bw * 1e9 / (plain.runner.weight_bytes + kv_per_token * mean_ctx)
    costs = {b: verify_cost(plain, b, args.context, list(range(1, 9)), reps=7) for b in (1, 4)}
    copy = [w["name"] for w in workloads if w["kind"] == "copy"]
    many = [prompts[name] for name in copy] * (args.streams // len(copy))
    streams = {"plain": [], "spec": []}
    for r in range(args.rounds):
        streams["plain"].append(run_many(plain, many, args.output_len // 2, f"mp{r}"))
        streams["spec"].append(run_many(spec, many, args.output_len // 2, f"ms{r}"))
    use = meter.stop()

    lines = [
        f"`python -m benchmarks.spec_bench --engine {args.engine} --rounds {args.rounds} --output-len "
        f"{args.output_len} --streams {args.streams}{' --write' if args.write else ''}`; {machine_line()}; kernels {BACKEND.name}; other load during the run "
        f"{use.others:.2f} cores. One stream, greedy, {args.output_len} tokens each (ignore_eos), "
        f"--num-speculative-tokens {args.num_speculative_tokens} (k chosen per step), medians of {args.rounds} "
        f"interleaved rounds. Plain-decode roofline in this run: {roofline:.0f} tok/s (read bandwidth "
        f"{bw:.1f} GB/s, {plain.runner.weight_bytes / 1e6:.1f} MB of weights + the KV cache at "
        f"{mean_ctx:.0f} keys per token).",
        "",
        "| workload | plain tok/s | spec tok/s | speed-up | vs roofline | acceptance | mean k | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        pt = statistics.median(x["tok_s"] for x in res["plain"])
        st = statistics.median(x["tok_s"] for x in res["spec"])
        d = sum(x["draft_tokens"] for x in res["spec"])
        a = sum(x["accepted"] for x in res["spec"])
        steps = sum(x["drafts"] for x in res["spec"])
        same = all(x["tokens"] == y["tokens"] for x, y in zip(res["plain"], res["spec"], strict=True))
        lines.append(f"| {name} | {pt:.0f} | {st:.0f} | {st / pt:.2f}x | {st / roofline:.2f}x | "
                     f"{a / d if d else 0:.2f} | {d / steps if steps else 0:.1f} | {'yes' if same else 'NO'} |")  # fmt: skip
    lines += ["", f"Verify-step cost (forward time of 1 + k tokens per sequence / 1 token, {args.context} keys):", "",
              "| batch | " + " | ".join(f"k={k}" for k in range(1, 9)) + " |", "|---" * 9 + "|"]  # fmt: skip
    for b, c in costs.items():
        lines.append(f"| {b} | " + " | ".join(f"{c[k]:.2f}" for k in range(1, 9)) + " |")
    sp, ss = statistics.median(streams["plain"]), statistics.median(streams["spec"])
    lines += ["", f"{args.streams} streams of the copy-heavy prompts ({args.output_len // 2} tokens each), output "
              f"tok/s: plain {sp:.0f}, spec {ss:.0f} ({ss / sp:.2f}x; drafts only while "
              f"<= {args.disable_by_batch_size} decodes run)."]  # fmt: skip
    publish("Speculative decoding", lines, args.write)


if __name__ == "__main__":
    main()
