"""Triton tensors -> the service's domain request (the front door's counterpart of api/validation.py).

Sampling follows TensorRT-LLM's contract, so a Triton client gets what it would get from a real TensorRT-LLM
server: greedy unless top_k > 1 or top_p > 0 is given (the C++ runtime's defaults are top_k = 0, top_p = 0),
whatever the temperature; top_k = 1 or temperature = 0 is greedy; an end_id of -1 ignores the end token. The
values themselves are checked by the same SamplingParams as llm.v1, with messages naming the Triton tensor. The
guided-decoding inputs become the request's Constraint (guided.py).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from build_engine.triton_models.tables import COUNT_OUTPUTS, LOG_PROB_OUTPUTS, PERF_METRICS_OUTPUTS, ModelSpec
from service.api.triton.guided import GUIDE, GUIDE_TYPE, guided_constraint
from service.api.triton.tensors import scalar
from service.backends.base import BackendInfo
from service.errors import InvalidRequest
from service.request import MAX_STOP_STRINGS, SamplingParams

# domain field names (SamplingParams / admission messages) -> the tensor names of each model
_RENAMES = {
    "ensemble": {"each stop string": "each stop_words element", "stop": "stop_words", "logprobs": "return_log_probs"},
    "tensorrt_llm": {
        "max_tokens": "request_output_len", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
        "prompt_token_ids.ids": "input_ids", "stopping.stop_token_ids": "stop_words_list",
        "logprobs": "return_log_probs",
    },
}  # fmt: skip
_DEFAULT_ONLY = {  # accepted only at the value that means "off" (anything else is refused by name)
    "beam_width": 1, "num_return_sequences": 1, "return_context_logits": False, "return_generation_logits": False,
}  # fmt: skip


def tensor_names(message: str, model: ModelSpec) -> str:
    """A domain error message with the field names this model's tensors use."""
    for field, name in _RENAMES.get(model.kind, {}).items():
        message = re.sub(rf"(?<![\w.]){re.escape(field)}(?![\w])", name, message)
    return message


@dataclass(frozen=True, slots=True)
class TritonCall:
    """One inference request as the front door runs it."""

    model: ModelSpec
    client_id: str  # the KServe request id: echoed, never used to route or cancel across streams
    text: str | None  # ensemble: the prompt text (tokenized like llm.v1's `prompt`)
    prompt_ids: list[int] | None  # tensorrt_llm: the prompt's token ids
    sampling: SamplingParams
    stream: bool  # one response per token step, or one with everything
    exclude_input: bool  # leave the prompt out of a non-streamed output
    outputs: frozenset[str]  # output tensors to return
    stop: bool = False  # tensorrt_llm: end the requests with this id on this stream


def _num(tensors: dict[str, np.ndarray], name: str, kind: type):
    value = scalar(tensors, name)
    return None if value is None else kind(value)


def _strings(model: ModelSpec, tensors: dict[str, np.ndarray], name: str) -> list[str]:
    arr = tensors.get(name)
    if arr is None:
        return []
    out = []
    for raw in arr.reshape(-1):
        try:
            out.append(bytes(raw).decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name} is not valid UTF-8") from None
    return out


def _one_string(model: ModelSpec, tensors: dict[str, np.ndarray], name: str) -> str | None:
    """The single string of a [1, 1] BYTES input, or None when absent."""
    if name not in tensors:
        return None
    values = _strings(model, tensors, name)
    if len(values) != 1:
        raise InvalidRequest(f"input '{name}' must hold one string, got {len(values)}")
    return values[0]


def _check_default_only(tensors: dict[str, np.ndarray]) -> None:
    for name, off in _DEFAULT_ONLY.items():
        value = scalar(tensors, name)
        if value is not None and value != off:
            raise InvalidRequest(f"{name}={value} is not supported by this server (only {off})")


def _sampling(model: ModelSpec, tensors: dict[str, np.ndarray], max_tokens: int, info: BackendInfo) -> dict:
    """SamplingParams keywords from the tensors, with TensorRT-LLM's greedy rule and end-id semantics."""
    k_name, p_name = ("top_k", "top_p") if model.kind == "ensemble" else ("runtime_top_k", "runtime_top_p")
    top_k = _num(tensors, k_name, int) or 0
    top_p = _num(tensors, p_name, float) or 0.0
    temperature = _num(tensors, "temperature", float)
    values: dict = {"max_tokens": max_tokens}
    if temperature is not None:
        values["temperature"] = temperature
    if top_k:
        values["top_k"] = top_k
    if top_p:  # TensorRT-LLM's model.py: top_p <= 0 is unset; a negative one is refused here
        values["top_p"] = top_p
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = _num(tensors, name, float)
        if value is not None:
            values[name] = value
    min_tokens = _num(tensors, "min_tokens", int)
    if min_tokens is not None:
        values["min_tokens"] = min_tokens
    seed = _num(tensors, "seed", int)
    if seed is not None:
        values["seed"] = seed
    if scalar(tensors, "return_log_probs"):
        values["logprobs"] = 0  # the chosen token's log-probability (TensorRT-LLM's output_log_probs)
    end_id = _num(tensors, "end_id", int)
    if model.kind == "tensorrt_llm" and end_id is None:
        end_id = -1  # TensorRT-LLM's own model: no end_id, no end token (the ensemble's preprocessing fills it)
    if end_id is not None and not (end_id == -1 or 0 <= end_id < info.vocab_size):
        raise InvalidRequest(f"end_id must be -1 (no end token) or a token id in [0, {info.vocab_size}), got {end_id}")
    if end_id is not None and end_id not in info.eos_token_ids:
        values["ignore_eos"] = True
        if end_id != -1:
            values["stop_token_ids"] = (end_id,)
    return values


def _greedy(values: dict) -> bool:
    top_k, top_p = values.get("top_k", 0), values.get("top_p", 0.0)
    return values.get("temperature", 1.0) == 0 or top_k == 1 or (top_k == 0 and top_p == 0.0)


def _word_list(model: ModelSpec, tensors: dict[str, np.ndarray], name: str) -> list[int]:
    """stop_words_list [1, 2, L]: concatenated ids and cumulative end offsets (-1 padded); single-token words."""
    arr = tensors.get(name)
    if arr is None:
        return []
    ids, offsets = arr[0, 0].tolist(), [o for o in arr[0, 1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        if not start <= end <= len(ids):
            raise InvalidRequest(f"{name} has an offset {end} outside its {len(ids)} ids")
        if end - start != 1:
            raise InvalidRequest(f"{name}: only single-token stop words are supported, got {end - start} tokens")
        words.append(ids[start])
        start = end
    return words


def to_call(
    model: ModelSpec, request_id: str, tensors: dict[str, np.ndarray], requested: list[str], info: BackendInfo
) -> TritonCall:
    """Check the tensors' values and build the call (raises InvalidRequest naming the tensor)."""
    if model.kind == "tensorrt_llm" and scalar(tensors, "stop"):  # a stop request carries nothing else
        return TritonCall(model, request_id, None, None, SamplingParams(), False, True, frozenset(), stop=True)
    _check_default_only(tensors)
    if model.kind == "ensemble":
        if "bad_words" in tensors and any(_strings(model, tensors, "bad_words")):
            raise InvalidRequest("bad_words is not supported by this server")
        (text,) = _strings(model, tensors, "text_input")
        max_tokens = _num(tensors, "max_tokens", int)
        stream = bool(scalar(tensors, "stream"))
        prompt_ids = None
        stops = tuple(s for s in _strings(model, tensors, "stop_words") if s)  # empty elements are padding
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop_words allows at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        stop_ids: list[int] = []
    else:
        text, stops = None, ()
        if "input_ids" not in tensors:
            raise InvalidRequest("input_ids is required")
        if "bad_words_list" in tensors:
            raise InvalidRequest("bad_words_list is not supported by this server")
        ids = tensors["input_ids"].reshape(-1)
        length = _num(tensors, "input_lengths", int)
        if not 1 <= length <= len(ids):
            raise InvalidRequest(f"input_lengths must be in [1, {len(ids)}] (the ids given), got {length}")
        prompt_ids = ids[:length].tolist()
        max_tokens = _num(tensors, "request_output_len", int)
        stream = bool(scalar(tensors, "streaming"))
        stop_ids = _word_list(model, tensors, "stop_words_list")
    if stream and not model.decoupled:
        raise InvalidRequest("Streaming is only supported in decoupled mode.")
    values = _sampling(model, tensors, max_tokens, info)
    values["stop"] = stops
    values["constraint"] = guided_constraint(
        _one_string(model, tensors, GUIDE_TYPE), _one_string(model, tensors, GUIDE)
    )
    if values["constraint"] is not None:
        # the grammar decides where the output ends: the model's EOS ends it where the grammar accepts, even with
        # no end_id (which alone would mean no end token); an end_id that is not an EOS is still a stop token
        values.pop("ignore_eos", None)
    if stop_ids:
        values["stop_token_ids"] = tuple(dict.fromkeys((*values.get("stop_token_ids", ()), *stop_ids)))
    try:
        sampling = SamplingParams(**values)
    except InvalidRequest as exc:
        raise InvalidRequest(tensor_names(str(exc), model)) from None
    if _greedy(values):
        sampling = dataclasses.replace(sampling, temperature=0.0)
    return TritonCall(
        model=model,
        client_id=request_id,
        text=text,
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=stream,
        exclude_input=bool(scalar(tensors, "exclude_input_in_output")),
        outputs=_outputs(model, tensors, requested),
        stop=bool(scalar(tensors, "stop")),
    )


def _outputs(model: ModelSpec, tensors: dict[str, np.ndarray], requested: list[str]) -> frozenset[str]:
    """What to return: the named outputs, or (none named) the main one plus what the return_* flags ask."""
    for name in requested:
        spec = model.output(name)
        if spec is None:
            raise InvalidRequest(f"unexpected inference output '{name}' for model '{model.name}'")
        if not spec.served:
            raise InvalidRequest(
                f"output '{name}' of model '{model.name}' is not supported by this server (logits are not returned)"
            )
    main = ("text_output",) if model.kind == "ensemble" else ("output_ids", "sequence_length")
    produced = set(main)
    if scalar(tensors, "return_perf_metrics"):
        produced.update(PERF_METRICS_OUTPUTS)
    if scalar(tensors, "return_log_probs"):
        produced.update(LOG_PROB_OUTPUTS)
    produced.update({"batch_index", "sequence_index"} & set(requested))  # always 0: one sequence per request
    if scalar(tensors, "return_num_input_tokens"):
        produced.add(COUNT_OUTPUTS[0])
    if scalar(tensors, "return_num_output_tokens"):
        produced.add(COUNT_OUTPUTS[1])
    return frozenset(produced & set(requested) if requested else produced)
