"""Results: a summary table (rich), the JSON contract, CSV, and plots (matplotlib)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from clients.loadtest.metrics import STAT_KEYS

STAT_FIELDS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "server_ttft_ms", "server_tpot_ms", "ttft_gap_ms")
SCALAR_FIELDS = (
    "completed",
    "failed",
    "duration_s",
    "input_tokens",
    "output_tokens",
    "request_throughput_rps",
    "output_throughput_tok_s",
    "total_throughput_tok_s",
    "goodput_rps",
    "spec_draft_tokens",
    "spec_acceptance",
)


def load_label(run: dict) -> str:
    return f"c={run['concurrency']}" if "concurrency" in run else f"{run['request_rate']:g} req/s"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(runs: list[dict], console: Console | None = None) -> None:
    table = Table(title="Load test (client-side latencies in ms; server TTFT from the final message)")
    for col in ("load", "ok/fail", "req/s", "out tok/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "ITL p50", "E2E p50", "srv TTFT p50", "gap p50", "spec accept"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(
            load_label(r),
            f"{r['completed']}/{r['failed']}",
            _fmt(r["request_throughput_rps"], 2),
            _fmt(r["output_throughput_tok_s"]),
            _fmt(r["goodput_rps"], 2),
            _fmt(r["ttft_ms"]["p50"]),
            _fmt(r["ttft_ms"]["p99"]),
            _fmt(r["tpot_ms"]["p50"], 2),
            _fmt(r["tpot_ms"]["p99"], 2),
            _fmt(r["itl_ms"]["p50"], 2),
            _fmt(r["e2e_ms"]["p50"]),
            _fmt(r["server_ttft_ms"]["p50"]),
            _fmt(r["ttft_gap_ms"]["p50"], 2),
            _fmt(r.get("spec_acceptance"), 2),  # accepted / draft tokens; - where the server did not speculate
        )
    (console or Console(stderr=True)).print(table)


def write_json(path: Path, runs: list[dict], meta: dict) -> None:
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs]
    path.write_text(json.dumps({"runs": clean, "meta": meta}, indent=2) + "\n")


def write_csv(path: Path, runs: list[dict]) -> None:
    header = ["concurrency", "request_rate", *SCALAR_FIELDS]
    header += [f"{f}_{k}" for f in STAT_FIELDS for k in STAT_KEYS]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for r in runs:
            row = [r.get("concurrency", ""), r.get("request_rate", ""), *(r[k] for k in SCALAR_FIELDS)]
            row += [r[field][k] for field in STAT_FIELDS for k in STAT_KEYS]
            writer.writerow(row)


def write_plots(directory: Path, runs: list[dict]) -> list[Path]:
    """latency_vs_throughput.png (TTFT and TPOT p50/p99 against output tok/s), ttft_distribution.png and
    tpot_distribution.png (per-request histograms of every sweep point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    x = [r["output_throughput_tok_s"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [r[metric][pct] for r in runs], style, label=f"{title} {pct}")
        for r, xi in zip(runs, x, strict=True):
            if r[metric]["p50"] is not None:
                ax.annotate(
                    load_label(r), (xi, r[metric]["p50"]), textcoords="offset points", xytext=(4, 4), fontsize=8
                )
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} against throughput")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(directory / "latency_vs_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for metric, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in runs:
            values = r.get("_samples", {}).get(metric, [])
            if values:
                ax.hist(values, bins=30, alpha=0.5, label=load_label(r))
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("requests")
        ax.set_title(f"{title} distribution per sweep point")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths.append(directory / f"{metric.removesuffix('_ms')}_distribution.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
