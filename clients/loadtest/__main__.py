"""Load-test client: python -m clients.loadtest --target HOST:PORT --concurrency 1,4,16,64 ...

Closed-loop concurrency sweeps or open-loop request-rate sweeps (Poisson or gamma arrivals) against the llm.v1
service, a Triton server running the TensorRT-LLM ensemble, llama.cpp's llama-server, or any OpenAI-compatible HTTP
server (smg in front of this service, vLLM, ...). Reports TTFT, TPOT, ITL and E2E percentiles,
throughputs and goodput per sweep point (metric definitions and the results format: docs/loadtest.md).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from clients.common import HelpFormatter, add_connection_args, call_metadata, open_aio_channel, open_channel
from clients.loadtest import http, llama_server, openai_http, report
from clients.loadtest.backends import Backend, LLMBackend, Sampling, TritonBackend
from clients.loadtest.driver import closed_loop, open_loop
from clients.loadtest.metrics import SLO, RequestRecord, summarize
from clients.loadtest.workload import Lengths, TokenizerFns, load
from protos.llm.v1 import llm_pb2, llm_pb2_grpc


def _range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    lo, _, hi = text.partition(":")
    if not lo.isdigit() or not hi.isdigit() or int(lo) > int(hi) or int(lo) < 1:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {text!r}")
    return int(lo), int(hi)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m clients.loadtest",
        description=__doc__.splitlines()[0],
    )
    add_connection_args(p, auth_help="file holding the bearer token, sent as `authorization: Bearer TOKEN` (gRPC "
                        "metadata; HTTP header for llama-server --api-key and openai, e.g. smg/vLLM --api-key)")  # fmt: skip
    p.add_argument(
        "--protocol",
        choices=["llm", "triton", "llama-server", "openai"],
        default="llm",
        help="llm.v1, Triton KServe v2, llama-server's HTTP /completion (--target http://HOST:PORT), or an "
        "OpenAI-compatible server's streaming API (--target http[s]://HOST:PORT; https verifies the server's "
        "certificate and host name with --tls-ca, else the system's CAs)",
    )
    p.add_argument(
        "--model",
        help="model name: triton's model (default ensemble); openai's `model` field (default: the first id "
        "GET /v1/models lists)",
    )
    p.add_argument(
        "--openai-api",
        choices=sorted(openai_http.APIS),
        default="completions",
        help="with --protocol openai: /v1/completions (the prompt as text) or /v1/chat/completions (the prompt as "
        "one user message)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="synthetic", help="'synthetic', a JSONL prompt file, or a ShareGPT JSON file")
    w.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens")
    w.add_argument("--output-len", type=int, default=128, help="tokens to generate (max_tokens)")
    w.add_argument("--input-len-range", type=_range, help="MIN:MAX, synthetic prompt lengths drawn uniformly")
    w.add_argument("--output-len-range", type=_range, help="MIN:MAX, output lengths drawn uniformly")
    w.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens tokens")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument(
        "--json-schema",
        metavar="FILE",
        type=Path,
        help="every request's output must match this JSON schema (llm: GenerateRequest.constraint; openai: "
        "response_format json_schema)",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrival process")
    w.add_argument(
        "--tokenizer",
        help="tokenizer.json or engine dir (default for llm and llama-server: the server's); triton and openai "
        "need it to cut synthetic prompts and decode them to text (openai: not for a JSONL dataset)",
    )
    load_args = p.add_argument_group("load (each sweep point is one run)")
    mode = load_args.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", help="closed loop: comma-separated concurrency levels, e.g. 1,4,16,64")
    mode.add_argument("--request-rate", help="open loop: comma-separated request rates per second")
    load_args.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    load_args.add_argument("--num-requests", type=int, default=64, help="requests per run")
    load_args.add_argument("--duration", type=float, help="send for this many seconds instead of --num-requests")
    load_args.add_argument("--warmup", type=int, default=2, help="uncounted requests before each run")
    load_args.add_argument("--time-limit", type=float, default=600.0, help="hard limit per run, seconds")
    out = p.add_argument_group("results")
    out.add_argument("--slo", nargs="*", default=[], help="goodput SLOs: ttft_ms=MS tpot_ms=MS e2e_ms=MS")
    out.add_argument("--output", type=Path, help="write the results JSON here")
    out.add_argument("--csv", type=Path, help="write one CSV row per run here")
    out.add_argument("--plot", type=Path, help="write PNG plots into this directory")
    args = p.parse_args(argv)
    if args.model is None and args.protocol == "triton":
        args.model = "ensemble"
    if args.json_schema is not None:
        if args.protocol not in ("llm", "openai"):
            p.error("--json-schema needs --protocol llm or openai")
        if args.ignore_eos:
            p.error("--json-schema cannot be combined with --ignore-eos: the schema decides where an output ends")
    return args


def tokenizer_fns(args: argparse.Namespace) -> TokenizerFns:
    if args.tokenizer:
        from tokenizers import Tokenizer

        path = Path(args.tokenizer)
        tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        return TokenizerFns(lambda s: tok.encode(s).ids, lambda ids: tok.decode(ids, skip_special_tokens=False))
    if args.protocol == "triton":
        raise SystemExit("loadtest: error: --protocol triton needs --tokenizer to build and count text prompts")
    if args.protocol == "llama-server":
        return llama_server.tokenizer_fns(llama_server.base_url(args.target), _http_headers(args))
    if args.protocol == "openai":
        if args.dataset.endswith(".jsonl"):  # prompts are text; their token counts come from each response's usage
            return TokenizerFns(str.split, None)
        raise SystemExit(
            "loadtest: error: --protocol openai needs --tokenizer (the served model's tokenizer.json or engine dir) "
            "for this dataset: an OpenAI API does not tokenize for its clients, and synthetic prompts are cut as "
            "token ids and sent as text (smg 1.13.0 refuses token-id prompts); a JSONL dataset needs none"
        )
    stub = llm_pb2_grpc.LLMServiceStub(open_channel(args))
    metadata = call_metadata(args)

    def encode(text: str) -> list[int]:
        return list(stub.Tokenize(llm_pb2.TokenizeRequest(text=text), metadata=metadata, timeout=30).token_ids)

    return TokenizerFns(encode, None)  # the llm protocol takes token ids: synthetic prompts are exact


def served_model(args: argparse.Namespace) -> dict:
    """What the target serves, for the report: GetModelInfo over llm.v1; Triton does not say (its model's name)."""
    if args.protocol == "triton":
        return {"model_name": args.model, "weight_format": "not reported by the triton protocol"}
    if args.protocol == "llama-server":
        return llama_server.model_info(llama_server.base_url(args.target), _http_headers(args))
    if args.protocol == "openai":
        return openai_http.model_info(_openai_endpoint(args), args.model, args.openai_api, dict(call_metadata(args)))
    info = llm_pb2_grpc.LLMServiceStub(open_channel(args)).GetModelInfo(
        llm_pb2.GetModelInfoRequest(), metadata=call_metadata(args), timeout=30
    )
    return {"model_name": info.model_name, "backend": info.backend, "dtype": info.dtype,
            "weight_format": info.weight_format, "kv_cache_dtype": info.kv_cache_dtype or "not reported"}  # fmt: skip


def _http_headers(args: argparse.Namespace) -> dict[str, str]:
    if args.tls_ca:
        raise ValueError("--protocol llama-server speaks plain HTTP: no --tls-ca")
    return dict(call_metadata(args))  # llama-server --api-key checks the same "authorization: Bearer" header


def _openai_endpoint(args: argparse.Namespace) -> http.Endpoint:
    https = args.target.startswith("https://")
    if args.tls_ca and not https:
        raise ValueError("--tls-ca with --protocol openai takes an https:// --target")
    if args.tls_server_name:
        raise ValueError("--protocol openai checks the --target's host name: no --tls-server-name")
    tls = http.tls_context(args.tls_ca, args.tls_cert, args.tls_key) if https else None
    return http.endpoint(args.target, "--protocol openai", tls)


def make_backend(args: argparse.Namespace) -> Backend:
    if args.protocol == "triton":
        return TritonBackend(args.target, args.model)
    if args.protocol == "llama-server":
        return llama_server.LlamaServerBackend(args.target, _http_headers(args))
    if args.protocol == "openai":
        return openai_http.OpenAIBackend(_openai_endpoint(args), args.model, args.openai_api, dict(call_metadata(args)))
    return LLMBackend(open_aio_channel(args), call_metadata(args))


async def run_sweep(args: argparse.Namespace, console: Console) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    tok = tokenizer_fns(args)
    schema = args.json_schema.read_text() if args.json_schema is not None else None
    sampling = Sampling(temperature=args.temperature, ignore_eos=args.ignore_eos, json_schema=schema)
    levels = [("concurrency", int(c)) for c in (args.concurrency or "1").split(",")]
    if args.request_rate:
        levels = [("request_rate", float(r)) for r in args.request_rate.split(",")]
    slo = SLO.parse(args.slo)
    lengths = Lengths(args.input_len, args.output_len, args.input_len_range, args.output_len_range)
    backend = make_backend(args)
    runs = []
    try:
        for kind, level in levels:
            n = args.num_requests
            # warm-up requests get prompts of their own: a prefix cache they fill serves none of the counted ones
            items = load(args.dataset, tok, n + args.warmup, lengths, rng)
            items, warmup = items[:n], items[n:]
            for item in warmup:
                await backend.send(item, sampling, RequestRecord(input_tokens=item.input_tokens))
            with Progress(
                TextColumn(f"[bold]{kind}={level:g}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console, transient=True,
            ) as progress:  # fmt: skip
                task = progress.add_task("requests", total=None if args.duration else len(items))

                def advance(_rec: RequestRecord, task=task, progress=progress) -> None:
                    progress.advance(task)

                if kind == "concurrency":
                    records, duration = await closed_loop(
                        backend, items, level, sampling, args.time_limit, args.duration, advance
                    )
                else:
                    records, duration = await open_loop(
                        backend, items, level, sampling, args.time_limit, args.burstiness, rng, args.duration, advance
                    )
            summary = {kind: level, **summarize(records, duration, slo)}
            ok = [r for r in records if r.ok]
            summary["_samples"] = {
                "ttft_ms": [r.ttft_ms for r in ok if r.ttft_ms is not None],
                "tpot_ms": [r.tpot_ms for r in ok if r.tpot_ms is not None],
            }
            runs.append(summary)
            console.print(
                f"{kind}={level:g}: {summary['completed']} ok, {summary['failed']} failed in {duration:.1f} s, "
                f"{summary['output_throughput_tok_s']:.1f} output tok/s"
            )
    finally:
        await backend.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=170)  # a log file: do not squeeze the table into 80 columns
    started = time.time()
    try:
        model = served_model(args)
        if args.protocol == "openai":
            args.model = model["model_name"]  # what every request names
        console.print(f"model {model['model_name']}, weights {model['weight_format']}"
                      + (f", KV cache {model['kv_cache_dtype']}" if "kv_cache_dtype" in model else "")
                      + (f", backend {model['backend']}" if "backend" in model else ""))  # fmt: skip
        runs = asyncio.run(run_sweep(args, console))
    except grpc.RpcError as err:
        console.print(f"loadtest: error: {err.code().name}: {err.details()}")
        return 1
    except (ValueError, OSError) as exc:
        console.print(f"loadtest: error: {exc}")
        return 2
    report.print_table(runs, console)
    meta = {
        "target": args.target,
        "protocol": args.protocol,
        **({"openai_api": args.openai_api} if args.protocol == "openai" else {}),
        "model": model,
        "dataset": args.dataset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "num_requests": args.num_requests,
        "duration": args.duration,
        "slo": [s for s in args.slo],
        "started_unix": started,
        "command": "python -m clients.loadtest " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.output:
        report.write_json(args.output, runs, meta)
        console.print(f"wrote {args.output}")
    if args.csv:
        report.write_csv(args.csv, runs)
        console.print(f"wrote {args.csv}")
    if args.plot:
        for path in report.write_plots(args.plot, runs):
            console.print(f"wrote {path}")
    return 0 if all(r["completed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
