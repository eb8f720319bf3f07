"""Weights kept as quantized blocks for the native engine (`--weight-only auto|none|int8|int4`).

- auto (default): a GGUF's Q4_0 / Q4_1 / Q8_0 blocks are kept exactly as they come (no requantization): the
  kernels multiply them with fp32 activations, which is what the fp32 path computes from their dequantized
  values. Anything else (F32/F16 tensors, K-quants without a kernel, a Hugging Face checkpoint) stays fp32.
- int8: per-output-channel symmetric int8 (one scale per row), from the float weights (stored as Q8_0 blocks
  that share the row's scale).
- int4: asymmetric 4-bit in groups of 32, 64 or 128 (stored as Q4_1 blocks that share the group's scale and
  minimum); the LM head stays int8.
- none: fp32 everywhere (norm gains folded into the matrices, as before).

Quantized matrices cannot absorb the RMSNorm gains (those scale columns), so with packed weights the gains are
stored and applied to the activations; the attention scale 1/sqrt(head_dim) is folded into Q's block scales
when that is exact (a power of two with no fp16 underflow), else applied to q after the matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from build_engine.packing import QK, PackedMatrix, pack_blocks, scale_q4_rows_exact
from build_engine.source import BuildError

WEIGHT_ONLY = ("auto", "none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
Raw = tuple[np.ndarray, str]  # (uint8 [rows, n_blocks * block_bytes], "q4_0" | "q4_1" | "q8_0")


@dataclass(frozen=True, slots=True)
class WeightPlan:
    mode: str = "auto"  # auto | none | int8 | int4
    group_size: int = 32  # int4 only

    def __post_init__(self) -> None:
        if self.mode not in WEIGHT_ONLY:
            raise BuildError(f"--weight-only {self.mode} is not a native choice ({', '.join(WEIGHT_ONLY)})")
        if self.group_size not in INT4_GROUP_SIZES:
            raise BuildError(f"--int4-group-size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")

    @property
    def packs(self) -> bool:
        return self.mode != "none"


def _fp16(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(np.float16)


def int8_rows(w: np.ndarray) -> Raw:
    """Symmetric int8 with one scale per output row, as Q8_0 blocks (d fp16, 32 int8) sharing that scale."""
    rows, cols = w.shape
    if cols % QK:
        raise BuildError(f"int8 needs in_features to be a multiple of {QK}, got {cols}")
    d = _fp16(np.abs(w).max(axis=1) / 127.0)  # [rows]
    scale = np.where(d == 0, np.float32(1), d.astype(np.float32))[:, None]
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)  # [rows, cols]
    nblk = cols // QK
    out = np.empty((rows, nblk, 34), dtype=np.uint8)
    out[:, :, 0:2] = np.repeat(d[:, None], nblk, axis=1).view(np.uint8).reshape(rows, nblk, 2)
    out[:, :, 2:] = q.reshape(rows, nblk, QK).view(np.uint8)
    return out.reshape(rows, nblk * 34), "q8_0"


def int4_groups(w: np.ndarray, group: int) -> Raw:
    """Asymmetric 4-bit per group of `group` columns (w ~ d * q + m, q in 0..15), as Q4_1 blocks sharing them."""
    rows, cols = w.shape
    if cols % group:
        raise BuildError(f"int4 with groups of {group} needs in_features to be a multiple of {group}, got {cols}")
    g = w.reshape(rows, cols // group, group)
    lo, hi = g.min(axis=2), g.max(axis=2)  # [rows, groups]
    d16, m16 = _fp16((hi - lo) / 15.0), _fp16(lo)
    d, m = d16.astype(np.float32), m16.astype(np.float32)
    q = np.clip(np.rint((g - m[..., None]) / np.where(d == 0, 1, d)[..., None]), 0, 15).astype(np.uint8)
    nblk, per = cols // QK, group // QK
    q = q.reshape(rows, nblk, QK)
    out = np.empty((rows, nblk, 20), dtype=np.uint8)
    out[:, :, 0:2] = np.repeat(d16, per, axis=1).view(np.uint8).reshape(rows, nblk, 2)
    out[:, :, 2:4] = np.repeat(m16, per, axis=1).view(np.uint8).reshape(rows, nblk, 2)
    out[:, :, 4:] = q[:, :, :16] | (q[:, :, 16:] << 4)  # byte j: weight j low, weight j + 16 high (GGUF's order)
    return out.reshape(rows, nblk * 20), "q4_1"


def quantized(w: np.ndarray, plan: WeightPlan, head: bool = False) -> Raw:
    """float [rows, cols] -> raw blocks for plan.mode int8 / int4 (the LM head: int8 under int4)."""
    if plan.mode == "int8" or head:
        return int8_rows(np.asarray(w, np.float32))
    return int4_groups(np.asarray(w, np.float32), plan.group_size)


def fuse(parts: list[Raw]) -> Raw | None:
    """Row-concatenate raw matrices (Q,K,V or gate,up): exact, one block row per row; None if formats differ."""
    formats = {fmt for _, fmt in parts}
    if len(formats) != 1:
        return None
    return np.concatenate([raw for raw, _ in parts], axis=0), formats.pop()


def fold_q_scale(raw: Raw, q_rows: int, scale: float) -> tuple[Raw, bool]:
    """Fold the attention scale into the first q_rows rows' block scales if exact; (raw, folded?)."""
    scaled = scale_q4_rows_exact(raw[0], raw[1], slice(0, q_rows), scale)
    return ((scaled, raw[1]), True) if scaled is not None else (raw, False)


def pack(raw: Raw) -> PackedMatrix:
    return pack_blocks(*raw)


def describe(plan: WeightPlan, raw_formats: list[set[str] | None]) -> str:
    """The engine's weight_format: what `plan` stores given, per engine matrix, the formats of its parts' raw
    blocks (None when some part has no raw blocks). Deterministic, so it is known before the build."""
    if plan.mode == "none":
        return "float32"
    if plan.mode == "int8":
        return "int8"
    if plan.mode == "int4":
        return f"int4-g{plan.group_size}+int8"  # the LM head stays int8
    packed = {next(iter(f)) for f in raw_formats if f is not None and len(f) == 1}
    if not packed:
        return "float32"
    mixed = any(f is None or len(f) != 1 for f in raw_formats)
    return "+".join(sorted(packed)) + ("+float32" if mixed else "")
