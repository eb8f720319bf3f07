"""TritonServicer: the KServe v2 `inference.GRPCInferenceService` (the stubs that ship in tritonclient) over the
service's backend, speaking the TensorRT-LLM ensemble contract: inference (infer.py) and everything tools read
around it (metadata.py), one gRPC service.

Models (build_engine/triton_models/tables.py): `ensemble` (text) and `tensorrt_llm` (token ids), decoupled
unless `--triton-decoupled false` (the choice a deployment makes in config.pbtxt), their never-decoupled twins
`ensemble_sync` / `tensorrt_llm_sync` for unary ModelInfer, and the ensemble's steps `preprocessing` /
`postprocessing`, callable on their own (steps.py).

Everything around the model is the shared edge's (service/api/edge.py), as on the llm.v1 port: the same backend,
validation (SamplingParams, TextLimits, the backend's admission), status codes (service/api/status.py), RPC
slots (one per inference request), metrics, auth, TLS and drain. Handlers take raw bytes and parse them, so a
malformed message is INVALID_ARGUMENT (in a stream: an `error_message`, the stream stays open).
"""

from __future__ import annotations

import grpc
from tritonclient.grpc import service_pb2
from tritonclient.grpc.service_pb2_grpc import GRPCInferenceServiceServicer

from service.api.edge import Edge
from service.api.metrics import ServiceMetrics
from service.api.triton.infer import TritonInference
from service.api.triton.metadata import Models, Statistics, TritonMetadata
from service.api.triton.steps import Steps

SERVICE_NAME = "inference.GRPCInferenceService"


class TritonServicer:
    def __init__(
        self, edge: Edge, metrics: ServiceMetrics, max_requests_per_stream: int, engine_dir: str,
        decoupled: bool = True,
    ) -> None:  # fmt: skip
        models = Models(decoupled)
        statistics = Statistics(list(models.specs))
        self.metadata = TritonMetadata(edge, statistics, models)
        steps = Steps(edge, engine_dir)
        self.inference = TritonInference(edge, metrics, statistics, max_requests_per_stream, models, steps)

    def begin_drain(self) -> None:
        """The server drains: streams take no more requests and end once theirs have (idle ones at once)."""
        self.inference.begin_drain()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Every RPC of the service, taking raw request bytes (the handlers parse them); the ones neither part
        implements answer UNIMPLEMENTED."""
        desc = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        handlers = {}
        for method in desc.methods:
            serializer = getattr(service_pb2, method.output_type.name).SerializeToString
            fn = next(
                (getattr(part, method.name) for part in (self.metadata, self.inference) if hasattr(part, method.name)),
                _unimplemented(method.name),
            )
            if method.client_streaming:
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(fn, response_serializer=serializer)
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(fn, response_serializer=serializer)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _unimplemented(name: str):
    assert hasattr(GRPCInferenceServiceServicer, name), name  # a method of the service we do not implement

    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not supported by this server")

    return handler
