"""The Triton front door's health, metadata, configuration, statistics and repository RPCs (KServe v2): what
tools such as tritonclient, perf_analyzer and GenAI-Perf read before they infer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from tritonclient.grpc import service_pb2

from build_engine.triton_models.configs import model_config
from build_engine.triton_models.tables import MODEL_VERSION, ModelSpec, models
from service import PACKAGE, version
from service.api.edge import Edge
from service.api.status import unary_errors
from service.backends.base import Backend
from service.errors import EngineUnavailable, NotFound

EXTENSIONS = ("model_configuration", "binary_tensor_data", "parameters", "statistics")


class Models:
    """The models this front door serves (tables.models): `decoupled` is the transaction policy of the canonical
    `ensemble` and `tensorrt_llm` (`--triton-decoupled`; the `_sync` twins are never decoupled)."""

    def __init__(self, decoupled: bool = True) -> None:
        self.specs = models(decoupled)

    def find(self, name: str, version: str = "") -> ModelSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version not in ("", MODEL_VERSION):
            raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")
        return spec

    def known(self, name: str, version: str = "") -> bool:
        return name in self.specs and version in ("", MODEL_VERSION)


def model_metadata(spec: ModelSpec) -> service_pb2.ModelMetadataResponse:
    """ModelMetadata as Triton answers it: shapes with the batch dimension (-1) first."""
    meta = service_pb2.ModelMetadataResponse(name=spec.name, versions=[MODEL_VERSION], platform=spec.platform)
    for t in spec.served_inputs:
        meta.inputs.add(name=t.name, datatype=t.datatype, shape=[-1, *t.dims])
    for t in spec.outputs:
        if t.served:
            meta.outputs.add(name=t.name, datatype=t.datatype, shape=[-1, *t.dims])
    return meta


@dataclass(slots=True)
class ModelStats:
    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    last_ms: int = 0


class Statistics:
    """Per-model inference counts and times (ModelStatistics), recorded as requests finish."""

    def __init__(self, names: list[str]) -> None:
        self.models = {name: ModelStats() for name in names}

    def record(self, model: str, code: grpc.StatusCode, started_ns: int) -> None:
        stats = self.models.get(model)
        if stats is None:
            return
        elapsed = time.monotonic_ns() - started_ns
        stats.last_ms = int(time.time() * 1000)
        if code == grpc.StatusCode.OK:
            stats.success, stats.success_ns = stats.success + 1, stats.success_ns + elapsed
        else:
            stats.fail, stats.fail_ns = stats.fail + 1, stats.fail_ns + elapsed


class TritonMetadata:
    def __init__(self, edge: Edge, statistics: Statistics, models: Models) -> None:
        self.edge = edge
        self.models = models
        self.statistics = statistics
        self.server_version = version()

    # ---- helpers -------------------------------------------------------------------------------------------
    def _backend_or_none(self) -> Backend | None:
        try:
            return self.edge.ready()
        except EngineUnavailable:
            return None

    def _ready(self) -> bool:
        backend = self._backend_or_none()
        return backend is not None and backend.is_healthy

    # ---- health and metadata (unary: errors mapped by status.unary_errors) ---------------------------------------
    @unary_errors
    async def ServerLive(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ServerLiveResponse:
        self.edge.parse(service_pb2.ServerLiveRequest, raw)  # the health checks take no RPC slot
        return service_pb2.ServerLiveResponse(live=True)

    @unary_errors
    async def ServerReady(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ServerReadyResponse:
        self.edge.parse(service_pb2.ServerReadyRequest, raw)
        return service_pb2.ServerReadyResponse(ready=self._ready())

    @unary_errors
    async def ModelReady(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ModelReadyResponse:
        req = self.edge.parse(service_pb2.ModelReadyRequest, raw)
        return service_pb2.ModelReadyResponse(ready=self.models.known(req.name, req.version) and self._ready())

    @unary_errors
    async def ServerMetadata(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ServerMetadataResponse:
        with self.edge.slot(context.peer()):
            self.edge.parse(service_pb2.ServerMetadataRequest, raw)
            return service_pb2.ServerMetadataResponse(
                name=PACKAGE, version=self.server_version, extensions=list(EXTENSIONS)
            )

    @unary_errors
    async def ModelMetadata(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ModelMetadataResponse:
        with self.edge.slot(context.peer()):
            req = self.edge.parse(service_pb2.ModelMetadataRequest, raw)
            return model_metadata(self.models.find(req.name, req.version))

    @unary_errors
    async def ModelConfig(self, raw: bytes, context: grpc.aio.ServicerContext) -> service_pb2.ModelConfigResponse:
        with self.edge.slot(context.peer()):
            req = self.edge.parse(service_pb2.ModelConfigRequest, raw)
            spec = self.models.find(req.name, req.version)
            return service_pb2.ModelConfigResponse(config=model_config(spec, 1, self._parameters(spec)))

    def _parameters(self, spec: ModelSpec) -> dict[str, str]:
        """What the backend is, for the tensorrt_llm model's config (TensorRT-LLM's parameter names)."""
        backend = self._backend_or_none()
        if spec.kind != "tensorrt_llm" or backend is None:
            return {}
        i = backend.info
        return {
            "gpt_model_type": "inflight_fused_batching",
            "max_beam_width": "1",
            "enable_kv_cache_reuse": str(i.prefix_caching).lower(),
            "enable_chunked_context": "true",
            "max_tokens_in_paged_kv_cache": str(i.num_kv_blocks * i.kv_block_size),
            "exclude_input_in_output": "false",
            "llm_backend": i.backend,  # ours: the backend behind the front door (native, trtllm, triton)
            "llm_model_name": i.model_name,
            "llm_max_seq_len": str(i.max_seq_len),
            "llm_max_batch_size": str(i.max_batch_size),
        }

    @unary_errors
    async def ModelStatistics(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelStatisticsResponse:
        with self.edge.slot(context.peer()):
            req = self.edge.parse(service_pb2.ModelStatisticsRequest, raw)
            names = [self.models.find(req.name, req.version).name] if req.name else list(self.models.specs)
            resp = service_pb2.ModelStatisticsResponse()
            for name in names:
                s = self.statistics.models[name]
                m = resp.model_stats.add(
                    name=name,
                    version=MODEL_VERSION,
                    last_inference=s.last_ms,
                    inference_count=s.success,
                    execution_count=s.success,
                )
                m.inference_stats.success.count, m.inference_stats.success.ns = s.success, s.success_ns
                m.inference_stats.fail.count, m.inference_stats.fail.ns = s.fail, s.fail_ns
            return resp

    @unary_errors
    async def RepositoryIndex(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> service_pb2.RepositoryIndexResponse:
        with self.edge.slot(context.peer()):
            self.edge.parse(service_pb2.RepositoryIndexRequest, raw)
            state = "READY" if self._ready() else "UNAVAILABLE"
            resp = service_pb2.RepositoryIndexResponse()
            for name in self.models.specs:
                resp.models.add(name=name, version=MODEL_VERSION, state=state)
            return resp
