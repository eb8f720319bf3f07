"""Streaming client: python -m clients.stream --target localhost:50051 "prompt"

Prints the text as it arrives, then TTFT, TPOT and tokens/s measured here and by the server. With --json,
prints one JSON object per chunk; the last has token_ids, finish_reason, usage and timing. On an error it
prints the gRPC status code name and message and exits with 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict

from clients.common import (
    HelpFormatter,
    add_connection_args,
    add_constraint_args,
    add_sampling_args,
    build_request,
    call_metadata,
    open_channel,
)
from protos.llm.v1 import llm_pb2, llm_pb2_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m clients.stream",
        description="Stream a completion from the service.",
    )
    p.add_argument("prompt", help="prompt text (a user message with --chat)")
    add_connection_args(p)
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message (the chat template applies)")
    p.add_argument("--json", action="store_true", help="one JSON object per chunk, then a final summary object")
    p.add_argument("--deadline", type=float, help="seconds before the call is abandoned (DEADLINE_EXCEEDED)")
    add_sampling_args(p)
    add_constraint_args(p)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    try:
        request = build_request(args, args.prompt, args.chat)
    except OSError as exc:  # a --json-schema / --grammar / --gbnf file that cannot be read
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open_channel(args) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        start = time.perf_counter()
        token_times: list[float] = []
        token_ids: list[int] = []
        complete = None
        call = stub.Generate(request, timeout=args.deadline, metadata=call_metadata(args))
        interrupted: list[int] = []

        def on_sigint(signum: int, frame: object) -> None:  # Ctrl-C cancels the call; the loop below ends
            interrupted.append(signum)
            call.cancel()

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            for resp in call:
                now = time.perf_counter()
                if resp.HasField("chunk"):
                    ids = list(resp.chunk.token_ids)
                    token_ids += ids
                    token_times += [now] * len(ids)
                    if args.json:
                        print(
                            json.dumps(
                                {"text": resp.chunk.text, "token_ids": ids, "t_ms": (now - start) * 1e3},
                                ensure_ascii=False,
                            )
                        )
                    else:
                        print(resp.chunk.text, end="", flush=True)
                else:
                    complete = resp.complete
        except grpc.RpcError as err:
            if not args.json:
                print(file=sys.stderr)
            if interrupted:
                print("interrupted", file=sys.stderr)
                return 130
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGINT, previous)
    summary = client_timing(start, token_times)
    if args.json:
        done = MessageToDict(complete, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        print(json.dumps({"token_ids": token_ids, **done, "client_timing": summary}, ensure_ascii=False))
    else:
        t = complete.timing
        print(
            f"\n[{len(token_ids)} tokens, {llm_pb2.FinishReason.Name(complete.finish_reason)}] "
            f"client: TTFT {summary['ttft_ms']:.1f} ms, TPOT {summary['tpot_ms']:.2f} ms, "
            f"{summary['tokens_per_s']:.1f} tok/s | server: queue {t.queue_ms:.1f} ms, prefill {t.prefill_ms:.1f} ms, "
            f"TTFT {t.ttft_ms:.1f} ms, TPOT {t.tpot_ms:.2f} ms",
            file=sys.stderr,
        )
    return 0


def client_timing(start: float, token_times: list[float]) -> dict[str, float]:
    """TTFT, TPOT and tokens/s as this client saw them (arrival of each token's chunk)."""
    if not token_times:
        return {"ttft_ms": 0.0, "tpot_ms": 0.0, "e2e_ms": 0.0, "tokens_per_s": 0.0}
    n = len(token_times)
    decode = token_times[-1] - token_times[0]
    e2e = token_times[-1] - start
    return {
        "ttft_ms": (token_times[0] - start) * 1e3,
        "tpot_ms": decode * 1e3 / (n - 1) if n > 1 else 0.0,
        "e2e_ms": e2e * 1e3,
        "tokens_per_s": n / e2e if e2e > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:  # Ctrl-C outside the call (connecting, printing): no traceback either
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
