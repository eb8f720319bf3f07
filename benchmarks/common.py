"""Shared benchmark helpers: machine ceilings, medians, and writing a section of docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.engine.roofline import gemm_gflops, median_time, read_bandwidth_gbs

__all__ = [
    "free_port",
    "gemm_gflops",
    "machine_line",
    "median_time",
    "publish",
    "read_bandwidth_gbs",
    "start_service",
    "write_section",
]

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


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
    engine: str, port: int, kv_memory: str, *flags: str, wrapper: tuple[str, ...] = (), log=None
) -> subprocess.Popen:
    """`python -m service --engine ... FLAGS` on 127.0.0.1:port, returning once its health says SERVING.

    `wrapper`: run it through a module that takes its own flags, then `--` and the service's (tests.fault_server).
    """
    service = ["--engine", engine, "--port", str(port), "--kv-cache-memory", kv_memory, "--log-level", "WARNING"]
    service += [] if "--metrics-port" in flags else ["--metrics-port", "-1"]
    head = ["-m", wrapper[0], *wrapper[1:], "--"] if wrapper else ["-m", "service"]
    proc = subprocess.Popen([sys.executable, *head, *service, *flags], stdout=log, stderr=log)
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
