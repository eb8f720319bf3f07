"""The models of Triton's TensorRT-LLM layout (inflight_batcher_llm, 1.2 era), as tensor tables (a leaf module:
no grpc, no tritonclient).

One table serves two readers: the model-repository generator writes a real Triton repository from it
(build_engine/triton_repo.py), and the service's KServe v2 front door describes and validates its models with it
(service/api/triton/, which imports it from here: build_engine imports nothing of service). A tensor marked
`served=False` exists in TensorRT-LLM's own `tensorrt_llm` model (so the generated repository declares it) but the
front door does not take it.

Dims exclude the batch dimension (every model has max_batch_size > 0, so clients send shape [1, *dims]).
Datatypes are KServe wire names ("BYTES" is model_config's TYPE_STRING).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    datatype: str  # BOOL, INT32, INT64, UINT64, FP32, BYTES, ...
    dims: tuple[int, ...] = (1,)
    optional: bool = True
    scalar: bool = False  # reshape: { shape: [ ] } in the config (tensorrt_llm's [1] inputs)
    ragged: bool = False  # allow_ragged_batch
    served: bool = True  # the front door takes it (False: only declared in a generated repository)
    note: str = ""  # what the front door does with it, when not the obvious


@dataclass(frozen=True, slots=True)
class Step:
    model: str
    input_map: dict[str, str]  # the step's input -> the ensemble tensor it reads
    output_map: dict[str, str]  # the step's output -> the ensemble tensor it writes


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    kind: str  # ensemble | tensorrt_llm | preprocessing | postprocessing
    platform: str  # what ModelMetadata reports: ensemble, tensorrtllm, python
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    decoupled: bool = False
    steps: tuple[Step, ...] = ()
    parameters: dict[str, str] = field(default_factory=dict)

    def input(self, name: str) -> Tensor | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> Tensor | None:
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def served_inputs(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.inputs if t.served)


def _b(name: str, **kw) -> Tensor:
    return Tensor(name, "BOOL", **kw)


def _i(name: str, **kw) -> Tensor:
    return Tensor(name, "INT32", **kw)


def _f(name: str, **kw) -> Tensor:
    return Tensor(name, "FP32", **kw)


PERF_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
COUNT_OUTPUTS = ("num_input_tokens", "num_output_tokens")
KV_CACHE_OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
# with acceptance_rate: speculative decoding's counts (the native engine's n-gram drafts; 0 where none were made)
DRAFT_OUTPUTS = ("total_accepted_draft_tokens", "total_draft_tokens")
# what return_perf_metrics adds to the final response (TensorRT-LLM's RequestPerfMetrics: timing, KV cache,
# speculative decoding)
PERF_METRICS_OUTPUTS = (*PERF_OUTPUTS, *KV_CACHE_OUTPUTS, "acceptance_rate", *DRAFT_OUTPUTS)
LOG_PROB_OUTPUTS = ("cum_log_probs", "output_log_probs")

_GUIDED_INPUTS = (  # TYPE_STRING, dims [1], allow_ragged_batch, optional (both models' 1.2-era config.pbtxt)
    Tensor("guided_decoding_guide_type", "BYTES", ragged=True,
           note="json, json_schema, regex, ebnf_grammar or structural_tag (service/api/triton/guided.py)"),
    Tensor("guided_decoding_guide", "BYTES", ragged=True,
           note="the schema, regex, GBNF grammar or structural tag (none with json)"),
)  # fmt: skip

# ---- tensorrt_llm: token ids in, token ids out (TensorRT-LLM's C++ backend) -------------------------------------
_T = {"scalar": True}
TENSORRT_LLM_INPUTS = (
    _i("input_ids", dims=(-1,), ragged=True, note="required by the front door (as by TensorRT-LLM's model.py)"),
    _i(
        "decoder_input_ids",
        dims=(-1,),
        ragged=True,
        note="ignored: a decoder-only model (NVIDIA's preprocessing sends [[pad_id]])",
    ),
    _i("decoder_input_lengths", **{"scalar": True}, note="ignored, as decoder_input_ids"),
    _i("input_lengths", optional=False, **_T, note="the prompt is input_ids[:input_lengths]"),
    _i("request_output_len", optional=False, **_T),
    _i("end_id", **_T, note="the end token; -1 or absent: none (generate request_output_len tokens)"),
    _i("pad_id", **_T, note="accepted, unused (one sequence per request)"),
    _i("stop_words_list", dims=(2, -1), ragged=True, note="single-token words only"),
    _i("bad_words_list", dims=(2, -1), ragged=True, note="refused"),
    _f("embedding_bias", dims=(-1,), ragged=True, served=False),
    _i("beam_width", **_T, note="1 only"),
    _i("num_return_sequences", **_T, note="1 only"),
    _f("temperature", **_T),
    _i("runtime_top_k", **_T),
    _f("runtime_top_p", **_T),
    _f("runtime_top_p_min", **_T, served=False),
    _f("runtime_top_p_decay", **_T, served=False),
    _i("runtime_top_p_reset_ids", **_T, served=False),
    _f("len_penalty", **_T, note="accepted, no effect without beam search"),
    _b("early_stopping", **_T, served=False),
    _f("repetition_penalty", **_T),
    _i("min_tokens", **_T),
    _f("beam_search_diversity_rate", **_T, served=False),
    _f("presence_penalty", **_T),
    _f("frequency_penalty", **_T),
    Tensor("seed", "UINT64", **_T),
    _b("return_log_probs", **_T, note="cum_log_probs and output_log_probs (the model's raw distribution)"),
    _b("return_context_logits", **_T, note="false only"),
    _b("return_generation_logits", **_T, note="false only"),
    _b("return_perf_metrics", **_T),
    _b("return_num_input_tokens", **_T),
    _b("return_num_output_tokens", **_T),
    _b("exclude_input_in_output", **_T),
    _b("stop", **_T, note="ends the requests with this request's id on the same stream only"),
    _b("streaming", **_T),
    Tensor("lora_task_id", "UINT64", **_T, served=False),
    *_GUIDED_INPUTS,
)
# what tensorrt_llm returns per sequence besides its ids, and the ensemble passes through
_SEQUENCE_OUTPUTS = (
    _f("cum_log_probs", dims=(-1,)),
    _f("output_log_probs", dims=(-1, -1)),
    _f("context_logits", dims=(-1, -1), served=False),
    _f("generation_logits", dims=(-1, -1, -1), served=False),
    _i("batch_index"),
    _i("sequence_index"),
)
TENSORRT_LLM_OUTPUTS = (
    _i("output_ids", dims=(-1, -1)),
    _i("sequence_length", dims=(-1,)),
    *_SEQUENCE_OUTPUTS,
    Tensor("context_phase_params", "UINT8", dims=(-1,), served=False),
    *(_i(name) for name in KV_CACHE_OUTPUTS),
    *(Tensor(name, "INT64") for name in PERF_OUTPUTS),
    _f("acceptance_rate"),
    *(_i(name) for name in DRAFT_OUTPUTS),
    *(_i(name) for name in COUNT_OUTPUTS),
)

# ---- ensemble: text in, text out (preprocessing -> tensorrt_llm -> postprocessing) -----------------------------
ENSEMBLE_INPUTS = (
    Tensor("text_input", "BYTES", optional=False),
    _i("max_tokens", optional=False),
    Tensor("bad_words", "BYTES", dims=(-1,), note="refused"),
    Tensor("stop_words", "BYTES", dims=(-1,), note="stop strings (cut before the match); empty elements ignored"),
    _i("end_id", note="-1: ignore the end token; absent: the model's"),
    _i("pad_id", note="accepted, unused"),
    _i("top_k"),
    _f("top_p"),
    _f("temperature"),
    _f("length_penalty", note="accepted, no effect without beam search"),
    _f("repetition_penalty"),
    _i("min_tokens"),
    _f("presence_penalty"),
    _f("frequency_penalty"),
    Tensor("seed", "UINT64"),
    _b("return_log_probs", note="cum_log_probs and output_log_probs"),
    _b("return_context_logits", note="false only"),
    _b("return_generation_logits", note="false only"),
    _b("return_perf_metrics"),
    _b("return_num_input_tokens"),
    _b("return_num_output_tokens"),
    _b("exclude_input_in_output"),
    _i("beam_width", note="1 only"),
    _i("num_return_sequences", note="1 only"),
    _b("stream"),
    *_GUIDED_INPUTS,
)
ENSEMBLE_OUTPUTS = (
    Tensor("text_output", "BYTES", dims=(-1,), note="[batch x beams] (NVIDIA's postprocessing: one flat array)"),
    *_SEQUENCE_OUTPUTS,
    *(_i(name) for name in KV_CACHE_OUTPUTS),
    *(Tensor(name, "INT64") for name in PERF_OUTPUTS),
    _f("acceptance_rate"),
    *(_i(name) for name in DRAFT_OUTPUTS),
    *(_i(name) for name in COUNT_OUTPUTS),
)

# ---- the two Python steps around tensorrt_llm (our own model.py files: preprocessing.py, postprocessing.py) ---
PREPROCESSING_INPUTS = (
    Tensor("QUERY", "BYTES", optional=False),
    _i("REQUEST_OUTPUT_LEN", optional=False),
    Tensor("BAD_WORDS_DICT", "BYTES", dims=(-1,)),
    Tensor("STOP_WORDS_DICT", "BYTES", dims=(-1,)),
    _i("END_ID"),
    _i("PAD_ID"),
)
PREPROCESSING_OUTPUTS = (
    _i("INPUT_ID", dims=(-1,)),
    _i("DECODER_INPUT_ID", dims=(-1,), note="[[pad_id]]: a decoder-only model (as NVIDIA's preprocessing)"),
    _i("REQUEST_INPUT_LEN"),
    _i("REQUEST_DECODER_INPUT_LEN"),
    _i("REQUEST_OUTPUT_LEN"),
    _i("BAD_WORDS_IDS", dims=(2, -1)),
    _i("STOP_WORDS_IDS", dims=(2, -1)),
    _i("OUT_END_ID"),
    _i("OUT_PAD_ID"),
)
POSTPROCESSING_INPUTS = (_i("TOKENS_BATCH", dims=(-1, -1), optional=False), _i("SEQUENCE_LENGTH", dims=(-1,)))
# OUTPUT: NVIDIA's config says dims [-1]; its model.py (and ours) return one flat row of B * beams texts
POSTPROCESSING_OUTPUTS = (Tensor("OUTPUT", "BYTES", dims=(-1,), note="[batch * beams], flat"),)

# the ensemble's wiring (the same names as TensorRT-LLM's ensemble template)
_DIRECT = (  # ensemble input -> tensorrt_llm input
    ("top_k", "runtime_top_k"), ("top_p", "runtime_top_p"), ("temperature", "temperature"),
    ("length_penalty", "len_penalty"), ("repetition_penalty", "repetition_penalty"), ("min_tokens", "min_tokens"),
    ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"), ("seed", "seed"),
    ("return_log_probs", "return_log_probs"), ("return_context_logits", "return_context_logits"),
    ("return_generation_logits", "return_generation_logits"), ("return_perf_metrics", "return_perf_metrics"),
    ("return_num_input_tokens", "return_num_input_tokens"), ("return_num_output_tokens", "return_num_output_tokens"),
    ("exclude_input_in_output", "exclude_input_in_output"), ("beam_width", "beam_width"),
    ("num_return_sequences", "num_return_sequences"), ("stream", "streaming"),
    ("guided_decoding_guide_type", "guided_decoding_guide_type"), ("guided_decoding_guide", "guided_decoding_guide"),
)  # fmt: skip


def _steps(llm_model: str) -> tuple[Step, ...]:
    pre = Step(
        "preprocessing",
        {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
         "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id"},
        {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
         "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
         "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "OUT_END_ID": "_PREPROCESSOR_END_ID",
         "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID"},
    )  # fmt: skip
    llm_in = {
        "input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
        "end_id": "_PREPROCESSOR_END_ID", "pad_id": "_PREPROCESSOR_PAD_ID", "stop_words_list": "_STOP_WORDS_IDS",
        "bad_words_list": "_BAD_WORDS_IDS", **{dst: src for src, dst in _DIRECT},
    }  # fmt: skip
    llm_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}
    llm_out.update({t.name: t.name for t in ENSEMBLE_OUTPUTS if t.served and t.name != "text_output"})
    post = Step(
        "postprocessing",
        {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
        {"OUTPUT": "text_output"},
    )
    return (pre, Step(llm_model, llm_in, llm_out), post)


def models(decoupled: bool = True) -> dict[str, ModelSpec]:
    """The models by name; `decoupled` is the transaction policy a deployment chooses for the canonical
    `ensemble` and `tensorrt_llm` (TensorRT-LLM's `decoupled_mode`); the `_sync` twins are never decoupled."""

    def ensemble(name: str, llm_model: str, decoupled: bool) -> ModelSpec:
        return ModelSpec(name, "ensemble", "ensemble", ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, decoupled, _steps(llm_model))

    def trtllm(name: str, decoupled: bool) -> ModelSpec:
        return ModelSpec(name, "tensorrt_llm", "tensorrtllm", TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS, decoupled)

    specs = (
        ensemble("ensemble", "tensorrt_llm", decoupled),
        ensemble("ensemble_sync", "tensorrt_llm_sync", False),  # the unary (ModelInfer) twin
        trtllm("tensorrt_llm", decoupled),
        trtllm("tensorrt_llm_sync", False),
        ModelSpec("preprocessing", "preprocessing", "python", PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS),
        ModelSpec("postprocessing", "postprocessing", "python", POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS),
    )
    return {s.name: s for s in specs}


MODELS: dict[str, ModelSpec] = models()
MODEL_VERSION = "1"

# Tensors of the 1.2-era models (TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt) the
# front door refuses, by model kind, with the reason its INVALID_ARGUMENT gives. (Tensors in the tables above
# with served=False are refused with their note.)
_SPECULATIVE = "external draft tokens and lookahead are not supported: the native engine drafts from the request's own tokens (--speculative-method ngram)"
_LORA = "LoRA adapters are not supported"
_PROMPT_TABLE = "prompt tuning / multimodal embeddings are not supported"
_ENCODER = "this is a decoder-only model (no encoder)"
_RETENTION = "KV cache retention priorities are not supported"
_BIAS = "embedding bias is not supported"
_REUSE_STATS = "not an input of the 1.x models: return_perf_metrics returns the kv_cache_* outputs"
REFUSED: dict[str, dict[str, str]] = {
    "tensorrt_llm": {
        "encoder_input_features": _ENCODER, "encoder_output_lengths": _ENCODER, "cross_attention_mask": _ENCODER,
        "skip_cross_attn_blocks": _ENCODER, "draft_input_ids": _SPECULATIVE, "draft_logits": _SPECULATIVE,
        "draft_acceptance_threshold": _SPECULATIVE, "lookahead_window_size": _SPECULATIVE,
        "lookahead_ngram_size": _SPECULATIVE, "lookahead_verification_set_size": _SPECULATIVE,
        "prompt_embedding_table": _PROMPT_TABLE, "prompt_table_extra_ids": _PROMPT_TABLE,
        "prompt_vocab_size": _PROMPT_TABLE, "mrope_rotary_cos_sin": _PROMPT_TABLE,
        "mrope_position_deltas": _PROMPT_TABLE, "lora_task_id": _LORA, "lora_weights": _LORA, "lora_config": _LORA,
        "context_phase_params": "disaggregated serving (context / generation phases) is not supported",
        "retention_token_range_starts": _RETENTION, "retention_token_range_ends": _RETENTION,
        "retention_token_range_priorities": _RETENTION, "retention_token_range_durations_ms": _RETENTION,
        "retention_decode_priority": _RETENTION, "retention_decode_duration_ms": _RETENTION,
        "embedding_bias": _BIAS, "runtime_top_p_min": "top-p decay is not supported",
        "runtime_top_p_decay": "top-p decay is not supported", "runtime_top_p_reset_ids": "top-p decay is not "
        "supported", "early_stopping": "beam search is not supported (beam_width 1 only)",
        "beam_search_diversity_rate": "beam search is not supported (beam_width 1 only)",
        "return_kv_cache_reuse_stats": _REUSE_STATS,
    },
    "ensemble": {
        "decoder_text_input": _ENCODER, "prompt_embedding_table": _PROMPT_TABLE,
        "prompt_table_extra_id": _PROMPT_TABLE, "prompt_vocab_size": _PROMPT_TABLE,
        "embedding_bias_words": _BIAS, "embedding_bias_weights": _BIAS, "lora_task_id": _LORA, "lora_weights": _LORA, "lora_config": _LORA,
        "num_draft_tokens": _SPECULATIVE,
        "use_draft_logits": _SPECULATIVE,
        "return_kv_cache_reuse_stats": _REUSE_STATS,
    },
    "preprocessing": {
        "DECODER_QUERY": _ENCODER, "IMAGE_BYTES": _PROMPT_TABLE, "IMAGE_URL": _PROMPT_TABLE,
        "VIDEO_BYTES": _PROMPT_TABLE, "EMBEDDING_BIAS_WORDS": _BIAS, "EMBEDDING_BIAS_WEIGHTS": _BIAS, "PROMPT_TABLE_EXTRA_ID": _PROMPT_TABLE,
    },
}  # fmt: skip
