"""Engine-side output processing: each request's text (service/textstream.py: incremental detokenization and
stop strings) and its RequestOutput deltas. A stop string ends the request at once, freeing its blocks in the
same step."""

from __future__ import annotations

from service.request import FINISH_REASONS, Request, RequestOutput, TokenLogprob
from service.textstream import RequestText
from service.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[str, RequestText] = {}

    def add(self, req: Request) -> None:
        self.texts[req.request_id] = RequestText(self.tokenizer, req.prompt_token_ids, req.sampling)

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
