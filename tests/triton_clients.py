"""tritonclient as a Triton user drives it (sync client, streaming with empty final responses): request tensors
built from the models' tables, and whole streams collected. Real gRPC over 127.0.0.1, no doubles."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as tg

from build_engine.triton_models.tables import MODELS

NUMPY = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32}


def tensor(model: str, name: str, value) -> tg.InferInput:
    """An input of `model` holding `value`: a scalar -> [1, 1]; a list -> [1, n] (or [1, 2, n] word lists)."""
    spec = MODELS[model].input(name)
    datatype = spec.datatype if spec is not None else "FP32"
    if datatype == "BYTES":
        values = value if isinstance(value, list) else [value]
        arr = np.array([[v.encode() if isinstance(v, str) else v for v in values]], dtype=np.object_)
    else:
        arr = np.array(value, dtype=NUMPY[datatype])
        arr = arr.reshape(1, *arr.shape) if arr.ndim else arr.reshape(1, 1)
    t = tg.InferInput(name, list(arr.shape), datatype)
    t.set_data_from_numpy(arr)
    return t


def inputs(model: str, **values) -> list[tg.InferInput]:
    return [tensor(model, name, value) for name, value in values.items()]


def text_of(result) -> str:
    raw = result.as_numpy("text_output")
    return "" if raw is None else b"".join(raw.reshape(-1)).decode()


def ids_of(result) -> list[int]:
    raw = result.as_numpy("output_ids")
    return [] if raw is None else raw.reshape(-1).tolist()


def is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


@dataclass
class StreamRun:
    results: list = field(default_factory=list)  # InferResults in arrival order
    errors: list = field(default_factory=list)  # InferenceServerExceptions

    @property
    def text(self) -> str:
        return "".join(text_of(r) for r in self.results)

    @property
    def ids(self) -> list[int]:
        return [t for r in self.results for t in ids_of(r)]

    def scalar(self, name: str, which: int = -1):
        value = self.results[which].as_numpy(name)
        return None if value is None else value.reshape(-1)[0].item()

    def total(self, name: str) -> int:
        return sum(int(r.as_numpy(name).reshape(-1)[0]) for r in self.results if r.as_numpy(name) is not None)


class Streamer:
    """One client, one stream: send requests, then read until `n_final` requests have ended."""

    def __init__(self, url: str, **client_kw) -> None:
        self.client = tg.InferenceServerClient(url, **client_kw)
        self.queue: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.queue.put((result, error)))

    def send(self, model: str, tensors: list, request_id: str = "", empty_final: bool = True, **kw) -> None:
        self.client.async_stream_infer(
            model, tensors, request_id=request_id, enable_empty_final_response=empty_final, **kw
        )

    def read(self, n_final: int = 1, timeout: float = 60) -> StreamRun:
        run, done = StreamRun(), 0
        while done < n_final:
            result, error = self.queue.get(timeout=timeout)
            if error is not None:
                run.errors.append(error)
                done += 1
                continue
            run.results.append(result)
            done += is_final(result)
        return run

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_once(url: str, model: str, tensors: list, request_id: str = "", **kw) -> StreamRun:
    s = Streamer(url)
    try:
        s.send(model, tensors, request_id, **kw)
        return s.read()
    finally:
        s.close()
