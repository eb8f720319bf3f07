"""Model quality per weight format: perplexity on the bundled text and agreement with transformers' greedy tokens.

    python -m benchmarks.quality_bench [--work build/quality] [--write]

Engines built (native backend, into --work, reused when up to date): from the default GGUF, `--weight-only
none` (fp32) and `auto` (its own Q4_1/Q8_0 blocks); from that GGUF exported as a float32 Hugging Face checkpoint
(`--format hf`), `int8` (per output channel) and `int4` (groups of 32 and 64). The float checkpoint is itself the
Q4_1 grid dequantized: int8/int4 quantize weights that were 4-bit once already, the only float SmolLM2 here.
Agreement is against tests/golden (transformers fp32, 9 prompts x 32 greedy tokens): prompts whose free-running
greedy tokens are identical, the mean index of the first differing token, and teacher-forced top-1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import machine_line, publish
from benchmarks.quality import SEGMENT, TEXT, agreement, perplexity
from build_engine.builder import build, export
from build_engine.quantize import WeightPlan
from service.engine.runners.numpy_runner import NumpyRunner
from service.tokenizer import Tokenizer

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "smollm2_golden.json"
LIMITS = {"max_seq_len": 2048}
KV_BLOCKS = 400  # covers the golden prompts + 32 tokens, and the text's segments, at 16 tokens a block


def build_engines(model: str, work: Path) -> dict[str, Path]:
    """Label -> engine directory, for every format compared."""
    hf = work / "hf-float32"
    if not (hf / "config.json").exists():
        export(model, hf, force=True)
    plans = {  # label: (directory, source, weights)
        "fp32 (none)": ("fp32", model, WeightPlan("none")),
        "auto": ("auto", model, WeightPlan()),
        "int8": ("int8", str(hf), WeightPlan("int8")),
        "int4 g32": ("int4-g32", str(hf), WeightPlan("int4", 32)),
        "int4 g64": ("int4-g64", str(hf), WeightPlan("int4", 64)),
    }
    out = {}
    for label, (name, source, plan) in plans.items():
        build(source, work / name, LIMITS, progress=False, weights=plan)
        out[label] = work / name
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--work", type=Path, default=Path("build/quality"))
    p.add_argument("--write", action="store_true", help="regenerate the quality section of docs/benchmarks.md")
    args = p.parse_args()
    cases = json.loads(GOLDEN.read_text())["cases"]
    engines = build_engines(args.model, args.work)
    tokenizer = Tokenizer.from_engine_dir(engines["auto"])
    rows = {}
    for label, path in engines.items():
        print(f"{label}: scoring ...", file=sys.stderr)
        runner = NumpyRunner(path, num_kv_blocks=KV_BLOCKS)
        ppl, n = perplexity(runner, tokenizer)
        rows[label] = (
            runner.weight_format,
            (path / "model.safetensors").stat().st_size,
            ppl,
            n,
            agreement(runner, cases),
        )
    base = rows["fp32 (none)"][2]
    lines = [
        "## Model quality per weight format (`python -m benchmarks.quality_bench`)",
        "",
        "Command: `python -m benchmarks.quality_bench --write`  ",
        f"Machine: {machine_line()}. Perplexity of `{TEXT.relative_to(TEXT.parent.parent.parent)}` ({rows['auto'][3]} "
        f"tokens scored, segments of {SEGMENT} scored from their start); agreement with transformers fp32 greedy "
        "tokens on the 9 golden prompts x 32 tokens. int8/int4 are quantized at build time from the GGUF exported as "
        "a float32 checkpoint (the only float SmolLM2 here, itself 4-bit once).",
        "",
        "| Format | Weights stored | Weights MB | Perplexity | x fp32 | Greedy identical | Mean first divergence "
        "| Teacher-forced top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, (fmt, size, ppl, _, agree) in rows.items():
        mean_first = sum(agree.first_divergence) / agree.prompts
        lines.append(
            f"| {label} | {fmt} | {size / 1e6:.0f} | {ppl:.3f} | {ppl / base:.4f} | {agree.identical} / {agree.prompts} "
            f"| {mean_first:.1f} of 32 | {agree.teacher_forced_top1:.1%} |"
        )
    lines += [
        "",
        "Reading it: the float checkpoint is the GGUF's Q4_1 grid, so `int4 g32` finds the same 32-weight groups and "
        "reproduces those weights exactly; its only loss is the embedding / LM head, int8 per row (the GGUF has Q8_0 "
        "per 32). Groups of 64 straddle two of the source's blocks and round them again, the worst case for "
        "re-quantizing; they are stored as Q4_1 blocks sharing one scale and min, so they save no bytes either "
        "(group sizes 64/128 exist for checkpoints that are truly float and for TensorRT-LLM parity). "
        "int8 keeps one scale per output row.",
    ]
    publish("quality_bench", lines, args.write)


if __name__ == "__main__":
    main()
