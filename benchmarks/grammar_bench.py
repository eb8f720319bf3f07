"""Structured outputs' cost in the native engine: TPOT of JSON-schema requests vs unconstrained ones, the mask
time per step, and the compile time of each grammar of the test set.

    python -m benchmarks.grammar_bench --engine engines/smollm2-135m [--concurrency 1,16] [--rounds 3] [--write]

Per concurrency level C: C requests at once, every one with the same prompts, exactly --output-len tokens each:
unconstrained with ignore_eos, or constrained by a JSON schema that cannot end sooner (an object holding an
array of at least 64 strings), so both runs generate the same number of tokens through the same batch shapes.
TPOT is the engine's (first token -> last / (tokens - 1)), the median over the C requests; the figure is the
median of --rounds interleaved rounds (free, constrained, free, ...). Mask time: the worker thread's time to
fill the batch's bitmasks, and the part of it the step waited for after its forward pass (median per step).
Compile: each schema / regex / grammar of benchmarks/data (validate + matcher construction, a cold cache).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import CpuMeter, Rounds, bench_parser, int_list, joined, machine_line, publish
from service.engine.core import EngineCore
from service.engine.grammar import GrammarCompiler
from service.request import Constraint, GenerateRequest, SamplingParams

DATA = Path(__file__).resolve().parent / "data"
LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 64}},
    "required": ["items"],
    "additionalProperties": False,
}
PROMPT = "List as many fruits as you can, as JSON."
_RUNS = itertools.count()


def run_level(core: EngineCore, concurrency: int, constrained: bool, args: argparse.Namespace, tag: str) -> dict:
    prompt = core.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    if constrained:
        sp = SamplingParams(max_tokens=args.output_len, temperature=0, constraint=Constraint("json_schema",
                            json.dumps(LONG_SCHEMA)))  # fmt: skip
    else:
        sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    # distinct first tokens per request and per run: no prefix-cache sharing between the runs being compared
    first = 100 + 64 * next(_RUNS)
    gens = [GenerateRequest(f"{tag}-{i}", [first + i, *prompt], sp) for i in range(concurrency)]
    mask_ms, wait_ms, path_ms, step_ms = [], [], [], []
    outs: dict[str, list] = {g.request_id: [] for g in gens}
    for g in gens:
        core.add_request(g)
    timed = _Timed(core)
    while core.has_unfinished_requests():
        timed.ms = 0.0
        for out in core.step():
            outs[out.request_id].append(out)
        step = core.last_step
        if step is not None and step.num_decode_tokens == concurrency:  # decode steps of the whole batch
            mask_ms.append(step.mask_ms)
            wait_ms.append(step.mask_wait_ms)
            path_ms.append(timed.ms + step.mask_wait_ms)
            step_ms.append(step.step_ms)
    timed.undo()
    lengths = {len([t for o in v for t in o.new_token_ids]) for v in outs.values()}
    assert lengths == {args.output_len}, f"outputs of {lengths} tokens, expected {args.output_len}"
    return {
        "tpot_ms": statistics.median(v[-1].timing.tpot_ms for v in outs.values()),
        "mask_ms": statistics.median(mask_ms),
        "mask_wait_ms": statistics.median(wait_ms),
        "path_ms": statistics.median(path_ms),
        "step_ms": statistics.median(step_ms),
    }


class _Timed:
    """Times the sampler and the matchers' advance (with the wait for the masks: what a constraint adds to a
    step's critical path; the mask fill itself runs beside the forward pass)."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.ms = core, 0.0
        self._sample, self._advance = core.sampler.sample, core._advance_grammars
        core.sampler.sample = self._wrap(self._sample)
        core._advance_grammars = self._wrap(self._advance)

    def _wrap(self, fn):
        def timed(*a):
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.ms += (time.perf_counter() - start) * 1e3

        return timed

    def undo(self) -> None:
        self.core.sampler.sample, self.core._advance_grammars = self._sample, self._advance


def compile_times(core: EngineCore) -> list[tuple[str, float]]:
    compiler = GrammarCompiler(core.engine_dir / "tokenizer.json", core.config.arch.vocab_size, core.eos_token_ids)
    compiler.tokenizer  # noqa: B018 (built once, not counted)
    cases = json.loads((DATA / "structured_schemas.json").read_text())
    cases += json.loads((DATA / "structured_grammars.json").read_text())
    out = []
    for case in cases:
        c = Constraint("json_schema", json.dumps(case["schema"])) if "schema" in case else Constraint(case["kind"],
                                                                                                     case["spec"])  # fmt: skip
        out.append((case["name"], compiler.compile(c).compile_ms))
    return out


def main() -> None:
    p = bench_parser(__doc__, "grammar")
    p.add_argument("--concurrency", type=int_list, default="1,16", help="concurrency levels, e.g. 1,16")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request, exactly")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the medians are reported)")
    args = p.parse_args()
    core = EngineCore(args.engine, kv_cache_memory="512MiB")
    run_level(core, 2, True, args, "warm-c")
    run_level(core, 2, False, args, "warm-f")
    results: dict[tuple[int, bool], list[dict]] = {}
    meter = CpuMeter().start()
    for r in range(args.rounds):
        for c in args.concurrency:
            for constrained in (False, True):
                res = run_level(core, c, constrained, args, f"r{r}-c{c}-{int(constrained)}")
                results.setdefault((c, constrained), []).append(res)
                print(f"round {r} concurrency {c} {'json' if constrained else 'free'}: {res}", file=sys.stderr)
    others = meter.stop().others
    compiled = compile_times(core)
    lines = [
        "## Structured outputs: the cost of a constraint (`python -m benchmarks.grammar_bench`)",
        "",
        f"`python -m benchmarks.grammar_bench --engine {args.engine} --concurrency {joined(args.concurrency)} "
        f"--output-len {args.output_len} --rounds {args.rounds} --write`  ",
        f"{machine_line()}. Native engine, greedy, {args.output_len} output tokens per request; JSON: a schema that "
        "cannot end sooner (benchmarks/grammar_bench.py); medians of "
        f"{args.rounds} interleaved rounds (the rounds in brackets); other processes used {others:.1f} cores "
        "meanwhile.",
        "",
        "| concurrency | TPOT free (ms) | TPOT JSON schema (ms) | ratio | mask fill per step (ms) | of it waited for "
        "(ms) | sampling + advance per step, free -> JSON (ms) | added to the critical path per step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in args.concurrency:
        free, js = Rounds.of(results[(c, False)], "tpot_ms"), Rounds.of(results[(c, True)], "tpot_ms")
        mask = Rounds.of(results[(c, True)], "mask_ms")
        wait = Rounds.of(results[(c, True)], "mask_wait_ms")
        path_free, path_js = Rounds.of(results[(c, False)], "path_ms"), Rounds.of(results[(c, True)], "path_ms")
        step = Rounds.of(results[(c, False)], "step_ms")
        added = path_js.median - path_free.median
        lines.append(
            f"| {c} | {free.median:.2f} [{free.spread(2)}] | {js.median:.2f} [{js.spread(2)}] | "
            f"{js.median / free.median:.3f}x | {mask.median:.3f} | {wait.median:.3f} | "
            f"{path_free.median:.3f} -> {path_js.median:.3f} | {added:.3f} ms = {added / step.median:.1%} of a "
            f"{step.median:.1f} ms step |"
        )
    times = [ms for _, ms in compiled]
    lines += [
        "",
        f"Compile time per grammar of the test set ({len(compiled)}: benchmarks/data/structured_*.json; validate + "
        f"matcher, cold cache): median {statistics.median(times):.2f} ms, max {max(times):.2f} ms "
        f"({compiled[int(np.argmax(times))][0]}); the tokenizer for llguidance is built once per engine, on the "
        "first constrained request.",
        "",
        "| grammar | ms |",
        "|---|---:|",
        *(f"| {name} | {ms:.2f} |" for name, ms in compiled),
    ]
    publish("grammar_bench", lines, args.write)


if __name__ == "__main__":
    main()
