"""Logits -> tokens for a batch of requests, each with its own sampling parameters.

Order per row (vLLM's): logprobs of the raw model distribution; a constrained row's grammar mask (tokens the
grammar does not allow -> -inf: everything after respects it); repetition / presence / frequency penalties;
min_tokens suppression of stop ids (not where the grammar allows nothing else); then greedy argmax, or
temperature -> min_p -> top_k -> top_p -> draw.
The draw is an inverse-CDF lookup with one uniform number per token. A seeded request takes that number from
a generator keyed by (seed, index of the token being generated), so its tokens do not depend on what else is
in the batch, on the batch order, or on preemption (which recomputes the same position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.engine.spec_decode import tentative
from service.request import Request, TokenLogprob

# Relative probability below which tokens are left out of the sorted candidate set for top-k / top-p.
# The result stays exact: when the candidates cannot decide, the row falls back to a full sort.
CANDIDATE_THRESHOLD = 1e-4


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # one per row (None where not requested)


def log_softmax_row(row: np.ndarray) -> np.ndarray:
    z = row.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def token_logprob(row: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    lp = log_softmax_row(row)  # [V]
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        ids = np.argpartition(-lp, top_n)[:top_n]
        ids = ids[np.lexsort((ids, -lp[ids]))]  # most likely first, ties by id
        top = tuple((int(i), float(lp[i])) for i in ids)
    return TokenLogprob(token_id=token, logprob=float(lp[token]), top=top)


def apply_penalties(row: np.ndarray, req: Request) -> None:
    """In place on one row of logits [V]."""
    with np.errstate(over="ignore"):  # huge (valid) penalties saturate to +-inf, which is what they mean
        _penalize(row, req)


def _penalize(row: np.ndarray, req: Request) -> None:
    p = req.sampling
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(req.all_token_ids, dtype=np.int64))
        vals = row[seen]
        row[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        ids, counts = np.unique(np.asarray(req.output_token_ids, dtype=np.int64), return_counts=True)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty


def _uniform(req: Request, rng: np.random.Generator, purpose: int = 0) -> float:
    """A uniform number for the token at index len(output) (purpose 0: a plain draw; 1, 2: the acceptance test and
    the resample of speculative decoding's rejection rule)."""
    if req.sampling.seed is None:
        return float(rng.random())
    key = [req.sampling.seed, len(req.output_token_ids)] + ([purpose] if purpose else [])
    return float(np.random.default_rng(key).random())


def _draw(probs: np.ndarray, ids: np.ndarray | None, u: float) -> int:
    """Inverse CDF over unnormalized probabilities in a fixed order (ids[i] is the token of probs[i])."""
    cdf = np.cumsum(probs, dtype=np.float64)
    i = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(cdf) - 1)
    return int(i if ids is None else ids[i])


def sample_row(row: np.ndarray, req: Request, u: float) -> int:
    """One token from a row of (penalized) logits [V] with temperature > 0."""
    probs, ids = distribution(row, req)
    return _draw(probs, ids, u)


def distribution(row: np.ndarray, req: Request) -> tuple[np.ndarray, np.ndarray | None]:
    """What a row of (penalized) logits [V] is sampled from, temperature > 0: unnormalized probabilities, and
    the token of each (None: probs is over the whole vocabulary, [V])."""
    p = req.sampling
    scaled = row.astype(np.float64) / p.temperature
    probs = np.exp(scaled - scaled.max())  # [V] unnormalized; the most likely token has 1.0
    if p.min_p > 0:
        probs[probs < p.min_p] = 0.0
    if not p.top_k and p.top_p >= 1.0:
        return probs, None
    total = probs.sum()
    ids = np.flatnonzero(probs >= max(CANDIDATE_THRESHOLD, p.min_p))  # candidates, ascending ids
    cand = probs[ids]
    complete = len(ids) == np.count_nonzero(probs)
    exact = complete or (len(ids) >= p.top_k if p.top_k else cand.sum() >= p.top_p * total)
    if not exact:  # rare (a flat distribution): the candidates cannot decide, sort the whole support
        ids = np.flatnonzero(probs)
        cand = probs[ids]
    order = np.argsort(-cand, kind="stable")  # most likely first, ties by id
    cand, ids = cand[order], ids[order]
    mass = total
    if p.top_k:
        cand, ids = cand[: p.top_k], ids[: p.top_k]
        mass = cand.sum()  # top-p applies to the renormalized top-k set
    if p.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(cand, dtype=np.float64), p.top_p * mass, side="left")) + 1
        cand, ids = cand[:cut], ids[:cut]
    return cand, ids


def accept_or_resample(probs: np.ndarray, ids: np.ndarray | None, draft: int, u_accept: float, u_draw: float) -> int:
    """The rejection rule for a deterministic draft: the draft with probability p(draft), else a token from p with
    the draft removed and renormalized (the result is distributed exactly as p)."""
    at = draft if ids is None else np.flatnonzero(ids == draft)
    p_draft = float(probs[at].sum()) if np.size(at) else 0.0
    total = float(probs.sum(dtype=np.float64))
    if u_accept * total < p_draft:
        return draft
    rest = probs.astype(np.float64)  # a copy
    rest[at] = 0.0
    if not rest.any():  # p was a point mass on the draft (then u_accept < 1 accepted it): unreachable
        return draft
    return _draw(rest, ids, u_draw)


class Masks(Protocol):
    """The allowed tokens of a step's constrained rows (service/engine/grammar.py's BatchMasks)."""

    rows: dict[int, int]

    def allowed(self, row: int) -> np.ndarray:
        """bool [V]: the tokens row `row` may take."""

    def allowed_rows(self, rows: list[int]) -> np.ndarray:
        """bool [len(rows), V]."""


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)  # for requests without a seed

    def sample(self, logits: np.ndarray, reqs: list[Request], masks: Masks | None = None) -> SamplerOutput:
        """logits: [S, V] float32, row i for reqs[i]; returns one token (and optional logprobs) per row.
        masks: the allowed tokens of the constrained rows (None: no row is constrained)."""
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        masked = masks.rows if masks is not None else {}
        greedy = [i for i, r in enumerate(reqs) if r.sampling.greedy and not self._needs_edit(r)]
        greedy_rows = [i for i in greedy if i not in masked]
        argmax = np.argmax(logits[greedy_rows], axis=-1) if greedy_rows else []  # vectorized common case
        fast = dict(zip(greedy_rows, (int(t) for t in argmax), strict=True))
        greedy_masked = [i for i in greedy if i in masked]
        if greedy_masked:  # constrained greedy rows: vectorized too
            allowed = masks.allowed_rows(greedy_masked)
            argmax = np.argmax(np.where(allowed, logits[greedy_masked], -np.inf), axis=-1)
            fast.update(zip(greedy_masked, (int(t) for t in argmax), strict=True))
        for i, req in enumerate(reqs):
            row = logits[i]
            if i in fast:
                token = fast[i]
            else:
                row = row.copy()
                if i in masked:
                    row[~masks.allowed(i)] = -np.inf
                self._edit(row, req, i in masked)
                token = int(np.argmax(row)) if req.sampling.greedy else sample_row(row, req, _uniform(req, self._rng))
            tokens.append(token)
            n = req.sampling.logprobs
            logprobs.append(None if n is None else token_logprob(logits[i], token, n))
        return SamplerOutput(tokens, logprobs)

    def verify(
        self, rows: np.ndarray, req: Request, drafts: list[int], allowed: list[np.ndarray] | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Speculative decoding's verification of one request: rows [k + 1, V] the logits at the positions of the
        last accepted token and of the k drafts; allowed: a constrained request's mask at each position (bool
        [V], k + 1 of them). Returns the tokens that come out (the accepted drafts, then the correction or bonus
        token: 1 to k + 1) and their logprobs (service/engine/spec_decode.py)."""
        tokens: list[int] = []
        p = req.sampling
        for i, row in enumerate(rows):
            with tentative(req, tokens) as state:
                edited = row
                if allowed is not None or self._needs_edit(state):
                    edited = row.copy()
                    if allowed is not None:
                        edited[~allowed[i]] = -np.inf
                    self._edit(edited, state, allowed is not None)
                if i == len(drafts):  # every draft accepted: the bonus token, drawn as in a plain step
                    token = (
                        int(np.argmax(edited)) if p.greedy else sample_row(edited, state, _uniform(state, self._rng))
                    )
                elif p.greedy:
                    token = int(np.argmax(edited))
                else:
                    probs, ids = distribution(edited, state)
                    u_accept, u_draw = _uniform(state, self._rng, 1), _uniform(state, self._rng, 2)
                    token = accept_or_resample(probs, ids, drafts[i], u_accept, u_draw)
            tokens.append(token)
            if i == len(drafts) or token != drafts[i]:
                break
        n = p.logprobs
        logprobs = [None if n is None else token_logprob(rows[i], t, n) for i, t in enumerate(tokens)]
        return tokens, logprobs

    @staticmethod
    def _needs_edit(req: Request) -> bool:
        return req.sampling.has_penalties or len(req.output_token_ids) < req.sampling.min_tokens

    @staticmethod
    def _edit(row: np.ndarray, req: Request, masked: bool = False) -> None:
        p = req.sampling
        if p.has_penalties:
            apply_penalties(row, req)
        if len(req.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
            if banned:
                kept = row[banned]
                row[banned] = -np.inf
                if masked and np.isneginf(row).all():  # the grammar allows only a stop here: it wins
                    row[banned] = kept
