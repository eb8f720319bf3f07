"""Tokenizer of an engine directory: encode, decode, chat templates, and UTF-8-safe streaming detokenization."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from build_engine import spec

# How many prompt tokens seed the detokenizer, so the first output token keeps its leading space
# (tokenizers whose decoder strips a leading space only do so at the very start of a decode).
DETOKENIZER_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template raised)."""


class TooManyTokens(ValueError):
    """A text has more tokens than allowed; `at_least` of them were counted in its first `num_bytes` bytes."""

    def __init__(self, at_least: int, num_bytes: int) -> None:
        super().__init__(f"at least {at_least} tokens in its first {num_bytes} bytes")
        self.at_least, self.num_bytes = at_least, num_bytes


# Characters per token the first probe of encode(max_tokens=...) assumes (English prose is ~4); each further probe
# doubles it, so refusing a text that is too long costs at most about twice tokenizing max_tokens tokens.
PROBE_CHARS_PER_TOKEN = 4


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """A Hugging Face `tokenizers` tokenizer plus the chat template and special tokens of one engine."""

    def __init__(self, tok: tokenizers.Tokenizer, special: Mapping[str, Any], chat_template: str | None) -> None:
        self._tok = tok
        self.special = dict(special)  # bos_token, eos_token, unk_token, pad_token (strings), add_bos_token
        self.chat_template = chat_template
        self._template = None
        if chat_template is not None:
            env = ImmutableSandboxedEnvironment(**spec.CHAT_TEMPLATE_ENV)
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(chat_template)

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path) -> Tokenizer:
        engine_dir = Path(engine_dir)
        tok = tokenizers.Tokenizer.from_file(str(engine_dir / spec.TOKENIZER_FILE))
        special = json.loads((engine_dir / spec.TOKENIZER_CONFIG_FILE).read_text())
        template_path = engine_dir / spec.CHAT_TEMPLATE_FILE
        template = template_path.read_text() if template_path.is_file() else None
        return cls(tok, special, template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text (an upper bound: a partial UTF-8 byte counts as U+FFFD's 3).

        Text longer than max_seq_len x this many bytes can never tokenize into max_seq_len tokens, so the
        service refuses it by its size before tokenizing (assuming no byte is dropped by normalization).
        """
        texts = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(1, *(len(t.encode()) for t in texts))

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of raw text; add_special_tokens applies the tokenizer's post-processor (e.g. a BOS).

        With max_tokens, a text with more tokens raises TooManyTokens, after tokenizing little more than
        max_tokens tokens' worth of it (prefixes cut before a whitespace character, growing geometrically).
        """
        if max_tokens is not None:
            self._check_length(text, add_special_tokens, max_tokens)
        ids = self._encoding(text, add_special_tokens).ids
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids), len(text.encode()))
        return ids

    def encode_with_tokens(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        """Token ids and the token strings as the vocabulary spells them."""
        ids = self._encoding(text, add_special_tokens).ids
        # NOTE: Encoding.tokens builds its list in one call holding the GIL (75 ms for 214k tokens); a list
        # comprehension over the vocabulary lets other threads in between.
        vocab = self._token_strings
        return ids, [vocab[i] for i in ids]

    @functools.cached_property
    def _token_strings(self) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in range(self.vocab_size)]

    def _encoding(self, text: str, add_special_tokens: bool) -> tokenizers.Encoding:
        # NOTE: Tokenizer.encode holds the GIL for the whole call (seconds for a large text: every other
        # thread, the event loop and the engine's included, stops); encode_batch releases it, same ids.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def _check_length(self, text: str, add_special_tokens: bool, max_tokens: int) -> None:
        """Raise TooManyTokens if `text` has more than max_tokens tokens, tokenizing only prefixes of it.

        A prefix cut just before a whitespace character that follows a non-space one ends on a whole
        pre-token (the GPT-2 / Metaspace splits break there, and special tokens hold no whitespace), so its
        tokens are a prefix of the whole text's: more than max_tokens in the prefix means more in the text.
        """
        if len(text) <= max_tokens - 1:  # every token covers at least one character (plus one BOS)
            return
        size = (max_tokens + 1) * PROBE_CHARS_PER_TOKEN
        while size < len(text):
            cut = _whitespace_cut(text, size)
            if cut is None:
                return  # no place to cut: the caller's full encode decides
            n = len(self._encoding(text[:cut], add_special_tokens).ids)
            if n > max_tokens:
                raise TooManyTokens(n, len(text[:cut].encode()))
            size *= 2

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # NOTE: `tokenizers` defaults to skipping special tokens; transformers does not. We follow transformers.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render messages the way transformers' apply_chat_template does (same jinja2 environment and variables)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=cleaned,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.special.get("bos_token"),
                eos_token=self.special.get("eos_token"),
                unk_token=self.special.get("unk_token"),
                pad_token=self.special.get("pad_token"),
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The rendered text already holds every special token the template wants (as transformers does).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


_END_OF_WORD = re.compile(r"\S(?=\s)")


def _whitespace_cut(text: str, near: int) -> int | None:
    """The largest i in (near / 2, near] with text[i] whitespace and text[i - 1] not (the end of a pre-token)."""
    last = None
    for last in _END_OF_WORD.finditer(text, near // 2, near):  # noqa: B007 (the last match is wanted)
        pass
    return None if last is None else last.end()


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas (the prefix/read offset method of TGI and vLLM).

    Each push decodes a short window of recent tokens twice, with and without the newest ones, and emits the
    difference only when it grew and does not end in U+FFFD (an unfinished UTF-8 sequence). Concatenated
    deltas plus flush() equal a full decode of the output; a multi-byte character is never split, and a
    token's leading space survives because the window starts inside the prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-DETOKENIZER_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream, emit whatever is held back (an invalid byte tail decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
