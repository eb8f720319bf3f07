"""ModelSpec tables (tables.py) -> Triton's ModelConfig message (tritonclient's model_config_pb2).

Used by build_engine/triton_repo.py (the config.pbtxt files of a real repository, written with text_format) and by
the service's Triton front door (the ModelConfig RPC, service/api/triton/servicer.py), so both describe a model
with the same message. tritonclient is imported here: import this module lazily from anything on the native path.
"""

from __future__ import annotations

from collections.abc import Mapping

from tritonclient.grpc import model_config_pb2 as mc

from build_engine.triton_models.tables import ModelSpec, Tensor

# KServe wire datatype -> model_config DataType
DATA_TYPES = {
    "BOOL": mc.TYPE_BOOL, "UINT8": mc.TYPE_UINT8, "UINT16": mc.TYPE_UINT16, "UINT32": mc.TYPE_UINT32,
    "UINT64": mc.TYPE_UINT64, "INT8": mc.TYPE_INT8, "INT16": mc.TYPE_INT16, "INT32": mc.TYPE_INT32,
    "INT64": mc.TYPE_INT64, "FP16": mc.TYPE_FP16, "FP32": mc.TYPE_FP32, "FP64": mc.TYPE_FP64,
    "BYTES": mc.TYPE_STRING, "BF16": mc.TYPE_BF16,
}  # fmt: skip


def _input(t: Tensor) -> mc.ModelInput:
    m = mc.ModelInput(name=t.name, data_type=DATA_TYPES[t.datatype], dims=list(t.dims), optional=t.optional)
    if t.scalar:
        m.reshape.SetInParent()  # reshape: { shape: [ ] }: the [1] tensor reaches the backend as a scalar
    m.allow_ragged_batch = t.ragged
    return m


def _output(t: Tensor) -> mc.ModelOutput:
    return mc.ModelOutput(name=t.name, data_type=DATA_TYPES[t.datatype], dims=list(t.dims))


def model_config(
    spec: ModelSpec,
    max_batch_size: int,
    parameters: Mapping[str, str] | None = None,
    served_only: bool = True,
    instance_count: int = 1,
    decoupled: bool | None = None,
    ensemble_policy: bool = True,
) -> mc.ModelConfig:
    """The ModelConfig of one model; served_only=False declares every tensor of TensorRT-LLM's own model.

    ensemble_policy=False leaves model_transaction_policy off the ensemble, as TensorRT-LLM's template does (a
    Triton ensemble is decoupled through its steps); the front door states it, for tools that read only the
    ensemble's config."""
    cfg = mc.ModelConfig(name=spec.name, max_batch_size=max_batch_size)
    if spec.kind == "ensemble":
        cfg.platform = "ensemble"
    else:
        cfg.backend = "tensorrtllm" if spec.kind == "tensorrt_llm" else "python"
    keep = (lambda t: t.served) if served_only else (lambda t: True)
    cfg.input.extend(_input(t) for t in spec.inputs if keep(t))
    cfg.output.extend(_output(t) for t in spec.outputs if keep(t))
    is_decoupled = spec.decoupled if decoupled is None else decoupled
    if spec.kind == "tensorrt_llm" or (spec.kind == "ensemble" and ensemble_policy):
        cfg.model_transaction_policy.decoupled = is_decoupled
    if spec.kind == "ensemble":
        for step in spec.steps:
            s = cfg.ensemble_scheduling.step.add(model_name=step.model, model_version=-1)
            s.input_map.update(step.input_map)
            s.output_map.update(step.output_map)
    else:
        if spec.kind == "tensorrt_llm":
            cfg.dynamic_batching.preferred_batch_size.append(max_batch_size)
            cfg.dynamic_batching.max_queue_delay_microseconds = 0
            cfg.dynamic_batching.default_queue_policy.max_queue_size = 0
        else:
            cfg.dynamic_batching.SetInParent()
        cfg.instance_group.add(count=instance_count, kind=mc.ModelInstanceGroup.KIND_CPU)
    for key, value in {**spec.parameters, **(parameters or {})}.items():
        cfg.parameters[key].string_value = value
    return cfg
