"""Shared benchmark helpers: machine ceilings, medians, and writing a section of docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import numpy as np

from service.roofline import gemm_gflops, median_time, read_bandwidth_gbs

__all__ = ["gemm_gflops", "machine_line", "median_time", "publish", "read_bandwidth_gbs", "write_section"]

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
