"""Building test engines once per module or session, and driving an EngineCore through requests in tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from build_engine.builder import build
from build_engine.trtllm_builder import TrtllmOptions
from service.engine.core import EngineCore
from service.request import GenerateRequest, RequestOutput


def build_tiny(factory: pytest.TempPathFactory, name: str, backend: str = "native", **limits: int) -> Path:
    """The tiny-random model built with the given limits (max_batch_size, max_num_tokens, max_seq_len, ...).

    backend="trtllm" needs the TensorRT-LLM test double installed (tests.trtllm_double.installed()).
    """
    out = factory.mktemp("engines") / name
    options = TrtllmOptions(dtype="float16") if backend == "trtllm" else None
    build("tiny-random", out, limits, progress=False, backend=backend, trtllm=options)
    return out


def run_engine(
    engine: EngineCore,
    gens: list[GenerateRequest],
    arrival_steps: list[int] | None = None,
    on_step: Callable[[EngineCore], None] | None = None,
) -> dict[str, list[RequestOutput]]:
    """Run requests to completion, each added at its arrival step (0: at once), checking the scheduler's
    invariants after every step (and calling on_step with the engine); request id -> its outputs in order."""
    outputs: dict[str, list[RequestOutput]] = {g.request_id: [] for g in gens}
    pending = sorted(zip(arrival_steps or [0] * len(gens), range(len(gens)), gens, strict=True))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[2])
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine.scheduler.check_invariants()
        if on_step is not None:
            on_step(engine)
        step += 1
    return outputs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    """Every token id of a request's outputs, in order."""
    return [t for o in outs for t in o.new_token_ids]
