"""Building test engines once per module or session."""

from __future__ import annotations

from pathlib import Path

import pytest

from build_engine.builder import build
from build_engine.trtllm_builder import TrtllmOptions


def build_tiny(factory: pytest.TempPathFactory, name: str, backend: str = "native", **limits: int) -> Path:
    """The tiny-random model built with the given limits (max_batch_size, max_num_tokens, max_seq_len, ...).

    backend="trtllm" needs the TensorRT-LLM test double installed (tests.trtllm_double.installed()).
    """
    out = factory.mktemp("engines") / name
    options = TrtllmOptions(dtype="float16") if backend == "trtllm" else None
    build("tiny-random", out, limits, progress=False, backend=backend, trtllm=options)
    return out
