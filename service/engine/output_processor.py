"""Engine-side output processing: each request's RequestOutput deltas. Every request gets its text state
(service/textstream.py: incremental detokenization and stop strings) here, and the scheduler pushes each new
token into it when it decides the stop rules; this module only takes the text and tokens that can go out."""

from __future__ import annotations

from service.request import FINISH_REASONS, Request, RequestOutput, TokenLogprob
from service.textstream import RequestText
from service.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[str, RequestText] = {}

    def add(self, req: Request) -> None:
        req.text = self.texts[req.request_id] = RequestText(self.tokenizer, req.prompt_token_ids, req.sampling)

    def output(self, req: Request, num_new: int, logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """The delta for a request that just got num_new tokens (the final one if the request has finished)."""
        state = self.texts[req.request_id]
        if req.is_finished:
            state.finish()
        return self._output(req, state.take(req.is_finished), logprobs, num_new)

    def finished_output(self, req: Request) -> RequestOutput:
        """The final output of a request that ended without a new token (abort, error)."""
        state = self.texts.get(req.request_id)
        text = state.take(True) if state is not None else ""
        return self._output(req, text, None, 0)

    def _output(self, req: Request, text: str, logprobs: list[TokenLogprob] | None, num_new: int) -> RequestOutput:
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.output_token_ids[len(req.output_token_ids) - num_new :],
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
