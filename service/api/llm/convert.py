"""The llm.v1 door's field mappings: GenerateRequest / TokenizeRequest protobufs -> domain values, every field
checked before any work, errors naming the field as the proto spells it (the shared checks: validation.py)."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from protos.llm.v1 import llm_pb2
from service.api.validation import REQUEST_ID, TextLimits, encode_text
from service.errors import InvalidRequest
from service.request import CONSTRAINT_FIELDS, Constraint, SamplingParams
from service.tokenizer import ChatTemplateError, Tokenizer

MAX_CHAT_MESSAGES = 1024
MAX_CACHE_SALT_BYTES = 256


def _sampling(req: llm_pb2.GenerateRequest) -> SamplingParams:
    s, st, out = req.sampling, req.stopping, req.output
    values: dict = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if s.HasField(name):
            value = getattr(s, name)
            if not math.isfinite(value):
                raise InvalidRequest(f"sampling.{name} must be a finite number, got {value}")
            values[name] = value
    if s.HasField("top_k"):
        values["top_k"] = s.top_k
    if s.HasField("seed"):
        values["seed"] = s.seed
    if s.HasField("num_speculative_tokens"):
        values["num_speculative_tokens"] = s.num_speculative_tokens
    if st.HasField("max_tokens"):
        values["max_tokens"] = st.max_tokens
    if out.HasField("logprobs"):
        values["logprobs"] = out.logprobs
    if req.HasField("constraint"):
        values["constraint"] = constraint(req.constraint)
    values.update(
        min_tokens=st.min_tokens,
        stop=tuple(st.stop),
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        skip_special_tokens=not out.include_special_tokens,
    )
    try:
        return SamplingParams(**values)
    except InvalidRequest as exc:  # name the field as the proto spells it
        raise InvalidRequest(_proto_path(str(exc))) from None


_KINDS = {field: kind for kind, field in CONSTRAINT_FIELDS.items()}


def constraint(c: llm_pb2.Constraint) -> Constraint:
    """The Constraint message -> the domain's; its shape errors name the field."""
    field = c.WhichOneof("kind")
    if field is None:
        raise InvalidRequest("constraint: one of its kinds (json_schema, json_object, regex, ...) is required")
    kind = _KINDS[field]
    value = getattr(c, field)
    try:
        if kind == "json_object":
            if not value:
                raise InvalidRequest("must be true when set")
            return Constraint(kind, any_whitespace=not c.disable_any_whitespace)
        if kind == "choice":
            return Constraint(kind, choices=tuple(value.choices), any_whitespace=not c.disable_any_whitespace)
        return Constraint(kind, value, any_whitespace=not c.disable_any_whitespace)
    except InvalidRequest as exc:
        raise InvalidRequest(f"constraint.{field}: {exc}") from None


_PROTO_PREFIX = {
    "ignore_eos": "stopping.",
    "max_tokens": "stopping.",
    "min_tokens": "stopping.",
    "stop ": "stopping.",
    "each stop": "stopping.",
    "stop_token_ids": "stopping.",
    "logprobs": "output.",
}


def _proto_path(message: str) -> str:
    for field, prefix in _PROTO_PREFIX.items():
        if message.startswith(field):
            return prefix + message
    return "sampling." + message


def chat_messages(msgs: llm_pb2.ChatMessages, limits: TextLimits) -> tuple[list[dict[str, str]], int]:
    """The messages as the chat template takes them, and their size in bytes (checked against the limit)."""
    if not msgs.messages:
        raise InvalidRequest("messages.messages must hold at least one message")
    if len(msgs.messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"messages.messages allows at most {MAX_CHAT_MESSAGES} messages")
    size = sum(len(m.role.encode()) + len(m.content.encode()) for m in msgs.messages)
    limits.check(size, "messages")
    return [{"role": m.role, "content": m.content} for m in msgs.messages], size


@dataclass(frozen=True, slots=True)
class PromptInput:
    """A request's input, checked by size on the event loop, before it is tokenized in the pool."""

    field: str  # the input's name: prompt | prompt_token_ids | messages | text
    num_bytes: int  # text to tokenize (0 for token ids)
    text: str = ""
    messages: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True
    ids: list[int] | None = None  # pre-tokenized input

    @classmethod
    def of(cls, field: str, value: str | llm_pb2.ChatMessages | llm_pb2.TokenIds, limits: TextLimits) -> PromptInput:
        if isinstance(value, str):
            size = len(value.encode())
            limits.check(size, field)
            return cls(field, size, text=value)
        if isinstance(value, llm_pb2.TokenIds):
            return cls(field, 0, ids=list(value.ids))  # checked against the vocabulary by the backend's admission
        messages, size = chat_messages(value, limits)
        add = not value.HasField("add_generation_prompt") or value.add_generation_prompt
        return cls(field, size, messages=messages, add_generation_prompt=add)

    def render(self, tokenizer: Tokenizer) -> str:
        """The text to tokenize (chat messages rendered with the model's template)."""
        if self.messages is None:
            return self.text
        try:
            return tokenizer.apply_chat_template(self.messages, self.add_generation_prompt)
        except ChatTemplateError as exc:
            raise InvalidRequest(f"messages: {exc}") from None


def prompt_input(req: llm_pb2.GenerateRequest, limits: TextLimits) -> PromptInput:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("one of prompt, prompt_token_ids or messages is required")
    return PromptInput.of(kind, getattr(req, kind), limits)


def prompt_ids(p: PromptInput, tokenizer: Tokenizer, max_new_tokens: int, max_seq_len: int) -> list[int]:
    """Tokenize the request's input (slow for big inputs: run it in the pool)."""
    if p.ids is not None:
        if not p.ids:
            raise InvalidRequest(f"{p.field} is empty")
        return p.ids
    # the rendered chat already holds every special token the template wants (as transformers does)
    add_special = p.messages is None
    return encode_text(tokenizer, p.render(tokenizer), p.field, add_special, max_new_tokens, max_seq_len)


def cache_salt(req: llm_pb2.GenerateRequest) -> str:
    """The client's cache salt ("" when unset), size-checked."""
    size = len(req.cache_salt.encode())
    if size > MAX_CACHE_SALT_BYTES:
        raise InvalidRequest(f"cache_salt allows at most {MAX_CACHE_SALT_BYTES} bytes, got {size}")
    return req.cache_salt


def check_fields(req: llm_pb2.GenerateRequest) -> tuple[str, SamplingParams]:
    """The cheap checks (request id, sampling and stopping fields), before tokenizing."""
    request_id = req.request_id or uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(request_id):
        raise InvalidRequest("request_id must be 1 to 128 printable ASCII characters without spaces")
    return request_id, _sampling(req)
