"""Incremental detokenization with stop strings.

Text is produced token by token with `tokenizers`' DecodeStream, which holds back bytes of
an unfinished UTF-8 character and handles BPE merges across token boundaries. Stop strings
are searched in the text, so one that spans several tokens is still found. The token that
ends a request (an EOS or a stop token id) has no text unless include_stop_str_in_output, as in
vLLM; it still counts among the output's tokens. For streaming,
the last (longest stop string - 1) characters are held back until they cannot start a stop
string any more, so a stop string is never streamed to the client. At the end, bytes the
stream still holds (a character the last tokens left unfinished) are not dropped: the final
text is what decoding all the output tokens gives, U+FFFD for such bytes, as transformers'
`decode` shows them.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from tokenizers.decoders import DecodeStream

from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=self.skip_special)
        self.stops = params.stop_list
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.num_released = 0
        self.num_tokens = 0
        self.token_ends: list[int] = []  # per token: where its text ends in self.text
        self.num_tokens_released = 0
        self.cut = False  # a stop string cut the text
        self.held = False  # the stream holds bytes of an unfinished character
        self.skipped = False  # the last token ended the request and has no text (skip_stop_token)
        self.min_tokens = params.min_tokens
        # Where the first min_tokens tokens' text ends: no stop string is looked for before it.
        self.min_text_end = 0

    def update(self, token_ids: list[int], check_stops: bool = True) -> str | None:
        """Add new tokens; returns the stop string that matched, if one did (text is cut there).

        With check_stops False stop strings are not looked for. As vLLM, a stop string counts only
        in the text after the first min_tokens tokens (it was looked for in the min_tokens-th
        token's text too, and in what the holdback reached before it).
        """
        before = len(self.text)
        for t in token_ids[self.num_tokens :]:
            piece = self.stream.step(self.tokenizer.backend, t)
            if piece:
                self.text += piece
                self.held = False
            elif not (self.skip_special and t in self.tokenizer.all_special_ids):
                self.held = True
            self.token_ends.append(len(self.text))
            if len(self.token_ends) <= self.min_tokens:
                self.min_text_end = len(self.text)
        self.num_tokens = len(token_ids)
        if not self.stops or not check_stops or len(self.text) == before:
            return None
        search_from = max(0, before - self.holdback, self.min_text_end)
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.cut = True
        return s

    def skip_stop_token(self) -> None:
        """The token that ended the request (an EOS or a stop token id) counts, but its text is
        left out unless include_stop_str_in_output, as vLLM leaves it out."""
        self.num_tokens += 1
        self.token_ends.append(len(self.text))
        self.skipped = True

    def finish(self, token_ids: list[int]) -> None:
        """Let out the bytes the stream still holds, as the full decode of the output shows them
        (U+FFFD for an unfinished character)."""
        if self.cut or not self.held:
            return
        self.held = False
        decoded = token_ids[:-1] if self.skipped else token_ids
        full = self.tokenizer.decode(decoded, skip_special_tokens=self.skip_special)
        if full != self.text:
            self.text = full if full.startswith(self.text) else self.text + "\ufffd"

    def release(self, finished: bool) -> str:
        """New text that is safe to show (all of it once the request is finished)."""
        end = len(self.text) if finished else max(self.num_released, len(self.text) - self.holdback)
        delta = self.text[self.num_released : end]
        self.num_released = end
        return delta

    def release_tokens(self, finished: bool) -> tuple[int, int]:
        """The range of tokens newly released with the text (call after `release`): those whose
        text is all out; once finished, every token but those wholly in a cut stop string."""
        if not finished:
            n = bisect_right(self.token_ends, self.num_released)
        elif self.cut:  # a token counts if its text starts before the cut
            end = len(self.text)
            n = min(len(self.token_ends), bisect_left(self.token_ends, end) + 1) if end else 0
        else:
            n = len(self.token_ends)
        start = self.num_tokens_released
        self.num_tokens_released = max(start, n)
        return start, self.num_tokens_released
