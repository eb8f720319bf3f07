"""The text of one request as it streams: incremental detokenization and stop strings (every backend's).

Stop strings are matched on the detokenized text across token boundaries. While a request runs, the last
(longest stop string - 1) characters are held back, since they could be the start of a stop string; a match
ends the request and the text is cut before the stop string. Backends whose engine streams token ids (the
native engine, TensorRT-LLM, Triton's tensorrt_llm model) all produce their text through this, so the same
tokens give the same text and the same stops whatever runs the model.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.request import SamplingParams
from service.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestText:
    """The text state of one request."""

    __slots__ = ("detok", "emitted", "hold", "stopped", "stops", "text")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, sampling.skip_special_tokens)
        self.stops = sampling.stop
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

    def push_text(self, text: str) -> str | None:
        """Add text that arrives already detokenized (Triton's ensemble); return a stop string if one appears."""
        if self.stopped:
            return None
        before = len(self.text)
        self.text += text
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
