"""Offline generation CLI (the equivalent of TensorRT-LLM's run.py or vLLM's offline LLM.generate).

python -m service.offline --engine engines/smollm2-135m --prompt "..." [--chat] --max-tokens 32 --temperature 0
python -m service.offline --engine engines/smollm2-135m --prompts-file prompts.jsonl > results.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from build_engine.spec import EngineFormatError
from build_engine.verify import verify_engine
from service.config import KV_CACHE_DTYPES
from service.engine.core import DEFAULT_KV_CACHE_DTYPE, DEFAULT_KV_CACHE_MEMORY, EngineCore
from service.errors import InvalidRequest
from service.request import Constraint, GenerateRequest, RequestOutput, SamplingParams
from service.tokenizer import ChatTemplateError, Tokenizer

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        prog="python -m service.offline",
        description="Generate text offline from an engine.",
    )
    p.add_argument("--engine", required=True, help="engine directory written by python -m build_engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (a user message with --chat)")
    src.add_argument(
        "--prompts-file",
        help='JSONL, one request per line: {"prompt": "..."} or {"messages": [...]}, plus optional sampling fields '
        '(max_tokens, temperature, top_p, seed, stop, ...; constraint: {"kind": "json_schema", "spec": '
        '{...}}, kinds json_schema, json_object, regex, lark, gbnf, choice with "choices": [...], and '
        '"any_whitespace": false); all run concurrently through the scheduler',
    )
    p.add_argument("--chat", action="store_true", help="render the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this cumulative probability")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = all")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object per request instead of streaming text")
    p.add_argument("--kv-cache-memory", default=DEFAULT_KV_CACHE_MEMORY, help="bytes (512MiB) or a fraction of RAM")
    p.add_argument(
        "--kv-cache-dtype", default=DEFAULT_KV_CACHE_DTYPE, choices=KV_CACHE_DTYPES, help="the KV cache's stored type"
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks of common prompt prefixes")
    p.add_argument(
        "--skip-verify",
        action="store_true",
        help="do not check the engine's files against the sha256 checksums of its manifest.json (the shape, "
        "tokenizer and chat-template checks still run)",
    )
    return p.parse_args(argv)


SPEC_KEYS = {"id", "prompt", "messages", "chat"}


class PromptsFileError(ValueError):
    """A line of --prompts-file is not a valid request; the message names the file, the line and the problem."""


def _encode(tokenizer: Tokenizer, spec: dict[str, Any], chat: bool) -> list[int]:
    if "messages" in spec:
        messages = spec["messages"]
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        )
        if not ok:
            raise ValueError('"messages" must be a non-empty list of {"role": str, "content": str} objects')
        return tokenizer.encode_chat(messages)
    prompt = spec["prompt"]
    if not isinstance(prompt, str):
        raise ValueError(f'"prompt" must be a string, got {type(prompt).__name__}')
    if chat or spec.get("chat"):
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def _spec_request(spec: Any, index: int, defaults: dict[str, Any], tokenizer: Tokenizer, chat: bool) -> GenerateRequest:
    if not isinstance(spec, dict):
        raise ValueError(f"each line must be a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - SPEC_KEYS - SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} (known: prompt, messages, chat, id and "
                         f"the sampling fields {', '.join(sorted(SAMPLING_FIELDS))})")  # fmt: skip
    if ("prompt" in spec) == ("messages" in spec):
        raise ValueError('each line needs exactly one of "prompt" or "messages"')
    fields = {**defaults, **{k: v for k, v in spec.items() if k in SAMPLING_FIELDS}}
    for key in ("stop", "stop_token_ids"):
        if key in fields:
            if not isinstance(fields[key], list):
                raise ValueError(f'"{key}" must be a list')
            fields[key] = tuple(fields[key])
    if "constraint" in fields:
        fields["constraint"] = _constraint(fields["constraint"])
    try:
        sampling = SamplingParams(**fields)
    except TypeError as exc:  # e.g. a string where a number belongs
        raise ValueError(f"a sampling field has the wrong type ({exc})") from None
    return GenerateRequest(str(spec.get("id", index)), _encode(tokenizer, spec, chat), sampling)


CONSTRAINT_KEYS = {"kind", "spec", "choices", "any_whitespace"}


def _constraint(spec: Any) -> Constraint:
    """A prompts-file line's "constraint" object -> Constraint (a json_schema's spec may be the schema itself)."""
    if not isinstance(spec, dict) or not set(spec) <= CONSTRAINT_KEYS or "kind" not in spec:
        raise ValueError(
            f'"constraint" must be an object with "kind" and optionally {sorted(CONSTRAINT_KEYS - {"kind"})}'
        )
    text = spec.get("spec", "")
    if not isinstance(text, str):
        text = json.dumps(text)  # a schema given as JSON
    choices = spec.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError('"constraint.choices" must be a list of strings')
    return Constraint(spec["kind"], text, tuple(choices), bool(spec.get("any_whitespace", True)))


def _requests(args: argparse.Namespace, engine: EngineCore) -> list[GenerateRequest]:
    """The requests to run, each checked against the engine (errors name the prompts file's line)."""
    defaults = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
    }
    tokenizer = engine.tokenizer
    if args.prompt is not None:
        gen = _spec_request({"prompt": args.prompt}, 0, defaults, tokenizer, args.chat)
        engine.check(gen)
        return [gen]
    gens: list[GenerateRequest] = []
    ids: set[str] = set()
    with open(args.prompts_file) as f:
        for lineno, line in enumerate(f, start=1):  # numbered as editors number them, blank lines included
            if not line.strip():
                continue
            try:
                gen = _spec_request(json.loads(line), len(gens), defaults, tokenizer, args.chat)
                engine.check(gen)
                engine.compile(gen)
                if gen.request_id in ids:
                    raise ValueError(f"id {gen.request_id!r} is used twice")
            except (ValueError, ChatTemplateError) as exc:  # json, InvalidRequest and our own errors
                raise PromptsFileError(f"{args.prompts_file}:{lineno}: {exc}") from None
            ids.add(gen.request_id)
            gens.append(gen)
    return gens


def _result(gen: GenerateRequest, outs: list[RequestOutput]) -> dict[str, Any]:
    last = outs[-1]
    timing = dataclasses.asdict(last.timing)
    timing.pop("itl_ms")
    return {
        "id": gen.request_id,
        "prompt_token_ids": gen.prompt_token_ids,
        "token_ids": [t for o in outs for t in o.new_token_ids],
        "text": "".join(o.new_text for o in outs),
        "finish_reason": last.finish_reason,
        "num_cached_tokens": last.num_cached_tokens,
        "timing": timing,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        verify_engine(args.engine, checksums=not args.skip_verify)
        engine = EngineCore(
            args.engine,
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=not args.no_prefix_caching,
        )
        gens = _requests(args, engine)
        for gen in gens:
            engine.enqueue(gen, gen.request_id)  # checked above
    except (EngineFormatError, ChatTemplateError, InvalidRequest, ValueError, OSError) as exc:
        print(f"offline: error: {exc}", file=sys.stderr)
        return 2
    stream = args.prompt is not None and not args.json
    outputs: dict[str, list[RequestOutput]] = {g.request_id: [] for g in gens}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
            if stream:
                print(out.new_text, end="", flush=True)
    elapsed = time.perf_counter() - start
    results = [_result(g, outputs[g.request_id]) for g in gens]
    if stream:
        r, t = results[0], results[0]["timing"]
        print(
            f"\n[{len(r['token_ids'])} tokens, finish={r['finish_reason']}; prefill {t['prefill_ms']:.1f} ms "
            f"({len(r['prompt_token_ids'])} prompt tokens), decode {t['decode_ms']:.1f} ms, "
            f"TPOT {t['tpot_ms']:.2f} ms]",
            file=sys.stderr,
        )
    else:
        for r in results:
            print(json.dumps(r, ensure_ascii=False))
        generated = sum(len(r["token_ids"]) for r in results)
        print(
            f"[{len(results)} requests, {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
