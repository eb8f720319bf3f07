"""Reliability figures at full size, written to docs/reliability.md (CI runs the same checks scaled down).

    python -m benchmarks.reliability_bench --engine engines/smollm2-135m [--write] [--only fault,abuse,...]

fault     engine fault and stall injected through the FaultyRunner test double (tests/doubles.py): how fast the
          in-flight streams fail, the process exits (policy exit) or serves again (policy recover)
abuse     the abuse matrix (python -m clients.stress abuse) with normal traffic alongside
fuzz      10,000 seeded field-level fuzzed requests (python -m clients.stress fuzz)
soak      10,000 streams, 20% cancelled at random points, auth on (python -m clients.stress soak), on a
          tiny-random engine by default (--soak-engine): the leak checks are about the service, not the model
fairness  a 0.8 x max_seq_len prompt under a stream of short requests, and a short request during a long
          chunked prefill (EngineCore driven directly, timed on the engine's clock); then through gRPC, a
          decoding request's token gaps while a 6,000-token prompt is prefilled, with the long-prefill cap
          and without it (--long-prefill-token-threshold 0)
tokenize  the event loop's longest gap, health checks and another thread's rate while maximal prompts are
          tokenized (an in-process server: its own loop is probed), against tokenizers' GIL-holding encode
unread    a Triton stream that never reads (40 requests): other clients served, health, the slots it holds,
          and when the stall watch ends it
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import (
    bench_parser,
    free_port,
    machine_line,
    read_metric,
    start_service,
    stop_service,
    write_section,
)
from build_engine.builder import build
from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from service.engine.core import EngineCore
from service.request import GenerateRequest, SamplingParams

DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
KV = "512MiB"


def _stress(target: str, metrics: str, *args: str, token: str | None = None) -> dict:
    auth = ["--auth-token-file", token] if token else []
    cmd = [sys.executable, "-m", "clients.stress", "--target", target, "--metrics-url", metrics, *auth, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return json.loads(out.stdout)


def _served(engine: str, *flags: str, wrapper: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str]:
    port, metrics = free_port(), free_port()
    proc = start_service(engine, port, KV, "--metrics-port", str(metrics), *flags, wrapper=wrapper,
                         log=subprocess.DEVNULL)  # fmt: skip
    return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics"


# ---- fault -----------------------------------------------------------------------------------------------------
def _failing_streams(target: str, n: int) -> list[tuple[str, int, float]]:
    """(code, tokens, seconds from the last chunk to the error) for n streams that the fault ends."""
    stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target))
    max_tokens = stub.GetModelInfo(llm_pb2.GetModelInfoRequest()).max_seq_len - 32

    def one(i: int) -> tuple[str, int, float]:
        req = llm_pb2.GenerateRequest(request_id=f"f{i}", prompt=f"fault {i}",
                                      stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
        tokens, last = 0, time.monotonic()
        try:
            for resp in stub.Generate(req, timeout=120):
                tokens += len(resp.chunk.token_ids)
                last = time.monotonic()
        except grpc.RpcError as err:
            return err.code().name, tokens, time.monotonic() - last
        return "OK", tokens, 0.0

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def fault_figures(engine: str) -> list[tuple[str, str, str]]:
    rows = []
    for kind, fault, extra, goal in (
        ("fault", ("--fail-at-step", "40"), (), "fail within 5 s; exit non-zero"),
        ("stall", ("--stall-at-step", "40", "--stall-seconds", "600"), ("--stall-timeout", "5"),
         "NOT_SERVING and streams failed at the watchdog limit (5 s here); exit non-zero (a stall is fatal under exit)"),
    ):  # fmt: skip
        proc, target, _ = _served(engine, *extra, wrapper=("tests.fault_server", *fault))
        start = time.monotonic()
        results = _failing_streams(target, 4)
        failed_at = time.monotonic()
        code = proc.wait(60)
        exit_s = time.monotonic() - failed_at
        codes = sorted({r[0] for r in results})
        worst = max(r[2] for r in results)
        rows.append((f"{kind} injected at step 40, policy exit, 4 streams in flight",
                     f"streams ended with {'/'.join(codes)} (request id in the message) at most {worst:.2f} s after "
                     f"their last token; process exited with code {code} {exit_s:.1f} s later "
                     f"({failed_at - start:.1f} s after the streams began)",
                     goal))  # fmt: skip
    rows.append(_recover_figure(engine))
    return rows


def _recover_figure(engine: str) -> tuple[str, str, str]:
    proc, target, metrics = _served(engine, "--on-engine-error", "recover",
                                    wrapper=("tests.fault_server", "--fail-at-step", "40"))  # fmt: skip
    try:
        results = _failing_streams(target, 4)
        failed_at = time.monotonic()
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target))
        req = llm_pb2.GenerateRequest(prompt="after", stopping=llm_pb2.StoppingParams(max_tokens=8, ignore_eos=True))
        tokens = sum(len(r.chunk.token_ids) for r in stub.Generate(req, timeout=60))
        serving_s = time.monotonic() - failed_at
        state = asyncio.run(_idle(metrics))
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.Check(health_pb2.HealthCheckRequest()).status)
    finally:
        stop_service(proc)
    return ("fault injected at step 40, policy recover",
            f"streams ended with {'/'.join(sorted({r[0] for r in results}))}; next request served {tokens} tokens "
            f"{serving_s:.2f} s later; health {status}; KV blocks used {state['llm_kv_cache_blocks_used']:.0f}, "
            f"running {state['llm_num_requests_running']:.0f}",
            "serve again with every gauge back to zero")  # fmt: skip


async def _idle(metrics: str) -> dict:
    from clients.stress.run import wait_idle

    return await wait_idle(metrics)


# ---- abuse / fuzz / soak ---------------------------------------------------------------------------------------
def abuse_figure(engine: str) -> tuple[str, str, str]:
    proc, target, metrics = _served(engine)
    try:
        r = _stress(target, metrics, "abuse", "--baseline-s", "10")
    finally:
        stop_service(proc)
    failed = ", ".join(f["case"] for f in r["failed"]) or "none"
    return ("abuse matrix: every field at its bounds and beyond, malformed protobuf, invalid UTF-8 in every string "
            "field, oversized messages",
            f"{r['cases']} cases, failed: {failed}; refusals median {r['median_ms']} ms, slowest {r['max_ms']} ms; "
            f"normal traffic p99 {r['normal_p99_ms_alone']} ms alone, {r['normal_p99_ms_alongside']} ms alongside",
            "documented code naming the field, < 100 ms each")  # fmt: skip


def fuzz_figure(engine: str, n: int) -> tuple[str, str, str]:
    proc, target, metrics = _served(engine)
    try:
        r = _stress(target, metrics, "fuzz", "--requests", str(n), "--concurrency", "16", "--seed", "0")
    finally:
        stop_service(proc)
    codes = ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items()))
    return (f"field-level fuzz, {n} requests, seed 0",
            f"{codes}; findings {r['num_findings']}; health {r['health']}; KV blocks used after "
            f"{r['kv_blocks_used_after']:.0f}; {r['seconds']} s",
            "no crash, every answer a documented code, SERVING, 0 blocks")  # fmt: skip


def soak_figure(engine: str, n: int) -> tuple[str, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "token"
        token.write_text("soak-token\n")
        proc, target, metrics = _served(engine, "--auth-token-file", str(token))
        try:
            r = _stress(target, metrics, "soak", "--streams", str(n), "--concurrency", "32", "--max-tokens", "16",
                        "--warmup", "1000", token=str(token))  # fmt: skip
        finally:
            stop_service(proc)
    g = r["growth"]
    return (f"soak: {n} streams, 20% cancelled at random points, bearer auth on",
            f"{r['cancelled']} cancelled, problems {len(r['problems'])}; after warm-up: RSS "
            f"{g['process_resident_memory_bytes'] / 2**20:+.1f} MiB, fds {g['process_open_fds']:+.0f}, threads "
            f"{g['llm_process_threads']:+.0f}, event-loop tasks {g['llm_event_loop_tasks']:+.0f}; KV blocks used "
            f"{r['kv_blocks_used_after']:.0f}; {r['seconds']} s",
            "RSS < +20 MB; fds, threads, tasks back to baseline; every block free")  # fmt: skip


# ---- fairness ---------------------------------------------------------------------------------------------------
def fairness_figures(engine: str) -> list[tuple[str, str, str]]:
    core = EngineCore(engine, kv_cache_memory=KV)
    max_seq_len, budget = core.sched_cfg.max_seq_len, core.sched_cfg.max_num_batched_tokens
    vocab = core.config.arch.vocab_size
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    core.generate([GenerateRequest("warm", [5] * budget, greedy)])  # compile and page in
    # a short request arriving during a long chunked prefill
    long_len = int(0.8 * max_seq_len)
    core.add_request(GenerateRequest("long", [(7 + i) % vocab for i in range(long_len)], greedy))
    chunk_ms = _step_ms(core)  # the first chunk alone
    core.add_request(GenerateRequest("short", [9, 10, 11, 12], greedy))
    arrival, steps = core.clock(), 0
    while not core.scheduler.requests["short"].output_token_ids:
        _step_ms(core)
        steps += 1
    short_ttft = (core.clock() - arrival) * 1e3
    while core.has_unfinished_requests():
        core.step()
    decode_ms = min(_decode_step_ms(core) for _ in range(3))
    rows = [(f"short request (4 tokens) arriving during a {long_len}-token chunked prefill",
             f"first token after {steps} step(s), {short_ttft:.0f} ms; one {budget}-token chunk alone {chunk_ms:.0f} ms, "
             f"one decode step {decode_ms:.0f} ms",
             "TTFT <= one chunk + one decode step")]  # fmt: skip
    rows.append(_starvation_figure(engine, long_len))
    return rows


def _starvation_figure(engine: str, long_len: int) -> tuple[str, str, str]:
    """The long prompt under a steady stream of short requests (one every 4 steps, well within capacity), with a
    KV pool sized so the shorts in flight always leave too few blocks for it: only the bypass cap lets it in."""
    from build_engine.spec import load_engine_config

    config = load_engine_config(engine)
    bs, vocab = config.limits.kv_block_size, config.arch.vocab_size
    every, out_len = 4, 32
    short_blocks = -(-(3 + out_len) // bs)
    in_flight = out_len // every + 1  # shorts alive at once in steady state
    long_blocks = -(-(long_len + 4) // bs)
    core = EngineCore(engine, num_kv_blocks=long_blocks + in_flight * short_blocks // 2)  # shorts use ~2/3 of theirs
    shorts = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    step = 0

    def tick() -> None:
        nonlocal step
        if step % every == 0:
            core.add_request(GenerateRequest(f"s{step}", [(20 + step) % vocab, 21, 22], shorts))
        step += 1
        core.step()

    for _ in range(3 * out_len):  # steady state
        tick()
    core.add_request(GenerateRequest("long", [(8 + 3 * j) % vocab for j in range(long_len)],
                                     SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))  # fmt: skip
    long = core.scheduler.requests["long"]
    preempted_before = core.scheduler.num_preemptions
    waited, started = 0, None
    while not long.output_token_ids:
        tick()
        waited += 1
        if started is None and long.first_scheduled_time is not None:
            started = waited
    chunks = -(-long_len // core.sched_cfg.max_num_batched_tokens)
    preemptions = core.scheduler.num_preemptions - preempted_before
    return (f"{long_len}-token prompt (0.8 x max_seq_len) under a stream of short requests (one every {every} steps), "
            f"in a KV pool of {core.sched_cfg.num_kv_blocks} blocks that the shorts in flight keep too full for it",
            f"first scheduled after {started} step(s) (passed over {long.num_bypassed} times), first token after "
            f"{waited} steps ({chunks} chunks needed); preemptions meanwhile {preemptions} (of the long one: "
            f"{long.num_preemptions})",
            f"starts within a bounded number of steps (at most {core.sched_cfg.max_bypass} bypasses, then the shorts "
            "in flight drain)")  # fmt: skip


def _step_ms(core: EngineCore) -> float:
    start = time.perf_counter()
    core.step()
    return (time.perf_counter() - start) * 1e3


def _decode_step_ms(core: EngineCore) -> float:
    core.add_request(GenerateRequest("d", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    core.step()  # prefill
    ms = _step_ms(core)
    while core.has_unfinished_requests():
        core.step()
    return ms


# ---- prefill fairness through gRPC -----------------------------------------------------------------------------
def _gaps_during_prefill(engine: str, long_len: int, seed: int, *flags: str) -> tuple[float, list[float]]:
    """(the long prompt's TTFT in s, a decoding request's token gaps in s while the long prompt was prefilled)."""
    proc, target, _ = _served(engine, *flags)
    try:
        stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target))
        info = stub.GetModelInfo(llm_pb2.GetModelInfoRequest())
        rng = np.random.default_rng(seed)  # a prompt of its own each run: nothing from the prefix cache
        long_ids = rng.integers(100, info.vocab_size, long_len).tolist()
        short = stub.Generate(llm_pb2.GenerateRequest(
            prompt="Count slowly:", stopping=llm_pb2.StoppingParams(max_tokens=4096, ignore_eos=True)))  # fmt: skip
        next(short)  # decoding
        times: list[float] = []
        done = threading.Event()

        def read_short() -> None:
            try:
                for _ in short:
                    times.append(time.monotonic())
                    if done.is_set():
                        break
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read_short, daemon=True)
        reader.start()
        start = time.monotonic()
        req = llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=long_ids),
                                      stopping=llm_pb2.StoppingParams(max_tokens=1))  # fmt: skip
        list(stub.Generate(req, timeout=600))
        ttft = time.monotonic() - start
        done.set()
        short.cancel()
        reader.join(30)
        during = [t for t in times if t <= start + ttft]
        return ttft, [b - a for a, b in zip([start, *during], during, strict=False)]
    finally:
        stop_service(proc)


def prefill_fairness_figure(engine: str, long_len: int = 6000) -> tuple[str, str, str]:
    capped = _gaps_during_prefill(engine, long_len, 1)
    uncapped = _gaps_during_prefill(engine, long_len, 2, "--long-prefill-token-threshold", "0")
    (ttft, gaps), (ttft0, gaps0) = capped, uncapped
    return (f"a decoding request's inter-token gaps while a {long_len}-token prompt is prefilled (through gRPC)",
            f"with the long-prefill cap (default): max {max(gaps):.2f} s, p90 {np.percentile(gaps, 90):.2f} s over "
            f"{len(gaps)} tokens; the long prompt's TTFT {ttft:.1f} s. Without it (--long-prefill-token-threshold 0): "
            f"max {max(gaps0):.2f} s, p90 {np.percentile(gaps0, 90):.2f} s over {len(gaps0)} tokens, TTFT "
            f"{ttft0:.1f} s ({ttft / ttft0:.2f}x)",
            "max <= 1.0 s, p90 <= 0.5 s; the long prompt's TTFT within +25% of the uncapped one")  # fmt: skip


# ---- tokenization ------------------------------------------------------------------------------------------------
class _InProcessServer:
    """An LLMServer in its own event-loop thread, so the bench can probe that loop."""

    def __init__(self, engine: str) -> None:
        from service.api.server import LLMServer
        from service.config import BackendConfig, NativeConfig, ServerConfig

        cfg = ServerConfig(backend=BackendConfig(engine_dir=engine, native=NativeConfig(kv_cache_memory=KV)),
                           port=0, metrics_port=None, measure_ceilings=False)  # fmt: skip
        self.server = LLMServer(cfg)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(300)
        self.target = f"127.0.0.1:{self.server.port}"

    def longest_loop_gap(self, during) -> float:
        """Seconds of the longest stretch the server's event loop did not run, while `during()` runs here."""
        stop = threading.Event()

        async def probe() -> float:
            worst, last = 0.0, time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                worst, last = max(worst, now - last - 0.005), now
            return worst

        future = asyncio.run_coroutine_threadsafe(probe(), self.loop)
        try:
            during()
        finally:
            stop.set()
        return future.result(60)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.drain_and_stop(0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _maximal_tokenizations(target: str, text: str, health_stub) -> tuple[int, int]:
    """Two maximal Tokenize calls and one too-long Generate at once, on connections of their own, while health
    is asked every 50 ms: (health checks answered within 100 ms, asked)."""
    own = [("grpc.use_local_subchannel_pool", 1)]
    stubs = [llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target, options=own)) for _ in range(3)]
    done, answers = threading.Event(), []

    def ask_health() -> None:
        while not done.is_set():
            start = time.monotonic()
            health_stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            answers.append(time.monotonic() - start)
            time.sleep(0.05)

    checker = threading.Thread(target=ask_health, daemon=True)
    checker.start()
    calls = [stubs[0].Tokenize.future(llm_pb2.TokenizeRequest(text=text), timeout=300),
             stubs[1].Tokenize.future(llm_pb2.TokenizeRequest(text=text), timeout=300)]  # fmt: skip
    with contextlib.suppress(grpc.RpcError):  # refused: it cannot fit
        list(stubs[2].Generate(llm_pb2.GenerateRequest(prompt=text), timeout=300))
    for c in calls:
        c.result()
    done.set()
    checker.join(60)
    return sum(a < 0.1 for a in answers), len(answers)


def tokenize_figure(engine: str) -> tuple[str, str, str]:
    from service import tokenizer as tokenizer_module

    srv = _InProcessServer(engine)
    try:
        stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(srv.target))
        limit = stub.GetModelInfo(llm_pb2.GetModelInfoRequest()).max_text_bytes
        prose = "The keeper climbed the stairs at dusk, 1,204 steps, and lit the lamp for the 船 ships 🌊. "
        text = (prose * (limit // len(prose) + 1)).encode()[:limit].decode(errors="ignore")  # at most limit bytes
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(srv.target))
        result = {}
        now = tokenizer_module.Tokenizer._encoding
        held = lambda self, text, add: self._tok.encode(text, add_special_tokens=add)  # noqa: E731 (as before)
        for name, encoding in (("now", now), ("gil", held)):
            tokenizer_module.Tokenizer._encoding = encoding
            try:
                health_counts: list[tuple[int, int]] = []
                gap = srv.longest_loop_gap(
                    lambda counts=health_counts: counts.append(_maximal_tokenizations(srv.target, text, health))
                )
                result[name] = (gap, *health_counts[0])
            finally:
                tokenizer_module.Tokenizer._encoding = now
    finally:
        srv.close()
    (gap, fast, asked), (gap0, fast0, asked0) = result["now"], result["gil"]
    return (f"two maximal Tokenize calls ({limit:,}-byte texts of prose with CJK and emoji) and a too-long "
            "Generate at once, health asked every 50 ms (in-process server, its own event loop probed every 5 ms)",
            f"longest event-loop gap {gap * 1e3:.0f} ms, {fast}/{asked} health checks answered within 100 ms; with "
            f"tokenizers' GIL-holding encode (before): {gap0 * 1e3:.0f} ms, {fast0}/{asked0}",
            "event loop's longest gap < 100 ms")  # fmt: skip


# ---- a client that never reads ---------------------------------------------------------------------------------
def unread_figure(engine: str, stall_s: float = 10.0) -> tuple[str, str, str]:
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    proc, target, metrics = _served(engine, "--triton-port", str(triton := free_port()),
                                    "--stream-stall-timeout", str(stall_s))  # fmt: skip
    try:
        small = [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", 1024),
        ]
        channel = grpc.insecure_channel(f"127.0.0.1:{triton}", options=small)

        def request(i: int):
            req = service_pb2.ModelInferRequest(model_name="tensorrt_llm", id=f"u{i}")
            for name, dtype, value in (("input_ids", "INT32", [[5, 6, 7]]), ("input_lengths", "INT32", [[3]]),
                                       ("request_output_len", "INT32", [[40]]), ("streaming", "BOOL", [[True]]),
                                       ("end_id", "INT32", [[-1]])):  # fmt: skip
                arr = np.array(value, dtype=np.bool_ if dtype == "BOOL" else np.int32)
                req.inputs.add(name=name, datatype=dtype, shape=list(arr.shape))
                req.raw_input_contents.append(arr.tobytes())
            return req

        opened = time.monotonic()
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([request(i) for i in range(40)])
        )
        stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(target))
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        latencies, serving, slots_idle = [], 0, None
        ended = None
        req = llm_pb2.GenerateRequest(prompt="Hello", stopping=llm_pb2.StoppingParams(max_tokens=16, ignore_eos=True))
        while ended is None and time.monotonic() - opened < stall_s + 60:
            start = time.monotonic()
            list(stub.Generate(req, timeout=60))
            latencies.append(time.monotonic() - start)
            serving += health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
            if slots_idle is None and read_metric(metrics, "llm_rpc_slots_used") == 0:
                slots_idle = time.monotonic() - opened
            if read_metric(metrics, "llm_streams_stalled_total") >= 1:
                ended = time.monotonic() - opened
        call.cancel()
        blocks = read_metric(metrics, "llm_kv_cache_blocks_used")
    finally:
        stop_service(proc)
    return (f"one Triton stream that never reads (40 x 40-token requests, a 1 KB HTTP/2 window), "
            f"--stream-stall-timeout {stall_s:.0f} s, another client's 16-token Generate in a loop",
            f"{len(latencies)} other Generates all OK (p50 {np.median(latencies) * 1e3:.0f} ms, max "
            f"{max(latencies) * 1e3:.0f} ms), health SERVING {serving}/{len(latencies)}; the stream held no slot "
            f"from {slots_idle:.1f} s (its work done, its responses unread); ended at {ended:.1f} s; KV blocks "
            f"after: {blocks:.0f}",
            "other clients served, health SERVING, no slot kept once the work ends, the stream ended after the "
            "stall timeout")  # fmt: skip


# ---- report -----------------------------------------------------------------------------------------------------
def main() -> None:
    p = bench_parser(__doc__, "figures", doc_path="docs/reliability.md")
    p.add_argument("--soak-engine", help="engine for the soak (default: a tiny-random engine built for it)")
    p.add_argument("--only", default="fault,abuse,fuzz,soak,fairness,tokenize,unread")
    p.add_argument("--fuzz-requests", type=int, default=10_000)
    p.add_argument("--soak-streams", type=int, default=10_000)
    args = p.parse_args()
    only = set(args.only.split(","))
    rows: list[tuple[str, str, str]] = []
    started = time.monotonic()
    if "fault" in only:
        rows += fault_figures(args.engine)
    if "abuse" in only:
        rows.append(abuse_figure(args.engine))
    if "fuzz" in only:
        rows.append(fuzz_figure(args.engine, args.fuzz_requests))
    if "soak" in only:
        with tempfile.TemporaryDirectory() as tmp:
            soak_engine = args.soak_engine
            if soak_engine is None:
                soak_engine = str(Path(tmp) / "tiny")
                build("tiny-random", soak_engine, {"max_seq_len": 512, "max_num_tokens": 256}, progress=False)
            rows.append(soak_figure(soak_engine, args.soak_streams))
    if "fairness" in only:
        rows += fairness_figures(args.engine)
        rows.append(prefill_fairness_figure(args.engine))
    if "tokenize" in only:
        rows.append(tokenize_figure(args.engine))
    if "unread" in only:
        rows.append(unread_figure(args.engine))
    cmd = "python -m benchmarks.reliability_bench " + " ".join(sys.argv[1:]).replace(" --write", "")
    lines = [
        f"Command: `{cmd.strip()}` ({(time.monotonic() - started) / 60:.0f} min)  ",
        f"Machine: {machine_line()}. Engine: `{args.engine}`.",
        "",
        "| Figure | Measured | Target |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("reliability_bench", text, DOC)


if __name__ == "__main__":
    main()
