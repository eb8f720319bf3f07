"""Serving overhead of one stream: the engine's TPOT and CPU per token against the same request through gRPC.

    python -m benchmarks.overhead_bench --engine engines/smollm2-135m [--rounds 15] [--baseline DIR] [--write]

Each round takes a fresh random prompt of --input-len token ids and asks for exactly --output-len tokens
(greedy, ignore_eos), interleaved:
- engine: EngineCore in this process (no gRPC, no event loop): its own Timing.tpot_ms, and the CPU time of
  every thread of this process while it ran (the step thread and the kernels' pool);
- server: the same request to `python -m service` over gRPC on 127.0.0.1, the TPOT in its final message;
- client: that request's TPOT as the client saw it (first to last token's arrival / (tokens - 1)), the client
  a separate process pinned to the last core (the service is not pinned);
- with --baseline DIR, the same request to a second service run from another checkout (its .venv if it has
  one), right after the first: an A/B of two trees in paired rounds.
The engine runs before and after the gRPC requests of its round (the mean of the two is the round's engine).

Serving CPU per token: each service's threads are read from /proc/<pid>/task/<tid>/ before and after its
request (schedstat's nanoseconds on CPU; utime + stime in clock ticks where schedstat is missing). Threads
named `llm-engine` (the native engine's step thread and the kernels' pool workers it started, which inherit
its name) are the engine; every other thread (the event loop, gRPC's threads, tokenizer pools) is outside it.
A service that names no thread (an older tree) has its engine told by use: besides the main thread, the
busiest thread (the step thread) and every thread using > 25% of its CPU (the pool's workers; gRPC's threads
use ~1%). Targets: outside <= 0.2 ms CPU per token, server and client TPOT <= 1.10x the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import (
    CLK_TCK,
    Rounds,
    add_sweep_args,
    bench_parser,
    free_port,
    machine_line,
    publish,
    start_service,
    stop_service,
)
from build_engine.spec import load_engine_config

ENGINE_THREAD = "llm-engine"  # service/backends/runtime.py ENGINE_THREAD_NAME (not imported: a baseline may lack it)
BUSY_SHARE = 0.25  # an unnamed thread using more than this share of the busiest thread's CPU is the engine's


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, CPU seconds so far) of every thread of process `pid` (threads gone meanwhile are skipped)."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            try:
                with open(f"{base}/schedstat") as f:
                    cpu = int(f.read().split()[0]) / 1e9
            except OSError:
                with open(f"{base}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
        except (OSError, IndexError, ValueError):
            continue
        threads[int(tid)] = (name, cpu)
    return threads


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """CPU seconds a service spent during one request, by whose thread."""

    engine: float  # the step thread and the kernels' pool
    loop: float  # the main thread: the event loop
    other: float  # every other thread outside the engine (gRPC's, pools)

    @property
    def outside(self) -> float:
        return self.loop + self.other


def cpu_split(pid: int, before: dict, after: dict) -> CpuSplit:
    used = {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}
    named = any(name == ENGINE_THREAD for name, _ in used.values())
    busiest = max((cpu for tid, (_, cpu) in used.items() if tid != pid), default=0.0)

    def is_engine(tid: int, name: str, cpu: float) -> bool:
        return name == ENGINE_THREAD if named else tid != pid and cpu > BUSY_SHARE * busiest

    engine = sum(cpu for tid, (name, cpu) in used.items() if is_engine(tid, name, cpu))
    loop = used.get(pid, ("", 0.0))[1]
    return CpuSplit(engine, loop, sum(cpu for _, cpu in used.values()) - engine - loop)


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


def _engine_round(core, ids: list[int], output_len: int) -> tuple[float, float]:
    """(TPOT ms, CPU ms per token of this whole process) of one in-process request."""
    from service.request import GenerateRequest, SamplingParams

    gen = GenerateRequest(f"r{time.monotonic_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                                         ignore_eos=True))  # fmt: skip
    before = thread_cpu(os.getpid())
    outs = core.generate([gen])[gen.request_id]
    after = thread_cpu(os.getpid())
    cpu = sum(c - before.get(tid, ("", 0.0))[1] for tid, (_, c) in after.items())
    return outs[-1].timing.tpot_ms, cpu * 1e3 / outs[-1].num_output_tokens


@dataclass(slots=True)
class Side:
    """One service under test and what its rounds measured."""

    label: str
    proc: subprocess.Popen
    port: int
    server: list[float]  # TPOT ms, the service's Timing
    client: list[float]  # TPOT ms, as the client saw it
    cpu: list[CpuSplit]  # per token, ms

    def request(self, ids: list[int], output_len: int) -> None:
        child = [sys.executable, "-m", "benchmarks.overhead_bench", "--output-len", str(output_len),
                 "--client", f"127.0.0.1:{self.port}|{json.dumps(ids)}"]  # fmt: skip
        before = thread_cpu(self.proc.pid)
        res = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
        split = cpu_split(self.proc.pid, before, thread_cpu(self.proc.pid))
        if res["tokens"] != output_len:
            raise RuntimeError(f"{self.label} streamed {res['tokens']} tokens, not {output_len}")
        self.server.append(res["server_tpot_ms"])
        self.client.append(res["client_tpot_ms"])
        per_token = 1e3 / output_len
        self.cpu.append(CpuSplit(split.engine * per_token, split.loop * per_token, split.other * per_token))


@contextlib.contextmanager
def _service(label: str, engine: str, tree: str | None):
    port = free_port()
    python, cwd = sys.executable, None
    if tree is not None:
        venv = Path(tree) / ".venv" / "bin" / "python"
        python, cwd = (str(venv) if venv.exists() else sys.executable), tree
    proc = start_service(engine, port, "auto", python=python, cwd=cwd)
    try:
        yield Side(label, proc, port, [], [], [])
    finally:
        stop_service(proc)


def main() -> None:
    p = bench_parser(__doc__, "overhead")
    add_sweep_args(p, concurrency=None, rounds=5)
    p.add_argument("--baseline", metavar="DIR", help="also measure the service of this checkout, interleaved (A/B)")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: child mode, TARGET:IDS_JSON
    args = p.parse_args()
    if args.client:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
        target, ids = args.client.split("|", 1)
        print(json.dumps(_client(target, json.loads(ids), args.output_len)))
        return

    from service.engine.core import EngineCore

    engine_dir = os.path.abspath(args.engine)
    cfg = load_engine_config(engine_dir)
    core = EngineCore(engine_dir, num_kv_blocks=64)
    rng = np.random.default_rng(0)
    engine, engine_cpu = [], []
    with contextlib.ExitStack() as stack:
        sides = [stack.enter_context(_service("this tree", engine_dir, None))]
        if args.baseline:
            sides.append(stack.enter_context(_service("baseline", engine_dir, os.path.abspath(args.baseline))))
        warm = rng.integers(100, cfg.arch.vocab_size, 16).tolist()
        _engine_round(core, warm, 8)
        for side in sides:  # warm-up: the first request pays for one-time work (the tokenizer's tables)
            side.request(warm, args.output_len)
            for values in (side.server, side.client, side.cpu):
                values.clear()
        for r in range(args.rounds):
            ids = rng.integers(100, cfg.arch.vocab_size, args.input_len).tolist()
            before, cpu_before = _engine_round(core, ids, args.output_len)
            for side in sides if r % 2 == 0 else sides[::-1]:  # alternate the order: neither always goes first
                side.request(ids, args.output_len)
            after, cpu_after = _engine_round(core, ids, args.output_len)
            engine.append((before + after) / 2)
            engine_cpu.append((cpu_before + cpu_after) / 2)
            line = " | ".join(
                f"{s.label}: server {s.server[-1]:.2f}, client {s.client[-1]:.2f}, outside "
                f"{s.cpu[-1].outside:.3f} ms/token"
                for s in sides
            )
            print(f"round {r + 1}: engine {engine[-1]:.2f} ms | {line}", file=sys.stderr)
    publish("overhead_bench", _report(args, cfg.weight_format, engine, engine_cpu, sides), args.write)


def _report(args, weight_format: str, engine: list[float], engine_cpu: list[float], sides: list[Side]) -> list[str]:
    eng = Rounds(engine)

    def paired(values: list[float]) -> float:
        return Rounds([a / e for a, e in zip(values, engine, strict=True)]).median

    baseline = f" --baseline {args.baseline}" if args.baseline else ""
    lines = [
        "## Serving overhead of one stream (`python -m benchmarks.overhead_bench`)",
        "",
        f"Command: `python -m benchmarks.overhead_bench --engine {args.engine} --rounds {args.rounds}{baseline} "
        "--write`  ",
        f"Machine: {machine_line()}. Engine weights: {weight_format}. {args.input_len}-token random prompts, "
        f"exactly {args.output_len} greedy tokens; per round the same request in-process (EngineCore), then over "
        "gRPC (server Timing, and client arrival times with the client pinned to the last core), then in-process "
        f"again (the engine's value of a round is the mean of the two). Medians of {args.rounds} interleaved rounds; "
        "'x engine, paired' is the median of the per-round ratios (robust to the box's speed drifting).",
        "",
        "| Measured at | TPOT p50 ms | x engine (medians) | x engine, paired | rounds (ms) |",
        "|---|---|---|---|---|",
        f"| engine (EngineCore) | {eng.median:.2f} | 1.000x | 1.000x | {eng.spread(2)} |",
    ]
    for side in sides:
        suffix = f", {side.label}" if len(sides) > 1 else ""
        for name, values in ((f"server (gRPC Timing){suffix}", side.server), (f"client{suffix}", side.client)):
            r = Rounds(values)
            lines.append(
                f"| {name} | {r.median:.2f} | {r.median / eng.median:.3f}x | {paired(values):.3f}x | {r.spread(2)} |"
            )
    lines += [
        "",
        "CPU per generated token, ms (per thread from /proc/<pid>/task/*/schedstat; medians of the rounds). "
        "Engine: the step thread and the kernels' pool (`llm-engine` threads; in-process: every thread of the "
        "benchmark while EngineCore ran); outside: every other thread of the service.",
        "",
        "| Process | engine | outside | of which event loop | of which other threads | outside, rounds |",
        "|---|---|---|---|---|---|",
        f"| in-process EngineCore | {Rounds(engine_cpu).median:.3f} | - | - | - | - |",
    ]
    for side in sides:
        cpu = side.cpu
        outside = Rounds([c.outside for c in cpu])
        lines.append(
            f"| service, {side.label} | {Rounds([c.engine for c in cpu]).median:.3f} | **{outside.median:.3f}** | "
            f"{Rounds([c.loop for c in cpu]).median:.3f} | {Rounds([c.other for c in cpu]).median:.3f} | "
            f"{outside.spread(3)} |"
        )
    lines += ["", "Targets: outside <= 0.2 ms CPU per token; server and client <= 1.10x the engine (stretch 1.05x)."]
    return lines


if __name__ == "__main__":
    main()
