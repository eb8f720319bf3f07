"""Offline generation CLI (the equivalent of TensorRT-LLM's run.py or vLLM's offline LLM.generate).

python -m service.offline --engine engines/smollm2-135m --prompt "..." [--chat] --max-tokens 32 --temperature 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from build_engine.spec import EngineFormatError, load_engine_config
from service.runners.base import ForwardBatch, SeqChunk
from service.runners.numpy_runner import NumpyRunner
from service.sampling import greedy, sample_temperature
from service.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class Timing:
    prefill_ms: float  # start of the first forward pass -> first token sampled
    decode_ms: float  # first token -> last token
    tpot_ms: float  # decode_ms / (tokens - 1); 0 for a single token


@dataclass(slots=True)
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (an EOS token) or "length" (max_tokens)
    timing: Timing


def generate_one(
    runner: NumpyRunner,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    ignore_eos: bool = False,
    on_text=None,
) -> Generation:
    """Run one request alone: chunked prefill, then one decode step per token."""
    cfg = runner.config
    if len(prompt_ids) + max_tokens > cfg.limits.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds max_seq_len {cfg.limits.max_seq_len}"
        )
    blocks = list(range(-(-(len(prompt_ids) + max_tokens) // runner.block_size)))
    rng = np.random.default_rng(seed)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    eos = set() if ignore_eos else set(cfg.tokenizer.eos_token_ids)
    tokens: list[int] = []
    times: list[float] = []
    start = time.perf_counter()
    pending, done = list(prompt_ids), 0
    finish = "length"
    while len(tokens) < max_tokens:
        chunk = pending[: cfg.limits.max_num_tokens]
        logits = runner.execute(ForwardBatch.from_chunks([SeqChunk(chunk, done, blocks)], runner.block_size))
        done += len(chunk)
        pending = pending[len(chunk) :]
        if pending:  # prefill not finished: no token yet
            continue
        token = int(greedy(logits)[0]) if temperature == 0 else sample_temperature(logits[0], temperature, rng)
        times.append(time.perf_counter())
        tokens.append(token)
        if token in eos:
            finish = "stop"
            break
        if on_text is not None:
            on_text(detok.push(token))
        else:
            detok.push(token)
        pending = [token]
    tail = detok.flush()
    if on_text is not None and tail:
        on_text(tail)
    decode_ms = (times[-1] - times[0]) * 1e3
    timing = Timing(
        prefill_ms=(times[0] - start) * 1e3,
        decode_ms=decode_ms,
        tpot_ms=decode_ms / (len(tokens) - 1) if len(tokens) > 1 else 0.0,
    )
    return Generation(list(prompt_ids), tokens, detok.text, finish, timing)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service.offline", description="Generate text offline from an engine.")
    p.add_argument("--engine", required=True, help="engine directory written by python -m build_engine")
    p.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="render the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_tokens <= 0 or args.temperature < 0 or not np.isfinite(args.temperature):
        print("offline: error: --max-tokens must be > 0 and --temperature >= 0", file=sys.stderr)
        return 2
    try:
        config = load_engine_config(args.engine)
        tokenizer = Tokenizer.from_engine_dir(args.engine)
        if args.chat:
            prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt_ids = tokenizer.encode(args.prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        blocks = -(-(len(prompt_ids) + args.max_tokens) // config.limits.kv_block_size)
        runner = NumpyRunner(Path(args.engine), num_kv_blocks=blocks, config=config)
        stream = None if args.json else (lambda t: print(t, end="", flush=True))
        result = generate_one(
            runner, tokenizer, prompt_ids, args.max_tokens, args.temperature, args.seed, args.ignore_eos, stream
        )
    except (EngineFormatError, ChatTemplateError, ValueError) as exc:
        print(f"offline: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(result), ensure_ascii=False))
    else:
        t = result.timing
        print(
            f"\n[{len(result.token_ids)} tokens, finish={result.finish_reason}; prefill {t.prefill_ms:.1f} ms "
            f"({len(prompt_ids)} prompt tokens), decode {t.decode_ms:.1f} ms, TPOT {t.tpot_ms:.2f} ms]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
