"""The native engine against the reference implementation (transformers, fp32) on the real SmolLM2-135M, on every
kernel ISA this CPU runs (AVX-512, AVX2, portable C: forced dispatch, BACKEND.ext.force_isa).

Expected values come from tests/golden/make_golden.py (not run in CI; it needs torch + transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.engine.kernels.backend import BACKEND
from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner
from service.tokenizer import Tokenizer

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_golden.json").read_text())
LOGIT_RTOL = 1e-3

ISAS = tuple(BACKEND.ext.isas()) if BACKEND.ext is not None and BACKEND.matmul == "c" else (BACKEND.name,)

pytestmark = pytest.mark.slow


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    """The kernels the test runs on: each ISA of the extension in turn, or the one fallback in use."""
    if BACKEND.ext is None or BACKEND.matmul != "c":
        yield request.param
        return
    assert BACKEND.ext.force_isa(request.param) == request.param
    yield request.param
    BACKEND.ext.force_isa("best")


@pytest.fixture(scope="module")
def runner(smollm2_engine_dir: Path) -> NumpyRunner:
    return NumpyRunner(smollm2_engine_dir, num_kv_blocks=64)


@pytest.fixture(scope="module")
def tokenizer(smollm2_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_engine_dir(smollm2_engine_dir)


def test_golden_file_covers_the_required_cases() -> None:
    cases = GOLDEN["cases"]
    assert len(cases) >= 8
    assert {c["kind"] for c in cases} == {"raw", "chat"}
    assert sum(len(c["prompt_token_ids"]) >= 300 for c in cases) >= 2
    assert all(len(c["greedy_token_ids"]) == GOLDEN["num_tokens"] == 32 for c in cases)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_prompt_token_ids_match_reference(case: dict, tokenizer: Tokenizer) -> None:
    if case["kind"] == "chat":
        ids = tokenizer.encode_chat(case["messages"])
    else:
        ids = tokenizer.encode(case["text"])
    assert ids == case["prompt_token_ids"]


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_greedy_tokens_and_logits_match_reference(case: dict, runner: NumpyRunner, isa: str) -> None:
    prompt = case["prompt_token_ids"]
    blocks = list(range(runner.num_kv_blocks))[::-1]  # a non-trivial block table
    # the prompt in one prefill chunk, then one token per step, fed the reference's tokens (teacher forcing),
    # so a mismatch is reported at the step where it happens
    logits = runner.execute(ForwardBatch.from_chunks([SeqChunk(prompt, 0, blocks)], runner.block_size))[0]
    for step, expected in enumerate(case["greedy_token_ids"]):
        top = case["top_logits"][step]
        ours = logits[top["ids"]]
        ref = np.asarray(top["logits"])
        assert np.all(np.abs(ours - ref) <= LOGIT_RTOL * np.maximum(np.abs(ref), 1.0)), (step, ours, ref)
        assert int(np.argmax(logits)) == expected, f"greedy token differs at step {step}"
        pos = len(prompt) + step
        logits = runner.execute(ForwardBatch.from_chunks([SeqChunk([expected], pos, blocks)], runner.block_size))[0]
