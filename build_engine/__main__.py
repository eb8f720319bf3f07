"""python -m build_engine --model smollm2-135m --output engines/smollm2-135m [--backend native|trtllm] [--format hf]

One flag set for both backends; each flag's meaning and allowed values per backend are in --help.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from build_engine.builder import NAMED_MODELS, build, export
from build_engine.quantize import INT4_GROUP_SIZES, WEIGHT_ONLY, WeightPlan
from build_engine.source import BuildError
from build_engine.spec import BACKEND_DTYPES, BuildLimits, EngineFormatError
from build_engine.tensor_io import WRITE_DTYPES
from build_engine.trtllm_builder import TOKENS_PER_BLOCK, TrtllmOptions

DEFAULTS = BuildLimits()
TRTLLM = TrtllmOptions()
DEFAULT_DTYPES = {"native": DEFAULTS.dtype, "trtllm": TRTLLM.dtype, "hf": "float32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        prog="python -m build_engine",
        description="Compile a Llama-architecture model into an engine directory for the serving service "
        "(native numpy engine, or a TensorRT-LLM engine on an NVIDIA GPU), or export it as a Hugging Face "
        "checkpoint (--format hf).",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"{' | '.join(NAMED_MODELS)} | path to a GGUF file | path to a Hugging Face checkpoint directory",
    )
    p.add_argument(
        "--output",
        required=True,
        help="directory to write; if it already holds the engine this build would write, the build is skipped; "
        "another engine there is refused unless --force",
    )
    p.add_argument("--backend", choices=["native", "trtllm"], default="native",
                   help="native: our numpy engine (any CPU); trtllm: TensorRT-LLM 1.2.1 (needs it and a GPU)")  # fmt: skip
    p.add_argument("--format", choices=["engine", "hf"], default="engine",
                   help="engine: an engine directory for the service; hf: export the model as a Hugging Face "
                   "LlamaForCausalLM checkpoint (GGUF blocks dequantized, Q/K rows un-permuted) and stop")  # fmt: skip
    limits = p.add_argument_group("limits (both backends; the service enforces them)")
    limits.add_argument("--max-batch-size", type=int, default=DEFAULTS.max_batch_size, help="sequences per step")
    limits.add_argument("--max-num-tokens", type=int, default=DEFAULTS.max_num_tokens, help="tokens per step")
    limits.add_argument("--max-seq-len", type=int, default=None,
                        help="prompt + output tokens per request (None: the model's context)")  # fmt: skip
    # NOTE: "%(default).0s" prints nothing: the help states both backends' defaults (None picks per backend)
    limits.add_argument("--kv-block-size", type=int, default=None,
                        help=f"tokens per KV block (TensorRT-LLM: tokens_per_block; --backend trtllm: "
                        f"{TOKENS_PER_BLOCK}, TensorRT-LLM's default) (default: {DEFAULTS.kv_block_size})"
                        "%(default).0s")  # fmt: skip
    limits.add_argument("--max-input-len", type=int, default=None,
                        help="trtllm only: longest prompt (None: max_seq_len); the native engine takes any "
                        "prompt that fits max_seq_len")  # fmt: skip
    weights = p.add_argument_group("weights")
    weights.add_argument("--dtype", default=None,
                         help=f"native: {'|'.join(BACKEND_DTYPES['native'])} (default); trtllm: "
                         f"{'|'.join(BACKEND_DTYPES['trtllm'])} (default {TRTLLM.dtype}); --format hf: "
                         f"{'|'.join(WRITE_DTYPES)} (default float32)")  # fmt: skip
    weights.add_argument("--weight-only", default=None, choices=list(WEIGHT_ONLY),
                         help="native: auto (default: a GGUF's Q4_0/Q4_1/Q8_0 blocks kept as they are, exact; "
                         "other inputs float32), none (float32), int8 (per output channel), int4 (groups of "
                         "--int4-group-size; LM head int8); trtllm: none (default), int8 (W8A16) or int4 "
                         "(W4A16, per channel)")  # fmt: skip
    weights.add_argument("--int4-group-size", type=int, default=32, choices=list(INT4_GROUP_SIZES),
                         help="native --weight-only int4: weights per scale and minimum")  # fmt: skip
    parallel = p.add_argument_group("parallelism (trtllm only; native: 1)")
    parallel.add_argument("--tp-size", type=int, default=1, help="tensor-parallel GPUs")
    parallel.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel GPUs")
    p.add_argument("--force", action="store_true", help="rebuild and replace whatever the output holds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _check_native(args: argparse.Namespace) -> None:
    only_trtllm = {"--max-input-len": args.max_input_len is not None, "--tp-size": args.tp_size != 1,
                   "--pp-size": args.pp_size != 1}  # fmt: skip
    used = [flag for flag, set_ in only_trtllm.items() if set_]
    if used:
        raise BuildError(f"{', '.join(used)}: for --backend trtllm only (the native engine is one float32 process)")


def run(args: argparse.Namespace) -> str:
    """Build or export; returns the line to print."""
    start = time.perf_counter()
    kind = "hf" if args.format == "hf" else args.backend
    dtype = args.dtype or DEFAULT_DTYPES[kind]
    if args.format == "hf":
        source = export(args.model, args.output, dtype, force=args.force)
        return f"exported {source.name} as a Hugging Face checkpoint ({dtype}) -> {args.output}"
    limits = {
        "max_batch_size": args.max_batch_size,
        "max_num_tokens": args.max_num_tokens,
        "max_seq_len": args.max_seq_len,
        "kv_block_size": args.kv_block_size,
        "dtype": dtype,
    }
    trtllm = weights = None
    if args.backend == "trtllm":
        if args.weight_only == "auto":
            raise BuildError("--weight-only auto is native only (trtllm: none, int8, int4)")
        trtllm = TrtllmOptions(dtype, args.weight_only or "none", args.max_input_len, args.tp_size, args.pp_size)
    else:
        _check_native(args)
        weights = WeightPlan(args.weight_only or "auto", args.int4_group_size)
    result = build(args.model, args.output, limits, args.force, not args.no_progress, args.backend, trtllm, weights)
    config = result.config
    if result.skipped:
        return (f"engine {args.output} is up to date (same model input and build settings, every file matches its "
                "manifest checksum): skipping the build")  # fmt: skip
    arch = config.arch
    return (
        f"built {config.model_name} ({args.backend}, {dtype}, weights {config.weight_format}) -> {args.output} in "
        f"{time.perf_counter() - start:.1f}s: "
        f"{arch.num_hidden_layers} layers, hidden {arch.hidden_size}, heads {arch.num_attention_heads}/"
        f"{arch.num_key_value_heads}, vocab {arch.vocab_size}, max_seq_len {config.limits.max_seq_len}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        print(run(args))
    except (BuildError, EngineFormatError) as exc:
        print(f"build_engine: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
