"""A sequence's text as it is generated: incremental detokenizing, stop strings, held-back text.

While a sequence runs, the last `len(longest stop string) - 1` characters are held back, so a stop
string that is still being completed never reaches the client; the text before a stop string is
all that is ever sent (unless include_stop_str_in_output).
"""

from __future__ import annotations

from roseinfer.detokenizer import IncrementalDetokenizer
from roseinfer.outputs import TokenLogprob
from roseinfer.sampling_params import SamplingParams
from roseinfer.tokenizer import Tokenizer


class SequenceText:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self.text = ""
        self._sent = 0  # characters of `text` already handed out
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0

    def add_token(self, token_id: int, logprob: TokenLogprob | None = None) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob.logprob
        new_text = self._detokenizer.add_tokens([token_id])
        if not new_text:
            return None
        self.text += new_text
        return self._check_stop(len(new_text))

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self._stops:
            return None
        # A stop string ending in the new text starts at most longest-1 characters before it.
        search_from = max(0, len(self.text) - num_new_chars - self._longest_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop

    def take_delta(self, finished: bool, stopped_by_string: bool = False) -> str:
        """Text not handed out yet; while running, minus what could still become a stop string."""
        if finished:
            if not stopped_by_string:
                self.text += self._detokenizer.flush()
            end = len(self.text)
        else:
            end = max(self._sent, len(self.text) - max(self._longest_stop - 1, 0))
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
