"""The extension's one argument parser (csrc/args.c): every entry point refuses a wrong argument count, an int out
of its range, a wrong dtype, a buffer too small for the shapes it is told, and an index outside its bound,
before any kernel touches memory. Each case starts from a valid call (which must run) and breaks one thing."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.kernels.backend import BACKEND

pytestmark = pytest.mark.skipif(BACKEND.ext is None, reason="the compiled kernels extension is not built")

f32, i64 = np.float32, np.int64


def _valid() -> dict[str, list]:
    """One valid call per entry point (shapes small: T 3, H 2, KV 1, hd 16, 4 blocks of 4)."""
    w = np.zeros((1, 1, 640), np.uint8)  # one Q4 tile of 32 rows x 32 cols
    cache = np.zeros((4, 4, 1, 16), f32)
    none = np.zeros(0, f32)  # the int8 scales of a float32 cache
    return {
        "matmul": [0, w, 32, 32, np.zeros((3, 32), f32), 3, np.empty((3, 32), f32), 0],
        "dequantize_t": [0, w, 32, 32, np.empty((32, 32), f32)],
        "attention": [np.zeros((3, 2, 16), f32), *[np.zeros((5, 1, 16), f32)] * 2, np.empty((3, 32), f32),
                      3, 5, 2, 1, 16, 1],
        "paged_attention": [np.zeros((3, 2, 16), f32), cache, cache, none, none, np.array([2, 0], i64),
                            np.empty((3, 32), f32), 3, 5, 2, 1, 16, 4, 4, 1, 0],
        "decode_attention": [np.zeros((2, 2, 16), f32), cache, cache, none, none, np.array([1, 3, 2], i64),
                             np.array([0, 1, 3], i64), np.array([4, 5], i64), np.empty((2, 2, 16), f32),
                             2, 2, 1, 16, 4, 4, 1, 0],
        "rmsnorm": [np.ones((3, 8), f32), None, 1e-5, np.empty((3, 8), f32), 3, 8],
        "rope": [np.zeros((3, 3, 16), f32), np.zeros((2, 10, 8), f32), np.array([0, 9, 4], i64), 3, 3, 2, 16, 10],
        "silu_mul": [np.zeros((3, 8), f32), np.empty((3, 4), f32), 3, 4],
        "write_kv": [cache.copy(), cache.copy(), none.copy(), none.copy(), np.zeros((3, 4, 16), f32),
                     np.array([0, 15, 7], i64), 3, 2, 1, 16, 16, 0],
    }  # fmt: skip


# entry point -> (argument position, bad value, exception, message) cases
BROKEN = {
    "matmul": [(0, 2, ValueError, r"kind = 2 out of range \[0, 1\]"), (3, 48, ValueError, "multiple of 32"),
               (6, np.empty((3, 31), f32), ValueError, "y buffer too small"),
               (4, np.zeros((3, 32), np.float64), TypeError, "x must be a C-contiguous float32")],
    "dequantize_t": [(1, np.zeros(639, np.uint8), ValueError, "w buffer too small")],
    "attention": [(4, 6, ValueError, "n <= ctx"), (9, -1, ValueError, "threads = -1 out of range")],
    "paged_attention": [(5, np.array([2, 4], i64), ValueError, "block id 4 out of range"),
                        (5, np.array([2], i64), ValueError, "table buffer too small"),
                        (5, np.array([2, 0], np.int32), TypeError, "table must be a C-contiguous int64"),
                        (15, 4, ValueError, r"dtype = 4 out of range \[0, 3\]"),
                        (15, 1, TypeError, "2-byte items for dtype 1"),
                        (15, 3, ValueError, "k_scale buffer too small")],
    "decode_attention": [(5, np.array([1, 3, 9], i64), ValueError, r"block id 9 out of range \[0, 4\)"),
                         (7, np.array([4, 9], i64), ValueError, "sequence 1: 9 keys do not fit"),
                         (6, np.array([1, 1, 3], i64), ValueError, r"starts\[0\] must be 0"),
                         (11, 3, ValueError, "H must be a multiple of KV"),
                         (1, np.zeros((4, 4, 1, 8), f32), ValueError, "k buffer too small"),
                         (16, 2, TypeError, "2-byte items for dtype 2")],
    "rmsnorm": [(1, np.ones(7, f32), ValueError, "gain buffer too small"), (2, "x", TypeError, "must be real number")],
    "rope": [(2, np.array([0, 10, 4], i64), ValueError, r"position 10 out of range \[0, 10\)"),
             (5, 4, ValueError, "nrot must be at most nheads"), (6, 15, ValueError, "hd must be even")],
    "silu_mul": [(1, np.empty((3, 8), f32)[:, ::2], ValueError, "not C-contiguous")],
    "write_kv": [(5, np.array([0, 16, 7], i64), ValueError, r"slot 16 out of range \[0, 16\)"),
                 (11, 3, ValueError, "k_scale buffer too small"),
                 (0, np.zeros((4, 4, 1, 64), np.int8), TypeError, "4-byte items for dtype 0")],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_entry_point_checks_its_arguments(name: str) -> None:
    fn = getattr(BACKEND.ext, name)
    args = _valid()[name]
    fn(*args)  # the valid call runs
    with pytest.raises(TypeError, match=rf"{name}\(.*\) takes {len(args)} arguments, got {len(args) - 1}"):
        fn(*args[:-1])
    for pos, bad, error, message in BROKEN[name]:
        broken = [*args[:pos], bad, *args[pos + 1 :]]
        with pytest.raises(error, match=message):
            fn(*broken)


def test_read_only_outputs_are_refused() -> None:
    args = _valid()["silu_mul"]
    args[1].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        BACKEND.ext.silu_mul(*args)


def test_every_call_releases_its_buffers() -> None:
    """A bytearray cannot grow while a buffer of it is held: after a call that ran and after one refused late
    (its last buffer too small, every earlier one taken), the weights must be growable again."""
    args = _valid()["matmul"]
    w = args[1] = bytearray(640)
    BACKEND.ext.matmul(*args)
    w.append(0)
    args[6] = np.empty((3, 31), f32)
    with pytest.raises(ValueError, match="y buffer too small"):
        BACKEND.ext.matmul(*args)
    w.append(0)
