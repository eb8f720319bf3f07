"""KServe v2 tensors <-> numpy: request inputs checked against a model's table, responses built as Triton
builds them (raw_output_contents, one entry per output, BYTES as 4-byte little-endian length + bytes).

Every problem is an InvalidRequest naming the tensor: an unknown or duplicated input, a missing required one,
a wrong datatype or shape, a batch larger than one, contents whose size does not match the shape.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

import numpy as np
from tritonclient.grpc import service_pb2

from build_engine.triton_models.tables import REFUSED, ModelSpec, Tensor
from service.errors import InvalidRequest

NUMPY = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}  # fmt: skip
# InferTensorContents field of each datatype (the non-raw form)
CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip
MAX_ELEMENTS = 1 << 20  # input_ids: bounded again by max_seq_len at admission (as llm.v1's prompt_token_ids)
MAX_LIST_ELEMENTS = 256  # any other variable-length input (stop words, word lists): a few dozen mean anything
ID_TENSORS = frozenset({"input_ids", "decoder_input_ids", "TOKENS_BATCH"})  # token ids: MAX_ELEMENTS


def _shape_text(shape: Iterable[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _check_shape(model: ModelSpec, spec: Tensor, shape: list[int]) -> int:
    expected = [-1, *spec.dims]
    ok = len(shape) == len(expected) and all(
        d >= 0 and (e == -1 or d == e) for d, e in zip(shape, expected, strict=False)
    )
    if not ok:
        raise InvalidRequest(
            f"unexpected shape for input '{spec.name}' for model '{model.name}'. Expected "
            f"{_shape_text(expected)}, got {_shape_text(shape)}"
        )
    if shape[0] != 1:
        raise InvalidRequest(
            f"input '{spec.name}' has batch size {shape[0]}: this server takes one sequence per request "
            f"(shape [1, ...]); send one request per prompt"
        )
    count = math.prod(shape)
    limit = MAX_ELEMENTS if spec.name in ID_TENSORS else MAX_LIST_ELEMENTS
    if count > limit:  # checked before any element is decoded: a long list costs nothing
        raise InvalidRequest(f"input '{spec.name}' has {count} elements, more than {limit}")
    return count


def _bytes_elements(name: str, raw: bytes, count: int) -> np.ndarray:
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(raw):
            raise InvalidRequest(f"input '{name}': BYTES contents end inside an element's 4-byte length")
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + length > len(raw):
            raise InvalidRequest(f"input '{name}': a BYTES element of {length} bytes runs past the contents")
        out.append(raw[pos : pos + length])
        pos += length
    if pos != len(raw):
        raise InvalidRequest(f"input '{name}': {len(raw) - pos} bytes left over after {count} BYTES elements")
    arr = np.empty(count, dtype=np.object_)
    arr[:] = out
    return arr


def _from_raw(spec: Tensor, raw: bytes, count: int) -> np.ndarray:
    if spec.datatype == "BYTES":
        return _bytes_elements(spec.name, raw, count)
    dtype = NUMPY[spec.datatype]
    if len(raw) != count * dtype.itemsize:
        raise InvalidRequest(
            f"input '{spec.name}' has {len(raw)} bytes of contents; its shape and datatype need "
            f"{count * dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype)


def _from_contents(spec: Tensor, contents: service_pb2.InferTensorContents, count: int) -> np.ndarray:
    values = list(getattr(contents, CONTENTS[spec.datatype]))
    if len(values) != count:
        raise InvalidRequest(f"input '{spec.name}' has {len(values)} values; its shape needs {count}")
    if spec.datatype == "BYTES":
        arr = np.empty(count, dtype=np.object_)
        arr[:] = values
        return arr
    try:
        return np.array(values, dtype=NUMPY[spec.datatype])
    except OverflowError:
        raise InvalidRequest(f"input '{spec.name}' holds a value out of range for {spec.datatype}") from None


def _refusal(model: ModelSpec, name: str, spec: Tensor | None) -> str:
    """Why an input is not taken: a tensor of the 1.2-era model we do not serve (with the reason), or unknown."""
    reason = REFUSED.get(model.kind, {}).get(name)
    if reason is None and spec is None:
        return f"unexpected inference input '{name}' for model '{model.name}'"
    return f"input '{name}' of model '{model.name}' is not supported by this server: {reason or 'not served'}"


def decode_inputs(model: ModelSpec, request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    """The request's input tensors by name (shapes as sent), checked against the model's table."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(f"expected {len(request.inputs)} raw input contents (one per input), got {len(raw)}")
    tensors: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        spec = model.input(tensor.name)
        if spec is None or not spec.served:
            raise InvalidRequest(_refusal(model, tensor.name, spec))
        if tensor.name in tensors:
            raise InvalidRequest(f"input '{tensor.name}' is given more than once")
        if tensor.datatype != spec.datatype:
            raise InvalidRequest(
                f"unexpected datatype {tensor.datatype or '(none)'} for inference input '{tensor.name}', "
                f"expecting {spec.datatype}"
            )
        shape = list(tensor.shape)
        count = _check_shape(model, spec, shape)
        if raw:
            values = _from_raw(spec, raw[index], count)
        elif tensor.datatype in CONTENTS:
            values = _from_contents(spec, tensor.contents, count)
        else:
            raise InvalidRequest(f"input '{tensor.name}' of type {tensor.datatype} must come in raw_input_contents")
        tensors[tensor.name] = values.reshape(shape)
    missing = [t.name for t in model.served_inputs if not t.optional and t.name not in tensors]
    if missing:
        raise InvalidRequest(f"model '{model.name}' is missing required input(s) {', '.join(repr(m) for m in missing)}")
    return tensors


def scalar(tensors: dict[str, np.ndarray], name: str):
    """The single value of a [1, 1] tensor as a Python number or bool, or None when absent."""
    arr = tensors.get(name)
    if arr is None:
        return None
    flat = arr.reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"input '{name}' must hold one value, got {flat.size}")
    return flat[0].item() if hasattr(flat[0], "item") else flat[0]


class ResponseBuilder:
    """One ModelInferResponse: outputs in order, each with its raw contents (Triton's wire layout); for a stream,
    built in place inside its ModelStreamInferResponse (no copy)."""

    def __init__(self, model_name: str, version: str, request_id: str, stream: bool = False) -> None:
        self.message = service_pb2.ModelStreamInferResponse() if stream else service_pb2.ModelInferResponse()
        self.response = self.message.infer_response if stream else self.message
        self.response.model_name, self.response.model_version, self.response.id = model_name, version, request_id

    def add(self, name: str, datatype: str, values: np.ndarray) -> None:
        self.response.outputs.add(name=name, datatype=datatype, shape=list(values.shape))
        if datatype == "BYTES":
            raw = b"".join(struct.pack("<I", len(v)) + v for v in values.reshape(-1))
        else:
            raw = np.ascontiguousarray(values, dtype=NUMPY[datatype]).tobytes()
        self.response.raw_output_contents.append(raw)

    def final(self, final: bool):
        """The message (ModelStreamInferResponse for a stream), with triton_final_response set."""
        self.response.parameters["triton_final_response"].bool_param = final
        return self.message
