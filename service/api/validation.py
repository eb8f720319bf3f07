"""Protobuf request -> domain request, checking every field before any work (the servicer's edge).

Every error is an InvalidRequest whose message names the field and the limit.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from protos.llm.v1 import llm_pb2
from service.errors import InvalidRequest, MessageTooLarge
from service.request import SamplingParams
from service.tokenizer import ChatTemplateError, Tokenizer, TooManyTokens

REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
MAX_CHAT_MESSAGES = 1024
MAX_CACHE_SALT_BYTES = 256


@dataclass(frozen=True, slots=True)
class TextLimits:
    """Bounds on text fields, checked before any tokenization (RELIABILITY: bound inputs before work)."""

    max_text_bytes: int  # a prompt (or the messages' total) larger than this can never fit max_seq_len

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, max_seq_len: int) -> TextLimits:
        return cls(max_text_bytes=max_seq_len * tokenizer.max_token_bytes)

    def check(self, num_bytes: int, field: str) -> None:
        if num_bytes > self.max_text_bytes:
            raise InvalidRequest(
                f"{field} is {num_bytes} bytes: more than any prompt that fits max_seq_len can be "
                f"({self.max_text_bytes} bytes)"
            )


def transport_limit(max_message_bytes: int) -> int:
    """gRPC core's own receive limit: above --max-message-bytes, so that parse() refuses what lies between.

    gRPC core answers an oversized message only after ~100-200 ms whatever its size (measured, 4-16 MB on
    loopback), while a handler refuses it as soon as it has the bytes (~10 ms for 4 MB); messages past this
    bound still get gRPC's own RESOURCE_EXHAUSTED."""
    return max(2 * max_message_bytes, max_message_bytes + 2**20)


def parse(message_type: type[Message], raw: bytes, max_bytes: int | None = None) -> Message:
    """Parse request bytes; malformed input is INVALID_ARGUMENT naming the bad field when it can be found, and
    a message over `max_bytes` (--max-message-bytes) is RESOURCE_EXHAUSTED."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise MessageTooLarge(
            f"request message is {len(raw)} bytes, over the server's limit of {max_bytes} (--max-message-bytes)"
        )
    try:
        return message_type.FromString(raw)
    except DecodeError:
        path = _invalid_utf8_field(raw, message_type.DESCRIPTOR)
        if path is not None:
            raise InvalidRequest(f"{path} is not valid UTF-8") from None
        raise InvalidRequest(f"request is not a valid {message_type.DESCRIPTOR.full_name} message") from None


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ValueError("truncated varint")
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _invalid_utf8_field(raw: bytes, desc: Descriptor, prefix: str = "", depth: int = 0) -> str | None:
    """Walk the wire format (proto3: varint, 64-bit, length-delimited, 32-bit) to the string that is not UTF-8."""
    pos = 0
    counts: dict[int, int] = {}
    try:
        while pos < len(raw) and depth < 8:
            key, pos = _varint(raw, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(raw, pos)
                continue
            if wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
                continue
            if wire_type != 2:
                return None
            length, pos = _varint(raw, pos)
            chunk, pos = raw[pos : pos + length], pos + length
            field = desc.fields_by_number.get(number)
            if field is None:
                continue
            index = counts.get(number, 0)
            counts[number] = index + 1
            name = prefix + field.name + (f"[{index}]" if field.is_repeated else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _invalid_utf8_field(chunk, field.message_type, name + ".", depth + 1)
                if found is not None:
                    return found
    except ValueError:
        return None
    return None


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
    if st.HasField("max_tokens"):
        values["max_tokens"] = st.max_tokens
    if out.HasField("logprobs"):
        values["logprobs"] = out.logprobs
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


_PROTO_PREFIX = {
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


def encode_text(
    tokenizer: Tokenizer, text: str, field: str, add_special_tokens: bool, max_new_tokens: int, max_seq_len: int
) -> list[int]:
    """Tokenize a prompt that must leave room for max_new_tokens in max_seq_len (slow: run it in the pool).
    One too long is refused after tokenizing only about as much of it as could fit."""
    max_prompt = max(1, max_seq_len - max_new_tokens)
    try:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens, max_tokens=max_prompt)
    except TooManyTokens as exc:
        raise InvalidRequest(
            f"{field} ({exc.at_least}+ tokens, counted in its first {exc.num_bytes} bytes) + max_tokens "
            f"({max_new_tokens}) exceeds max_seq_len {max_seq_len}"
        ) from None
    if not ids:
        raise InvalidRequest(f"{field} is empty")
    return ids


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
