"""Prometheus metrics of the service (prometheus-client), one registry per server instance.

Updated by the backend as its Observer (service/telemetry.py: engine steps, outputs, gauges) and by the
servicer when an RPC ends (requests by final status code). Names follow vLLM's, with an `llm_` prefix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from service.request import RequestOutput
from service.telemetry import BackendStats, Ceilings, StepStats

# Fine at the low end: decode steps of a small model take a few milliseconds (vllm#55276: a 10 ms smallest
# bucket makes fast-decode percentiles unrecoverable).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("llm_time_to_first_token_seconds", "Arrival to first token.")
        self.tpot = hist("llm_time_per_output_token_seconds", "Per request: (last - first token) / (tokens - 1).")
        self.itl = hist("llm_inter_token_latency_seconds", "Gap between consecutive tokens of a request.")
        self.e2e = hist("llm_e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("llm_request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = hist("llm_request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = hist("llm_request_decode_time_seconds", "First token to last token.")
        self.step_time = Histogram(
            "llm_step_duration_seconds",
            "Forward pass time of an engine step, by phase (prefill: only prompt tokens, decode: only "
            "generated tokens, mixed: both).",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_gflops = Gauge(
            "llm_step_achieved_gflops", "Achieved GFLOP/s of the last step of each phase.", ["phase"], registry=r
        )
        self.step_gbs = Gauge(
            "llm_step_achieved_gbytes_per_second",
            "Achieved GB/s of the last step of each phase.",
            ["phase"],
            registry=r,
        )
        self.machine_gflops = Gauge(
            "llm_machine_gemm_gflops",
            "fp32 GEMM rate of this machine, measured once serving (0 until then): the best of 3 1024^3 products (BLAS, default "
            "threads).",
            registry=r,
        )
        self.machine_gbs = Gauge(
            "llm_machine_read_gbytes_per_second",
            "Read bandwidth of this machine, measured once serving (0 until then): the best of 3 fp32 GEMVs over a matrix of at least "
            "4x the last-level cache (BLAS, default threads; the benchmarks' ceiling, docs/timing.md).",
            registry=r,
        )
        self.running = Gauge("llm_num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("llm_num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.blocks_total = Gauge("llm_kv_cache_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.blocks_used = Gauge("llm_kv_cache_blocks_used", "KV cache blocks held by requests.", registry=r)
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter(
            "llm_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.generation_tokens = Counter("llm_generation_tokens", "Generated tokens.", registry=r)
        self.preemptions = Counter("llm_num_preemptions", "Requests preempted (recomputed later).", registry=r)
        # speculative decoding, vLLM's counter names (spec_decode_*) under our prefix
        self.spec_drafts = Counter(
            "llm_spec_decode_num_drafts", "Verify steps' sequences that carried draft tokens.", registry=r
        )
        self.spec_draft_tokens = Counter("llm_spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.spec_accepted = Counter(
            "llm_spec_decode_num_accepted_tokens",
            "Draft tokens accepted (equal to the model's own choice).",
            registry=r,
        )
        self.spec_accepted_per_pos = Counter(
            "llm_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first draft).",
            ["position"],
            registry=r,
        )
        self.requests = Counter(
            "llm_requests",
            "Finished generation requests by final gRPC status code (llm.v1 Generate RPCs and the Triton "
            "front door's inference requests).",
            ["code"],
            registry=r,
        )
        self.triton_requests = Counter(
            "llm_triton_requests",
            "Finished inference requests of the Triton front door by model and final status code (also counted "
            "in llm_requests_total).",
            ["model", "code"],
            registry=r,
        )
        self.stalled_streams = Counter(
            "llm_streams_stalled",
            "Streams ended because their client took no response for --stream-stall-timeout seconds.",
            registry=r,
        )
        self.rpc_slots = Gauge("llm_rpc_slots_used", "RPC slots held by requests in progress.", registry=r)
        # the process: resident memory, open fds, CPU (process_*), and threads and event-loop tasks, which a
        # leak would grow (the soak test reads these)
        ProcessCollector(registry=r)
        Gauge("llm_process_threads", "OS threads of the server process.", registry=r).set_function(_num_threads)
        self.loop_tasks = Gauge("llm_event_loop_tasks", "asyncio tasks alive in the server's event loop.", registry=r)

    def watch_event_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))

    def set_static(self, num_kv_blocks: int, ceilings: Ceilings | None) -> None:
        self.blocks_total.set(num_kv_blocks)
        if ceilings is not None:
            self.machine_gflops.set(ceilings.gemm_gflops)
            self.machine_gbs.set(ceilings.read_gbytes_per_s)

    def generated_tokens(self) -> float:
        """Tokens generated since the server started (the counter's value)."""
        return self.registry.get_sample_value("llm_generation_tokens_total") or 0.0

    # ---- the backend's Observer (called in the backend's thread) -------------------------------------------
    def on_step(self, stats: StepStats) -> None:
        """An engine step (native backend): phase histograms, achieved rates, gauges."""
        self.on_gauges(BackendStats(stats.num_running, stats.num_waiting, stats.kv_blocks_used, 0))
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
        if stats.num_spec_drafts:
            self.spec_drafts.inc(stats.num_spec_drafts)
            self.spec_draft_tokens.inc(stats.num_spec_draft_tokens)
            self.spec_accepted.inc(stats.num_spec_accepted_tokens)
            for pos, n in enumerate(stats.spec_accepted_per_pos):
                self.spec_accepted_per_pos.labels(str(pos)).inc(n)
        if stats.num_prefill_tokens and stats.num_decode_tokens:
            phase = "mixed"
        else:
            phase = "prefill" if stats.num_prefill_tokens else "decode"
        self.step_time.labels(phase).observe(stats.forward_ms / 1e3)
        self.step_gflops.labels(phase).set(stats.gflops_per_s)
        self.step_gbs.labels(phase).set(stats.gbytes_per_s)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        generated = sum(len(o.new_token_ids) for o in outputs)
        if generated:
            self.generation_tokens.inc(generated)
        for out in outputs:
            if out.finished:
                self.request_finished(out)

    def on_gauges(self, stats: BackendStats) -> None:
        self.blocks_used.set(stats.kv_blocks_used)
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        if stats.kv_blocks_total:
            self.blocks_total.set(stats.kv_blocks_total)

    def request_finished(self, out: RequestOutput) -> None:
        t = out.timing
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.cached_tokens.inc(out.num_cached_tokens)
        if t is None:
            return
        self.e2e.observe(t.e2e_ms / 1e3)
        self.queue.observe(t.queue_ms / 1e3)
        if out.num_output_tokens:
            self.ttft.observe(t.ttft_ms / 1e3)
            self.prefill.observe(t.prefill_ms / 1e3)
            self.decode.observe(t.decode_ms / 1e3)
        if out.num_output_tokens > 1:
            self.tpot.observe(t.tpot_ms / 1e3)
        for gap in t.itl_ms:
            self.itl.observe(gap / 1e3)

    def stream_stalled(self) -> None:
        self.stalled_streams.inc()

    def watch_slots(self, used: Callable[[], int]) -> None:
        self.rpc_slots.set_function(used)

    def rpc_finished(self, code: str) -> None:
        self.requests.labels(code).inc()

    def triton_request_finished(self, model: str, code: str) -> None:
        self.requests.labels(code).inc()
        self.triton_requests.labels(model, code).inc()


def _num_threads() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0
