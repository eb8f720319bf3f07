"""What every front door checks the same way before any work: message size and parsing (a malformed message is
INVALID_ARGUMENT naming the field), text sizes, request ids, and tokenizing a prompt that must fit the context.

Every error is an InvalidRequest whose message names the field and the limit. The protocols' own field mappings
live with their doors (service/api/llm/convert.py, service/api/triton/convert.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from service.errors import InvalidRequest, MessageTooLarge
from service.tokenizer import Tokenizer, TooManyTokens

REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


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
