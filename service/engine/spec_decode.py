"""Speculative decoding with n-gram (prompt-lookup) drafts, verified exactly in one multi-token step.

Drafting (NgramDrafter): the longest n-gram at the end of a request's tokens (prompt + output), n from
prompt_lookup_max down to prompt_lookup_min, that occurred earlier proposes the tokens that followed its most
recent earlier occurrence. No second model.

How many drafts (choose_k): per request, the expected tokens a verify step of k drafts yields divided by that
step's measured cost relative to a one-token step (VerifyCost: an online median of the engine's own forward times
by rows in the step); k = 0 (no drafts) where nothing pays, so prose does not slow down. The expected tokens come
from the drafter's record on this request by run length (SpecState): how often its token was right after r right
ones in a row. Copying comes in runs: once the output has followed the text it copies for a few tokens, the next
draft is far likelier to be accepted than after a miss. Every step checks the drafter, drafting or not: a plain
step compares the token the drafter would have proposed with the model's, so a request learns when its output
starts copying without paying for drafts to find out.

Verification (verify): the last accepted token plus the k drafts run as one step; row i's logits are the model's
distribution for the position of draft i (bitwise those of a one-token step: batch-invariant kernels,
docs/kernels.md). Greedy accepts the longest prefix of drafts equal to the model's own argmax and adds the argmax
after it (the correction, or a bonus token when every draft is accepted): token-identical to plain greedy.
Sampling uses the rejection rule for a deterministic draft: accept draft x with probability p(x), else sample from
p with x removed and renormalised, where p is the distribution the sampler would draw from at that position
(penalties, min_tokens, temperature, min_p, top_k, top_p applied with the state after the earlier drafts), so the
output has exactly the distribution of plain sampling. Seeded requests draw their numbers from (seed, output index,
purpose): the same output run to run with speculation on (not the same as without it).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from service.config import SpecConfig
from service.request import Request

# Relative cost of a verify step by rows (1 + drafts) before the engine has measured its own; a prior only.
PRIOR_COST = (1.0, 1.0, 1.25, 1.3, 1.35, 1.45, 1.55, 1.65, 1.75, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6)
# The drafter's record is kept by run length: draft positions in a row it got right (drafts accepted, and its
# next token checked against the model's at every other step), runs of RUN_CAP or more sharing one estimate.
RUN_CAP = 8
# The chance its token is right by run length before the request has its own record (a prior: after a miss, after
# one right token, after two or more), counted as PRIOR_WEIGHT observations. On spec_bench's plain greedy outputs
# the drafter's next token is right 6-40% of the time after a miss (json's 70%), 61-83% after one right token (one
# workload 13%) and 71-100% after three.
PRIOR_HIT = (0.3, 0.5) + (0.7,) * (RUN_CAP - 1)
PRIOR_WEIGHT = 2.0
# Observations per run length a request remembers (an exponential window): its text may stop copying.
HIT_WINDOW = 32.0


class NgramDrafter:
    """One request's n-gram index over its tokens (prompt + accepted output), grown as tokens are appended."""

    __slots__ = ("_index", "_indexed", "nmax", "nmin")

    def __init__(self, nmin: int, nmax: int) -> None:
        self.nmin, self.nmax = nmin, nmax
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(nmax + 1)]  # n -> n-gram -> next pos
        self._indexed = 0  # tokens[:_indexed] are indexed (every n-gram that ends before them)

    def _grow(self, tokens: Sequence[int]) -> None:
        # index the n-grams ending at positions < len - 1: each maps to the position right after it (most
        # recent occurrence wins); the n-gram ending at the last token is the query, never its own match
        end = len(tokens) - 1
        for pos in range(max(self._indexed, 1), end + 1):  # n-grams ending at pos - 1, followed by pos
            for n in range(self.nmin, min(self.nmax, pos) + 1):
                self._index[n][tuple(tokens[pos - n : pos])] = pos
        self._indexed = max(self._indexed, end + 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `tokens` (empty: no n-gram of the configured range recurs)."""
        if k <= 0 or len(tokens) < self.nmin + 1:
            return []
        self._grow(tokens)
        for n in range(min(self.nmax, len(tokens) - 1), self.nmin - 1, -1):
            pos = self._index[n].get(tuple(tokens[len(tokens) - n :]))
            if pos is not None:
                return list(tokens[pos : pos + k])
        return []


def _per_run(value: float) -> list[float]:
    return [value] * (RUN_CAP + 1)


@dataclass(slots=True)
class SpecState:
    """A speculating request's drafter, its record by run length, and its counters (Request.spec)."""

    drafter: NgramDrafter
    max_k: int  # the request's cap (its num_speculative_tokens, or the server's)
    drafts: int = 0  # verify steps that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i
    run: int = 0  # draft positions in a row the drafter got right, up to now
    hits: list[float] = field(default_factory=lambda: _per_run(0.0))  # [RUN_CAP + 1] right, by run length
    tries: list[float] = field(default_factory=lambda: _per_run(0.0))  # [RUN_CAP + 1] checked, by run length
    proposed: list[int] = field(default_factory=list)  # the drafter's tokens from this step's position: the
    # drafts, then one more (checked against the model's token there; the drafts alone if the scheduler drops them)

    def acceptance(self, k: int) -> list[float]:
        """[k] the chance draft i is accepted given drafts 0..i-1 were, from this request's record."""
        return [self._hit_rate(self.run + i) for i in range(k)]

    def _hit_rate(self, run: int) -> float:
        r = min(run, RUN_CAP)
        return (self.hits[r] + PRIOR_WEIGHT * PRIOR_HIT[r]) / (self.tries[r] + PRIOR_WEIGHT)

    def _observe(self, right: bool) -> None:
        r, keep = min(self.run, RUN_CAP), 1.0 - 1.0 / HIT_WINDOW
        self.hits[r] = self.hits[r] * keep + right
        self.tries[r] = self.tries[r] * keep + 1.0
        self.run = self.run + 1 if right else 0

    def record(self, num_drafts: int, tokens: Sequence[int]) -> None:
        """A step's tokens for this request: a verify step's accepted drafts and the model's token after them
        (num_drafts > 0), or a plain step's token."""
        proposed, self.proposed = self.proposed, []
        if num_drafts:
            accepted = len(tokens) - 1
            self.drafts += 1
            self.draft_tokens += num_drafts
            self.accepted_tokens += accepted
            if len(self.accepted_per_pos) < num_drafts:
                self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
            for i in range(accepted):
                self.accepted_per_pos[i] += 1
                self._observe(True)
            if accepted < num_drafts:
                self._observe(False)
                return
        # no draft rejected: the model's last token against what the drafter proposed (or would have) there
        if len(proposed) > num_drafts:
            self._observe(tokens[-1] == proposed[num_drafts])
        else:  # it had nothing to propose (or was not asked): the output does not follow a copy here
            self.run = 0


class VerifyCost:
    """The engine's forward time by rows in a single-sequence step, relative to one row: a running median of
    each row count's last few measurements (PRIOR_COST until measured)."""

    def __init__(self, max_rows: int, samples: int = 9) -> None:
        self.samples = samples
        self._ms: list[list[float]] = [[] for _ in range(max_rows + 1)]

    def observe(self, rows: int, forward_ms: float) -> None:
        if 1 <= rows < len(self._ms):
            ms = self._ms[rows]
            ms.append(forward_ms)
            if len(ms) > self.samples:
                del ms[0]

    def relative(self, rows: int) -> float:
        base = self._ms[1]
        own = self._ms[rows] if rows < len(self._ms) else []
        if len(base) >= 3 and len(own) >= 3:
            return statistics.median(own) / statistics.median(base)
        return PRIOR_COST[min(rows - 1, len(PRIOR_COST) - 1)]


def choose_k(acceptance: Sequence[float], cost: VerifyCost) -> int:
    """The number of drafts that maximises expected tokens per unit of step time (0: do not speculate), at most
    len(acceptance); acceptance[i]: the chance draft i is accepted given the drafts before it were."""
    best_k, best = 0, 1.0  # a plain step: one token for one unit
    expected = reach = 1.0
    for k, a in enumerate(acceptance, 1):
        reach *= a
        expected += reach
        rate = expected / cost.relative(k + 1)
        if rate > best * 1.02:  # a clear gain only: noise in the cost estimate must not flip it
            best_k, best = k, rate
    return best_k


@contextlib.contextmanager
def tentative(req: Request, tokens: Sequence[int]) -> Iterator[Request]:
    """The request as if `tokens` had been generated (penalties, min_tokens and seeds see them); undone after."""
    n = len(tokens)
    req.output_token_ids.extend(tokens)
    req.all_token_ids.extend(tokens)
    try:
        yield req
    finally:
        if n:
            del req.output_token_ids[-n:]
            del req.all_token_ids[-n:]


class Speculator:
    """The scheduler's drafting policy: which decodes carry drafts in a step, and how many."""

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.cost = VerifyCost(cfg.num_speculative_tokens + 1)

    def state(self, req: Request) -> SpecState | None:
        """The request's speculation state, made on first use; None where it does not speculate (asked for 0
        drafts)."""
        if req.spec is None:
            asked = req.sampling.num_speculative_tokens
            max_k = self.cfg.num_speculative_tokens if asked is None else min(asked, self.cfg.num_speculative_tokens)
            if max_k == 0:
                req.spec = False
                return None
            req.spec = SpecState(NgramDrafter(self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max), max_k)
        return req.spec or None

    def drafts(self, req: Request, room: int) -> list[int]:
        """Draft tokens for a decoding request, at most `room` (token budget, max_tokens and max_seq_len left)."""
        state = self.state(req)
        if state is None:
            return []
        state.proposed = []
        if room <= 0:
            return []
        k = choose_k(state.acceptance(min(state.max_k, room)), self.cost)
        proposed = state.drafter.propose(req.all_token_ids, k + 1)  # one more: checked against the model's token
        if k and proposed and req.grammar is not None:  # drafts only what the grammar allows: the longest valid prefix
            valid = req.grammar.matcher.validate_tokens(proposed[:k])
            proposed = proposed[:valid] if valid < min(k, len(proposed)) else proposed
        state.proposed = proposed
        return proposed[:k]
