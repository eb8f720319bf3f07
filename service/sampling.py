"""Turning logits into tokens."""

from __future__ import annotations

import numpy as np


def greedy(logits: np.ndarray) -> np.ndarray:
    """Argmax per row. logits: [B, V] -> [B] int64."""
    return np.argmax(logits, axis=-1)


def sample_temperature(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Sample one token from softmax(logits / temperature). logits: [V]; temperature > 0."""
    z = logits.astype(np.float64) / temperature  # [V]
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))
