"""Engine-side output processing: incremental detokenization, stop strings, and RequestOutput deltas.

Stop strings are matched on the detokenized text across token boundaries. While a request runs, the last
(longest stop string - 1) characters are held back, since they could be the start of a stop string; a match
ends the request at once (freeing its blocks in the same step) and the text is cut before the stop string.
"""

from __future__ import annotations

from service.request import FINISH_REASONS, Request, RequestOutput, TokenLogprob
from service.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestText:
    """The text state of one request."""

    __slots__ = ("detok", "emitted", "hold", "stopped", "stops", "text")

    def __init__(self, tokenizer: Tokenizer, req: Request) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.sampling.skip_special_tokens)
        self.stops = req.sampling.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of self.text already sent
        self.stopped = False  # a stop string was found: nothing more is added

    def push(self, token: int) -> str | None:
        """Add a token's text; return the stop string if one now appears in the text."""
        if self.stopped:
            return None
        before = len(self.text)
        self.text += self.detok.push(token)
        return self._find_stop(before)

    def finish(self) -> str | None:
        if self.stopped:
            return None
        before = len(self.text)
        self.text += self.detok.flush()
        return self._find_stop(before)

    def _find_stop(self, before: int) -> str | None:
        if not self.stops or len(self.text) == before:
            return None
        start = max(0, before - self.hold)  # a new match must end inside the new text
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = self.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stopped = True
        return best[1]

    def take(self, finished: bool) -> str:
        """The text that can be sent now."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[str, RequestText] = {}

    def add(self, req: Request) -> None:
        self.texts[req.request_id] = RequestText(self.tokenizer, req)

    def push(self, req: Request) -> str | None:
        """Detokenize the request's newest token; return a stop string if the text now contains one."""
        return self.texts[req.request_id].push(req.output_token_ids[-1])

    def output(self, req: Request, logprob: TokenLogprob | None) -> RequestOutput:
        """The delta for a request that just got a token (the final one if the request has finished)."""
        state = self.texts[req.request_id]
        if req.is_finished:
            state.finish()
        return self._output(req, state.take(req.is_finished), [logprob] if logprob is not None else None)

    def finished_output(self, req: Request) -> RequestOutput:
        """The final output of a request that ended without a new token (abort, error)."""
        state = self.texts.get(req.request_id)
        text = state.take(True) if state is not None else ""
        return self._output(req, text, None, new_tokens=False)

    def _output(
        self,
        req: Request,
        text: str,
        logprobs: list[TokenLogprob] | None,
        new_tokens: bool = True,
    ) -> RequestOutput:
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.output_token_ids[-1:] if new_tokens else [],
            new_text=text,
            logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens,
        )
        if req.is_finished:
            out.finished = True
            out.finish_reason = FINISH_REASONS[req.status]
            out.stop_reason = req.stop_reason
            out.timing = req.timing()
            self.texts.pop(req.request_id, None)
        return out
