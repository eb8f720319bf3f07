"""Workloads: synthetic prompts cut from a bundled text, JSONL prompt files, ShareGPT conversations."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request to send."""

    prompt: str | None  # text (JSONL / ShareGPT, and synthetic for text-only protocols)
    prompt_token_ids: list[int] | None  # exact-length synthetic prompts where the protocol takes token ids
    input_tokens: int  # prompt length in tokens (as the tokenizer counts it)
    max_tokens: int  # output tokens requested


@dataclass(frozen=True, slots=True)
class TokenizerFns:
    """How the workload counts and cuts tokens: the server's Tokenize RPC or a local tokenizer.json."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str] | None  # None: prompts are sent as token ids


@dataclass(frozen=True, slots=True)
class Lengths:
    """Prompt and output lengths in tokens: fixed, or drawn uniformly from [min, max] when a range is given."""

    input_len: int = 128
    output_len: int = 128
    input_range: tuple[int, int] | None = None
    output_range: tuple[int, int] | None = None

    @staticmethod
    def _draw(rng: np.random.Generator, n: int, fixed: int, spread: tuple[int, int] | None) -> list[int]:
        return [fixed] * n if spread is None else rng.integers(spread[0], spread[1] + 1, size=n).tolist()

    def inputs(self, rng: np.random.Generator, n: int) -> list[int]:
        return self._draw(rng, n, self.input_len, self.input_range)

    def outputs(self, rng: np.random.Generator, n: int) -> list[int]:
        return self._draw(rng, n, self.output_len, self.output_range)

    @property
    def max_output(self) -> int:
        return self.output_len if self.output_range is None else self.output_range[1]


def synthetic(tok: TokenizerFns, n: int, lengths: Lengths, rng: np.random.Generator) -> list[WorkItem]:
    """Windows of the bundled text at random offsets, each exactly the asked number of tokens long."""
    # paragraph by paragraph: a server's Tokenize refuses text longer than any prompt could be
    corpus = [t for para in CORPUS.read_text().split("\n\n") for t in tok.encode(para + "\n\n")]
    items = []
    for in_len, out_len in zip(lengths.inputs(rng, n), lengths.outputs(rng, n), strict=True):
        start = int(rng.integers(0, len(corpus)))
        ids = [corpus[(start + i) % len(corpus)] for i in range(in_len)]  # wraps around the text
        if tok.decode is None:
            items.append(WorkItem(None, ids, in_len, out_len))
        else:
            text = tok.decode(ids)
            items.append(WorkItem(text, None, len(tok.encode(text)), out_len))
    return items


def from_jsonl(path: Path, tok: TokenizerFns, output_len: int) -> list[WorkItem]:
    """{"prompt": "...", "max_tokens"|"output_len": N} per line (max_tokens defaults to --output-len)."""
    items = []
    for line in path.read_text().splitlines():
        if line.strip():
            doc = json.loads(line)
            out = int(doc.get("max_tokens", doc.get("output_len", output_len)))
            items.append(WorkItem(doc["prompt"], None, len(tok.encode(doc["prompt"])), out))
    return items


def from_sharegpt(path: Path, tok: TokenizerFns, max_input: int, max_output: int) -> list[WorkItem]:
    """ShareGPT JSON: the first human turn is the prompt, the first reply's length the output length
    (as vLLM samples it); conversations too short or too long are skipped."""
    items = []
    for conv in json.loads(path.read_text()):
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        in_len, out_len = len(tok.encode(prompt)), len(tok.encode(reply))
        if in_len < 4 or out_len < 4 or in_len > max_input or out_len > max_output:
            continue
        items.append(WorkItem(prompt, None, in_len, out_len))
    return items


def load(
    dataset: str, tok: TokenizerFns, n: int, lengths: Lengths, rng: np.random.Generator, max_input: int = 4096
) -> list[WorkItem]:
    """n requests of the dataset (file datasets are sampled, with repetition when shorter than n)."""
    if dataset == "synthetic":
        return synthetic(tok, n, lengths, rng)
    path = Path(dataset)
    if not path.is_file():
        raise ValueError(f"dataset {dataset!r} is neither 'synthetic' nor a file")
    if path.suffix == ".jsonl":
        pool = from_jsonl(path, tok, lengths.output_len)
    else:
        pool = from_sharegpt(path, tok, max_input, lengths.max_output)
    if not pool:
        raise ValueError(f"dataset {dataset} holds no usable prompt")
    return [pool[i] for i in rng.integers(0, len(pool), size=n)]
