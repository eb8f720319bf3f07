"""Shared benchmark helpers: the command line (engine, sweep, rounds, --write), the service and load-tester runs,
the machine's load (a CPU meter, waiting for a quiet machine), medians of interleaved rounds, machine ceilings
(service/engine/roofline.py: the one GEMM rate and the one read bandwidth), our kernel path, and writing a section
of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.engine.roofline import gemm_gflops, read_bandwidth_gbs, read_method

__all__ = [
    "CpuMeter",
    "CpuUse",
    "Rounds",
    "add_sweep_args",
    "bench_parser",
    "ceilings_line",
    "free_port",
    "gemm_gflops",
    "joined",
    "kernel_path",
    "loadtest",
    "machine_line",
    "publish",
    "read_bandwidth_gbs",
    "read_method",
    "read_metric",
    "running_service",
    "start_service",
    "stop_service",
    "wait_for_quiet",
    "write_section",
]

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DEFAULT_ENGINE = "engines/smollm2-135m"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- the command line ---------------------------------------------------------------------------------------------
def bench_parser(doc: str, section: str, engines: bool = False, engine_help: str | None = None,
                 doc_path: str = "docs/benchmarks.md") -> argparse.ArgumentParser:  # fmt: skip
    """A benchmark's command line: its module docstring as --help, --engine (several with engines=True), --write."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if engines:
        p.add_argument("--engine", nargs="+", default=[DEFAULT_ENGINE], help=engine_help or "engine directories")
    else:
        p.add_argument("--engine", default=DEFAULT_ENGINE, help=engine_help or "engine directory")
    p.add_argument("--write", action="store_true", help=f"regenerate the {section} section of {doc_path}")
    return p


def int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (argparse type: positive integers, comma-separated)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def joined(values: Iterable[int]) -> str:
    """[1, 4, 16] -> '1,4,16' (as it is typed on the command line)."""
    return ",".join(str(v) for v in values)


def add_sweep_args(p: argparse.ArgumentParser, concurrency: str | None = "1,4,16,32,64", input_len: int = 128,
                   output_len: int = 128, rounds: int | None = None,
                   rounds_help: str = "interleaved rounds (the medians are reported)") -> None:  # fmt: skip
    """--concurrency (levels, as a list of ints), --input-len, --output-len and, where given, --rounds."""
    if concurrency is not None:
        p.add_argument("--concurrency", type=int_list, default=concurrency, help="concurrency levels, e.g. 1,4,16")
    p.add_argument("--input-len", type=int, default=input_len, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=output_len, help="output tokens per request, exactly (ignore_eos)")
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)


# ---- medians of interleaved rounds ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rounds:
    """One figure measured once per interleaved round: the median is the result, the rounds show the spread."""

    values: list[float]

    @classmethod
    def of(cls, runs: Iterable[dict], key: str) -> Rounds:
        """From load-test summaries: `key` is a field or a dotted path ("output_throughput_tok_s", "ttft_ms.p50")."""
        values = []
        for run in runs:
            value = run
            for part in key.split("."):
                value = value[part]
            values.append(float(value))
        return cls(values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def spread(self, digits: int = 1) -> str:
        return ", ".join(f"{v:.{digits}f}" for v in self.values)


# ---- the machine's load -------------------------------------------------------------------------------------------
def box_busy_s() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user .. steal; guest time is inside user already
    return (sum(v) - v[3] - v[4]) / CLK_TCK


def process_cpu_s(pid: int | None = None) -> float:
    """utime + stime (all threads) of process `pid`, or of this one; 0 for a process that is gone."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass(frozen=True, slots=True)
class CpuUse:
    """Cores used on average over an interval (CPU seconds / wall seconds)."""

    box: float  # the whole machine
    own: float  # this process (the benchmark, or the load tester running in it)
    watched: float  # the processes the meter was given (the servers under test)

    @property
    def others(self) -> float:
        """Everything else: what a shared machine took from the measurement."""
        return max(0.0, self.box - self.own - self.watched)

    def as_dict(self) -> dict[str, float]:
        return {"box": round(self.box, 2), "own": round(self.own, 2), "watched": round(self.watched, 2),
                "others": round(self.others, 2)}  # fmt: skip


class CpuMeter:
    """CPU cores used between start() and stop(): the machine, this process, the processes `pids`, the rest."""

    def __init__(self, pids: Iterable[int | None] = ()) -> None:
        self.pids = [pid for pid in pids if pid]

    def _read(self) -> tuple[float, float, float, float]:
        return time.monotonic(), box_busy_s(), process_cpu_s(), sum(process_cpu_s(pid) for pid in self.pids)

    def start(self) -> CpuMeter:
        self._start = self._read()
        return self

    def stop(self) -> CpuUse:
        (t1, box1, own1, pids1), (t0, box0, own0, pids0) = self._read(), self._start
        dt = max(t1 - t0, 1e-9)
        return CpuUse((box1 - box0) / dt, (own1 - own0) / dt, (pids1 - pids0) / dt)


def wait_for_quiet(timeout_s: float, max_cores: float = 0.2, hold_s: float = 0.0, window_s: float = 1.0) -> float:
    """Wait until other processes have used < max_cores for hold_s seconds in a row (at least one window_s), or
    until timeout_s has passed; returns the seconds waited. Other processes' load makes 2-thread barriers (ours,
    OpenBLAS's, llama.cpp's) stall badly, so a benchmark asked to can start its rounds on a quiet machine."""
    start = time.monotonic()
    quiet_since = None
    while time.monotonic() - start < timeout_s:
        meter = CpuMeter().start()
        time.sleep(window_s)
        if meter.stop().others >= max_cores:
            quiet_since = None
            continue
        quiet_since = quiet_since if quiet_since is not None else time.monotonic() - window_s
        if time.monotonic() - quiet_since >= hold_s:
            break
    return time.monotonic() - start


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, numpy {np.__version__}, Python {platform.python_version()}"


def ceilings_line(gemm: float, bandwidth: float, runs: int, n: int = 2048) -> str:
    """The report line of the ceilings measured in the run (roofline.gemm_gflops and read_bandwidth_gbs)."""
    return (
        f"Ceilings in the same run: fp32 GEMM {n}^3 {gemm:.0f} GFLOP/s (best of {runs}); read bandwidth "
        f"{bandwidth:.1f} GB/s ({read_method(runs)})."
    )


def kernel_path() -> str:
    """Which kernels ours ran, for report lines: BACKEND.name ('c-avx2', 'numba', ...), and its ISA where the
    backend names one apart from the name."""
    from service.engine.kernels.backend import BACKEND

    isa = getattr(BACKEND, "isa", None)
    isa = isa() if callable(isa) else isa
    return BACKEND.name + (f" (ISA {isa})" if isa and str(isa) not in BACKEND.name else "")


def publish(name: str, lines: list[str], write: bool) -> None:
    """Print a benchmark's report; with write, also put it into its section of docs/benchmarks.md."""
    text = "\n".join(lines)
    print(text)
    if write:
        write_section(name, text)


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the block between <!-- name:start --> and <!-- name:end --> in docs/benchmarks.md."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(
    engine: str, port: int, kv_memory: str, *flags: str, wrapper: tuple[str, ...] = (), log=None,
    python: str = sys.executable, cwd: str | None = None,
) -> subprocess.Popen:  # fmt: skip
    """`python -m service --engine ... FLAGS` on 127.0.0.1:port, returning once its health says SERVING.

    `wrapper`: run it through a module that takes its own flags, then `--` and the service's (tests.fault_server).
    `python`, `cwd`: another checkout's service (an A/B against a baseline tree).
    """
    service = ["--engine", engine, "--port", str(port), "--kv-cache-memory", kv_memory, "--log-level", "WARNING"]
    service += [] if "--metrics-port" in flags else ["--metrics-port", "-1"]
    head = ["-m", wrapper[0], *wrapper[1:], "--"] if wrapper else ["-m", "service"]
    proc = subprocess.Popen([python, *head, *service, *flags], stdout=log, stderr=log, cwd=cwd)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the service exited during startup")
        try:
            if (
                health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                == health_pb2.HealthCheckResponse.SERVING
            ):
                return proc
        except grpc.RpcError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the service did not become SERVING")


def stop_service(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (a server drains, then exits), then a kill if it has not exited within timeout_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_service(engine: str, kv_memory: str, *flags: str, **kw) -> Iterator[tuple[subprocess.Popen, int]]:
    """start_service on a free port for the block: (process, port); stopped at its end, whatever happened."""
    port = free_port()
    proc = start_service(engine, port, kv_memory, *flags, **kw)
    try:
        yield proc, port
    finally:
        stop_service(proc)


def read_metric(url: str, name: str) -> float:
    """One sample of a Prometheus text endpoint (`name` with no labels); 0 when it is not there yet."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    m = re.search("^" + re.escape(name) + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def loadtest(target: str, concurrency: int, requests: int, input_len: int, output_len: int, *flags: str,
             seed: int = 0, console=None) -> dict:  # fmt: skip
    """One closed-loop run of the load tester (clients.loadtest, in this process): `requests` requests of
    `input_len` synthetic tokens, exactly `output_len` out (ignore_eos), after 2 warm-up requests; its summary
    (docs/loadtest.md). `seed` picks the prompts: give every run its own, or a prefix cache serves the repeats."""
    from rich.console import Console

    from clients.loadtest.__main__ import parse_args, run_sweep

    args = parse_args([
        "--target", target, "--concurrency", str(concurrency), "--num-requests", str(requests),
        "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos", "--warmup", "2",
        "--seed", str(seed), *flags,
    ])  # fmt: skip
    (run,) = asyncio.run(run_sweep(args, console or Console(stderr=True)))
    return run
