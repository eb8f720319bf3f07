"""KServe v2 HTTP/REST bodies <-> the gRPC door's protobuf messages (tritonclient's service_pb2), so the HTTP door
runs every request through the same handlers as the gRPC door (service/api/triton/http.py).

- infer: the JSON inference request (`inputs` with `data`, or with the binary tensor extension's
  `binary_data_size` and the bytes after the JSON header, `Inference-Header-Content-Length`), its `parameters`
  and requested `outputs` -> a ModelInferRequest with raw_input_contents; the ModelInferResponse -> JSON, each
  output as JSON `data` or as binary (`binary_data` per output, `binary_data_output` for all), as Triton's
  HTTP server writes them.
- generate / generate_stream (Triton's generate extension): a flat JSON object whose keys are the model's input
  names (a scalar or a list each; shapes follow the model's metadata as Triton pads them), everything else a
  request parameter, `parameters` a nested object of the same -> a ModelInferRequest; a response -> flat JSON
  (`model_name`, `model_version`, `id`, each output by name: a single element as a scalar, else a list).
- metadata, configuration, statistics: protobuf messages -> Triton's JSON (proto field names, 64-bit integers as
  numbers).

Every problem is an InvalidRequest naming the field (400), Triton's words where it has some.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import numpy as np
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2

from build_engine.triton_models.tables import ModelSpec
from service.api.triton.tensors import NUMPY
from service.errors import InvalidRequest

HEADER_LENGTH = "Inference-Header-Content-Length"
RESERVED_PREFIX = "triton_"
STREAM_INPUTS = ("stream", "streaming")  # the models' streaming switch (ensemble, tensorrt_llm)
ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that generates various "
    "number of responses"
)  # Triton's words
_INTS = {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}


@dataclass(slots=True)
class OutputFormat:
    """How an infer response writes each output: binary (after the JSON header) or JSON `data`."""

    default_binary: bool = False  # the request's binary_data_output
    binary: dict[str, bool] = field(default_factory=dict)  # an output's own binary_data

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.default_binary)


# ---- JSON values <-> tensor contents ---------------------------------------------------------------------------
def _load(raw: bytes, what: str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequest(f"failed to parse the {what} JSON: {exc}") from None


def _flatten(data: object, limit: int) -> list:
    """A (nested) JSON array's elements in row-major order, at most `limit` + 1 of them read."""
    out, stack = [], [data]
    while stack and len(out) <= limit:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def _check_kind(name: str, datatype: str, values: list) -> None:
    if datatype == "BYTES":
        ok = all(isinstance(v, str) for v in values)
    elif datatype == "BOOL":
        ok = all(isinstance(v, bool) for v in values)
    elif datatype in _INTS:
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    else:
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not ok:
        kind = {"BYTES": "strings", "BOOL": "booleans"}.get(datatype, "integers" if datatype in _INTS else "numbers")
        raise InvalidRequest(f"Unable to parse 'data': input '{name}' of datatype {datatype} takes JSON {kind}")


def contents(name: str, datatype: str, data: object, count: int) -> bytes:
    """The raw contents (KServe wire layout) of `count` JSON values of `datatype` for input `name`."""
    values = _flatten(data, count)
    if len(values) != count:
        given = f"more than {count}" if len(values) > count else str(len(values))
        raise InvalidRequest(f"input '{name}' has {given} values in 'data'; its shape needs {count}")
    if datatype != "BYTES" and datatype not in NUMPY:
        raise InvalidRequest(f"input '{name}' has an unknown datatype '{datatype}'")
    _check_kind(name, datatype, values)
    if datatype == "BYTES":
        try:
            encoded = [v.encode() for v in values]
        except UnicodeEncodeError:
            raise InvalidRequest(f"input '{name}' is not valid UTF-8") from None
        return b"".join(struct.pack("<I", len(v)) + v for v in encoded)
    try:
        return np.array(values, dtype=NUMPY[datatype]).tobytes()
    except OverflowError:
        raise InvalidRequest(f"input '{name}' holds a value out of range for {datatype}") from None


def _json_values(datatype: str, raw: bytes) -> list:
    """The elements of raw contents as JSON values (BYTES as text)."""
    if datatype == "BYTES":
        out, pos = [], 0
        while pos + 4 <= len(raw):
            (length,) = struct.unpack_from("<I", raw, pos)
            out.append(raw[pos + 4 : pos + 4 + length].decode(errors="replace"))
            pos += 4 + length
        return out
    return np.frombuffer(raw, dtype=NUMPY[datatype]).tolist()


def _parameter(params: service_pb2.InferParameter, key: str, value: object) -> None:
    """A request parameter as Triton takes it from JSON: a string, an integer, a boolean or a number."""
    if key.startswith(RESERVED_PREFIX):
        raise InvalidRequest(
            "parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified."
        )
    p = params[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int) and -(2**63) <= value < 2**63:
        p.int64_param = value
    elif isinstance(value, str):
        p.string_param = value
    elif isinstance(value, float) and math.isfinite(value):
        p.double_param = value
    else:
        raise InvalidRequest(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")


# ---- infer ------------------------------------------------------------------------------------------------------
def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary tensor data after it."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        length = int(header_length)
    except ValueError:
        raise InvalidRequest(f"Unable to parse {HEADER_LENGTH}, got: {header_length}") from None
    if length == 0:
        raise InvalidRequest(
            f"a raw binary request ({HEADER_LENGTH}: 0, no JSON header) is only for models of one input; these "
            "models take several: send the JSON inference header"
        )
    if not 0 < length <= len(body):
        raise InvalidRequest(f"inference header size should be in range (0, {len(body)}), got: {header_length}")
    return body[:length], memoryview(body)[length:]


def _member(obj: dict, key: str, kind: type, where: str, default: object = None) -> object:
    value = obj.get(key, default)
    if value is None and default is None:
        raise InvalidRequest(f"{where}: '{key}' is required")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"Unable to parse '{key}' ({where}): expected a JSON {kind.__name__}")
    return value


def _shape(tensor: dict, where: str) -> list[int]:
    shape = _member(tensor, "shape", list, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape):
        raise InvalidRequest(f"Unable to parse 'shape' ({where}): expected a list of non-negative integers")
    return shape


def _input(req: service_pb2.ModelInferRequest, tensor: object, index: int, binary: memoryview, pos: int) -> int:
    """One entry of `inputs` into the request; the position in the binary data after it."""
    where = f"inputs[{index}]"
    if not isinstance(tensor, dict):
        raise InvalidRequest(f"Unable to parse 'inputs': {where} is not a JSON object")
    name = _member(tensor, "name", str, where)
    datatype = _member(tensor, "datatype", str, where)
    shape = _shape(tensor, where)
    params = _member(tensor, "parameters", dict, where, {})
    if "shared_memory_region" in params:
        raise InvalidRequest(f"input '{name}': shared memory is not supported by this server")
    given = [k for k in ("data", "binary_data_size") if k in (tensor if k == "data" else params)]
    if len(given) != 1:
        raise InvalidRequest(
            "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters'. But "
            + (f"set {' '.join(repr(k) for k in given)}" if given else "no field is set")
            + f" (input '{name}')"
        )
    req.inputs.add(name=name, datatype=datatype, shape=shape)
    if given[0] == "data":
        count = math.prod(shape)
        req.raw_input_contents.append(contents(name, datatype, tensor["data"], count))
        return pos
    size = params["binary_data_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InvalidRequest(f"Unable to parse 'binary_data_size' (input '{name}')")
    if pos + size > len(binary):
        raise InvalidRequest(
            f"unexpected size for input '{name}', expecting {pos + size - len(binary)} additional bytes for model "
            f"'{req.model_name}'"
        )
    req.raw_input_contents.append(bytes(binary[pos : pos + size]))
    return pos + size


def _outputs(req: service_pb2.ModelInferRequest, outputs: object, fmt: OutputFormat) -> None:
    if not isinstance(outputs, list):
        raise InvalidRequest("Unable to parse 'outputs': expected a JSON array")
    for index, out in enumerate(outputs):
        where = f"outputs[{index}]"
        if not isinstance(out, dict):
            raise InvalidRequest(f"Unable to parse 'outputs': {where} is not a JSON object")
        name = _member(out, "name", str, where)
        params = _member(out, "parameters", dict, where, {})
        for key in ("classification", "shared_memory_region"):
            if key in params:
                raise InvalidRequest(f"output '{name}': '{key}' is not supported by this server")
        if "binary_data" in params:
            fmt.binary[name] = _member(params, "binary_data", bool, f"output '{name}'")
        req.outputs.add(name=name)


def infer_request(
    body: bytes, header_length: str | None, model: str, version: str
) -> tuple[service_pb2.ModelInferRequest, OutputFormat]:
    """An HTTP infer body -> the ModelInferRequest the gRPC door takes, and how to write its response."""
    header, binary = _split(body, header_length)
    doc = _load(header, "inference request")
    if not isinstance(doc, dict):
        raise InvalidRequest("the inference request must be a JSON object")
    req = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    req.id = _member(doc, "id", str, "the request", "")
    fmt = OutputFormat()
    for key, value in _member(doc, "parameters", dict, "the request", {}).items():
        if key == "binary_data_output":
            fmt.default_binary = _member({key: value}, key, bool, "parameters")
        else:
            _parameter(req.parameters, key, value)
    pos = 0
    for index, tensor in enumerate(_member(doc, "inputs", list, "the request")):
        pos = _input(req, tensor, index, binary, pos)
    if pos != len(binary):
        raise InvalidRequest(f"unexpected additional input data for model '{model}'")
    if "outputs" in doc:
        _outputs(req, doc["outputs"], fmt)
    return req, fmt


def infer_response(resp: service_pb2.ModelInferResponse, fmt: OutputFormat) -> tuple[bytes, int | None]:
    """The HTTP infer response body, and the JSON header's length when binary data follows it (else None)."""
    doc: dict = {"model_name": resp.model_name, "model_version": resp.model_version}
    if resp.id:
        doc["id"] = resp.id
    if resp.parameters:
        doc["parameters"] = _parameters_json(resp.parameters)
    outputs, binary = [], []
    for out, raw in zip(resp.outputs, resp.raw_output_contents, strict=True):
        entry: dict = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        if fmt.is_binary(out.name):
            entry["parameters"] = {"binary_data_size": len(raw)}
            binary.append(raw)
        else:
            entry["data"] = _json_values(out.datatype, raw)
        outputs.append(entry)
    doc["outputs"] = outputs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not binary:
        return header, None
    return header + b"".join(binary), len(header)


def _parameters_json(params) -> dict:
    return {
        key: getattr(p, p.WhichOneof("parameter_choice"))
        for key, p in params.items()
        if p.WhichOneof("parameter_choice")
    }


# ---- generate ---------------------------------------------------------------------------------------------------
def _generate_shape(name: str, dims: list[int], count: int) -> list[int]:
    """Triton's padding of a generate value to an input's shape (batch dimension included): the fixed dimensions
    take what they need from the innermost out, the innermost variable one the rest, the others 1."""
    shape, rest = list(dims), count
    for d in reversed(shape):
        if d != -1:
            if d == 0 or rest % d:
                raise InvalidRequest(f"The schema can not convert input '{name}' to tensor with proper shape")
            rest //= d
    for i in reversed(range(len(shape))):
        if shape[i] == -1:
            shape[i], rest = rest, 1
    if rest != 1:
        raise InvalidRequest(f"The schema can not convert input '{name}' to tensor with proper shape")
    return shape


def _generate_value(req: service_pb2.ModelInferRequest, spec: ModelSpec, key: str, value: object) -> None:
    tensor = spec.input(key)
    if tensor is None or not tensor.served:
        _parameter(req.parameters, key, value)
        return
    if isinstance(value, dict):
        raise InvalidRequest(f"input '{key}' must be a JSON scalar or array, got an object")
    count = len(_flatten(value, 1 << 62)) if isinstance(value, list) else 1
    shape = _generate_shape(key, [-1, *tensor.dims], count)
    req.inputs.add(name=key, datatype=tensor.datatype, shape=shape)
    req.raw_input_contents.append(contents(key, tensor.datatype, value, count))


def generate_request(body: bytes, spec: ModelSpec, version: str, streaming: bool) -> service_pb2.ModelInferRequest:
    """A generate / generate_stream body -> the ModelInferRequest the gRPC door takes."""
    doc = _load(body, "generate request") if body.strip() else {}
    if not isinstance(doc, dict):
        raise InvalidRequest("the generate request must be a JSON object")
    req = service_pb2.ModelInferRequest(model_name=spec.name, model_version=version)
    req.id = _member(doc, "id", str, "the request", "")
    for key, value in doc.items():
        if key == "parameters":
            if spec.input(key) is not None:
                raise InvalidRequest("Keyword 'parameters' for nested schema also given as input tensor name")
            for inner, inner_value in _member(doc, key, dict, "the request").items():
                _generate_value(req, spec, inner, inner_value)
        elif key != "id":
            _generate_value(req, spec, key, value)
    names = [t.name for t in req.inputs]
    if len(names) != len(set(names)):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidRequest(f"input '{dup}' is given more than once (at the top level and in 'parameters')")
    if not streaming and any(_true(req, name) for name in STREAM_INPUTS):
        raise InvalidRequest(ONE_RESPONSE)
    return req


def _true(req: service_pb2.ModelInferRequest, name: str) -> bool:
    for tensor, raw in zip(req.inputs, req.raw_input_contents, strict=True):
        if tensor.name == name and tensor.datatype == "BOOL":
            return any(raw)
    return False


def generate_response(resp: service_pb2.ModelInferResponse) -> bytes:
    """One generate response as Triton writes it: flat JSON, outputs by name (one element: a scalar)."""
    doc: dict = {}
    if resp.id:
        doc["id"] = resp.id
    doc["model_name"], doc["model_version"] = resp.model_name, resp.model_version
    for out, raw in zip(resp.outputs, resp.raw_output_contents, strict=True):
        values = _json_values(out.datatype, raw)
        doc[out.name] = values[0] if len(values) == 1 else values
    return json.dumps(doc, separators=(",", ":")).encode()


# ---- metadata, configuration, statistics ------------------------------------------------------------------------
def message_json(message: Message) -> dict:
    """A protobuf message as Triton's HTTP server writes it: proto field names, every scalar field present, 64-bit
    integers as JSON numbers (protobuf's own JSON mapping writes them as strings)."""
    doc = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(doc, message.DESCRIPTOR)


_WIDE = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)


def _numbers(doc: dict, descriptor: Descriptor) -> dict:
    for key, value in doc.items():
        f = descriptor.fields_by_name.get(key)
        if f is None:
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value_field = f.message_type.fields_by_name["value"]
            doc[key] = {k: _convert(value_field, v) for k, v in value.items()}
        elif f.is_repeated:
            doc[key] = [_convert(f, v) for v in value]
        else:
            doc[key] = _convert(f, value)
    return doc


def _convert(f: FieldDescriptor, value: object) -> object:
    if f.message_type is not None and isinstance(value, dict):
        return _numbers(value, f.message_type)
    if f.cpp_type in _WIDE and isinstance(value, str):
        return int(value)
    return value
