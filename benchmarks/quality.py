"""What a weight format costs in model quality: perplexity on a bundled text, agreement with the fp32 greedy tokens.

Both run on the model runner directly (no scheduler, no sampling): several sequences advance together, one
token per step after a first chunk, so every position's next-token distribution is seen.

The text (benchmarks/data/perplexity.txt, ~1,300 SmolLM2 tokens) is public-domain prose (the Gettysburg
Address, the Declaration of Independence's preamble, the openings of Pride and Prejudice and Moby-Dick) and
three short plain paragraphs written for this file. It is split into segments of SEGMENT tokens, each scored
from its own start, so the number is comparable between formats, not with published perplexities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.engine.runners.base import ForwardBatch, SeqChunk
from service.engine.runners.numpy_runner import NumpyRunner
from service.tokenizer import Tokenizer

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
SEGMENT = 256


@dataclass(frozen=True)
class Scored:
    """One sequence scored from position `start` on: what the model said about each following token."""

    logprobs: np.ndarray  # [n - start] float64, log p(ids[t + 1] | ids[: t + 1]) for t = start - 1 .. n - 2
    top1: np.ndarray  # [n - start] int64, the argmax at those positions


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)  # [S, V]
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _block_tables(runner: NumpyRunner, lengths: list[int]) -> list[list[int]]:
    """Disjoint block tables, one per sequence of the given token counts."""
    per_seq = [-(-n // runner.block_size) for n in lengths]
    if sum(per_seq) > runner.num_kv_blocks:
        raise ValueError(f"{sum(per_seq)} KV blocks needed, the runner has {runner.num_kv_blocks}")
    offsets = np.cumsum([0, *per_seq]).tolist()
    return [list(range(offsets[i], offsets[i + 1])) for i in range(len(lengths))]


def score(runner: NumpyRunner, sequences: list[list[int]], starts: list[int]) -> list[Scored]:
    """Teacher-force every sequence: ids[:start] as one chunk, then one token per step, all sequences together."""
    bs = runner.block_size
    tables = _block_tables(runner, [len(s) for s in sequences])
    logprobs: list[list[float]] = [[] for _ in sequences]
    top1: list[list[int]] = [[] for _ in sequences]
    done = [0] * len(sequences)  # tokens of each sequence in the KV cache
    while True:
        live = [i for i, s in enumerate(sequences) if done[i] < len(s) - 1]
        if not live:
            break
        chunks = []
        for i in live:
            end = starts[i] if done[i] == 0 else done[i] + 1
            chunks.append(SeqChunk(sequences[i][done[i] : end], done[i], tables[i]))
        lp = _log_softmax(runner.execute(ForwardBatch.from_chunks(chunks, bs)))  # [len(live), V]
        for row, i in enumerate(live):
            done[i] += len(chunks[row].token_ids)
            logprobs[i].append(float(lp[row, sequences[i][done[i]]]))
            top1[i].append(int(lp[row].argmax()))
    return [Scored(np.asarray(lp), np.asarray(t)) for lp, t in zip(logprobs, top1, strict=True)]


def perplexity(runner: NumpyRunner, tokenizer: Tokenizer, max_tokens: int | None = None) -> tuple[float, int]:
    """(perplexity, tokens scored) of the bundled text, in segments of SEGMENT tokens scored from their start."""
    ids = tokenizer.encode(TEXT.read_text())[:max_tokens]
    segments = [ids[i : i + SEGMENT] for i in range(0, len(ids), SEGMENT)]
    segments = [s for s in segments if len(s) > 1]
    scored = score(runner, segments, [1] * len(segments))
    lps = np.concatenate([s.logprobs for s in scored])
    return math.exp(-lps.mean()), len(lps)


@dataclass(frozen=True)
class Agreement:
    """A format's greedy tokens against reference greedy tokens (transformers fp32) on the golden prompts."""

    prompts: int
    identical: int  # prompts whose free-running greedy tokens equal the reference's
    first_divergence: list[int]  # per prompt: index of the first differing token (len(reference) if none)
    teacher_forced_top1: float  # fraction of positions where argmax equals the reference's next token


def greedy(runner: NumpyRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Free-running greedy continuation of n tokens for each prompt (no EOS stop), prompts batched together."""
    bs = runner.block_size
    tables = _block_tables(runner, [len(p) + n for p in prompts])
    out: list[list[int]] = [[] for _ in prompts]
    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    for _ in range(n):
        logits = runner.execute(ForwardBatch.from_chunks(chunks, bs))  # [B, V]
        for i, tok in enumerate(logits.argmax(axis=-1).tolist()):
            out[i].append(tok)
        chunks = [SeqChunk([o[-1]], len(p) + len(o) - 1, t) for p, o, t in zip(prompts, out, tables, strict=True)]
    return out


def agreement(runner: NumpyRunner, cases: list[dict]) -> Agreement:
    """Compare with each case's prompt_token_ids / greedy_token_ids (the golden file's format)."""
    prompts = [c["prompt_token_ids"] for c in cases]
    refs = [c["greedy_token_ids"] for c in cases]
    ours = greedy(runner, prompts, max(map(len, refs)))
    firsts = []
    for o, r in zip(ours, refs, strict=True):
        firsts.append(next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), len(r)))
    forced = score(runner, [p + r for p, r in zip(prompts, refs, strict=True)], [len(p) for p in prompts])
    hits = sum(int((s.top1 == np.asarray(r)).sum()) for s, r in zip(forced, refs, strict=True))
    return Agreement(
        prompts=len(cases),
        identical=sum(f == len(r) for f, r in zip(firsts, refs, strict=True)),
        first_divergence=firsts,
        teacher_forced_top1=hits / sum(map(len, refs)),
    )
