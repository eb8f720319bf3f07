"""Read safetensors files as memory maps.

Engines are written with the `safetensors` library; Hugging Face exports with write_safetensors() below, since
that library's numpy API cannot write bfloat16. Reading is done here because its numpy API copies every
tensor into memory and cannot represent bfloat16: the runner wants a memory map (loading an engine costs no
conversion and shares pages between processes) and Hugging Face checkpoints are often bfloat16.
The format is an 8-byte little-endian header length, a JSON header and the raw little-endian data.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 by to_float32()
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "U8": np.dtype("u1"),  # packed quantized blocks (build_engine/packing.py)
}


class TensorFileError(ValueError):
    """A safetensors file is truncated, malformed, or holds a dtype we cannot read."""


def _read_header(buf: mmap.mmap, path: Path) -> tuple[dict, int]:
    if len(buf) < 8:
        raise TensorFileError(f"{path} is too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", buf[:8])
    if header_len > len(buf) - 8 or header_len > 100 << 20:
        raise TensorFileError(f"{path} has a corrupt safetensors header (length {header_len})")
    try:
        header = json.loads(bytes(buf[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TensorFileError(f"{path} has a corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict) or not all(isinstance(e, dict) for e in header.values()):
        raise TensorFileError(f"{path} has a corrupt safetensors header (not a table of tensors)")
    return header, 8 + header_len


class SafetensorsFile:
    """A read-only memory map of one safetensors file; tensors are zero-copy numpy views."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = self.path.stat().st_size
            if size == 0:
                raise TensorFileError(f"{self.path} is empty")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header, self._data_start = _read_header(self._buf, self.path)
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self._entries: dict[str, dict] = header

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name (F32, U8, ...), from the header."""
        return self._entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the header (no data is read)."""
        return tuple(self._entries[name]["shape"])

    def check_layout(self) -> None:
        """Every tensor's dtype is readable and its byte range matches its shape inside the file (reads no data)."""
        for name in self._entries:
            self._span(name)

    def _span(self, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
        entry = self._entries[name]
        dtype_name = entry.get("dtype")
        if dtype_name not in _DTYPES:
            raise TensorFileError(f"{self.path}: tensor {name} has unsupported dtype {dtype_name}")
        dtype = _DTYPES[dtype_name]
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(x) for x in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise TensorFileError(f"{self.path}: tensor {name} has a malformed header entry") from None
        count = int(np.prod(shape, dtype=np.int64))
        if begin < 0 or end - begin != count * dtype.itemsize or self._data_start + end > len(self._buf):
            raise TensorFileError(f"{self.path}: tensor {name} is truncated or has inconsistent offsets")
        return dtype, shape, begin

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """The tensor as stored (bfloat16 as uint16 bits) and its safetensors dtype name."""
        dtype, shape, begin = self._span(name)
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._data_start + begin)
        return array.reshape(shape), self._entries[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        """A float32 (or integer) array; zero-copy when the file already stores float32."""
        array, dtype_name = self.raw(name)
        return to_float32(array, dtype_name) if dtype_name in ("BF16", "F16", "F64") else array


def to_float32(array: np.ndarray, dtype_name: str) -> np.ndarray:
    if dtype_name == "BF16":
        # bfloat16 is the upper half of a float32: shift the bits into place.
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


WRITE_DTYPES = ("float32", "float16", "bfloat16")


def _encode(a: np.ndarray, dtype: str) -> tuple[str, bytes]:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "bfloat16":  # round to nearest even, as torch does (NaN/inf are not expected in weights)
        bits = a.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return "BF16", bits.astype("<u2").tobytes()
    if dtype == "float16":
        return "F16", a.astype("<f2").tobytes()
    return "F32", a.astype("<f4").tobytes()


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "float32") -> None:
    """Write float tensors as one safetensors file in `dtype` (float32, float16 or bfloat16), names sorted."""
    if dtype not in WRITE_DTYPES:
        raise ValueError(f"dtype must be one of {WRITE_DTYPES}, got {dtype!r}")
    entries, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        code, data = _encode(tensors[name], dtype)
        entries[name] = {
            "dtype": code,
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for blob in blobs:
            f.write(blob)
