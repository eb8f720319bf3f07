"""Speculative decoding with n-gram (prompt-lookup) drafts, verified exactly in one multi-token step.

Drafting (NgramDrafter): the longest n-gram at the end of a request's tokens (prompt + output), n from
prompt_lookup_max down to prompt_lookup_min, that occurred earlier proposes the tokens that followed its most
recent earlier occurrence. No second model.

How many drafts (choose_k): per request, the expected tokens a verify step of k drafts yields under the
request's recent acceptance rate a (1 + a + ... + a^k) divided by that step's measured cost relative to a one-token
step (VerifyCost: an online median of the engine's own forward times by rows in the step); k = 0 (no drafts)
where nothing pays, so prose does not slow down.

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
# A request's acceptance rate before it has drafted (a prior).
PRIOR_ACCEPTANCE = 0.5
# Draft positions tried (accepted, or the one rejected) the acceptance estimate remembers (an exponential window):
# short, so a request whose drafts stop matching stops paying for verify rows within a few steps (8 kept copy tasks
# from drafting again after a short miss; 32 kept prose drafting too long).
ACCEPTANCE_WINDOW = 16.0
# Decode steps without drafts after which a request probes with one draft (accepted: its estimate goes back to the
# prior at least, so a copy that starts late is drafted from again).
RETRY_STEPS = 16


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


@dataclass(slots=True)
class SpecState:
    """A speculating request's drafter and counters (Request.spec)."""

    drafter: NgramDrafter
    max_k: int  # the request's cap (its num_speculative_tokens, or the server's)
    drafts: int = 0  # verify steps that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i
    acceptance: float = PRIOR_ACCEPTANCE  # recent acceptance rate (exponential window)
    idle: int = 0  # decode steps since the last drafts
    probing: bool = False  # the drafts in flight are a probe (one draft while the estimate said none)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        probe, self.probing = self.probing, False
        if num_drafts == 0:
            return
        if probe and num_accepted:  # the text copies again: back to the prior, the cost model decides from there
            self.acceptance = max(self.acceptance, PRIOR_ACCEPTANCE)
        self.drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        # the acceptance rate per draft position reached: accepted / (accepted + one rejection, if any)
        tried = num_accepted + (1 if num_accepted < num_drafts else 0)
        keep = max(0.0, 1.0 - tried / ACCEPTANCE_WINDOW)
        self.acceptance = keep * self.acceptance + (1 - keep) * (num_accepted / tried)


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


def choose_k(acceptance: float, max_k: int, cost: VerifyCost) -> int:
    """The number of drafts that maximises expected tokens per unit of step time (0: do not speculate)."""
    best_k, best = 0, 1.0  # a plain step: one token for one unit
    expected = 1.0
    for k in range(1, max_k + 1):
        expected += acceptance**k
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
        if state is None or room <= 0:
            return []
        k = choose_k(state.acceptance, min(state.max_k, room), self.cost)
        state.idle = 0 if k else state.idle + 1
        if not k and state.idle < RETRY_STEPS:
            return []
        if not k:  # a request that stopped drafting probes with one draft now and then (SpecState.record)
            k, state.idle, state.probing = 1, 0, True
        drafts = state.drafter.propose(req.all_token_ids, k)
        if drafts and req.grammar is not None:  # only what the grammar allows: the longest valid prefix
            drafts = drafts[: req.grammar.matcher.validate_tokens(drafts)]
        state.probing = state.probing and bool(drafts)
        return drafts
