"""The quant kernels (service/engine/kernels/matmul.py) against fp32 BLAS over the same matrices dequantized, in one run.

    python -m benchmarks.kernel_bench --engine engines/smollm2-135m [SECTION ...] [--reps 7] [--wait-quiet S] [--write]

SECTION: decode (with the kernel-backend comparison), head, batch, prefill (the default: these four, ~2.5 min
on 2 cores), pools (thread-pool interplay, ~1.5 min), crossover (direct vs panel path), all.
The matrices are the engine directory's own (NumpyRunner: every layer's qkv, o, gate_up, down, memory-mapped
as the engine runs them, and the LM head); the fp32 reference is dequantize_packed of the same matrices, so
both sides compute the same product. The whole weight set is streamed each repetition (120 fused matrices,
106 M weights for SmolLM2-135M; the LM head separately), so weights come from DRAM as in a real decode step.

Every number is a median over rounds. A round runs every configuration in turn (set our pool's and OpenBLAS's
thread counts, settle SETTLE_S so the other pool's spinning workers go to sleep, one warm call, then the fastest
of 3 calls, or 1 for prefill), so slow drifts of the box hit all of them alike. "others" is the CPU (in cores)
that other processes used during one row's rounds (/proc/stat minus this process) with the number of clean rounds
(others < CLEAN cores in that round); the medians are over the clean rounds when at least 2 are clean.
pools: one whole-model step (weight matmuls plus attention-sized BLAS calls) per configuration, each in its own
process, OpenBLAS at 1 or 2 threads; environment variables such as OPENBLAS_THREAD_TIMEOUT pass through. It is
the weakest table: no interleaving and no dropped rounds, only each configuration's other load, marked when high.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import CpuMeter, kernel_path, machine_line, publish, wait_for_quiet
from build_engine.packing import PackedMatrix, dequantize_packed
from service.engine.kernels import matmul as qk
from service.engine.kernels.backend import BACKEND
from service.engine.kernels.threads import openblas_threads
from service.engine.runners.numpy_runner import NumpyRunner

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("decode", "head", "batch", "prefill", "pools", "crossover")
DEFAULT_SECTIONS = ("decode", "head", "batch", "prefill")
SETTLE_S = 0.25  # after switching thread counts: our pool's and OpenBLAS's idle workers spin before they sleep
CLEAN = 0.2  # a round in which other processes used more cores than this is dropped (if >= 2 rounds are clean)
POOL_KERNELS = ("c2", "c1", "numba-omp", "numba-workqueue", "none", "deq")
POOL_WORKLOADS = ("decode", "batch16", "prefill")


@dataclass
class Result:
    """Medians (seconds) per label over the rounds used, and what the box did meanwhile."""

    t: dict[str, float]
    others: float  # cores used by other processes over the whole measurement
    clean: int
    rounds: int

    def __getitem__(self, label: str) -> float:
        return self.t[label]

    @property
    def note(self) -> str:
        return f"{self.others:.2f} ({self.clean}/{self.rounds} clean)"


class Bench:
    def __init__(self, wait_quiet_s: float) -> None:
        self.wait_quiet_s = wait_quiet_s

    def wait_quiet(self, threshold: float = 0.15, window: float = 1.0) -> None:
        """Wait (up to --wait-quiet s) until the whole box used < threshold cores over `window` s."""
        wait_for_quiet(self.wait_quiet_s, max_cores=threshold, window_s=window)

    def rounds(self, groups: list[tuple[int, int, dict[str, Callable]]], n_rounds: int, per_round: int = 3) -> Result:
        """groups: [(our threads, BLAS threads, {label: fn})], each group run in turn in every round."""
        total = CpuMeter().start()  # others: the box minus this process
        per: list[tuple[float, dict[str, float]]] = []
        for _ in range(n_rounds):
            self.wait_quiet()
            o = CpuMeter().start()
            got: dict[str, float] = {}
            for ours, blas, fns in groups:
                set_threads(ours, blas)
                time.sleep(SETTLE_S)
                for label, fn in fns.items():
                    fn()
                    best = float("inf")
                    for _ in range(per_round):
                        start = time.perf_counter()
                        fn()
                        best = min(best, time.perf_counter() - start)
                    got[label] = best
            per.append((o.stop().others, got))
        clean = [g for load, g in per if load < CLEAN]
        use = clean if len(clean) >= 2 else [g for _, g in per]
        t = {k: float(np.median([g[k] for g in use])) for k in use[0]}
        return Result(t, total.stop().others, len(clean), len(per))


def set_threads(ours: int, blas: int) -> None:
    qk.set_num_threads(ours)
    openblas_threads(blas)


def load(engine: str) -> tuple[list[PackedMatrix], PackedMatrix | None]:
    runner = NumpyRunner(engine, num_kv_blocks=1)
    mats = [m for layer in runner.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if not all(isinstance(m, PackedMatrix) for m in mats):
        raise SystemExit(f"{engine}: the layer matrices are not packed quant blocks (build a quantized engine)")
    head = runner.lm_head if isinstance(runner.lm_head, PackedMatrix) else None
    return mats, head


def fmt_of(mats: list[PackedMatrix]) -> str:
    return "+".join(sorted({m.source_format or m.kind for m in mats}))


def _xs(rows: int, cols: set[int], seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {c: rng.standard_normal((rows, c)).astype(np.float32) for c in cols}  # [rows, c]


def _set_fns(mats, dq, xs, ys, path: str = "auto"):
    def ours():
        for m, y in zip(mats, ys, strict=True):
            qk.matmul(xs[m.cols], m, out=y, path=path)

    def blas():
        for w, y in zip(dq, ys, strict=True):
            np.matmul(xs[w.shape[1]], w.T, out=y)

    return ours, blas


def section_decode(b: Bench, mats, dq, head, dh, reps: int) -> list[str]:
    nw = sum(m.size for m in mats)
    fmt = fmt_of(mats)
    xs = _xs(1, {m.cols for m in mats}, 0)
    ys = [np.empty((1, m.rows), np.float32) for m in mats]
    ours, blas = _set_fns(mats, dq, xs, ys)
    has_head = head is not None
    yh = np.empty((1, head.rows), np.float32) if has_head else None
    lines = [
        f"### Decode GEMV (1 row), whole {fmt} set ({nw / 1e6:.1f} M weights) per repetition",
        "",
        f"| threads (ours / BLAS) | {fmt} set ours ms | G w/s | fp32 BLAS ms | G w/s | speed-up | "
        + ("LM head ours ms | fp32 BLAS ms | speed-up | ours total ms/token | BLAS total | " if has_head else "")
        + "others (cores) |",
        "|---|---|---|---|---|---|" + ("---|---|---|---|---|" if has_head else "") + "---|",
    ]
    for thr in (1, 2):
        g_ours: dict[str, Callable] = {"ours": ours}
        g_blas: dict[str, Callable] = {"blas": blas}
        if has_head:
            g_ours["ours_head"] = lambda: qk.matmul(xs[head.cols], head, out=yh)
            g_blas["blas_head"] = lambda: np.matmul(xs[head.cols], dh.T, out=yh)
        r = b.rounds([(thr, 1, g_ours), (thr, thr, g_blas)], reps)
        row = (
            f"| {thr} / {thr} | {r['ours'] * 1e3:.2f} | {nw / r['ours'] / 1e9:.1f} | {r['blas'] * 1e3:.2f} | "
            f"{nw / r['blas'] / 1e9:.1f} | {r['blas'] / r['ours']:.2f}x | "
        )
        if has_head:
            row += (
                f"{r['ours_head'] * 1e3:.2f} | {r['blas_head'] * 1e3:.2f} | {r['blas_head'] / r['ours_head']:.2f}x | "
                f"{(r['ours'] + r['ours_head']) * 1e3:.2f} | {(r['blas'] + r['blas_head']) * 1e3:.2f} | "
            )
        lines.append(row + f"{r.note} |")
    return lines + ["", *kernel_comparison(b, mats, dq, xs, ys, max(3, reps // 2))]


def kernel_comparison(b: Bench, mats, dq, xs, ys, reps: int) -> list[str]:
    """Decode over the whole set with every backend: C AVX2 and portable C on our pool, numba, fp32 BLAS."""
    nw = sum(m.size for m in mats)
    ours, blas = _set_fns(mats, dq, xs, ys)
    ext = BACKEND.ext  # the C extension module, None where it is not built
    one: dict[str, Callable] = {"c1": ours}
    two: dict[str, Callable] = {"c2": ours}
    labels = {
        "c1": f"C {BACKEND.name[2:]}, 1 thread",
        "c2": f"C {BACKEND.name[2:]}, 2 threads (own pool)",
    }
    if ext is not None and ext.isa() != "generic":

        def generic():
            ext.force_generic(True)
            try:
                ours()
            finally:
                ext.force_generic(False)

        two["generic2"] = generic
        labels["generic2"] = "C portable (QUANT_KERNELS_GENERIC=1), 2 threads"
    layer = ""
    nk = BACKEND.numba  # None where numba is not installed
    if nk is not None:

        def numba_fn(n: int) -> Callable:
            def run():
                for m, y in zip(mats, ys, strict=True):
                    nk.matmul(xs[m.cols], m, y, n)

            return run

        one["numba1"], one["numba2"] = numba_fn(1), numba_fn(2)
        one["numba2"]()  # compile and start numba's pool before the clock
        import numba

        layer = f", {numba.threading_layer()} layer"
        labels["numba1"], labels["numba2"] = "numba (same layout), 1 thread", f"numba prange(2){layer}"
    one["blas1"] = blas
    labels["blas1"] = "fp32 BLAS, 1 thread"
    r = b.rounds([(1, 1, one), (2, 1, two), (2, 2, {"blas2": blas})], reps)
    labels["blas2"] = "fp32 BLAS, 2 threads"
    lines = [
        f"Kernel backends, decode over the whole {fmt_of(mats)} set (OpenBLAS at 1 thread except the last row; "
        f"others {r.note} cores):",
        "",
        "| kernel | ms/token | G w/s | vs fp32 BLAS 2t |",
        "|---|---|---|---|",
    ]
    order = ["c1", "c2", "generic2", "numba1", "numba2", "blas1", "blas2"]
    for k in (k for k in order if k in r.t):
        lines.append(f"| {labels[k]} | {r[k] * 1e3:.2f} | {nw / r[k] / 1e9:.1f} | {r['blas2'] / r[k]:.2f}x |")
    return lines


def section_batch(b: Bench, mats, dq, reps: int, rows=(2, 4, 8, 16, 32, 64)) -> list[str]:
    nw = sum(m.size for m in mats)
    lines = [
        f"### Small-batch GEMM, whole {fmt_of(mats)} set per repetition (ms per step)",
        "",
        "| x rows | ours 2t (BLAS 1t) | fp32 BLAS 2t | speed-up | ours 1t | fp32 BLAS 1t | speed-up | "
        "ours 2t GFLOP/s | BLAS 2t GFLOP/s | others |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in rows:
        xs = _xs(n, {m.cols for m in mats}, n)
        ys = [np.empty((n, m.rows), np.float32) for m in mats]
        ours, blas = _set_fns(mats, dq, xs, ys)
        r = b.rounds([(2, 1, {"o2": ours}), (2, 2, {"b2": blas}), (1, 1, {"o1": ours, "b1": blas})], reps)
        fl = 2 * n * nw
        lines.append(
            f"| {n} | {r['o2'] * 1e3:.2f} | {r['b2'] * 1e3:.2f} | {r['b2'] / r['o2']:.2f}x | {r['o1'] * 1e3:.2f} | "
            f"{r['b1'] * 1e3:.2f} | {r['b1'] / r['o1']:.2f}x | {fl / r['o2'] / 1e9:.0f} | {fl / r['b2'] / 1e9:.0f} | "
            f"{r.note} |"
        )
    return lines


def _dequantize_fns(mats, xs, ys, buf: np.ndarray):
    """Our 2-thread dequantize into one reusable fp32 buffer, then BLAS; and the dequantize alone."""

    def wt(m: PackedMatrix) -> np.ndarray:
        return qk.dequantize_t(m, buf[: m.size].reshape(m.cols, m.rows))  # fp32 W.T [cols, rows]

    def deq_blas():
        for m, y in zip(mats, ys, strict=True):
            np.matmul(xs[m.cols], wt(m), out=y)

    def deq_only():
        for m in mats:
            wt(m)

    return deq_blas, deq_only


def section_prefill(b: Bench, mats, dq, reps: int, rows=(128, 512)) -> list[str]:
    nw = sum(m.size for m in mats)
    lines = [
        f"### Prefill GEMM, whole {fmt_of(mats)} set per repetition, 2 threads",
        "",
        "| x rows | fp32 BLAS 2t ms (GFLOP/s) | ours panel 2t, BLAS 1t (GFLOP/s, vs BLAS) | "
        "dequant + BLAS 2t (vs BLAS) | dequant alone 2t ms (G w/s) | others |",
        "|---|---|---|---|---|---|",
    ]
    buf = np.empty(max(m.size for m in mats), np.float32)
    for n in rows:
        xs = _xs(n, {m.cols for m in mats}, n)
        ys = [np.empty((n, m.rows), np.float32) for m in mats]
        ours, blas = _set_fns(mats, dq, xs, ys, path="panel")
        deq_blas, deq_only = _dequantize_fns(mats, xs, ys, buf)

        r = b.rounds([(2, 1, {"ours": ours, "deq": deq_only}), (2, 2, {"blas": blas, "deq_blas": deq_blas})], reps, 1)
        fl = 2 * n * nw
        lines.append(
            f"| {n} | {r['blas'] * 1e3:.1f} ({fl / r['blas'] / 1e9:.0f}) | {r['ours'] * 1e3:.1f} "
            f"({fl / r['ours'] / 1e9:.0f}, {r['blas'] / r['ours']:.2f}x) | {r['deq_blas'] * 1e3:.1f} "
            f"({r['blas'] / r['deq_blas']:.2f}x) | {r['deq'] * 1e3:.1f} ({nw / r['deq'] / 1e9:.1f}) | {r.note} |"
        )
    return lines


def section_head(b: Bench, head, dh, reps: int) -> list[str]:
    nw = head.size
    fp32_mb = head.size * 4 / 1e6
    lines = [
        f"### {head.source_format or head.kind} LM head [{head.rows}, {head.cols}] alone ({nw / 1e6:.1f} M weights, "
        f"{head.nbytes / 1e6:.1f} MB packed, {fp32_mb:.0f} MB as fp32)",
        "",
        "| x rows | threads | ours ms | G w/s | fp32 BLAS ms | speed-up | others |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in (1, 4, 16):
        xs = _xs(n, {head.cols}, n)
        ys = [np.empty((n, head.rows), np.float32)]
        ours, blas = _set_fns([head], [dh], xs, ys)
        for thr in (1, 2):
            r = b.rounds([(thr, 1, {"o": ours}), (thr, thr, {"b": blas})], reps)
            lines.append(
                f"| {n} | {thr} | {r['o'] * 1e3:.2f} | {n * nw / r['o'] / 1e9:.1f} | {r['b'] * 1e3:.2f} | "
                f"{r['b'] / r['o']:.2f}x | {r.note} |"
            )
    return lines


def section_crossover(b: Bench, mats, reps: int, rows=(4, 5, 6, 8, 10, 12, 16)) -> list[str]:
    """direct vs panel path around DIRECT_MAX_ROWS, our 2-thread pool, BLAS 1 thread."""
    lines = [
        f"### Direct vs panel path, whole {fmt_of(mats)} set, 2 threads (auto: direct up to {qk.DIRECT_MAX_ROWS} rows)",
        "",
        "| x rows | direct ms | panel ms | panel / direct | others |",
        "|---|---|---|---|---|",
    ]
    for n in rows:
        xs = _xs(n, {m.cols for m in mats}, n)
        ys = [np.empty((n, m.rows), np.float32) for m in mats]
        direct, _ = _set_fns(mats, [], xs, ys, path="direct")
        panel, _ = _set_fns(mats, [], xs, ys, path="panel")
        r = b.rounds([(2, 1, {"d": direct, "p": panel})], reps)
        lines.append(f"| {n} | {r['d'] * 1e3:.2f} | {r['p'] * 1e3:.2f} | {r['p'] / r['d']:.2f} | {r.note} |")
    return lines


# ------------------------------------------------------------------------------------------------------------
# Thread pools side by side: each configuration in its own process (pools and their spinning state are
# process-wide; numba's threading layer is fixed at its first parallel launch).


def pool_child(engine: str, kernel: str, blas_threads: int, workload: str, steps: int) -> dict:
    """One configuration: median of `steps` whole-model steps (per layer the 4 weight matmuls plus attention-like
    BLAS calls after qkv; decode and batch16: per sequence [3x3x64]@[3x64x512]@[3x512x64], prefill 512 tokens:
    [3x1536x64]@[3x64x512]@[3x512x64])."""
    mats, _ = load(engine)
    n = {"decode": 1, "batch16": 16, "prefill": 512}[workload]
    rng = np.random.default_rng(0)
    xs = _xs(n, {m.cols for m in mats}, 0)
    ys = [np.empty((n, m.rows), np.float32) for m in mats]
    mm: Callable[[int, PackedMatrix, np.ndarray], object]
    if kernel == "none":
        dq = [dequantize_packed(m) for m in mats]

        def mm(i, m, y):
            np.matmul(xs[m.cols], dq[i].T, out=y)
    elif kernel == "deq":
        qk.set_num_threads(2)

        def mm(i, m, y):
            qk.matmul(xs[m.cols], m, out=y, path="blas")
    elif kernel in ("c1", "c2"):
        qk.set_num_threads(int(kernel[1]))

        def mm(i, m, y):
            qk.matmul(xs[m.cols], m, out=y)
    else:
        nk = BACKEND.numba

        def mm(i, m, y):
            nk.matmul(xs[m.cols], m, y, 2)

    openblas_threads(blas_threads)  # after NumpyRunner, which sets 1 for packed engines
    rows = 3 * 512 if workload == "prefill" else 3  # grouped query rows per KV head
    q = rng.standard_normal((3, rows, 64)).astype(np.float32)  # [KV, rows, hd]
    kt = rng.standard_normal((3, 64, 512)).astype(np.float32)
    v = rng.standard_normal((3, 512, 64)).astype(np.float32)
    n_attn = 1 if workload == "prefill" else n  # one small attention per sequence

    def step() -> None:
        for i, (m, y) in enumerate(zip(mats, ys, strict=True)):
            mm(i, m, y)
            if i % 4 == 0:  # after the layer's qkv
                for _ in range(n_attn):
                    (q @ kt) @ v

    for _ in range(1 if workload == "prefill" else 2):  # warm-up
        step()
    ts = []
    others = CpuMeter().start()
    for _ in range(steps):
        start = time.perf_counter()
        step()
        ts.append(time.perf_counter() - start)
    res = {"median_ms": float(np.median(ts)) * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3}
    res["others"] = others.stop().others
    if kernel.startswith("numba-"):
        import numba

        res["layer"] = numba.threading_layer()
    return res


def section_pools(engine: str, workloads: list[str], steps: dict[str, int]) -> list[str]:
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(("OPENBLAS", "OMP", "NUMBA"))}
    lines = [
        "### Thread pools side by side (one process per configuration, whole-model step incl. attention-sized BLAS)",
        "",
        "Environment: " + (" ".join(f"{k}={v}" for k, v in sorted(env_vars.items())) or "no OPENBLAS/OMP/NUMBA variables")
        + f". Steps per configuration: {', '.join(f'{w} {steps[w]}' for w in workloads)}.",
        "",
        "| workload | weight kernel | OpenBLAS threads | step median ms | min | max | others (cores) |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    names = {
        "c2": "our C pool, 2 threads",
        "c1": "our C, 1 thread",
        "numba-omp": "numba prange(2), omp",
        "numba-workqueue": "numba prange(2), workqueue",
        "none": "fp32 BLAS",
        "deq": "our dequantize (2t) + BLAS",
    }
    for wl in workloads:
        for kernel in POOL_KERNELS:
            if (wl == "prefill" and kernel.startswith("numba")) or (wl != "prefill" and kernel == "deq"):
                continue  # numba has no GEMM path worth timing at 512 rows; dequantize + BLAS only for prefill
            for bt in (1, 2):
                print(f"pools: {wl} {kernel} BLAS {bt}t ...", file=sys.stderr)
                env = dict(os.environ)
                if kernel.startswith("numba-"):
                    env.update(NUMBA_THREADING_LAYER=kernel.split("-", 1)[1], NUMBA_NUM_THREADS="2")
                cmd = [sys.executable, "-m", "benchmarks.kernel_bench", "--engine", engine, "--pool-child",
                       kernel, str(bt), wl, str(steps[wl])]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
                if out.returncode:
                    err = (out.stderr.strip().splitlines() or ["?"])[-1][:80]
                    lines.append(f"| {wl} | {names[kernel]} | {bt} | failed: {err} | | | |")
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                name = names[kernel] + (f" ({r['layer']})" if r.get("layer", "") not in ("", kernel[6:]) else "")
                lines.append(
                    f"| {wl} | {name} | {bt} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['max_ms']:.2f} | "
                    f"{r['others']:.2f}{' (noisy)' if r['others'] >= CLEAN else ''} |"
                )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sections", nargs="*", metavar="SECTION",
                   help=f"{', '.join(SECTIONS)}, all (default: {' '.join(DEFAULT_SECTIONS)})")  # fmt: skip
    p.add_argument("--engine", default="engines/smollm2-135m", help="a packed (quantized) engine directory")
    p.add_argument("--reps", type=int, default=7, help="rounds per measurement (prefill: max(3, reps // 2))")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each round wait up to S seconds for the box to be idle (< 0.15 cores)")  # fmt: skip
    p.add_argument("--pool-workloads", default=",".join(POOL_WORKLOADS), help="pools: workloads, comma-separated")
    p.add_argument("--pool-steps", type=int, default=0, help="pools: steps per configuration (0: 15 / 10 / 3)")
    p.add_argument("--pool-child", nargs=4, metavar=("KERNEL", "BLAS", "WORKLOAD", "STEPS"), help=argparse.SUPPRESS)
    p.add_argument("--write", action="store_true", help="write the results into docs/benchmarks.md")
    args = p.parse_args()
    if args.pool_child:
        kernel, bt, wl, steps = args.pool_child
        print(json.dumps(pool_child(args.engine, kernel, int(bt), wl, int(steps))))
        return

    unknown = set(args.sections) - {*SECTIONS, "all"}
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    wanted = SECTIONS if "all" in args.sections else args.sections or DEFAULT_SECTIONS
    sections = [s for s in SECTIONS if s in wanted]
    b = Bench(args.wait_quiet)
    start = time.monotonic()
    load_start = open("/proc/loadavg").read().split()[:3]
    mats, head = load(args.engine)
    print("dequantizing the fp32 reference ...", file=sys.stderr)
    dq = [dequantize_packed(m) for m in mats]  # fp32 [rows, cols] each
    dh = dequantize_packed(head) if head is not None else None
    lines = [
        "## Quant kernels vs fp32 BLAS (`python -m benchmarks.kernel_bench`)",
        "",
        f"Command: `{shlex.join(['python', '-m', 'benchmarks.kernel_bench', *sys.argv[1:]])}`  ",
        f"Machine: {machine_line()}. Kernel backend {kernel_path()}. Engine {args.engine}: {len(mats)} layer "
        f"matrices ({fmt_of(mats)}, {sum(m.size for m in mats) / 1e6:.1f} M weights, "
        f"{sum(m.nbytes for m in mats) / 1e6:.1f} MB)"
        + (f", LM head {head.source_format or head.kind} [{head.rows}, {head.cols}]" if head is not None else "")
        + f"; fp32 BLAS runs over dequantize_packed of the same matrices. Medians of {args.reps} interleaved rounds "
        f"(prefill {max(3, args.reps // 2)}), {SETTLE_S} s settle at every thread switch; 'others' = other processes' "
        f"CPU in cores, 'k/n clean' = rounds under {CLEAN} cores (the medians use only those when k >= 2).",
    ]
    for s in sections:
        print(f"{s} ... ({time.monotonic() - start:.0f} s so far)", file=sys.stderr)
        lines.append("")
        if s == "decode":
            lines += section_decode(b, mats, dq, head, dh, args.reps)
        elif s == "head" and head is not None:
            lines += section_head(b, head, dh, args.reps)
        elif s == "batch":
            lines += section_batch(b, mats, dq, args.reps)
        elif s == "prefill":
            lines += section_prefill(b, mats, dq, max(3, args.reps // 2))
        elif s == "crossover":
            lines += section_crossover(b, mats, args.reps)
        elif s == "pools":
            workloads = [w for w in args.pool_workloads.split(",") if w]
            unknown = set(workloads) - set(POOL_WORKLOADS)
            if unknown:
                raise SystemExit(f"--pool-workloads: unknown {sorted(unknown)} (choose from {POOL_WORKLOADS})")
            default_steps = {"decode": 15, "batch16": 10, "prefill": 3}
            steps = {w: args.pool_steps or default_steps[w] for w in workloads}
            lines += section_pools(str(Path(args.engine).resolve()), workloads, steps)
    load_end = open("/proc/loadavg").read().split()[:3]
    lines += [
        "",
        f"Load average at start {' '.join(load_start)}, at end {' '.join(load_end)}; "
        f"{time.monotonic() - start:.0f} s in all.",
    ]
    publish("kernel_bench", lines, args.write)


if __name__ == "__main__":
    main()
