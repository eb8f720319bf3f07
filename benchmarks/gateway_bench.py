"""The Shepherd Model Gateway (smg) in front of the service: its cost against direct llm.v1, cache-aware routing
fed by our KV events against round-robin over two replicas, and our load tester against NVIDIA's aiperf.

    python -m benchmarks.gateway_bench --engine engines/smollm2-135m [--rounds 3] [--routing-rounds 3]
        [--tool-rounds 2] [--aiperf /work/aiperf-venv/bin/aiperf] [--write]
    python -m benchmarks.gateway_bench --from-results build/gateway_bench.json --write   # re-render only

1. Overhead. One `python -m service` (prefix caching off, so the second arm of a pair, which sends the same
   prompts, is not served from the cache the first filled) and `smg launch --policy cache_aware` in front of it.
   Both arms send the same requests: a JSONL file of text prompts (--input-len-token windows of the load
   tester's bundled corpus, decoded to text), the same seed, max_tokens --output-len with ignore_eos, greedy.
   Direct: `clients.loadtest --protocol llm` (the server tokenizes the text); through smg:
   `--protocol openai --openai-api completions` (smg tokenizes it, with the bundle our GetTokenizer serves).
   Output tok/s at concurrency --overhead-concurrency and TTFT p50 at concurrency 1, --rounds interleaved rounds
   (direct, smg, direct, smg, ...): medians and per-round ratios.
2. Routing. Two fresh replicas (each `python -m service` with OPENBLAS_NUM_THREADS=1 and its kernels' thread pool
   at --replica-threads) and smg with --policy cache_aware (its index fed by our SubscribeKvEvents) or
   round_robin; every arm starts cold (new server processes, new smg). The workload is built here,
   deterministically: --groups system prompts of ~--system-len tokens, each with short user turns, sent as
   two-message chats (system + user), --routing-requests requests at concurrency --routing-concurrency, the
   first request of each system prompt first, then the rest in a seeded shuffle. The prefix-hit ratio is
   llm_prefix_cache_hit_tokens_total / llm_prompt_tokens_total over both replicas (their metrics ports, read
   before and after); the ideal is what one cache holding every earlier request of a system prompt would serve
   (per request, its longest whole-block common prefix with an earlier request of the same system prompt, at
   most its length - 1, as the server reuses), from the token ids our Tokenize renders for each chat.
3. Load testers. Through smg on the setup of 1: our load tester (`--protocol openai --openai-api completions`)
   and aiperf (`aiperf profile --endpoint-type completions --streaming`, the same prompts in the same order,
   the same max_tokens, ignore_eos, temperature 0), one after the other (alternating which goes first),
   --tool-rounds times: TTFT p50, and each tool's mean TTFT against the server's own mean TTFT over the same run
   (its metrics port), which takes out how fast the shared machine happened to be in that minute.

Results JSON: build/gateway_bench.json; the markdown report is printed (--write: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
from rich.console import Console

from benchmarks.common import (
    CpuMeter,
    Rounds,
    bench_parser,
    free_port,
    loadtest,
    machine_line,
    publish,
    read_metric,
    running_service,
    start_service,
    stop_service,
)
from clients.loadtest.__main__ import parse_args as loadtest_args
from clients.loadtest.__main__ import tokenizer_fns
from clients.loadtest.backends import Sampling
from clients.loadtest.driver import closed_loop
from clients.loadtest.http import endpoint
from clients.loadtest.metrics import SLO, summarize
from clients.loadtest.openai_http import OpenAIBackend
from clients.loadtest.workload import CORPUS, Lengths, TokenizerFns, WorkItem, load, synthetic
from protos.llm.v1 import llm_pb2, llm_pb2_grpc

RESULTS = Path("build/gateway_bench.json")
AIPERF = "/work/aiperf-venv/bin/aiperf"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
REPLICA_FLAG = "--replica-threads"  # internal: run the service with its kernels' pool at N threads


# ---- a replica with fewer kernel threads ---------------------------------------------------------------------------
def serve_replica(argv: list[str]) -> None:
    """`python -m benchmarks.gateway_bench --replica-threads N -- SERVICE FLAGS`: the service, its C kernels' pool at
    N threads (the service has no flag for it: the pool takes every online CPU, and two replicas' spinning
    workers on 2 cores would fight)."""
    threads, rest = int(argv[1]), argv[argv.index("--") + 1 :]
    from service.engine.kernels import matmul

    matmul.set_num_threads(threads)
    sys.argv = ["service", *rest]
    runpy.run_module("service", run_name="__main__")


@contextlib.contextmanager
def replicas(engine: str, kv: str, n: int, threads: int) -> Iterator[list[tuple[subprocess.Popen, int, int]]]:
    """n fresh servers with OPENBLAS_NUM_THREADS=1 and `threads` kernel threads: [(process, port, metrics port)]."""
    ports = [(free_port(), free_port()) for _ in range(n)]
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        wrapper = ("benchmarks.gateway_bench", REPLICA_FLAG, str(threads))

        def start(p: tuple[int, int]) -> subprocess.Popen:
            return start_service(
                engine, p[0], kv, "--metrics-port", str(p[1]), "--no-measure-ceilings", wrapper=wrapper
            )

        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(start, p) for p in ports]
        procs = [f.result() for f in futures if f.exception() is None]
        if len(procs) < n:  # one did not come up: stop the others, then say why
            for proc in procs:
                stop_service(proc)
            next(f.result() for f in futures if f.exception() is not None)
    finally:
        if saved is None:
            os.environ.pop("OPENBLAS_NUM_THREADS")
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved
    try:
        yield [(proc, port, mport) for proc, (port, mport) in zip(procs, ports, strict=True)]
    finally:
        for proc in procs:
            stop_service(proc)


# ---- smg -----------------------------------------------------------------------------------------------------------
def tokenizer_bundle(port: int, run: Path) -> tuple[str, Path]:
    """The worker's GetTokenizer zip, unzipped into run/MODEL_NAME (how smg 1.13.0 matches --tokenizer-path to the
    worker's model): (model name, that directory)."""
    from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc
    from smg_grpc_proto.generated import common_pb2

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    model = llm_pb2_grpc.LLMServiceStub(channel).GetModelInfo(llm_pb2.GetModelInfoRequest(), timeout=30).model_name
    chunks = list(pb_grpc.TrtllmServiceStub(channel).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    if chunks[-1].sha256 != hashlib.sha256(data).hexdigest():
        raise RuntimeError("the tokenizer bundle's sha256 does not match")
    zipfile.ZipFile(io.BytesIO(data)).extractall(run / model)
    return model, run / model


def smg_metric(metrics_url: str, name: str, worker: str) -> float:
    """The sum of smg's samples of `name` whose labels name `worker` (grpc://HOST:PORT)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and f'worker="grpc://{worker}"' in line)  # fmt: skip


def _routable(url: str, model: str, workers: list[str]) -> bool:
    try:
        listed = json.loads(urllib.request.urlopen(url + "/workers", timeout=5).read())["workers"]
        healthy = {w["url"] for w in listed if w.get("is_healthy") and w.get("status", "ready") == "ready"}
        if not all(f"grpc://{w}" in healthy for w in workers):
            return False
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
        return urllib.request.urlopen(req, timeout=10).status == 200
    except (OSError, ValueError, KeyError):
        return False


@contextlib.contextmanager
def gateway(
    workers: list[str], model: str, run: Path, policy: str, kv_events: bool = True
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`smg launch` in `run` (which holds the bundle as run/MODEL) in front of `workers` (HOST:PORT) with `policy`,
    returned once every worker is registered and healthy, a completion goes through and (cache_aware) smg is
    subscribed to every worker's KV events (workers with prefix caching off serve none): (its URL, the process; its metrics at proc.metrics_url)."""
    smg = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    port, prom = free_port(), free_port()
    cmd = [smg, "launch", "--worker-urls", *(f"grpc://{w}" for w in workers), "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
           "--tokenizer-path", model, "--policy", policy]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with (run / f"smg-{policy}.log").open("ab") as log:
        proc = subprocess.Popen(cmd, cwd=run, stdout=log, stderr=subprocess.STDOUT)
        proc.metrics_url = f"http://127.0.0.1:{prom}/metrics"  # type: ignore[attr-defined]
        try:
            deadline = time.monotonic() + 120
            while not _routable(url, model, workers) or (
                policy == "cache_aware"
                and kv_events
                and not all(smg_metric(proc.metrics_url, "smg_kv_event_subscriptions_total", w) > 0 for w in workers)
            ):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = ANSI.sub("", (run / f"smg-{policy}.log").read_text()[-800:])
                    raise RuntimeError(f"smg did not come up routing to {workers}: {tail}")
                time.sleep(0.5)
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- workloads -----------------------------------------------------------------------------------------------------
def local_tokenizer(engine: str) -> TokenizerFns:
    """The engine's tokenizer.json, as the load tester loads it for --tokenizer."""
    return tokenizer_fns(loadtest_args(["--tokenizer", engine]))


def write_prompts(path: Path, tok: TokenizerFns, n: int, input_len: int, output_len: int) -> None:
    """n text prompts (windows of the bundled corpus, input_len tokens, decoded) as load-tester JSONL."""
    items = synthetic(tok, n, Lengths(input_len, output_len), np.random.default_rng(12345))
    path.write_text("".join(json.dumps({"prompt": it.prompt, "max_tokens": output_len}) + "\n" for it in items))


def as_sent(path: Path, n: int, warmup: int, seed: int) -> list[WorkItem]:
    """The requests `clients.loadtest --dataset path --seed seed` sends, in order: its warm-up ones, then the rest
    (the same sampling with the same seed)."""
    items = load(str(path), TokenizerFns(str.split, None), n + warmup, Lengths(), np.random.default_rng(seed))
    return items[n:] + items[:n]


QUESTIONS = [
    "Summarize the second paragraph in one sentence.", "Which names appear in the text?",
    "What is the tone of the passage?", "List three facts the text states.", "Explain the last sentence.",
    "Is there a date in the text?", "What happens first?", "Give the passage a title.",
    "Which word is used most often?", "Who is speaking?", "What would a reader ask next?",
    "Rewrite the first sentence plainly.", "What is the main claim?", "Is the text fiction or not?",
    "Name one object mentioned.", "What happens at the end?",
]  # fmt: skip


def routing_workload(tok: TokenizerFns, groups: int, system_len: int, n: int, seed: int) -> list[list[dict]]:
    """n two-message chats over `groups` system prompts of ~system_len tokens (each opening with words of its own,
    so no two share a first KV block): the first chat of each system prompt first, then a seeded shuffle."""
    corpus = [t for para in CORPUS.read_text().split("\n\n") for t in tok.encode(para + "\n\n")]
    assert tok.decode is not None
    systems = []
    for g in range(groups):
        start = (g * len(corpus)) // groups
        body = tok.decode([corpus[(start + i) % len(corpus)] for i in range(system_len)])
        systems.append(f"System prompt {g} of archive {chr(65 + g)}: answer questions about this text.\n\n{body}")
    per_group = -(-n // groups)
    chats = [
        [{"role": "system", "content": systems[g]},
         {"role": "user", "content": f"Question {q + 1} on text {chr(65 + g)}: {QUESTIONS[q % len(QUESTIONS)]}"}]
        for q in range(per_group) for g in range(groups)
    ][:n]  # fmt: skip
    head, rest = chats[:groups], chats[groups:]
    order = np.random.default_rng(seed).permutation(len(rest))
    return head + [rest[i] for i in order]


def ideal_hits(ids: list[list[int]], group_of: list[int], block: int) -> int:
    """Prompt tokens one unbounded cache per system prompt would serve: for each request, its longest common
    prefix with an earlier request of its system prompt, in whole blocks, at most len - 1 (the last prompt token
    is always computed)."""
    total = 0
    for i, seq in enumerate(ids):
        best = 0
        for j in range(i):
            if group_of[j] != group_of[i]:
                continue
            other, k = ids[j], 0
            while k < min(len(seq), len(other)) and seq[k] == other[k]:
                k += 1
            best = max(best, k)
        total += (min(best, len(seq) - 1) // block) * block
    return total


class SystemChatBackend(OpenAIBackend):
    """The load tester's OpenAI backend (chat) sending each item as a two-message chat: `chats` maps an item's
    prompt (the user turn) to its messages (the CLI's --openai-api chat sends one user message only)."""

    def __init__(self, url: str, model: str, chats: dict[str, list[dict]]) -> None:
        super().__init__(endpoint(url, "--protocol openai"), model, "chat")
        self.chats = chats

    def body(self, item: WorkItem, sampling: Sampling) -> dict:
        body = super().body(item, sampling)
        body["messages"] = self.chats[item.prompt or ""]
        return body


def run_chats(url: str, model: str, chats: list[list[dict]], concurrency: int, output_len: int) -> dict:
    backend = SystemChatBackend(url, model, {c[1]["content"]: c for c in chats})
    items = [WorkItem(c[1]["content"], None, 0, output_len) for c in chats]
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    records, duration = asyncio.run(closed_loop(backend, items, concurrency, sampling, 900.0))
    return summarize(records, duration, SLO.parse([]))


# ---- aiperf --------------------------------------------------------------------------------------------------------
def run_aiperf(aiperf: str, url: str, model: str, tokenizer: Path, items: list[WorkItem], concurrency: int,
               warmup: int, out: Path, nice: int = 0) -> dict:  # fmt: skip
    """`aiperf profile` through smg on exactly `items` (warm-up ones first), its own process tree; its export's
    TTFT and throughput, and whether its log shows any attempt to reach the Hugging Face hub."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "inputs.jsonl"
    data.write_text("".join(json.dumps({"text": it.prompt, "output_length": it.max_tokens}) + "\n" for it in items))
    cmd = [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--concurrency", str(concurrency), "--request-count", str(len(items) - warmup),
           "--warmup-request-count", str(warmup), "--input-file", str(data), "--custom-dataset-type", "single_turn",
           "--dataset-sampling-strategy", "sequential", "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", "temperature:0", "--tokenizer", str(tokenizer), "--artifact-dir", str(out / "artifacts"),
           "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--random-seed", "0"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1")
    cmd = (["nice", "-n", str(nice)] if nice else []) + cmd
    start, t0 = time.monotonic(), os.times()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=900, cwd=out)
    wall, t1 = time.monotonic() - start, os.times()
    cores = (t1.children_user + t1.children_system - t0.children_user - t0.children_system) / wall
    log = ANSI.sub("", proc.stdout + proc.stderr)
    (out / "aiperf.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf exited with {proc.returncode}: {log[-1500:]}")
    export = out / "artifacts" / "profile_export_aiperf.json"  # the profiling phase (phases/ holds each)
    doc = json.loads(export.read_text())

    def metric(name: str, stat: str = "p50") -> float | None:
        entry = doc.get(name) or next((m for m in doc.get("metrics", []) if m.get("tag") == name), None)
        return None if not entry else entry.get(stat)

    hub = sorted(set(re.findall(r"[^\n]*(?:huggingface\.co|hf\.co/|HTTPSConnectionPool)[^\n]*", log)))[:3]
    return {"ttft_ms_p50": metric("time_to_first_token"), "ttft_ms_avg": metric("time_to_first_token", "avg"), "ttft_ms_p90": metric("time_to_first_token", "p90"),
            "ttfot_ms_p50": metric("time_to_first_output_token"),
            "output_tok_s": metric("output_token_throughput", "avg"),
            "requests": metric("request_count", "avg"), "output_tokens_per_request": metric("output_sequence_length",
                                                                                           "avg"),
            "input_tokens_per_request": metric("input_sequence_length", "avg"), "wall_s": wall,
            "hub_lines": hub, "export": str(export), "aiperf_cores": cores}  # fmt: skip


# ---- the three measurements ----------------------------------------------------------------------------------------
def overhead_and_tools(args: argparse.Namespace, run: Path) -> dict:
    """Parts 1 and 3: one server, smg (cache_aware) in front of it."""
    tok = local_tokenizer(args.engine)
    prompts = run / "prompts.jsonl"
    write_prompts(prompts, tok, 256, args.input_len, args.output_len)
    quiet = Console(stderr=True, quiet=True)
    res: dict = {"direct": [], "smg": [], "ours": [], "aiperf": [], "cpu": []}
    mport = free_port()
    murl = f"http://127.0.0.1:{mport}/metrics"
    flags = ("--no-prefix-caching", "--no-measure-ceilings", "--metrics-port", str(mport))
    with running_service(args.engine, args.kv_cache_memory, *flags) as (srv, port):
        model, bundle = tokenizer_bundle(port, run)
        with gateway([f"127.0.0.1:{port}"], model, run, "cache_aware", kv_events=False) as (url, smg):
            arms = {"direct": (f"127.0.0.1:{port}", ()),
                    "smg": (url, ("--protocol", "openai", "--openai-api", "completions", "--model", model))}  # fmt: skip
            for i in range(args.rounds):
                for arm, (target, flags) in arms.items():
                    meter = CpuMeter([srv.pid, smg.pid]).start()
                    hi = loadtest(target, args.overhead_concurrency, args.overhead_requests, args.input_len,
                                  args.output_len, "--dataset", str(prompts), *flags, seed=100 + i, console=quiet)  # fmt: skip
                    one = loadtest(target, 1, args.ttft_requests, args.input_len, args.output_len,
                                   "--dataset", str(prompts), *flags, seed=200 + i, console=quiet)  # fmt: skip
                    use = meter.stop().as_dict()
                    res[arm].append({"c_hi": strip(hi), "c1": strip(one), "cpu": use})
                    print(f"overhead round {i + 1} {arm}: {hi['output_throughput_tok_s']:.1f} tok/s at "
                          f"c={args.overhead_concurrency}, TTFT p50 {one['ttft_ms']['p50']:.0f} ms at c=1, cpu {use}",
                          file=sys.stderr)  # fmt: skip
            for i in range(args.tool_rounds if args.aiperf else 0):
                seed, out = 300 + i, {}
                for tool in ("ours", "aiperf") if i % 2 == 0 else ("aiperf", "ours"):
                    before = server_ttft(murl)
                    meter = CpuMeter([srv.pid, smg.pid]).start()
                    if tool == "ours":
                        ours = loadtest(url, args.tool_concurrency, args.tool_requests, args.input_len,
                                        args.output_len, "--dataset", str(prompts), *arms["smg"][1], seed=seed,
                                        console=quiet)  # fmt: skip
                        out[tool] = {**strip(ours), "cpu": meter.stop().as_dict()}
                    else:
                        items = as_sent(prompts, args.tool_requests, 2, seed)
                        out[tool] = run_aiperf(args.aiperf, url, model, bundle, items, args.tool_concurrency, 2,
                                               run / f"aiperf{i}", args.aiperf_nice)  # fmt: skip
                        out[tool]["cpu"] = meter.stop().as_dict()
                    after = server_ttft(murl)
                    out[tool]["server_ttft_mean_ms"] = 1000 * (after[0] - before[0]) / max(after[1] - before[1], 1)
                    out[tool]["order"] = list(out).index(tool)
                res["ours"].append(out["ours"])
                res["aiperf"].append(out["aiperf"])
                print(f"tools round {i + 1}: ours TTFT p50 {out['ours']['ttft_ms']['p50']:.0f} ms (server mean "
                      f"{out['ours']['server_ttft_mean_ms']:.0f}), aiperf {out['aiperf']['ttft_ms_p50']:.0f} ms "
                      f"(server mean {out['aiperf']['server_ttft_mean_ms']:.0f}); hub lines "
                      f"{out['aiperf']['hub_lines']}", file=sys.stderr)  # fmt: skip
    return res


def server_ttft(metrics_url: str) -> tuple[float, float]:
    """The server's own TTFT histogram so far: (sum of seconds, count)."""
    return (read_metric(metrics_url, "llm_time_to_first_token_seconds_sum"),
            read_metric(metrics_url, "llm_time_to_first_token_seconds_count"))  # fmt: skip


def strip(run: dict) -> dict:
    """A load-test summary without its per-request samples."""
    return {k: v for k, v in run.items() if not k.startswith("_")}


def routing(args: argparse.Namespace, run: Path) -> dict:
    """Part 2: cache_aware against round_robin, two fresh replicas and a fresh smg per arm."""
    tok = local_tokenizer(args.engine)
    chats = routing_workload(tok, args.groups, args.system_len, args.routing_requests, seed=7)
    group_of = [int(c[0]["content"].split()[2]) for c in chats]
    block = json.loads((Path(args.engine) / "config.json").read_text())["build"]["kv_block_size"]
    res: dict = {"cache_aware": [], "round_robin": [], "ideal": None}
    for i in range(args.routing_rounds):
        for policy in ("cache_aware", "round_robin") if i % 2 == 0 else ("round_robin", "cache_aware"):
            with replicas(args.engine, args.kv_cache_memory, 2, args.replica_threads) as reps:
                if res["ideal"] is None:
                    stub = llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(f"127.0.0.1:{reps[0][1]}"))
                    ids = [list(stub.Tokenize(llm_pb2.TokenizeRequest(messages=llm_pb2.ChatMessages(
                        messages=[llm_pb2.ChatMessage(**m) for m in c])), timeout=30).token_ids) for c in chats]  # fmt: skip
                    res["ideal"] = {"hit_tokens": ideal_hits(ids, group_of, block),
                                    "prompt_tokens": sum(map(len, ids)), "system_tokens": [
                                        len(ids[g]) for g in range(args.groups)], "block": block}  # fmt: skip
                model, _ = tokenizer_bundle(reps[0][1], run)
                with gateway([f"127.0.0.1:{p}" for _, p, _ in reps], model, run, policy) as (url, smg):
                    urls = [f"http://127.0.0.1:{m}/metrics" for _, _, m in reps]
                    names = ("llm_prompt_tokens_total", "llm_prefix_cache_hit_tokens_total")
                    before = [[read_metric(u, n) for n in names] for u in urls]
                    meter = CpuMeter([p.pid for p, _, _ in reps] + [smg.pid]).start()
                    summary = run_chats(url, model, chats, args.routing_concurrency, args.routing_output_len)
                    use = meter.stop().as_dict()
                    after = [[read_metric(u, n) for n in names] for u in urls]
            per = [[a - b for a, b in zip(x, y, strict=True)] for x, y in zip(after, before, strict=True)]
            prompt, hits = sum(p[0] for p in per), sum(p[1] for p in per)
            res[policy].append({"summary": strip(summary), "prompt_tokens": prompt, "hit_tokens": hits,
                                "per_replica": per, "cpu": use})  # fmt: skip
            print(f"routing round {i + 1} {policy}: hits {hits:.0f} / {prompt:.0f} prompt tokens (ideal "
                  f"{res['ideal']['hit_tokens']}), per replica {per}, TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, "
                  f"{summary['failed']} failed, cpu {use}", file=sys.stderr)  # fmt: skip
    return res


# ---- the report ----------------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def ratios(a: list[float], b: list[float]) -> str:
    return ", ".join(f"{x / y:.2f}" for x, y in zip(a, b, strict=True))


def command_line(args: argparse.Namespace) -> str:
    """The command that measures what `args` asked for: the flags that differ from their defaults, and --write."""
    defaults = vars(parser().parse_args([]))
    flags = [f"--{k.replace('_', '-')} {v if v != '' else repr(v)}" for k, v in vars(args).items()
             if k not in ("engine", "write", "from_results", "output") and str(v) != str(defaults.get(k))]  # fmt: skip
    return " ".join(["python -m benchmarks.gateway_bench --engine", args.engine, *flags, "--write"])


def cpu_line(runs: list[dict]) -> str:
    others = [r["others"] for r in runs]
    box = [r["box"] for r in runs]
    return (
        f"machine busy {statistics.median(box):.2f} cores (median), other processes {min(others):.2f}-{max(others):.2f}"
    )


def report(args: argparse.Namespace, res: dict, minutes: float) -> list[str]:
    ov, rt = res["overhead"], res["routing"]
    lines = [
        "## Gateway (smg) vs direct; cache-aware routing (`python -m benchmarks.gateway_bench`)",
        "",
        f"Command: `{command_line(args)}` ({minutes:.0f} min)  ",
        f"Machine: {machine_line()}; smg 1.13.0 (`smg launch`, its own process), the servers and the load "
        "generator all share the 2 cores. Each figure is the median of interleaved rounds, every round in brackets; "
        "ratios are of medians measured side by side in this run.",
        "",
    ]
    lines += overhead_lines(args, ov) if ov["direct"] else []
    lines += routing_lines(args, rt) if rt["ideal"] else []
    lines += tools_lines(args, ov) if ov["aiperf"] else []
    lines += [
        "What limits these figures: smg, the servers and the load generator share 2 cores, so every gateway cycle "
        "(HTTP parsing, tokenization, detokenization, SSE) is taken from the engine's steps rather than from an "
        "idle core as on a real deployment; the two replicas of the routing test each get about one core at best, "
        "and other jobs on this shared VM add noise that interleaved rounds spread over both arms but do not remove.",
    ]
    return lines


def overhead_lines(args: argparse.Namespace, ov: dict) -> list[str]:
    c = args.overhead_concurrency
    d_tok = Rounds.of([r["c_hi"] for r in ov["direct"]], "output_throughput_tok_s")
    s_tok = Rounds.of([r["c_hi"] for r in ov["smg"]], "output_throughput_tok_s")
    d_ttft = Rounds.of([r["c1"] for r in ov["direct"]], "ttft_ms.p50")
    s_ttft = Rounds.of([r["c1"] for r in ov["smg"]], "ttft_ms.p50")
    tok_ratio, ttft_ratio = s_tok.median / d_tok.median, s_ttft.median / d_ttft.median
    d_in = statistics.mean(r["c_hi"]["input_tokens"] / r["c_hi"]["completed"] for r in ov["direct"])
    s_in = statistics.mean(r["c_hi"]["input_tokens"] / r["c_hi"]["completed"] for r in ov["smg"])
    d_out = {r["c_hi"]["output_tokens"] // r["c_hi"]["completed"] for r in ov["direct"]}
    s_out = {r["c_hi"]["output_tokens"] // r["c_hi"]["completed"] for r in ov["smg"]}
    failed = sum(r[k]["failed"] for arm in ("direct", "smg") for r in ov[arm] for k in ("c_hi", "c1"))
    return [
        f"### smg in front of one server against llm.v1 direct ({args.rounds} rounds)",
        "",
        f"One `python -m service` (prefix caching off: both arms send the same prompts, and the second of a pair "
        f"must not be served from the cache the first filled), `smg launch --policy cache_aware` in front of it "
        f"(a worker with prefix caching off serves no KV events: smg logs that it disables the subscription and "
        f"routes its one worker without them). Both arms send the same JSONL of text prompts ({args.input_len}-token windows of the load tester's "
        f"corpus, decoded) with the same seed, max_tokens {args.output_len}, ignore_eos, greedy: direct "
        f"`clients.loadtest --protocol llm --dataset prompts.jsonl` (the server tokenizes), through smg "
        f"`--protocol openai --openai-api completions` (smg tokenizes, with the bundle GetTokenizer serves). "
        f"Concurrency {c}: {args.overhead_requests} requests per round; concurrency 1: {args.ttft_requests}; 2 "
        f"warm-up requests each. Prompt tokens per request as counted: direct {d_in:.1f} (our Tokenize), smg "
        f"{s_in:.1f} (its usage); output tokens per request {sorted(d_out)} / {sorted(s_out)}; {failed} failed.",
        "",
        "| | direct (llm.v1) | through smg (OpenAI completions) | smg / direct (per round) | target | |",
        "|---|---|---|---|---|---|",
        f"| output tok/s, concurrency {c} | {d_tok.median:.1f} [{d_tok.spread()}] | {s_tok.median:.1f} "
        f"[{s_tok.spread()}] | **{tok_ratio:.2f}x** [{ratios(s_tok.values, d_tok.values)}] | >= 0.95x | "
        f"{verdict(tok_ratio >= 0.95)} |",
        f"| TTFT p50 ms, concurrency 1 | {d_ttft.median:.1f} [{d_ttft.spread()}] | {s_ttft.median:.1f} "
        f"[{s_ttft.spread()}] | **{ttft_ratio:.2f}x** [{ratios(s_ttft.values, d_ttft.values)}] | <= 1.05x | "
        f"{verdict(ttft_ratio <= 1.05)} |",
        "",
        f"Load: direct rounds {cpu_line([r['cpu'] for r in ov['direct']])}; smg rounds "
        f"{cpu_line([r['cpu'] for r in ov['smg']])} (cores, from /proc/stat).",
        "",
    ]


def routing_lines(args: argparse.Namespace, rt: dict) -> list[str]:
    ideal = rt["ideal"]
    if ideal:
        ca, rr = rt["cache_aware"], rt["round_robin"]
        ideal_ratio = ideal["hit_tokens"] / ideal["prompt_tokens"]

        def hit_ratio(runs: list[dict]) -> Rounds:
            return Rounds([r["hit_tokens"] / r["prompt_tokens"] for r in runs])

        ca_hit, rr_hit = hit_ratio(ca), hit_ratio(rr)
        ca_ttft = Rounds.of([r["summary"] for r in ca], "ttft_ms.p50")
        rr_ttft = Rounds.of([r["summary"] for r in rr], "ttft_ms.p50")
        of_ideal = ca_hit.median / ideal_ratio
        prompt_counted = sorted({int(r["prompt_tokens"]) for r in ca + rr})
        failed = sum(r["summary"]["failed"] for r in ca + rr)
        return [
            f"### Cache-aware routing against round-robin, 2 replicas ({args.routing_rounds} rounds)",
            "",
            f"Per arm two fresh `python -m service` replicas (OPENBLAS_NUM_THREADS=1, the kernels' pool at "
            f"{args.replica_threads} thread{'s' if args.replica_threads > 1 else ''}, {args.kv_cache_memory} KV each) "
            f"and a fresh smg (`--policy cache_aware`, its index fed by our SubscribeKvEvents, or `--policy "
            f"round_robin`), so each arm starts cold; the arms alternate which goes first. {args.routing_requests} "
            f"chats at concurrency {args.routing_concurrency}: {args.groups} system prompts of "
            f"{min(ideal['system_tokens'])}-{max(ideal['system_tokens'])} prompt tokens with the first user turn "
            f"(chat template included), each with short user turns, max_tokens {args.routing_output_len} "
            f"(ignore_eos), sent by the load tester's driver and OpenAI backend as system + user messages; the "
            f"first chat of each system prompt goes first, the rest in a seeded shuffle. Hit ratio = "
            f"llm_prefix_cache_hit_tokens_total / llm_prompt_tokens_total over both replicas (before/after). Ideal: "
            f"every request after the first of its system prompt served its whole-block common prefix "
            f"({ideal['hit_tokens']} of {ideal['prompt_tokens']} prompt tokens, {ideal_ratio:.3f}; the replicas "
            f"counted {', '.join(map(str, prompt_counted))} prompt tokens per arm"
            + (
                ": exactly the ids our Tokenize renders for these chats, so smg sends the chat template's rendering "
                "and adds no system prompt of its own"
                if prompt_counted == [ideal["prompt_tokens"]]
                else ", not the ids our Tokenize renders for these chats"
            )
            + f"); {failed} failed.",
            "",
            "| | cache_aware | round_robin | cache_aware / round_robin | target | |",
            "|---|---|---|---|---|---|",
            f"| prefix-hit ratio (ideal {ideal_ratio:.3f}) | {ca_hit.median:.3f} [{ca_hit.spread(3)}] | "
            f"{rr_hit.median:.3f} [{rr_hit.spread(3)}] | {ca_hit.median / rr_hit.median:.3f}x | cache_aware >= 0.9 "
            f"of ideal and above round_robin | {verdict(of_ideal >= 0.9 and ca_hit.median > rr_hit.median)} "
            f"({of_ideal:.3f} of ideal; round_robin {rr_hit.median / ideal_ratio:.3f}) |",
            f"| TTFT p50 ms | {ca_ttft.median:.0f} [{ca_ttft.spread(0)}] | {rr_ttft.median:.0f} "
            f"[{rr_ttft.spread(0)}] | **{ca_ttft.median / rr_ttft.median:.2f}x** | lower | "
            f"{verdict(ca_ttft.median < rr_ttft.median)} |",
            "",
            "Prompt tokens per replica, per round: "
            + "; ".join(
                f"{p} {[int(x[0]) for x in r['per_replica']]}" for p in ("cache_aware", "round_robin") for r in rt[p]
            )
            + f". Load: cache_aware rounds {cpu_line([r['cpu'] for r in ca])}; round_robin rounds "
            f"{cpu_line([r['cpu'] for r in rr])}.",
            "",
        ]
    return []


def normalized_rows(ov: dict) -> list[str]:
    """TTFT against the server's own TTFT over the same run: what each tool sees on top of the server (smg, HTTP,
    the client), which the machine's speed in that minute mostly cancels out of."""
    if not all("server_ttft_mean_ms" in r for r in ov["ours"] + ov["aiperf"]):
        return []
    ours_mean = Rounds.of(ov["ours"], "ttft_ms.mean")
    theirs_mean = Rounds([r["ttft_ms_avg"] for r in ov["aiperf"]])
    ours_srv = Rounds([r["server_ttft_mean_ms"] for r in ov["ours"]])
    theirs_srv = Rounds([r["server_ttft_mean_ms"] for r in ov["aiperf"]])
    ours_x = Rounds([a / b for a, b in zip(ours_mean.values, ours_srv.values, strict=True)])
    theirs_x = Rounds([a / b for a, b in zip(theirs_mean.values, theirs_srv.values, strict=True)])
    ratio = theirs_x.median / ours_x.median
    return [
        f"| TTFT mean ms | {ours_mean.median:.1f} [{ours_mean.spread()}] | {theirs_mean.median:.1f} "
        f"[{theirs_mean.spread()}] | {theirs_mean.median / ours_mean.median:.2f}x | | |",
        f"| the server's own TTFT mean over the same run, ms | {ours_srv.median:.1f} [{ours_srv.spread()}] | "
        f"{theirs_srv.median:.1f} [{theirs_srv.spread()}] | | | |",
        f"| TTFT mean / server's TTFT mean | {ours_x.median:.3f} [{ours_x.spread(3)}] | {theirs_x.median:.3f} "
        f"[{theirs_x.spread(3)}] | **{ratio:.2f}x** | within 10% | {verdict(abs(ratio - 1) <= 0.10)} |",
    ]


def tools_lines(args: argparse.Namespace, ov: dict) -> list[str]:
    if ov["aiperf"]:
        ours = Rounds.of(ov["ours"], "ttft_ms.p50")
        theirs = Rounds([r["ttft_ms_p50"] for r in ov["aiperf"]])
        ratio = theirs.median / ours.median
        hub = sorted({line for r in ov["aiperf"] for line in r["hub_lines"]})
        return [
            f"### Our load tester against aiperf 0.13.0, through smg ({args.tool_rounds} rounds)",
            "",
            f"aiperf in a venv of its own (`python3 -m venv /work/aiperf-venv && /work/aiperf-venv/bin/pip install "
            f"aiperf==0.13.0`), given the unzipped tokenizer bundle as `--tokenizer` (no HF_HUB_OFFLINE: aiperf "
            f"0.13.0 refuses a local folder with it set). The setup above (one server, smg cache_aware); concurrency {args.tool_concurrency}, "
            f"{args.tool_requests} requests after 2 warm-up ones, the same prompts in the same order (aiperf "
            f"`--input-file` single_turn, sequential), max_tokens {args.output_len}, ignore_eos, temperature 0; "
            f"ours (`--protocol openai --openai-api completions`, this process) then aiperf (`aiperf profile "
            f"--endpoint-type completions --streaming --tokenizer BUNDLE_DIR --ui-type none`, its own processes), "
            f"one after the other in each round (rounds alternate which goes first). aiperf counted {ov['aiperf'][0]['input_tokens_per_request']:.1f} "
            f"input / {ov['aiperf'][0]['output_tokens_per_request']:.1f} output tokens per request with the "
            f"bundle's tokenizer; ours {statistics.mean(r['input_tokens'] / r['completed'] for r in ov['ours']):.1f} "
            f"/ {statistics.mean(r['output_tokens'] / r['completed'] for r in ov['ours']):.1f} (smg's usage). "
            + (
                "aiperf's log shows no attempt to reach the Hugging Face hub."
                if not hub
                else f"aiperf's log mentions the hub: `{hub[0][:160]}`."
            ),
            "",
            "| | ours | aiperf | aiperf / ours (per round) | target | |",
            "|---|---|---|---|---|---|",
            f"| TTFT p50 ms | {ours.median:.1f} [{ours.spread()}] | {theirs.median:.1f} [{theirs.spread()}] | "
            f"**{ratio:.2f}x** [{ratios(theirs.values, ours.values)}] | within 10% | "
            f"{verdict(abs(ratio - 1) <= 0.10)} |",
            f"| output tok/s | {Rounds.of(ov['ours'], 'output_throughput_tok_s').median:.1f} | "
            f"{statistics.median(r['output_tok_s'] for r in ov['aiperf']):.1f} | | | |",
            *normalized_rows(ov),
            "",
            f"Load: ours {cpu_line([r['cpu'] for r in ov['ours']])}; aiperf {cpu_line([r['cpu'] for r in ov['aiperf']])} "
            "(aiperf runs as processes of its own: its load is inside `other processes`)"
            + (
                f"; aiperf's own process tree used {statistics.median(r['aiperf_cores'] for r in ov['aiperf']):.2f} "
                "cores over its runs (start-up included), our load tester "
                f"{statistics.median(r['cpu']['own'] for r in ov['ours']):.2f}."
                if all("aiperf_cores" in r for r in ov["aiperf"])
                else "."
            ),
            "",
        ]
    return []


def parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, "gateway_bench")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (overhead and load-tester runs)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request, exactly (ignore_eos)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved direct/smg rounds")
    p.add_argument("--overhead-concurrency", type=int, default=16)
    p.add_argument("--overhead-requests", type=int, default=48, help="requests per round at --overhead-concurrency")
    p.add_argument("--ttft-requests", type=int, default=12, help="requests per round at concurrency 1")
    p.add_argument("--routing-rounds", type=int, default=3, help="cache_aware/round_robin rounds (0: skip)")
    p.add_argument("--routing-requests", type=int, default=64)
    p.add_argument("--routing-concurrency", type=int, default=4)
    p.add_argument("--routing-output-len", type=int, default=64)
    p.add_argument("--groups", type=int, default=4, help="shared system prompts")
    p.add_argument("--system-len", type=int, default=480, help="corpus tokens in each system prompt")
    p.add_argument("--replica-threads", type=int, default=1, help="kernel threads per replica (routing)")
    p.add_argument("--tool-rounds", type=int, default=2, help="ours/aiperf rounds")
    p.add_argument("--tool-concurrency", type=int, default=4)
    p.add_argument("--tool-requests", type=int, default=32)
    p.add_argument("--aiperf", default=AIPERF if Path(AIPERF).exists() else "",
                   help="the aiperf executable ('' skips the load-tester comparison)")  # fmt: skip
    p.add_argument("--aiperf-nice", type=int, default=0, help="run aiperf under `nice -n N`")
    p.add_argument("--kv-cache-memory", default="512MiB", help="per server (max_seq_len 8192 needs >= 512MiB)")
    p.add_argument("--output", type=Path, default=RESULTS, help="results JSON")
    p.add_argument(
        "--from-results", type=Path, help="measure nothing: print (and --write) the report of a results JSON"
    )
    return p


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == REPLICA_FLAG:
        serve_replica(sys.argv[1:])
        return
    p = parser()
    args = p.parse_args()
    if args.from_results:
        res = json.loads(args.from_results.read_text())
        args = argparse.Namespace(**{**res["args"], "write": args.write})
        publish("gateway_bench", report(args, res, res["minutes"]), args.write)
        return
    started = time.monotonic()
    run = args.output.with_suffix("").resolve()  # smg's logs, prompts, the tokenizer bundle, aiperf's artifacts
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    res = {"overhead": overhead_and_tools(args, run)}
    res["routing"] = routing(args, run) if args.routing_rounds else {"ideal": None}
    for log in run.glob("smg-*.log"):
        res.setdefault("smg_errors", []).extend(
            line for line in ANSI.sub("", log.read_text()).splitlines() if " ERROR " in line
        )
    minutes = (time.monotonic() - started) / 60
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    res["minutes"] = minutes
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1, default=str))
    publish("gateway_bench", report(args, res, minutes), args.write)


if __name__ == "__main__":
    main()
