"""Hugging Face layout -> the native runner's layout, so that loading an engine is a memory map.

Engine tensors (all float32, C-contiguous, [out_features, in_features] so the runner computes x @ W.T):
  embed                 [vocab, hidden]
  lm_head               [vocab, hidden]          only when embeddings are untied (else embed is the head)
  final_norm            [hidden]
  layers.{i}.qkv        [q_size + 2 * kv_size, hidden]   Q, K, V fused; input_layernorm gain and the
                                                         1/sqrt(head_dim) softmax scale (Q rows) folded in
  layers.{i}.o          [hidden, q_size]
  layers.{i}.gate_up    [2 * intermediate, hidden]       gate then up; post_attention_layernorm gain folded in
  layers.{i}.down       [hidden, intermediate]
  rope_freq_factors     [head_dim // 2]           only for Llama 3 style rope scaling

Folding a norm gain g into the next matmul is exact algebra: (x / rms(x) * g) @ W.T == (x / rms(x)) @ (W * g).T.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from build_engine.source import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    ROPE_FREQ_FACTORS,
    BuildError,
    ModelSource,
    expected_shapes,
    layer_tensor_names,
)


def checked_tensor(source: ModelSource, name: str, shapes: dict[str, tuple[int, ...]]) -> np.ndarray:
    """A tensor of the source as float32, with the shape the config implies and only finite values."""
    w = np.asarray(source.get_tensor(name), dtype=np.float32)
    if w.shape != shapes[name]:
        raise BuildError(f"tensor {name} has shape {list(w.shape)}, expected {list(shapes[name])} from the config")
    if not np.all(np.isfinite(w)):
        raise BuildError(f"tensor {name} contains NaN or Inf values")
    return w


def _layer(source: ModelSource, i: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    n = layer_tensor_names(i)
    get = {key: checked_tensor(source, name, shapes) for key, name in n.items()}
    q_scale = np.float32(1.0 / np.sqrt(source.arch.head_dim))
    qkv = np.concatenate([get["q"] * q_scale, get["k"], get["v"]], axis=0) * get["attn_norm"][None, :]
    gate_up = np.concatenate([get["gate"], get["up"]], axis=0) * get["ffn_norm"][None, :]
    return {
        f"layers.{i}.qkv": qkv,  # [q_size + 2 * kv_size, hidden]
        f"layers.{i}.o": get["o"],  # [hidden, q_size]
        f"layers.{i}.gate_up": gate_up,  # [2 * intermediate, hidden]
        f"layers.{i}.down": get["down"],  # [hidden, intermediate]
    }


def engine_tensors(source: ModelSource, progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (engine tensor name, array) in a fixed order, with a progress bar over the layers."""
    arch = source.arch
    shapes = expected_shapes(arch)
    yield "embed", checked_tensor(source, EMBED, shapes)
    yield "final_norm", checked_tensor(source, FINAL_NORM, shapes)
    if not arch.tie_word_embeddings:
        yield "lm_head", checked_tensor(source, LM_HEAD, shapes)
    if arch.rope_freq_factors:
        yield "rope_freq_factors", checked_tensor(source, ROPE_FREQ_FACTORS, shapes)
    for i in tqdm(range(arch.num_hidden_layers), desc="converting layers", unit="layer", disable=not progress):
        for name, w in _layer(source, i, shapes).items():
            yield name, np.ascontiguousarray(w, dtype=np.float32)
