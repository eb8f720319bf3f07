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

from build_engine.packing import stored
from build_engine.quantize import Raw, WeightPlan, describe, fold_q_scale, fuse, pack, quantized
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
    """fp32 layer with the norm gains and the attention scale folded in (--weight-only none)."""
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


class Packer:
    """Matrices as packed blocks (--weight-only auto|int8|int4); `meta` collects how to read each one back."""

    def __init__(self, source: ModelSource, plan: WeightPlan, shapes: dict[str, tuple[int, ...]]) -> None:
        self.source, self.plan, self.shapes = source, plan, shapes
        self.meta: dict[str, dict] = {}  # engine tensor name -> packing facts (plus "q_scale_folded")

    def raw(self, hf_name: str, head: bool = False) -> Raw | None:
        """The tensor's blocks: the GGUF's own (auto), freshly quantized (int8/int4), or None (stays fp32)."""
        if self.plan.mode == "auto":
            return self.source.get_raw(hf_name) if self.source.get_raw is not None else None
        return quantized(checked_tensor(self.source, hf_name, self.shapes), self.plan, head)

    def matrix(self, name: str, hf_names: list[str], scale_q_rows: int = 0) -> np.ndarray:
        """One engine matrix (fused when several): packed uint8 if every part packs alike, else fp32."""
        parts = [self.raw(n) for n in hf_names]
        fused = fuse(parts) if all(p is not None for p in parts) else None
        scale = np.float32(1.0 / np.sqrt(self.source.arch.head_dim))
        if fused is None:  # fp32, exact; the attention scale folded (a power of two for usual head sizes)
            w = np.concatenate([checked_tensor(self.source, n, self.shapes) for n in hf_names], axis=0)
            if scale_q_rows:
                w[:scale_q_rows] *= scale
                self.meta.setdefault("q_scale_folded", {})[name] = True
            return np.ascontiguousarray(w, dtype=np.float32)
        if scale_q_rows:
            fused, folded = fold_q_scale(fused, scale_q_rows, float(scale))
            self.meta.setdefault("q_scale_folded", {})[name] = folded
        data, self.meta[name] = stored(pack(fused))
        return data

    def layer(self, i: int) -> dict[str, np.ndarray]:
        n = layer_tensor_names(i)
        q_rows = self.source.arch.q_size
        return {
            f"layers.{i}.qkv": self.matrix(f"layers.{i}.qkv", [n["q"], n["k"], n["v"]], scale_q_rows=q_rows),
            f"layers.{i}.o": self.matrix(f"layers.{i}.o", [n["o"]]),
            f"layers.{i}.gate_up": self.matrix(f"layers.{i}.gate_up", [n["gate"], n["up"]]),
            f"layers.{i}.down": self.matrix(f"layers.{i}.down", [n["down"]]),
            f"layers.{i}.attn_norm": checked_tensor(self.source, n["attn_norm"], self.shapes),  # on activations
            f"layers.{i}.ffn_norm": checked_tensor(self.source, n["ffn_norm"], self.shapes),
        }

    def embedding(self, hf_name: str, engine_name: str) -> np.ndarray:
        raw = self.raw(hf_name, head=True)
        if raw is None:
            return checked_tensor(self.source, hf_name, self.shapes)
        data, self.meta[engine_name] = stored(pack(raw))
        return data


def engine_matrices(arch) -> list[list[str]]:
    """The HF tensors behind each engine matrix (fused parts together), embedding and LM head included."""
    out = [[EMBED]] + ([] if arch.tie_word_embeddings else [[LM_HEAD]])
    for i in range(arch.num_hidden_layers):
        n = layer_tensor_names(i)
        out += [[n["q"], n["k"], n["v"]], [n["o"]], [n["gate"], n["up"]], [n["down"]]]
    return out


def weight_format(source: ModelSource, plan: WeightPlan) -> str:
    """What the engine will store (config.json weight_format), worked out before converting anything."""
    formats: list[set[str] | None] = []
    if plan.mode == "auto":
        for names in engine_matrices(source.arch):
            raws = [source.get_raw(n) if source.get_raw is not None else None for n in names]
            formats.append(None if any(r is None for r in raws) else {fmt for _, fmt in raws})
    return describe(plan, formats)


def engine_tensors(
    source: ModelSource, progress: bool = True, plan: WeightPlan | None = None, meta: dict | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (engine tensor name, array) in a fixed order, with a progress bar over the layers.

    With a packing plan, quantized matrices are uint8 arrays in build_engine.packing's layout and `meta` (filled
    as they are yielded) says how to read each one back (safetensors metadata "packed").
    """
    arch = source.arch
    shapes = expected_shapes(arch)
    plan = plan or WeightPlan("none")
    packer = Packer(source, plan, shapes) if plan.packs else None
    if packer is None:
        yield "embed", checked_tensor(source, EMBED, shapes)
    else:
        yield "embed", packer.embedding(EMBED, "embed")
    yield "final_norm", checked_tensor(source, FINAL_NORM, shapes)
    if not arch.tie_word_embeddings:
        yield (
            "lm_head",
            checked_tensor(source, LM_HEAD, shapes) if packer is None else packer.embedding(LM_HEAD, "lm_head"),
        )
    if arch.rope_freq_factors:
        yield "rope_freq_factors", checked_tensor(source, ROPE_FREQ_FACTORS, shapes)
    for i in tqdm(range(arch.num_hidden_layers), desc="converting layers", unit="layer", disable=not progress):
        layer = _layer(source, i, shapes) if packer is None else packer.layer(i)
        for name, w in layer.items():
            yield name, w if w.dtype == np.uint8 else np.ascontiguousarray(w, dtype=np.float32)
    if packer is not None and meta is not None:
        meta.update(packer.meta)
