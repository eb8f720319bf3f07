"""The config.pbtxt parameters the 1.2-era TensorRT-LLM C++ backend (Triton's `tensorrtllm` backend) reads
without a fallback: a model instance fails to load when one is missing (a leaf module: it imports nothing).

Read from NVIDIA/TensorRT-LLM at SOURCE_COMMIT, `triton_backend/inflight_batcher_llm/src/`. There
`ModelState::GetParameter<T>` (model_state.cc) throws "Cannot find parameter with name: ..." for an absent key,
and every other parameter is read inside a try whose catch logs and keeps a default; these are read outside
any try, so the throw reaches ModelInstanceState::Create, which turns it into the error that stops the model
instance from loading. model_state.cc reads only with fallbacks (gpu_device_ids, participant_ids, worker_path,
executor_worker_path); libtensorrtllm.cc and utils.cc read no parameter.

Not in the table, though the backend needs them: gpt_model_path is read inside a try, but its fallback (an
empty path) then fails "Both encoder and decoder model paths are empty"; the lookahead_* parameters are read
without a fallback only when decoding_mode is lookahead (ours is top_k_top_p). tests/test_triton_repo.py checks
the generated repository against this table.
"""

from __future__ import annotations

from typing import NamedTuple

SOURCE_REPO = "NVIDIA/TensorRT-LLM"
# the newest of the stored versions of model_instance_state.cc (it has "enable_trt_overlap is deprecated and
# will be ignored"; the other stored version 0c8de69a still sets it, and reads the same parameters without a
# fallback); the v1.2.1 tag itself could not be read, so identity with 1.2.1 is inferred, not proven
SOURCE_COMMIT = "c8c6df08bd0ead54cd47f7973e1e425c28a174cd"
SOURCE_DIR = "triton_backend/inflight_batcher_llm/src"
MODEL_STATE_COMMIT = "5cdd69218f8815d6c8c101ca1facf2ec4ac4b622"  # model_state.cc (GetParameter, LoadParameters)


class BackendParameter(NamedTuple):
    name: str  # the config.pbtxt parameters key
    file: str  # under SOURCE_DIR
    function: str  # where it is read without a fallback
    unset: str | None  # the value the C++ code treats as "not set" (None: there is none; a real value is needed)


REQUIRED_PARAMETERS: tuple[BackendParameter, ...] = (
    # must be v1, V1, inflight_batching or inflight_fused_batching, else "Invalid gpt_model_type"
    BackendParameter("gpt_model_type", "model_instance_state.cc", "ModelInstanceState::getBatchingTypeFromParams",
                     None),
    # "" or "${tokenizer_dir}": nothing logged; any other value: "Guided decoding C++ workflow does not use
    # tokenizer_dir, this parameter will be ignored"
    BackendParameter("tokenizer_dir", "model_instance_state.cc",
                     "ModelInstanceState::getGuidedDecodingConfigFromParams", ""),
    # "" or "${xgrammar_tokenizer_info_path}" (or the same for guided_decoding_backend): no guided decoding
    BackendParameter("xgrammar_tokenizer_info_path", "model_instance_state.cc",
                     "ModelInstanceState::getGuidedDecodingConfigFromParams", ""),
    BackendParameter("guided_decoding_backend", "model_instance_state.cc",
                     "ModelInstanceState::getGuidedDecodingConfigFromParams", ""),
)  # fmt: skip
BATCHING_TYPES = ("v1", "V1", "inflight_batching", "inflight_fused_batching")  # getBatchingTypeFromParams


def unset_values() -> dict[str, str]:
    """The parameters that have an "unset" value, with it: what a repository without guided decoding sets."""
    return {p.name: p.unset for p in REQUIRED_PARAMETERS if p.unset is not None}
