"""The packed weight layout of the native engine: GGUF quantized blocks (Q4_0, Q4_1, Q8_0) in the tiled form the
quant kernels (service/engine/kernels/matmul.py) read. Part of the engine-directory contract (like spec.py).

GGUF stores a matrix [rows, cols] row by row, each row as cols/32 blocks (ggml's block structs):
  Q4_0  18 bytes: fp16 d, 16 bytes qs            weight = d * (q - 8)    q = 4-bit nibble 0..15
  Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes qs    weight = d * q + m
  Q8_0  34 bytes: fp16 d, 32 int8 qs             weight = d * q
  In the 4-bit formats byte j (0..15) of qs holds weight j in its low nibble and weight j + 16 in its high one.

Packed layout (PackedMatrix.data, one contiguous uint8 array, 64-byte aligned):
  rows are grouped in tiles of TILE_ROWS = 32 (the last tile zero-padded: d = m = 0, so padded rows give 0);
  data[tile, blk] is one "chunk" holding the 32 rows' block blk, stored column-major so the kernels can
  load 32 consecutive rows of one weight position with one 32-byte load (SIMD across output rows):
    Q4 (Q4_0 and Q4_1)  chunk = 640 bytes: qs[16][32] uint8 (byte j of the block for rows 0..31),
                                            d[32] fp16, m[32] fp16
    Q8_0                chunk = 1088 bytes: qs[32][32] int8, d[32] fp16
  data.shape == (n_tiles, n_blocks, chunk_bytes).
Q4_0 is stored as Q4_1 with m = -8 d (exact: multiplying an fp16 by 8 is exact unless it overflows, checked),
so one kernel serves both. The packed form holds exactly the information of the GGUF blocks: fp16 d and m are
kept as fp16 (the kernels convert them with F16C, which is exact), the nibbles are unchanged.

Row operations needed by the engine (fusing Q,K,V or gate,up; un-permuting Q/K rows) are done on the raw
GGUF rows before packing: a row of blocks is an independent unit, so reordering/concatenating rows is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE_ROWS = 32  # output rows per tile (4 AVX2 vectors of 8 fp32 lanes)
QK = 32  # weights per GGUF block

# format name -> (GGUF block bytes, packed chunk bytes)
RAW_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
CHUNK_BYTES = {"q4": 20 * TILE_ROWS, "q8_0": 34 * TILE_ROWS}
GGML_TYPE_NAMES = {2: "q4_0", 3: "q4_1", 8: "q8_0"}  # ggml type id -> format


@dataclass(frozen=True, slots=True)
class PackedMatrix:
    """A [rows, cols] matrix kept as quantized blocks in the tiled layout described in the module docstring."""

    kind: str  # "q4" (Q4_0 and Q4_1) or "q8_0"
    rows: int  # output features (any count; the last tile is padded)
    cols: int  # input features, a multiple of 32
    data: np.ndarray  # uint8 [n_tiles, cols // 32, CHUNK_BYTES[kind]], C-contiguous, 64-byte aligned
    source_format: str = ""  # "q4_0" / "q4_1" / "q8_0": what the blocks came from (informational)

    @property
    def n_tiles(self) -> int:
        return self.data.shape[0]

    @property
    def n_blocks(self) -> int:
        return self.cols // QK

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def size(self) -> int:
        """Weights held (rows x cols), as numpy's size counts them."""
        return self.rows * self.cols


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type = np.uint8, align: int = 64) -> np.ndarray:
    """np.empty(shape, dtype) whose first byte is `align`-aligned (a view into a slightly larger buffer).

    numpy's allocator aligns to 16 bytes, a large array 16 bytes past a page: the kernels' 64-byte loads of its
    rows would each straddle two cache lines (the packed weights here; the runner's activations, kernels/ops.py).
    """
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(n + align, dtype=np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off : off + n].view(dtype).reshape(shape)


def _split_raw(raw: np.ndarray, fmt: str, cols: int | None) -> tuple[np.ndarray, int]:
    # raw: uint8 [rows, n_blocks * block_bytes] (gguf ReaderTensor.data) -> [rows, n_blocks, block_bytes]
    bb = RAW_BLOCK_BYTES[fmt]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % bb:
        raise ValueError(f"{fmt} raw blocks must be uint8 [rows, n_blocks * {bb}], got {raw.shape}")
    nblk = raw.shape[1] // bb
    if cols is not None and cols != nblk * QK:
        raise ValueError(f"cols={cols} does not match {nblk} blocks of {QK}")
    return raw.reshape(raw.shape[0], nblk, bb), nblk * QK


def pack_blocks(raw: np.ndarray, fmt: str, cols: int | None = None) -> PackedMatrix:
    """Repack GGUF raw blocks (uint8 [rows, n_blocks * block_bytes], fmt in q4_0/q4_1/q8_0) into the tiled layout."""
    blocks, cols = _split_raw(raw, fmt, cols)  # [rows, nblk, bb]
    rows, nblk, _ = blocks.shape
    n_tiles = -(-rows // TILE_ROWS)
    pad = n_tiles * TILE_ROWS - rows
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, nblk, blocks.shape[2]), np.uint8)], axis=0)
    # [n_tiles, 32 rows, nblk, bb] -> per (tile, blk): fields transposed to [field bytes][32 rows]
    t = blocks.reshape(n_tiles, TILE_ROWS, nblk, blocks.shape[2]).transpose(0, 2, 3, 1)  # [tiles, nblk, bb, 32]
    if fmt == "q8_0":
        out = aligned_empty((n_tiles, nblk, CHUNK_BYTES["q8_0"]))
        flat = out.reshape(n_tiles, nblk, 34 * TILE_ROWS)
        flat[:, :, : 32 * TILE_ROWS] = t[:, :, 2:34].reshape(n_tiles, nblk, 32 * TILE_ROWS)  # qs[32 j][32 rows]
        d16 = np.ascontiguousarray(t[:, :, 0:2].transpose(0, 1, 3, 2))  # [tiles, nblk, 32 rows, 2 bytes] fp16
        flat[:, :, 32 * TILE_ROWS :] = d16.reshape(n_tiles, nblk, 2 * TILE_ROWS)  # d[32 rows] fp16
        return PackedMatrix("q8_0", rows, cols, out, "q8_0")
    out = aligned_empty((n_tiles, nblk, CHUNK_BYTES["q4"]))
    o = out.reshape(n_tiles, nblk, 20, TILE_ROWS)
    qoff = 2 if fmt == "q4_0" else 4
    o[:, :, :16] = t[:, :, qoff : qoff + 16]  # qs[16][32 rows]
    d16 = np.ascontiguousarray(t[:, :, 0:2].transpose(0, 1, 3, 2)).view(np.float16)[..., 0]  # [tiles, nblk, 32]
    if fmt == "q4_1":
        m16 = np.ascontiguousarray(t[:, :, 2:4].transpose(0, 1, 3, 2)).view(np.float16)[..., 0]
    else:  # Q4_0: d * (q - 8) == d * q + (-8 d), and -8 d is exact in fp16 unless it overflows
        with np.errstate(over="ignore"):
            m16 = (d16 * np.float16(-8.0)).astype(np.float16)
        if not np.array_equal(m16.astype(np.float64), d16.astype(np.float64) * -8.0):
            raise ValueError("Q4_0 scale too large to store -8*d exactly in fp16")
    dm = out.reshape(n_tiles, nblk, 20 * TILE_ROWS)
    dm[:, :, 16 * TILE_ROWS : 18 * TILE_ROWS] = d16.view(np.uint8).reshape(n_tiles, nblk, 2 * TILE_ROWS)
    dm[:, :, 18 * TILE_ROWS : 20 * TILE_ROWS] = m16.view(np.uint8).reshape(n_tiles, nblk, 2 * TILE_ROWS)
    return PackedMatrix("q4", rows, cols, out, fmt)


def chunk_fields(w: PackedMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Views of the packed fields: qs [tiles, nblk, 16|32, 32] (uint8|int8), d and m fp16 [tiles, nblk, 32]."""
    nt, nb = w.n_tiles, w.n_blocks
    R = TILE_ROWS
    if w.kind == "q8_0":
        flat = w.data.reshape(nt, nb, 34 * R)
        qs = flat[:, :, : 32 * R].view(np.int8).reshape(nt, nb, 32, R)
        d = flat[:, :, 32 * R :].view(np.float16)
        return qs, d, None
    flat = w.data.reshape(nt, nb, 20 * R)
    qs = flat[:, :, : 16 * R].reshape(nt, nb, 16, R)
    d = flat[:, :, 16 * R : 18 * R].view(np.float16)
    m = flat[:, :, 18 * R :].view(np.float16)
    return qs, d, m


def dequantize_packed(w: PackedMatrix) -> np.ndarray:
    """fp32 [rows, cols] matrix of the packed blocks; equal bit for bit to gguf.quants.dequantize of the source."""
    qs, d16, m16 = chunk_fields(w)
    d = d16.astype(np.float32)[:, :, None, :]  # [tiles, nblk, 1, 32]
    if w.kind == "q8_0":
        wt = qs.astype(np.float32) * d  # [tiles, nblk, 32 j, 32 rows]
    else:
        m = m16.astype(np.float32)[:, :, None, :]
        lo = (qs & 15).astype(np.float32) * d + m
        hi = (qs >> 4).astype(np.float32) * d + m
        wt = np.concatenate([lo, hi], axis=2)  # [tiles, nblk, 32 j, 32 rows]
    full = wt.transpose(0, 3, 1, 2).reshape(w.n_tiles * TILE_ROWS, w.cols)
    return np.ascontiguousarray(full[: w.rows])


def scale_q4_rows_exact(raw: np.ndarray, fmt: str, row_slice: slice, scale: float) -> np.ndarray | None:
    """Raw Q4_0/Q4_1/Q8_0 blocks with d (and Q4_1's m) of the given rows times `scale`, or None if not exact.

    Used to fold the attention softmax scale 1/sqrt(head_dim) into the Q rows. It is exact when the scale is a
    power of two and no scaled fp16 value underflows into the subnormal range (checked value by value);
    otherwise the caller must scale q after the matmul instead.
    """
    blocks, _ = _split_raw(raw, fmt, None)
    out = blocks.copy()
    fields = [(0, 2)] + ([(2, 4)] if fmt == "q4_1" else [])
    for a, b in fields:
        v = np.ascontiguousarray(out[row_slice, :, a:b]).view(np.float16)  # [r, nblk, 1]
        s = (v.astype(np.float64) * scale).astype(np.float16)
        if not np.array_equal(s.astype(np.float64), v.astype(np.float64) * scale):
            return None
        out[row_slice, :, a:b] = s.view(np.uint8)
    return out.reshape(raw.shape)


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (see build_engine.gguf_source.unpermute_qk): new[i] = old[p[i]]."""
    head_dim = n_rows // n_heads
    return np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(n_rows)


def gguf_raw(tensor) -> tuple[np.ndarray, str]:
    """(raw uint8 [rows, n_blocks * block_bytes], format) of a gguf.ReaderTensor in Q4_0 / Q4_1 / Q8_0."""
    fmt = GGML_TYPE_NAMES.get(int(tensor.tensor_type))
    if fmt is None:
        raise ValueError(f"{tensor.name}: ggml type {tensor.tensor_type!r} has no quant kernel")
    return np.asarray(tensor.data, dtype=np.uint8), fmt


def dequantize_rows(w: PackedMatrix, rows: np.ndarray) -> np.ndarray:
    """fp32 [len(rows), cols]: only the given rows (the token embedding's lookup), without the whole matrix."""
    rows = np.asarray(rows, dtype=np.int64)
    tiles, lanes = rows // TILE_ROWS, rows % TILE_ROWS
    qs, d16, m16 = chunk_fields(w)
    d = d16[tiles, :, lanes].astype(np.float32)[:, :, None]  # [T, nblk, 1]
    q = qs[tiles, :, :, lanes]  # [T, nblk, 16 | 32]
    if w.kind == "q8_0":
        vals = q.astype(np.float32) * d  # [T, nblk, 32]
    else:
        m = m16[tiles, :, lanes].astype(np.float32)[:, :, None]
        vals = np.concatenate([(q & 15).astype(np.float32) * d + m, (q >> 4).astype(np.float32) * d + m], axis=2)
    return vals.reshape(len(rows), w.cols)


def stored(w: PackedMatrix) -> tuple[np.ndarray, dict]:
    """What the engine file holds for a packed matrix: its uint8 data and the facts to rebuild it."""
    return w.data, {"kind": w.kind, "rows": w.rows, "cols": w.cols, "source": w.source_format}


def from_stored(data: np.ndarray, meta: dict) -> PackedMatrix:
    return PackedMatrix(meta["kind"], int(meta["rows"]), int(meta["cols"]), data, meta.get("source", ""))
