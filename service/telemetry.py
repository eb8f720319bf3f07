"""What backends report to observers (the service's metrics): engine steps, request outputs and gauges.

A leaf module shared by the native engine, the other backends and the API layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from service.request import RequestOutput


@dataclass(frozen=True, slots=True)
class StepStats:
    step: int  # index of the step since start
    num_seqs: int  # sequences in the batch
    num_prefill_tokens: int  # prompt / recompute tokens
    num_decode_tokens: int  # generated-token steps
    num_sampled: int  # tokens that came out
    step_ms: float  # wall time of schedule + forward + sample + outputs
    forward_ms: float  # wall time of the forward pass alone
    flops: float  # matmul + attention + LM head FLOPs the step needed
    bytes_moved: float  # weights + KV read + KV written
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    num_preempted: int  # preemptions during this step's scheduling
    mask_ms: float = 0.0  # time to fill the constrained rows' grammar masks (in a worker thread, beside the forward)
    mask_wait_ms: float = 0.0  # of which the step waited for after its forward pass (0 without constraints)
    # speculative decoding (vLLM's spec_decode counters): verify steps' sequences with drafts, their draft tokens,
    # the drafts accepted, and accepted drafts by position (index 0: first draft)
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def gflops_per_s(self) -> float:
        return self.flops / (self.forward_ms * 1e6) if self.forward_ms else 0.0

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes_moved / (self.forward_ms * 1e6) if self.forward_ms else 0.0


@dataclass(frozen=True, slots=True)
class Ceilings:
    """This machine's ceilings, measured at startup, each one way (service/engine/roofline.py, docs/timing.md)."""

    gemm_gflops: float  # fp32 GEMM rate: the best of a few 1024^3 products, BLAS on its default threads
    read_gbytes_per_s: float  # read bandwidth: the best of a few fp32 GEMVs over >= 4x the last-level cache


@dataclass(frozen=True, slots=True)
class BackendStats:
    """Gauges of a backend's state (for the native engine exact; for others as their own stats report)."""

    num_running: int  # requests in the running batch
    num_waiting: int  # requests accepted, not yet scheduled
    kv_blocks_used: int
    kv_blocks_total: int


class Observer(Protocol):
    """Receives a backend's telemetry; called from the backend's own thread, so it must not block."""

    def on_step(self, stats: StepStats) -> None:
        """One engine step (backends that run steps themselves: the native engine)."""

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Outputs delivered to requests (tokens; the finished ones carry their timing)."""

    def on_gauges(self, stats: BackendStats) -> None:
        """The backend's state changed without a step (aborts, failures, a stats poll)."""
