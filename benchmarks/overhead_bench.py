"""Serving overhead of one stream: the engine's TPOT against the same request's TPOT through gRPC.

    python -m benchmarks.overhead_bench --engine engines/smollm2-135m [--rounds 5] [--write]

Each round takes a fresh random prompt of --input-len token ids and asks for exactly --output-len tokens
(greedy, ignore_eos), three ways, interleaved:
- engine: EngineCore in this process (no gRPC, no event loop, no detokenizer): its own Timing.tpot_ms;
- server: the same request to `python -m service` over gRPC on 127.0.0.1, the TPOT in its final message;
- client: that request's TPOT as the client saw it (first to last token's arrival / (tokens - 1)), the client
  a separate process pinned to the last core (the service is not pinned).
Ratios: of medians over rounds, and the median of per-round ratios (the engine measured before and after the
gRPC request of its round); the target is server and client <= 1.10x the engine (stretch 1.05x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import Rounds, add_sweep_args, bench_parser, machine_line, publish, running_service
from build_engine.spec import load_engine_config


def _client(target: str, ids: list[int], output_len: int) -> dict[str, float]:
    """One stream (run in a child process that pinned itself before grpc started any thread)."""
    import grpc

    from protos.llm.v1 import llm_pb2, llm_pb2_grpc

    stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target))
    stub.GetModelInfo(llm_pb2.GetModelInfoRequest(), timeout=30)  # connected before the clock starts
    req = llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=ids))
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = output_len
    req.stopping.ignore_eos = True
    times, tokens, server_tpot = [], 0, 0.0
    for msg in stub.Generate(req, timeout=600):
        now = time.perf_counter()
        if msg.HasField("chunk") and msg.chunk.token_ids:
            tokens += len(msg.chunk.token_ids)
            times.append((now, tokens))
        elif msg.HasField("complete"):
            server_tpot = msg.complete.timing.tpot_ms
    (t0, n0), (t1, n1) = times[0], times[-1]
    return {"client_tpot_ms": (t1 - t0) * 1e3 / (n1 - n0), "server_tpot_ms": server_tpot, "tokens": tokens}


def _engine_tpot(core, ids: list[int], output_len: int) -> float:
    from service.request import GenerateRequest, SamplingParams

    gen = GenerateRequest(f"r{time.monotonic_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                                         ignore_eos=True))  # fmt: skip
    outs = core.generate([gen])[gen.request_id]
    return outs[-1].timing.tpot_ms


def main() -> None:
    p = bench_parser(__doc__, "overhead")
    add_sweep_args(p, concurrency=None, rounds=5)
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: child mode, TARGET:IDS_JSON
    args = p.parse_args()
    if args.client:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
        target, ids = args.client.split("|", 1)
        print(json.dumps(_client(target, json.loads(ids), args.output_len)))
        return

    from service.engine.core import EngineCore

    cfg = load_engine_config(args.engine)
    core = EngineCore(args.engine, num_kv_blocks=64)
    rng = np.random.default_rng(0)
    engine, server, client = [], [], []
    with running_service(args.engine, "auto") as (_, port):
        _engine_tpot(core, rng.integers(100, cfg.arch.vocab_size, 16).tolist(), 8)  # warm-up both sides
        for r in range(args.rounds):
            ids = rng.integers(100, cfg.arch.vocab_size, args.input_len).tolist()
            before = _engine_tpot(core, ids, args.output_len)
            child = [sys.executable, "-m", "benchmarks.overhead_bench", "--output-len", str(args.output_len),
                     "--client", f"127.0.0.1:{port}|{json.dumps(ids)}"]  # fmt: skip
            res = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
            if res["tokens"] != args.output_len:
                raise RuntimeError(f"the service streamed {res['tokens']} tokens, not {args.output_len}")
            # The engine runs before and after the gRPC request: this box's speed drifts over seconds, and the
            # per-round ratio against the mean of the two cancels most of that drift.
            engine.append((before + _engine_tpot(core, ids, args.output_len)) / 2)
            server.append(res["server_tpot_ms"])
            client.append(res["client_tpot_ms"])
            print(f"round {r + 1}: engine {engine[-1]:.2f} ms, server {server[-1]:.2f}, client {client[-1]:.2f}",
                  file=sys.stderr)  # fmt: skip
    rounds = {"engine": Rounds(engine), "server": Rounds(server), "client": Rounds(client)}
    med = {k: r.median for k, r in rounds.items()}
    paired = {k: Rounds([a / e for a, e in zip(r.values, engine, strict=True)]).median for k, r in rounds.items()}
    lines = [
        "## Serving overhead of one stream (`python -m benchmarks.overhead_bench`)",
        "",
        f"Command: `python -m benchmarks.overhead_bench --engine {args.engine} --rounds {args.rounds} --write`  ",
        f"Machine: {machine_line()}. Engine weights: {cfg.weight_format}. {args.input_len}-token random prompts, "
        f"exactly {args.output_len} greedy tokens; per round the same request in-process (EngineCore), then over "
        "gRPC (server Timing, and client arrival times with the client pinned to the last core), then in-process "
        f"again (the engine's value of a round is the mean of the two). Medians of {args.rounds} interleaved rounds; "
        "'x engine, paired' is the median of the per-round ratios (robust to the box's speed drifting).",
        "",
        "| Measured at | TPOT p50 ms | x engine (medians) | x engine, paired | rounds (ms) |",
        "|---|---|---|---|---|",
    ]
    for name in ("engine (EngineCore)", "server (gRPC Timing)", "client"):
        key = name.split()[0]
        lines.append(
            f"| {name} | {med[key]:.2f} | {med[key] / med['engine']:.3f}x | {paired[key]:.3f}x | "
            f"{rounds[key].spread(2)} |"
        )
    lines += ["", "Target: server and client <= 1.10x the engine (stretch 1.05x)."]
    publish("overhead_bench", lines, args.write)


if __name__ == "__main__":
    main()
