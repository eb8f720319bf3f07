"""The worker door's field mappings: TensorRT-LLM's `trtllm.GenerateRequest` (smg-grpc-proto) -> domain values, and
RequestOutputs -> its GenerateStreamChunk / GenerateComplete.

Every field of the request is in one of two tables, by its path as the proto spells it: HONOURED (what it
becomes here) or REFUSED (why not). A field the client set that is in neither, a field a newer proto added, is
refused by name too (`check_fields`), so nothing a client sends is ever silently dropped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from smg_grpc_proto import trtllm_service_pb2 as pb

from service.api.validation import REQUEST_ID
from service.errors import InvalidRequest
from service.limits import check_token_ids
from service.request import Constraint, GenerateRequest, RequestOutput, SamplingParams, TokenLogprob

# sub-messages whose fields are mapped one by one (the tables below name their fields, not them)
CONTAINERS = ("tokenized", "sampling_config", "output_config")

HONOURED: dict[str, str] = {
    "request_id": "the request's id for Abort (1 to 128 printable ASCII characters; unique while in flight)",
    "tokenized.input_token_ids": "the prompt (required; checked against the vocabulary and max_seq_len)",
    "tokenized.original_text": "logging only, as the proto says: never tokenized",
    "sampling_config.beam_width": "0 or 1 (no beam search here; larger values are refused)",
    "sampling_config.num_return_sequences": "0 or 1 (one sequence per request here; larger values are refused)",
    "sampling_config.top_k": "SamplingParams.top_k (0: all tokens)",
    "sampling_config.top_p": "SamplingParams.top_p",
    "sampling_config.seed": "SamplingParams.seed (the same seed gives the same tokens, whatever the batch)",
    "sampling_config.temperature": "SamplingParams.temperature (0: greedy)",
    "sampling_config.min_tokens": "SamplingParams.min_tokens",
    "sampling_config.repetition_penalty": "SamplingParams.repetition_penalty",
    "sampling_config.presence_penalty": "SamplingParams.presence_penalty",
    "sampling_config.frequency_penalty": "SamplingParams.frequency_penalty",
    "sampling_config.min_p": "SamplingParams.min_p",
    "output_config.logprobs": "SamplingParams.logprobs: the chosen token's logprob plus the top N (N <= 20)",
    "output_config.exclude_input_from_output": "true or false: output ids never repeat the prompt (TRT-LLM's default)",
    "output_config.return_perf_metrics": "GenerateComplete.perf_metrics, from the request's Timing",
    "max_tokens": "SamplingParams.max_tokens (required, >= 1)",
    "streaming": "a GenerateStreamChunk per step, then the GenerateComplete; false: the complete only",
    "cache_salt_id": "the prefix cache's salt: blocks are shared only among requests with the same id",
    "arrival_time": "informational (a finite number): queue and latency times are the server's own clock",
    "stop": "SamplingParams.stop: stop strings, matched across token boundaries",
    "stop_token_ids": "SamplingParams.stop_token_ids",
    "ignore_eos": "SamplingParams.ignore_eos",
    "include_stop_token_in_output": "false: the EOS / stop token id that ended the request is left out of the ids",
    "guided_decoding": "SamplingParams.constraint: JSON (the guide ignored: any JSON object), JSON_SCHEMA, REGEX, "
    "EBNF_GRAMMAR (GBNF), STRUCTURAL_TAG (refused by the native engine)",
}

REFUSED: dict[str, str] = {
    "tokenized.query_token_ids": "star attention (VLM query tokens) is not supported",
    "sampling_config.top_p_min": "top-p decay is not supported",
    "sampling_config.top_p_reset_ids": "top-p decay is not supported",
    "sampling_config.top_p_decay": "top-p decay is not supported",
    "sampling_config.beam_search_diversity_rate": "beam search is not supported",
    "sampling_config.prompt_ignore_length": "penalties always count the whole prompt here",
    "sampling_config.length_penalty": "beam search is not supported",
    "sampling_config.early_stopping": "beam search is not supported",
    "sampling_config.no_repeat_ngram_size": "no-repeat n-gram blocking is not supported",
    "sampling_config.beam_width_array": "beam search is not supported",
    "output_config.prompt_logprobs": "prompt logprobs are not computed by this server",
    "output_config.return_context_logits": "logits are not returned by this server",
    "output_config.return_generation_logits": "logits are not returned by this server",
    "output_config.return_encoder_output": "encoder-decoder models are not served",
    "embedding_bias": "embedding bias is not supported",
    "lora_config": "LoRA adapters are not supported",
    "prompt_tuning_config": "prompt tuning is not supported",
    "multimodal_input": "multimodal input is not supported (text models only)",
    "kv_cache_retention": "KV cache retention policies are not supported",
    "disaggregated_params": "disaggregated (context / generation) serving is not supported",
    "lookahead_config": "lookahead decoding is not supported",
    "bad": "bad words are not supported",
    "bad_token_ids": "bad token ids are not supported",
}

# SamplingParams' own checks name its fields; these are where they live in the request
_TOP_LEVEL = ("max_tokens", "stop ", "each stop", "stop_token_ids", "ignore_eos")
_SAMPLING_FIELDS = (
    "top_k", "top_p", "temperature", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "min_p",
)  # fmt: skip
MAX_SEED = 2**63 - 1


def set_fields(msg: Message, prefix: str = "") -> Iterator[str]:
    """The paths of the fields the client set (non-default scalars, present optionals, non-empty lists),
    descending into CONTAINERS."""
    for fd, _ in msg.ListFields():
        path = prefix + fd.name
        if path in CONTAINERS and fd.type == FieldDescriptor.TYPE_MESSAGE:
            yield from set_fields(getattr(msg, fd.name), path + ".")
        else:
            yield path


def check_fields(req: pb.GenerateRequest) -> None:
    """INVALID_ARGUMENT naming the first field the client set that this server cannot honour."""
    for path in set_fields(req):
        if path in HONOURED:
            continue
        reason = REFUSED.get(path, "this server does not know the field")
        raise InvalidRequest(f"{path} is not supported: {reason}")


def _sampling(req: pb.GenerateRequest) -> SamplingParams:
    s, out = req.sampling_config, req.output_config
    if s.beam_width > 1:
        raise InvalidRequest(f"sampling_config.beam_width must be 0 or 1 (no beam search here), got {s.beam_width}")
    if s.num_return_sequences > 1:
        raise InvalidRequest(
            f"sampling_config.num_return_sequences must be 0 or 1 (one sequence per request), got "
            f"{s.num_return_sequences}"
        )
    if req.max_tokens < 1:
        raise InvalidRequest("max_tokens is required and must be >= 1")
    values: dict = {"max_tokens": req.max_tokens}
    for name in _SAMPLING_FIELDS:
        if s.HasField(name):
            value = getattr(s, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequest(f"sampling_config.{name} must be a finite number, got {value}")
            values[name] = value
    if s.HasField("seed"):
        if s.seed > MAX_SEED:
            raise InvalidRequest(f"sampling_config.seed must be in [0, 2^63 - 1], got {s.seed}")
        values["seed"] = s.seed
    if out.HasField("logprobs"):
        values["logprobs"] = out.logprobs
    values.update(stop=tuple(req.stop), stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos)
    if req.HasField("guided_decoding"):
        values["constraint"] = guided_decoding(req.guided_decoding)
    try:
        return SamplingParams(**values)
    except InvalidRequest as exc:  # name the field as the proto spells it
        message = str(exc)
        if message.startswith(_TOP_LEVEL):
            raise InvalidRequest(message) from None
        prefix = "output_config." if message.startswith("logprobs") else "sampling_config."
        raise InvalidRequest(prefix + message) from None


GUIDE_TYPES = {
    pb.GuidedDecodingParams.GUIDE_TYPE_JSON: "json_object",
    pb.GuidedDecodingParams.GUIDE_TYPE_JSON_SCHEMA: "json_schema",
    pb.GuidedDecodingParams.GUIDE_TYPE_REGEX: "regex",
    pb.GuidedDecodingParams.GUIDE_TYPE_EBNF_GRAMMAR: "gbnf",  # XGrammar's EBNF is GBNF
    pb.GuidedDecodingParams.GUIDE_TYPE_STRUCTURAL_TAG: "structural_tag",
}


def guided_decoding(g: pb.GuidedDecodingParams) -> Constraint:
    """TensorRT-LLM's GuidedDecodingParams -> Constraint (smg sends OpenAI's json_object as the JSON_SCHEMA
    {"type": "object"}; JSON takes no guide, as TensorRT-LLM's)."""
    kind = GUIDE_TYPES.get(g.guide_type)
    if kind is None:
        raise InvalidRequest(f"guided_decoding.guide_type must be set (JSON, JSON_SCHEMA, ...), got {g.guide_type}")
    try:
        return Constraint(kind) if kind == "json_object" else Constraint(kind, g.guide)
    except InvalidRequest as exc:
        raise InvalidRequest(f"guided_decoding.guide: {exc}") from None


def to_domain(req: pb.GenerateRequest, vocab_size: int, salt: str) -> GenerateRequest:
    """The request as the backend takes it; every check before any work (the salt: the tenant's and cache_salt_id,
    joined by the caller)."""
    check_fields(req)
    if not REQUEST_ID.fullmatch(req.request_id):
        raise InvalidRequest("request_id must be 1 to 128 printable ASCII characters without spaces")
    if req.HasField("arrival_time") and not math.isfinite(req.arrival_time):
        raise InvalidRequest(f"arrival_time must be a finite number, got {req.arrival_time}")
    ids = list(req.tokenized.input_token_ids)
    if not ids:
        raise InvalidRequest("tokenized.input_token_ids is required and must not be empty")
    check_token_ids(ids, vocab_size, "tokenized.input_token_ids")
    sampling = _sampling(req)
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop_token_ids")
    return GenerateRequest(request_id=req.request_id, prompt_token_ids=ids, sampling=sampling, cache_salt=salt)


# the backends' own refusals name llm.v1's fields (service/limits.py, the remote backends): this protocol's names
_BACKEND_NAMES = (
    ("prompt_token_ids.ids", "tokenized.input_token_ids"),
    ("prompt_token_ids", "tokenized.input_token_ids"),
    ("stopping.min_tokens", "sampling_config.min_tokens"),
    ("stopping.", ""),
    ("sampling.", "sampling_config."),
    ("output.logprobs", "output_config.logprobs"),
    ("cache_salt", "cache_salt_id"),
    ("constraint: ", "guided_decoding: "),
    ("constraint.", "guided_decoding.guide: "),
)


def proto_names(message: str) -> str:
    """A backend's InvalidRequest message with the field named as this protocol spells it."""
    for ours, theirs in _BACKEND_NAMES:
        if message.startswith(ours):
            return theirs + message[len(ours) :]
    return message


def client_salt(req: pb.GenerateRequest) -> str:
    """cache_salt_id as our cache salt ("" when unset: shared with every unsalted request)."""
    return f"id:{req.cache_salt_id}" if req.HasField("cache_salt_id") else ""


# ---- replies ---------------------------------------------------------------------------------------------
def logprobs(lps: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in lps or ()
    ]


def ends_on_token(out: RequestOutput) -> bool:
    """The request ended on an EOS or a stop token id (the token include_stop_token_in_output is about)."""
    return out.finished and out.finish_reason == "stop" and not isinstance(out.stop_reason, str)


def chunk(request_id: str, ids: list[int], lps: list[TokenLogprob] | None, out: RequestOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id,
        chunk=pb.GenerateStreamChunk(
            token_ids=ids,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            logprobs=logprobs(lps),
        ),
    )


def complete(
    request_id: str, out: RequestOutput, ids: list[int], lps: list[TokenLogprob], last_token: int | None, perf: bool
) -> pb.GenerateResponse:
    """The final message: every output id (the stop token left out unless asked for), why it ended, the counts
    (speculative decoding's spec_draft_tokens / spec_accepted_tokens included)."""
    done = pb.GenerateComplete(
        output_token_ids=ids,
        finish_reason=out.finish_reason or "",
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        cached_tokens=out.num_cached_tokens,
        logprobs=logprobs(lps),
    )
    if isinstance(out.stop_reason, str):
        done.finish_reason = "stop_word"
        done.matched_stop_str = out.stop_reason
    elif out.finish_reason == "stop":
        # a stop token id names itself; an EOS is the last token generated
        token = out.stop_reason if isinstance(out.stop_reason, int) else last_token
        if token is not None:
            done.matched_token_id = token
    if out.timing is not None:  # speculative decoding's counts (0 where the backend does not speculate)
        done.spec_draft_tokens = out.timing.spec_draft_tokens
        done.spec_accepted_tokens = out.timing.spec_accepted_tokens
    if perf and out.timing is not None:
        done.perf_metrics.CopyFrom(perf_metrics(out))
    return pb.GenerateResponse(request_id=request_id, complete=done)


def perf_metrics(out: RequestOutput) -> pb.PerfMetrics:
    """TRT-LLM's absolute times (unix seconds), from our Timing's intervals, ending now (no KV transfer here)."""
    t = out.timing
    end = time.time()
    arrival = end - t.e2e_ms / 1e3
    first_token = arrival + t.ttft_ms / 1e3 if t.ttft_ms else 0.0
    return pb.PerfMetrics(
        arrival_time=arrival,
        first_scheduled_time=arrival + t.queue_ms / 1e3,
        first_token_time=first_token,
        last_token_time=first_token + t.decode_ms / 1e3 if first_token else 0.0,
    )
