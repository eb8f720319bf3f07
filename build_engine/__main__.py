"""python -m build_engine --model smollm2-135m --output engines/smollm2-135m"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from build_engine.builder import NAMED_MODELS, build
from build_engine.source import BuildError
from build_engine.spec import SUPPORTED_DTYPES, BuildLimits, EngineFormatError

DEFAULTS = BuildLimits()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        prog="python -m build_engine",
        description="Compile a Llama-architecture model into an engine directory for the serving service.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help=f"{' | '.join(NAMED_MODELS)} | path to a GGUF file | path to a Hugging Face checkpoint directory",
    )
    parser.add_argument(
        "--output",
        required=True,
        help="engine directory to write; if it already holds the engine this build would write, the build is "
        "skipped; another engine there is refused unless --force",
    )
    parser.add_argument("--backend", choices=["native"], default="native", help="engine backend")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULTS.max_batch_size, help="sequences per step")
    parser.add_argument("--max-num-tokens", type=int, default=DEFAULTS.max_num_tokens, help="tokens per step")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="prompt + output tokens per request (default: the model's context)",
    )
    parser.add_argument("--kv-block-size", type=int, default=DEFAULTS.kv_block_size, help="tokens per KV block")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES, default=DEFAULTS.dtype, help="weight/activation dtype")
    parser.add_argument("--force", action="store_true", help="rebuild and replace whatever the output holds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    try:
        limits = {
            "max_batch_size": args.max_batch_size,
            "max_num_tokens": args.max_num_tokens,
            "max_seq_len": args.max_seq_len,
            "kv_block_size": args.kv_block_size,
            "dtype": args.dtype,
        }
        result = build(args.model, args.output, limits, force=args.force, progress=not args.no_progress)
    except (BuildError, EngineFormatError) as exc:
        print(f"build_engine: error: {exc}", file=sys.stderr)
        return 2
    config = result.config
    if result.skipped:
        print(
            f"engine {args.output} is up to date (same model input and build settings, every file matches its "
            "manifest checksum): skipping the build"
        )
        return 0
    arch = config.arch
    print(
        f"built {config.model_name} -> {args.output} in {time.perf_counter() - start:.1f}s: "
        f"{arch.num_hidden_layers} layers, hidden {arch.hidden_size}, heads {arch.num_attention_heads}/"
        f"{arch.num_key_value_heads}, vocab {arch.vocab_size}, max_seq_len {config.limits.max_seq_len}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
