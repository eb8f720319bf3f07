"""Structured outputs in the native engine: a Constraint compiled to an llguidance grammar, one matcher per
sequence, and the batch's allowed-token masks (docs/structured.md).

- GrammarCompiler.compile: Constraint -> CompiledGrammar (checked with LLMatcher.validate_grammar, its message in
  InvalidRequest naming the llm.v1 field), cached by (kind, text, choices, whitespace) in a bounded LRU. Thread
  safe: the native backend compiles off the event loop, the engine thread takes the cached result.
- GrammarState: one sequence's matcher, advanced with each accepted token (a copy of the compiled template, so a
  request never pays the compile twice); is_error() is checked after every consumed token; rollback(n) leaves
  room for speculative verification.
- MaskFiller: the batch's bitmasks, filled in a worker thread (llguidance drops the GIL) while the forward pass
  runs; a batch without constrained sequences never touches it.

EOS: llguidance's own guess for SmolLM2's tokenizer is id 0; the engine's EOS ids are passed explicitly, so the
mask allows them exactly where the grammar accepts.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

from service.errors import InvalidRequest
from service.request import CONSTRAINT_FIELDS, Constraint

# the kinds this engine compiles (structural_tag is refused by name: see grammar_of)
SUPPORTED_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf", "choice")
GRAMMAR_CACHE_SIZE = 256
# JSON with any whitespace: runs of at most this many whitespace characters between tokens (xgrammar's
# max_whitespace_cnt; unbounded, a small model can emit newlines until max_tokens)
MAX_JSON_WHITESPACE = 16


def field_name(kind: str) -> str:
    return "constraint." + CONSTRAINT_FIELDS[kind]


def _refuse(kind: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field_name(kind)}: {message.strip()}")


def grammar_of(c: Constraint) -> str:
    """The llguidance grammar text of a constraint (not yet validated)."""
    options: dict = {"whitespace_flexible": c.any_whitespace}
    if c.any_whitespace:
        options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"
    if c.kind in ("json_schema", "json_object"):
        spec = c.spec if c.kind == "json_schema" else '{"type": "object"}'
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise _refuse(c.kind, f"not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise _refuse(c.kind, "a JSON schema must be an object or a boolean")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as exc:
            raise _refuse(c.kind, str(exc)) from None
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(c.spec)
    if c.kind == "gbnf":
        try:
            return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(c.spec))
        except Exception as exc:  # the converter raises its own errors (and asserts) on bad input
            raise _refuse(c.kind, f"cannot convert the GBNF grammar: {exc}") from None
    if c.kind == "choice":
        # JSON string escapes are Lark's string-literal escapes
        alternatives = " | ".join(json.dumps(s) for s in c.choices)
        return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    raise _refuse(c.kind, "structural_tag constraints are not supported by the native engine")


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    key: tuple
    template: object  # an llguidance LLMatcher in its start state, copied for every sequence
    compile_ms: float


class GrammarCompiler:
    """Constraints -> compiled grammars for one tokenizer (the engine's), with the engine's EOS ids."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 0):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size or GRAMMAR_CACHE_SIZE
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._tokenizer_lock = threading.Lock()  # held while the tokenizer is built: cache hits never wait for it
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The llguidance tokenizer (about 1 s to build: on the first constrained request, off the event loop)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llg.LLTokenizer(
                    str(self.tokenizer_json), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    @staticmethod
    def key(c: Constraint) -> tuple:
        return (c.kind, c.spec, c.choices, c.any_whitespace)

    def keys(self) -> list[tuple]:
        """The cache's keys, least recently used first."""
        with self._lock:
            return list(self._cache)

    def cached(self, c: Constraint) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(self.key(c))
            if hit is not None:
                self._cache.move_to_end(hit.key)
            return hit

    def compile(self, c: Constraint) -> CompiledGrammar:
        """The compiled grammar of a constraint; InvalidRequest naming the field if it does not compile."""
        hit = self.cached(c)
        if hit is not None:
            return hit
        start = time.perf_counter()
        grammar = grammar_of(c)
        tokenizer = self.tokenizer
        message = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if message:
            raise _refuse(c.kind, message)
        template = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _refuse(c.kind, template.get_error())
        compiled = CompiledGrammar(self.key(c), template, (time.perf_counter() - start) * 1e3)
        with self._lock:
            self._cache[compiled.key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def state(self, c: Constraint) -> GrammarState:
        """A fresh matcher for one sequence."""
        return GrammarState(self.compile(c).template.deep_copy())


class GrammarError(Exception):
    """A sequence's matcher entered its error state (a token the mask should have excluded)."""


class GrammarState:
    """One sequence's matcher. The mask always reflects every output token consumed so far, so a recompute
    preemption changes nothing here (the recomputed tokens are not consumed again)."""

    __slots__ = ("matcher", "num_consumed")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_consumed = 0

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past accepted tokens; GrammarError if the matcher refuses one (it is then in its error state)."""
        for token in tokens:
            self.matcher.consume_token(token)
            if self.matcher.is_error():
                raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")
            self.num_consumed += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens consumed (rejected draft tokens of a speculative step)."""
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise GrammarError(f"cannot roll back {num_tokens} tokens: {self.matcher.get_error()}")
        self.num_consumed -= num_tokens

    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` from the current state are a valid continuation (the state is left unchanged)."""
        return self.matcher.validate_tokens(list(tokens)) == len(tokens)

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()


@dataclass(slots=True)
class BatchMasks:
    """The allowed tokens of the constrained rows of one step (unpacked in the worker thread too)."""

    rows: dict[int, int]  # sampler row -> row of `table`
    table: np.ndarray  # [n, vocab] bool: token t allowed
    fill_ms: float  # time spent filling and unpacking the masks (in the worker thread)

    @classmethod
    def of(cls, rows: dict[int, int], bitmask: np.ndarray, vocab_size: int, fill_ms: float = 0.0) -> BatchMasks:
        """From llguidance's bitmask [n, words] int32 (bit t of a row: token t allowed)."""
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return cls(rows, bits.view(bool), fill_ms)

    def allowed(self, row: int) -> np.ndarray:
        """bool [vocab] for a sampler row."""
        return self.table[self.rows[row]]

    def allowed_rows(self, rows: list[int]) -> np.ndarray:
        """bool [len(rows), vocab] for sampler rows."""
        return self.table[[self.rows[r] for r in rows]]


class MaskFiller:
    """Fills the batch's bitmasks in a worker thread while the forward pass runs (llguidance's LLExecutor
    spreads the matchers over its own threads and drops the GIL)."""

    def __init__(self, vocab_size: int, overlap: bool = True) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap  # False: fill in the calling thread, before the forward pass (for comparison)
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None

    def start(self, states: list[tuple[int, GrammarState]]) -> Future[BatchMasks]:
        """Begin filling the masks of (sampler row, state) pairs; the states must not change until the result."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            self._executor = llg.LLExecutor()
        if self.overlap:
            return self._pool.submit(self._fill, states)
        done: Future[BatchMasks] = Future()
        done.set_result(self._fill(states))
        return done

    def _fill(self, states: list[tuple[int, GrammarState]]) -> BatchMasks:
        start = time.perf_counter()
        bitmask = allocate_token_bitmask(len(states), self.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, (_, s) in enumerate(states)], bitmask)
        masks = BatchMasks.of({row: i for i, (row, _) in enumerate(states)}, bitmask, self.vocab_size)
        masks.fill_ms = (time.perf_counter() - start) * 1e3
        return masks

    def along(self, state: GrammarState, tokens: Sequence[int]) -> list[np.ndarray]:
        """The allowed tokens at each position of a speculative verify step: bool [vocab] for the state now and
        after each of `tokens` (len(tokens) + 1 masks; the tokens must be valid: Speculator drafts only those).
        In the calling thread; the state is rolled back to where it was."""
        bitmask = allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
        consumed = 0
        try:
            for i in range(len(tokens) + 1):
                fill_next_token_bitmask(state.matcher, bitmask, i)
                if i < len(tokens):
                    state.consume([tokens[i]])
                    consumed += 1
        finally:
            state.rollback(consumed)
        table = BatchMasks.of({}, bitmask, self.vocab_size).table
        return list(table)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
