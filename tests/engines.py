"""Building test engines once per module or session."""

from __future__ import annotations

from pathlib import Path

import pytest

from build_engine.builder import build


def build_tiny(factory: pytest.TempPathFactory, name: str, **limits: int) -> Path:
    """The tiny-random model built with the given limits (max_batch_size, max_num_tokens, max_seq_len, ...)."""
    out = factory.mktemp("engines") / name
    build("tiny-random", out, limits, progress=False)
    return out
